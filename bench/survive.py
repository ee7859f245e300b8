"""Survival: a tool's answer trained by ``vramcal train``'s own runner under the budget.

Each run is what ``vramcal train --gpu none --capacity BUDGET --profile P --stride S --max-steps N`` does
(:func:`vramcal.train.plan.resolve`, :func:`~vramcal.train.plan.plan_run`,
:func:`vramcal.train.runner.train`): the trainer in a worker forked from vramcal's preloaded server, its
data segment limited to the budget (``RLIMIT_DATA`` = the plan's ``host_memory_limit_bytes``), training
``steps`` optimizer steps (over as many epochs as that takes, each ending with a validation pass).

**The benchmark's one use of vramcal internals:** the trainer clamps a requested batch size to the
profile's safe size, so to train *any* tool's answer the plan's sizing is replaced after planning
(``dataclasses.replace(plan, sizing=...)``) by :func:`sizing_at`: that batch size, with the profile's
point prediction and upper 95 % bound for it (the data term included), so the runner's closed-loop line
compares the measured peak with the profile's prediction at that size.

The outcome: ``ok`` (every step done, no out-of-memory fallback), ``oom-fallback`` (finished only
because the trainer halved its micro-batch after an out-of-memory error: an out-of-memory error all the
same), ``oom`` (could not recover), ``error``.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from vramcal.profile import Profile
from vramcal.sizing import SizeRequest, Sizing, length_model, size


def sizing_at(profile: Profile, batch_size: int, pool_data_bytes: int | None = None) -> Sizing:
    """A :class:`~vramcal.sizing.Sizing` at ``batch_size`` whatever the profile's limits (no clamping):
    the profile's prediction and upper bound there, plus the data term; ``batch_size`` samples an optimizer step,
    in one micro-batch. Pure."""
    base = size(profile, SizeRequest(limit="safe"), pool_data_bytes=pool_data_bytes)
    model = length_model(profile)
    delta = base.data_delta_bytes
    return dataclasses.replace(base, batch_size=batch_size, source="bench", effective_batch_size=batch_size,
                               accumulation_steps=1, predicted_peak_bytes=int(model.predict(batch_size) + delta),
                               upper_bytes=int(model.upper(batch_size) + delta))


def outcome(steps_wanted: int, steps_done: int, fallbacks: int, failure: str | None) -> str:
    """``ok``, ``oom-fallback``, ``oom`` or ``error`` (module docstring). Pure."""
    if failure is not None:
        return "oom" if "out of memory" in failure else "error"
    if fallbacks:
        return "oom-fallback"
    return "ok" if steps_done == steps_wanted else "error"


def survive(spec: dict[str, Any], budget_bytes: int, batch_size: int, profile_path: str, *, data: str,
            stride: int, steps: int, workers: Any = None, echo: Any = None) -> dict[str, Any]:
    """Train ``steps`` steps at ``batch_size`` with vramcal's runner under the budget (module docstring).

    Returns:
        ``status``, ``steps_done``, ``peak_bytes`` (the largest epoch peak, DESIGN.md's definition),
        ``predicted_peak_bytes``/``upper_bytes``/``usable_bytes`` of ``profile_path`` at that size, the
        number of out-of-memory ``fallbacks``, ``wall_s`` and the runner's lines.
    """
    from vramcal.models.regressor.spec import RegressorSpec
    from vramcal.train.config import TrainConfig
    from vramcal.train.errors import TrainError
    from vramcal.train.plan import plan_run, resolve
    from vramcal.train.runner import train

    lines: list[str] = []

    def collect(line: str) -> None:
        lines.append(line)
        if echo is not None:
            echo(line)

    config = TrainConfig(data=data, spec=RegressorSpec.from_dict(spec), implementation="transformers", gpu="none",
                         profile=profile_path, epochs=10**6, max_steps=steps, stride=stride)
    started = time.time()
    failure, result = None, None
    with tempfile.TemporaryDirectory(prefix="vramcal-bench-run-") as folder:
        run_dir = Path(folder) / "run"
        setting = resolve(config, capacity_bytes=budget_bytes)
        plan = plan_run(config, run_dir, setting)
        sizing = sizing_at(setting.profile, batch_size, setting.pool_data_bytes)
        plan = dataclasses.replace(plan, sizing=sizing, profile_path=None)  # the bench's profiles stay as made
        def stop_after_fallback(row: dict[str, Any]) -> str | None:
            # The trainer recovered from an out-of-memory error by halving its micro-batch: the outcome is
            # decided (oom-fallback), the rest of the steps would only cost time.
            return "stop" if row.get("micro_batch_size", batch_size) < batch_size else None

        try:
            result = train(plan, echo=collect, on_epoch=stop_after_fallback, workers=workers)
        except TrainError as error:
            failure = str(error)
        rows = _metrics(run_dir)
    fallbacks = [r for r in rows if r.get("kind") == "oom"]
    epochs = [r for r in rows if r.get("kind") == "epoch"]
    if result is not None and result.stopped:
        result = None  # stopped after a fallback: the figures come from the metrics
    steps_done = result.steps if result is not None else max((r.get("step", 0) for r in epochs), default=0)
    return {"batch_size": batch_size, "status": outcome(steps, steps_done, len(fallbacks), failure),
            "steps": steps, "steps_done": steps_done, "epochs": len(epochs),
            "peak_bytes": result.peak_bytes if result is not None else max(
                (r["peak_bytes"] for r in epochs if r.get("peak_bytes")), default=None),
            "epoch_peak_bytes": [r.get("peak_bytes") for r in epochs],
            "predicted_peak_bytes": sizing.predicted_peak_bytes, "upper_bytes": sizing.upper_bytes,
            "usable_bytes": sizing.usable_bytes, "data_delta_bytes": sizing.data_delta_bytes,
            "host_memory_limit_bytes": plan.host_memory_limit_bytes, "fallbacks": fallbacks,
            "failure": failure, "wall_s": time.time() - started, "lines": lines[-12:]}


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
