"""Running a planned training run: the caller's side of ``vramcal train`` (and of each ``vramcal tune`` trial).

It writes the run folder's records, starts the training worker (:func:`vramcal.train.worker.train_in_worker`) as the
trials that sized the run were started, prints what it says and closes the loop: the measured peak beside the
profile's prediction after the first epoch and at the end, the time beside the forecast
(:mod:`vramcal.train.timing`), and the run's observation appended to the profile. Whatever fails in the worker ends
here as one line (:class:`~vramcal.train.errors.TrainError`) naming the last good checkpoint."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramcal import __version__
from vramcal.profile import Observation, ProfileError, append_observation, utc_now
from vramcal.service.pool import worker_pool
from vramcal.sizing import compare
from vramcal.train import checkpoint, timing, tracking
from vramcal.train.errors import DivergedError, NonFiniteError, Stopped, TrainError
from vramcal.train.plan import Plan
from vramcal.units import format_bytes, format_duration

Echo = Callable[[str], None]
TRAIN_WORKER = "vramcal.train.worker:train_in_worker"  # by name: the caller does not import torch
# Errors raised in the worker whose message is already one line for people.
_USER_ERRORS = {"DataError", "CorpusError", "RunDirError", "TrainError", "NonFiniteError", "DivergedError",
                "WorkloadError", "ValueError", "MeterError", "ConfigError", "SizingError"}


@dataclass(frozen=True)
class RunResult:
    """How a run ended: its last epoch row, steps, largest epoch peak and the observation recorded."""

    last: dict[str, Any]
    steps: int
    peak_bytes: int | None
    observation: Observation | None
    stopped: bool = False


def train(plan: Plan, echo: Echo = print, on_epoch: Callable[[dict[str, Any]], Any] | None = None,
          workers: Any = None) -> RunResult:
    """Run ``plan`` in a worker and close the loop with its profile (module docstring).

    Args:
        on_epoch: called with each epoch's row; returning ``"stop"`` ends the run (``RunResult.stopped``).
        workers: a :class:`vramcal.measure.worker.Workers` to fork from (default
            :func:`vramcal.service.pool.worker_pool`).

    Raises:
        TrainError: the run failed; the message is one line naming the last good checkpoint.
        KeyboardInterrupt: interrupted (the worker is killed; checkpoints on disk stay).
    """
    try:
        return _run(plan, echo, on_epoch, workers)
    finally:
        checkpoint.release_run_dir(plan.run_dir)  # the folder claimed when it was prepared (checkpoint module)


def _run(plan: Plan, echo: Echo, on_epoch: Callable[[dict[str, Any]], Any] | None, workers: Any) -> RunResult:
    if not plan.resume and plan.rank == 0:  # absolute paths: --resume works from any directory
        checkpoint.write_json(plan.run_dir / checkpoint.CONFIG, plan.config.with_absolute_paths().to_dict())
        checkpoint.write_json(plan.run_dir / checkpoint.RUN, plan.record())
    first, rows = [], []
    forecast = timing.plan_forecast(plan)
    if forecast is not None:
        echo(timing.forecast_line(forecast, plan))
    trackers = tracking.run_trackers(plan, echo)

    def handle(kind: str, payload: Any) -> Any:
        if kind == "line":
            echo(payload)
        elif kind == "epoch":
            rows.append(payload)
            for tracker in trackers:
                tracker.epoch(payload)
            if not first and own_peak(plan, payload):
                first.append(payload)
                _report(plan, own_peak(plan, payload), echo, "after the first epoch")
            if len(rows) == 1 and forecast is not None:
                for line in timing.first_epoch_lines(forecast, payload, fresh=not plan.resume):
                    echo(line)
            if (left := time_left_line(plan, payload)) is not None:
                echo(left)
            return on_epoch(payload) if on_epoch is not None else None
        return None

    outcome = _in_worker(plan, handle, trackers, workers)
    if outcome.status != "ok":
        if outcome.error_type == "Stopped":
            return RunResult({}, 0, None, None, stopped=True)
        unstable = {"NonFiniteError": NonFiniteError, "DivergedError": DivergedError}  # kept: tune prunes them
        raise unstable.get(outcome.error_type, TrainError)(_failure_line(plan, outcome))
    result = outcome.result
    observation, peak = None, own_peak(plan, result)
    if peak:
        if result["epochs"] > 1:
            _report(plan, peak, echo, "at the end")
        if result.get("rank_peak_bytes"):
            echo(describe_ranks(result["batch_sizes"], result["rank_peak_bytes"]))
        observation = _observe(plan, {**result, "peak_bytes": peak}, echo,
                               timing.observed(forecast, rows, fresh=not plan.resume))
    return RunResult(result["last"], result["step"], peak, observation)


def _in_worker(plan: Plan, handle: Callable[[str, Any], Any], trackers: list[Any], workers: Any) -> Any:
    """The run's training in a worker (its messages to ``handle``); the trackers closed with how it ended."""
    status = "KILLED"  # until the worker says otherwise: an interrupt ends the run here
    try:
        outcome = (workers or worker_pool()).run(TRAIN_WORKER, plan, handler=handle,
                                                 usable_bytes=plan.sizing.usable_bytes if plan.sizing else None,
                                                 device_kind=plan.device.kind)
        status = "FINISHED" if outcome.status == "ok" else "KILLED" if outcome.error_type == "Stopped" else "FAILED"
    finally:
        for tracker in trackers:
            tracker.close(status)
    return outcome


