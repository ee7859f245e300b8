"""The closed loop for time: a training run's forecast from its profile, and its measured times beside it.

As the memory loop does (:mod:`vramcal.train.runner`), the run prints its forecast before the first step
(:func:`vramcal.forecast.forecast_batch` at the run's own batch size, data and epochs), its measured epoch time
beside the forecast after the first epoch, and records both in its profile's observation
(:class:`vramcal.profile.Observation`: ``samples_per_s``, ``epoch_s`` and their forecasts). A run whose first
epoch is more than :data:`vramcal.forecast.FAR_FRACTION` off its forecast, and more than its steps' own noise
may take it (:func:`vramcal.forecast.time_band`), says so (:func:`vramcal.forecast.time_verdict`).

Measured figures are the trainer's epoch rows (:mod:`vramcal.train.loop`): ``epoch_s`` = the epoch's step
times plus its validation pass, ``samples_per_s`` = training samples over step time; only complete epochs
count, and the first epoch's forecast carries the first step's extra time (it allocates AdamW's state).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import Any

from vramcal.forecast import FAR, FAR_FRACTION, Dataset, Forecast, forecast_batch, time_band, time_verdict
from vramcal.profile import ProfileError, load_profile
from vramcal.train.plan import Plan
from vramcal.units import format_duration, format_rate


def plan_forecast(plan: Plan) -> Forecast | None:
    """The forecast for ``plan``'s run (its batch size, windows and epochs; under DDP this rank's share of the
    windows, at its own batch size: the ranks step together); None without a profile file or a forecast there
    (no throughput measured around the batch size)."""
    if plan.profile_path is None:
        return None
    try:
        profile = load_profile(plan.profile_path)
    except ProfileError:
        return None
    stats = plan.data_stats
    ranks = plan.world.nproc if plan.world is not None else 1
    dataset = Dataset(math.ceil(int(stats["train_windows"]) / ranks), math.ceil(int(stats["val_windows"]) / ranks),
                      "this run's data" if ranks == 1 else "this rank's share of this run's data")
    per_epoch, steps = cut_steps(plan, dataset)
    epochs = plan.config.epochs if steps is None else math.ceil(steps / per_epoch)
    found = forecast_batch(profile, plan.batch_size, plan.sizing.label, dataset, epochs,
                           seq_len=plan.config.spec.seq_len)
    if found.epoch_s is None:
        return None
    if steps is None:
        return found
    # the last epoch stops at max_steps (and still validates): its training time not run comes off, at each rate
    unrun = (epochs * per_epoch - steps) / per_epoch * found.train_s

    def less(run_s: float | None, rate: float | None) -> float | None:
        return None if run_s is None or rate is None else run_s - unrun * found.samples_per_s / rate

    return dataclasses.replace(found, run_s=less(found.run_s, found.samples_per_s),
                               run_low_s=less(found.run_low_s, found.high_samples_per_s),
                               run_high_s=less(found.run_high_s, found.low_samples_per_s))


def cut_steps(plan: Plan, dataset: Dataset) -> tuple[int, int | None]:
    """(optimizer steps per epoch of ``dataset``, the steps of ``plan``'s run when its max_steps stops it before
    its epochs end: None for whole epochs)."""
    per_epoch, max_steps = math.ceil(dataset.train_samples / plan.step_batch_size), plan.config.max_steps
    if not max_steps or max_steps >= plan.config.epochs * per_epoch:
        return per_epoch, None
    return per_epoch, max_steps


def forecast_line(forecast: Forecast, plan: Plan | None = None) -> str:
    """``forecast: 30.1 samples/s at batch_size 161, epoch 16.1 s (training 14.1 s + validation 2.0 s), 10 epochs
    2.7 min`` (``..., 40 steps (max_steps, in epoch 2) 9.5 s`` when ``plan``'s max_steps stops it sooner)."""
    val = "validation not counted" if forecast.val_s is None else f"validation {format_duration(forecast.val_s)}"
    run = f"{forecast.epochs} epoch{'s' * (forecast.epochs != 1)}"
    if plan is not None and forecast.dataset is not None:
        steps = cut_steps(plan, forecast.dataset)[1]
        run = run if steps is None else f"{steps} step{'s' * (steps != 1)} (max_steps, in epoch {forecast.epochs})"
    return (f"forecast: {format_rate(forecast.samples_per_s)} samples/s at batch_size {forecast.batch_size}, epoch "
            f"{format_duration(forecast.epoch_s)} (training {format_duration(forecast.train_s)} + {val}), "
            f"{run} {format_duration(forecast.run_s)}")


def epoch_steps(row: dict[str, Any]) -> int:
    """The optimizer steps of an epoch row (0 without its batch size). :func:`vramcal.forecast.time_band` counts
    these: with gradient accumulation, k micro-batches a step, the steps' noise is the micro-steps' averaged
    over k, and the band this count gives is up to √k wider than it need be (a looser check, never a stricter one)."""
    return math.ceil(row["samples"] / row["batch_size"]) if row.get("batch_size") else 0


def first_epoch_lines(forecast: Forecast, row: dict[str, Any], fresh: bool) -> list[str]:
    """The first epoch's measured time beside its forecast, and a warning when it is far from it: farther than its
    steps' own noise may take it (:func:`vramcal.forecast.time_band`), and at least 25 %."""
    if not row.get("epoch_s") or not row.get("complete", True):
        return []
    expected = forecast.epoch_s + (forecast.first_s or 0.0) * fresh
    error = (row["epoch_s"] - expected) / expected
    steps = epoch_steps(row)
    band = time_band(forecast, steps)
    noise = f"; its {steps} steps may vary by ±{band:.0%}" if band > FAR_FRACTION else ""
    lines = [f"after the first epoch: {format_duration(row['epoch_s'])} (training {format_duration(row['train_s'])}"
             f", {format_rate(row['samples_per_s'])} samples/s; validation {format_duration(row['val_s'])}): forecast "
             f"{format_duration(expected)} ({error:+.1%}{noise})"]
    if time_verdict(row["epoch_s"], expected, band) == FAR:
        short = ("; its rate rested on a short trial's few timed steps" if forecast.steady is False else "")
        lines.append(f"warning: the epoch took {error:+.0%} against the forecast: the profile's throughput does not "
                     f"describe this run (a busier machine, other software, another card?{short}); re-run "
                     f"`vramcal probe` here to measure it again")
    return lines


def observed(forecast: Forecast | None, rows: Sequence[dict[str, Any]], fresh: bool) -> dict[str, float | None]:
    """The observation's time fields (:class:`vramcal.profile.Observation`) from the run's epoch rows: the
    measured mean epoch time and samples/s over its complete epochs, the forecast's for the same epochs, and the
    band its mean epoch may land in by its steps' noise (:func:`vramcal.forecast.time_band`, over all their
    steps)."""
    done = [r for r in rows if r.get("complete", True) and r.get("epoch_s")]
    if not done:
        return {}
    train_s = sum(r["train_s"] for r in done)
    fields = {"epoch_s": statistics.fmean(r["epoch_s"] for r in done),
              "samples_per_s": sum(r["samples"] for r in done) / train_s if train_s > 0 else None}
    if forecast is not None and forecast.epoch_s is not None:
        first = (forecast.first_s or 0.0) if fresh and done[0].get("epoch") == 1 else 0.0
        fields.update(forecast_epoch_s=forecast.epoch_s + first / len(done),
                      forecast_samples_per_s=forecast.samples_per_s,
                      time_band=time_band(forecast, sum(epoch_steps(r) for r in done)))
    return fields
