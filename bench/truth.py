"""The ground truth: the largest batch size whose vramcal trial — the trainer's own program — finishes
under the budget, found by bisection, and its cache.

A trial (:class:`vramcal.measure.trial.TrialRunner`) builds the trainer's step with the regressor's
factory on the same data, runs 1 warm-up + 2 measured steps and a validation pass, in a worker forked
from vramcal's preloaded server, under ``RLIMIT_DATA = budget``. The search doubles from 1 until a size
does not fit, then bisects until the largest fitting and the smallest non-fitting size are adjacent.

Only memory decides (:func:`memory_verdict`): a size does not fit when its trial ran out of memory
(``oom``) or finished with a peak above the budget (the peak vramcal's boundary is defined by); it fits
when its trial finished within the budget. A trial that ends in ``error`` or ``timeout`` says nothing about
memory: it is run once more, both are listed apart (``non_oom_failures``), and a size that ends so twice
stops the bisection with :class:`TruthError` rather than become the boundary.

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
from typing import Any, Literal

REPO = Path(__file__).resolve().parent.parent
Verdict = Literal["fits", "over", "unknown"]


class TruthError(RuntimeError):
    """No ground truth: a size whose trial ended in ``error`` or ``timeout`` twice (the message says which)."""


def memory_verdict(status: str, peak_bytes: int | None, budget_bytes: int) -> Verdict:
    """What a trial says about memory: ``fits`` (finished, peak within ``budget_bytes``), ``over`` (ran out of
    memory, or finished with a peak above the budget) or ``unknown`` (``error``/``timeout``: not a memory outcome).

    The same rule as the GPU check's boundary bisection (scripts/gpu_check.py).
    """
    if status == "oom" or (status == "ok" and peak_bytes is not None and peak_bytes > budget_bytes):
        return "over"
    if status == "ok" and peak_bytes is not None:
        return "fits"
    return "unknown"


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

    Raises:
        TruthError: a size ended in ``error`` or ``timeout`` twice (module docstring).
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
        for _attempt in range(2):  # an error or a timeout is run once more: it is not a memory outcome
            (trial,) = runner.run(template.with_batch_size(batch_size), purpose="truth")
            trials.append({"batch_size": batch_size, "status": trial.status, "peak_bytes": trial.peak_bytes,
                           "data_peak_bytes": trial.data_peak_bytes, "rss_peak_bytes": trial.rss_peak_bytes,
                           "wall_s": trial.wall_s, "error": (trial.error or "")[-300:] or None})
            last_line = trial.error.strip().splitlines()[-1][:160] if trial.error and trial.error.strip() else ""
            verdict = memory_verdict(trial.status, trial.peak_bytes, budget_bytes)
            echo(f"  truth trial {batch_size}: {trial.status}" + (" (peak above the budget)" if verdict == "over"
                 and trial.status == "ok" else "") + (f" ({last_line})" if verdict == "unknown" and last_line else ""))
            if verdict != "unknown":
                return verdict == "fits"
        raise TruthError(f"batch size {batch_size} ended in {trial.status} twice ({last_line or 'no message'}): "
                         f"that is not out-of-memory, so the ground truth cannot be bisected past it; run that "
                         f"trial alone to see why, or give a longer --timeout")

    low, high = bisect_largest(fits)
    return {"batch_size": low, "first_failing_batch_size": high, "trials": trials,
            "non_oom_failures": [t for t in trials if t["status"] not in ("ok", "oom")],
            "wall_s": time.time() - started}