def time_left_line(plan: Plan, row: dict[str, Any]) -> str | None:
    """``about 1.20 min left: 30 steps and 2 validations at 2.10 s/step (median), 1.50 s each`` after an epoch row
    (the steps counted as :class:`vramcal.train.loop.Trainer` counts them); None after the last epoch."""
    config, batch, n_train = plan.config, int(row["batch_size"]), int(plan.data_stats["train_windows"])
    per_epoch = row.get("steps_per_epoch") or max(1, n_train // batch if plan.world is not None
                                                  else math.ceil(n_train / batch))  # a language model's: its own
    total = min(config.max_steps or math.inf, config.epochs * per_epoch)
    steps = int(total - row["step"])
    step_s = row.get("step_s_median")
    if steps <= 0 or not step_s:
        return None
    validations = max(1, math.ceil(total / per_epoch) - row["epoch"])
    seconds = steps * step_s + validations * row["val_s"]
    return (f"about {format_duration(seconds)} left: {steps} step{'s' * (steps > 1)} and {validations} "
            f"validation{'s' * (validations > 1)} at {step_s:.3g} s/step (median), {row['val_s']:.3g} s each")


def run_summary(run_dir: Path) -> dict[str, Any]:
    """What a finished run left in its folder (``run.json``, ``metrics.jsonl``), for programs (``vramcal train
    --json``): one process and a DDP world alike.

    Returns:
        ``run_dir``, ``model``; ``batch_size`` (per forward/backward, rank 0's) and ``step_batch_size`` (per
            optimizer
        step, all ranks); ``sizing`` (None: unchecked) and ``profile``; ``predicted_peak_bytes`` and ``upper_bytes``;
        ``peak_bytes`` (rank 0's under DDP) and ``rank_peak_bytes`` (DDP, else None); the last epoch row's ``steps``,
        ``epochs``, ``train_loss``, ``val_loss``, ``val_zero_loss`` (None before one); the paths of ``metrics``,
        ``checkpoint``, ``best_checkpoint`` and ``tensorboard``.

    Raises:
        OSError, ValueError: the run folder has no readable ``run.json`` or ``metrics.jsonl``.
    """
    run_dir = Path(run_dir)
    record = json.loads((run_dir / checkpoint.RUN).read_text())
    rows = [json.loads(line) for line in (run_dir / checkpoint.METRICS).read_text().splitlines() if line.strip()]
    epochs = [r for r in rows if r["kind"] == "epoch"]
    last, sizing = epochs[-1] if epochs else {}, record["sizing"]
    measured = [r for r in epochs if r.get("peak_bytes") is not None]
    ranks = [max(r["rank_peak_bytes"][i] for r in measured) for i in range(len(measured[-1]["rank_peak_bytes"]))] \
        if measured and measured[-1].get("rank_peak_bytes") else None
    return {"run_dir": str(run_dir), "model": record["config"].get("model", "regressor"),
            "batch_size": sizing["batch_size"] if sizing else record["config"]["batch_size"],
            "step_batch_size": last.get("batch_size"), "sizing": sizing, "profile": record["profile"],
            "predicted_peak_bytes": sizing and sizing["predicted_peak_bytes"],
            "upper_bytes": sizing and sizing["upper_bytes"],
            "peak_bytes": ranks[0] if ranks else max((r["peak_bytes"] for r in measured), default=None),
            "rank_peak_bytes": ranks, "steps": last.get("step", 0), "epochs": last.get("epoch", 0),
            "train_loss": last.get("train_loss"), "val_loss": last.get("val_loss"),
            "val_zero_loss": last.get("val_zero_loss"),
            "metrics": str(run_dir / checkpoint.METRICS), "checkpoint": str(run_dir / checkpoint.LAST),
            "best_checkpoint": str(run_dir / checkpoint.BEST), "tensorboard": str(run_dir / tracking.TENSORBOARD)}


