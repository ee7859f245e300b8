"""The ground truth: the largest batch size whose vramcal trial — the trainer's own program — finishes
under the budget, found by bisection, and its cache.

A trial (:class:`vramcal.measure.trial.TrialRunner`) builds the trainer's step with the regressor's
factory on the same data, runs 1 warm-up + 2 measured steps and a validation pass, in a worker forked
from vramcal's preloaded server, under ``RLIMIT_DATA = budget``. The search doubles from 1 until a trial
fails, then bisects until the largest finishing and the smallest failing size are adjacent. A trial that
ends in ``error`` or ``timeout`` counts as a failure at that size but is listed apart, never as an
out-of-memory error.

The cache lives in the results JSON, keyed by (spec, budget, data options, Python, torch, vramcal
commit): :func:`truth_key`. The commit is the last one that changed ``vramcal/`` (plus a hash of
uncommitted changes there), so commits elsewhere keep the cache and any change to what a trial does
invalidates it; ``--refresh-truth`` recomputes it anyway.
"""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def bisect_largest(fits: Callable[[int], bool], start: int = 1) -> tuple[int, int]:
    """(largest fitting, smallest failing) batch size, by doubling from ``start`` then bisection.

    Assumes fitting is monotone (every size below a fitting one fits). Returns ``(0, start)`` when
    ``start`` itself does not fit (``start`` should be 1 then).
    """
    low, high = 0, start
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low, high


def vramcal_commit() -> str | None:
    """The last commit that changed ``vramcal/``, with ``+dirty-<hash>`` for uncommitted changes there
    (the hash of ``git diff HEAD -- vramcal``, so two different dirty trees do not share a cache entry)."""
    try:
        head = subprocess.run(["git", "log", "-1", "--format=%h", "--", "vramcal"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
        diff = subprocess.run(["git", "diff", "HEAD", "--", "vramcal"], cwd=REPO, capture_output=True,
                              check=True).stdout
        untracked = subprocess.run(["git", "ls-files", "--others", "--exclude-standard", "--", "vramcal"], cwd=REPO,
                                   capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    if not diff and not untracked:
        return head
    digest = hashlib.sha1(diff)
    for name in sorted(untracked.decode().split()):
        digest.update(name.encode() + (REPO / name).read_bytes())
    return f"{head}+dirty-{digest.hexdigest()[:10]}"


def truth_key(spec: dict[str, Any], budget_bytes: int, options: dict[str, Any], commit: str | None,
              torch_version: str | None) -> dict[str, Any]:
    """What a cached truth must match: spec, budget, data options, Python and torch versions, vramcal commit."""
    return {"spec": spec, "budget_bytes": budget_bytes, "options": options, "python": platform.python_version(),
            "torch": torch_version, "vramcal_commit": commit}


def cached(old: dict[str, Any], key: dict[str, Any]) -> dict[str, Any] | None:
    """The cached truth in an earlier results dict when its key matches, else None."""
    truth = old.get("ground_truth")
    return truth if truth and truth.get("key") == key else None


def ground_truth(spec: dict[str, Any], budget_bytes: int, data: str, stride: int, timeout_s: float = 1800.0,
                 runner: Any = None, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Bisect the largest batch size whose vramcal trial finishes under ``RLIMIT_DATA = budget_bytes``.

    Args:
        spec: the :class:`~vramcal.models.regressor.RegressorSpec` as a dict.
        data, stride: the bars and window stride the trials hold (as the tools' and the trainer's).
        runner: a :class:`~vramcal.measure.trial.TrialRunner` (one is made by default).

    Returns:
        ``batch_size`` (the truth), ``first_failing_batch_size``, every trial, the non-oom failures and
        the wall time (seconds).
    """
    from vramcal.api import worker_pool
    from vramcal.measure.device import host_device
    from vramcal.measure.trial import TrialRequest, TrialRunner
    from vramcal.models.regressor.spec import RegressorSpec
    from vramcal.records import TrialSettings

    runner = runner or TrialRunner(worker_pool())
    template = TrialRequest(RegressorSpec.from_dict(spec).ref("transformers"), 1,
                            host_device(capacity_bytes=budget_bytes),
                            json.dumps({"data": data, "stride": stride}, sort_keys=True),
                            TrialSettings(timeout_s=timeout_s))
    trials: list[dict[str, Any]] = []
    started = time.time()

    def fits(batch_size: int) -> bool:
        trial = runner.run(template.with_batch_size(batch_size), purpose="truth")
        trials.append({"batch_size": batch_size, "status": trial.status, "peak_bytes": trial.peak_bytes,
                       "data_peak_bytes": trial.data_peak_bytes, "rss_peak_bytes": trial.rss_peak_bytes,
                       "wall_s": trial.wall_s, "error": (trial.error or "")[-300:] or None})
        echo(f"  truth trial {batch_size}: {trial.status}"
             + (f" ({trial.error.strip().splitlines()[-1][:160]})" if trial.status not in ("ok", "oom")
                and trial.error else ""))
        return trial.status == "ok"

    low, high = bisect_largest(fits)
    return {"batch_size": low, "first_failing_batch_size": high, "trials": trials,
            "non_oom_failures": [t for t in trials if t["status"] not in ("ok", "oom")],
            "wall_s": time.time() - started}