def own_peak(plan: Plan, figures: dict[str, Any]) -> int | None:
    """This process's peak in an epoch row or a run's result (under DDP its own rank's, which its profile predicts)."""
    ranks = figures.get("rank_peak_bytes")
    return ranks[plan.rank] if ranks else figures.get("peak_bytes")


def describe_ranks(batch_sizes: list[int], peaks: list[int]) -> str:
    """``ranks: 0: batch 48, peak 2.10 GiB; 1: batch 48, peak 2.11 GiB (global batch 96)``."""
    each = "; ".join(f"{rank}: batch {b}, peak {format_bytes(peak)}"
                     for rank, (b, peak) in enumerate(zip(batch_sizes, peaks)))
    return f"ranks: {each} (global batch {sum(batch_sizes)})"


def _report(plan: Plan, peak_bytes: int, echo: Echo, when: str) -> None:
    if plan.sizing is None:
        echo(f"{when}: peak {format_bytes(peak_bytes)} at batch_size {plan.batch_size} (unchecked: no profile "
             f"predicted it)")
        return
    line, warnings = compare(plan.sizing, peak_bytes)
    echo(f"{when}: {line}")
    for warning in warnings:
        echo(f"warning: {warning}")


def _observe(plan: Plan, result: dict[str, Any], echo: Echo, times: dict[str, Any]) -> Observation | None:
    """Append the run's observation (with its times: ``times``) to its profile; a failed write is a warning. None for
    an unchecked run."""
    if plan.sizing is None:
        return None
    observation = Observation(
        recorded_utc=utc_now(), vramcal_version=__version__, batch_size=plan.batch_size,
        data_bytes=int(result["data_bytes"]), peak_bytes=int(result["peak_bytes"]),
        predicted_peak_bytes=plan.sizing.predicted_peak_bytes, upper_bytes=plan.sizing.upper_bytes,
        warn_bytes=plan.sizing.line_bytes,
        usable_bytes=plan.sizing.usable_bytes, steps=int(result["step"]), run_dir=str(plan.run_dir.resolve()),
        rank=plan.rank if plan.world else None, world_size=plan.world.nproc if plan.world else None, **times)
    if plan.profile_path is None:
        return observation
    try:
        append_observation(plan.profile_path, observation)
    except (OSError, ProfileError) as error:
        echo(f"warning: could not record this run in {plan.profile_path} ({error})")
    return observation


def _failure_line(plan: Plan, outcome: Any) -> str:
    if outcome.error_type in _USER_ERRORS and outcome.message:
        return outcome.message
    kept = checkpoint.last_good(plan.run_dir)
    if outcome.status == "oom":
        return (f"the training process ran out of memory ({outcome.message}) and could not recover; {kept}; "
                f"a smaller --batch-size, or a fresh `vramcal probe`, may be needed")
    return f"the training process failed ({outcome.error_type or outcome.status}: {outcome.message}); {kept}"


__all__ = ["RunResult", "Stopped", "TrainError", "run_summary", "train"]
