"""The closed loop for time: a run's forecast from its profile before the first step, its first epoch's measured time
beside it, and both in the profile's observation (DESIGN.md "Throughput, time and cost").

Under DDP a rank is forecast on its share of the windows and its rates given as the world's (:func:`world_rates`), as
the trainer's rows count them. A family whose trainer batches documents of every length
(:attr:`vramcal.models.registry.Family.documents`) is forecast by ``step_s = t0 + t_token × batch_size × seq_len``
fitted to its trials by least squares and summed over the epoch's padded batches (:func:`documents_forecast`)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vramcal.calibration.throughput import NO_DIFFERENCE
from vramcal.estimate.result import line
from vramcal.forecast import FAR, FAR_FRACTION, Dataset, Forecast, forecast_batch, noise_band, time_band, time_verdict
from vramcal.models.registry import family_of
from vramcal.profile import Profile, ProfileError, load_profile
from vramcal.records import Trial
from vramcal.train.plan import Plan
from vramcal.units import format_duration, format_rate


def plan_forecast(plan: Plan) -> Forecast | None:
    """The forecast for ``plan``'s run (under DDP this rank's share of the windows at its own batch); None without a
    profile file or throughput measured around the batch size."""
    if plan.profile_path is None:
        return None
    if family_of(plan.model).documents:
        return documents_forecast(plan)
    try:
        profile = load_profile(plan.profile_path)
    except ProfileError:
        return None
    stats = plan.data_stats
    ranks = plan.world.nproc if plan.world is not None else 1
    share = "" if ranks == 1 else f", this rank's share of {ranks}"
    dataset = Dataset(math.ceil(int(stats["train_windows"]) / ranks), math.ceil(int(stats["val_windows"]) / ranks),
                      f"{Path(plan.config.data or 'synthetic bars').name}, windows of {stats.get('seq_len')} bars, "
                      f"stride {stats.get('stride')}{share}")
    per_epoch, steps = cut_steps(plan, dataset)
    epochs = plan.config.epochs if steps is None else math.ceil(steps / per_epoch)
    found = forecast_batch(profile, plan.batch_size, plan.sizing.label, dataset, epochs,
                           seq_len=plan.config.spec.seq_len)
    if found.epoch_s is None:
        return None
    found = world_rates(found, ranks)
    if steps is None:
        return found
    # the last epoch stops at max_steps (and still validates): its training time not run comes off, at each rate
    unrun = (epochs * per_epoch - steps) / per_epoch * found.train_s

    def less(run_s: float | None, rate: float | None) -> float | None:
        return None if run_s is None or rate is None else run_s - unrun * found.samples_per_s / rate

    return dataclasses.replace(found, run_s=less(found.run_s, found.samples_per_s),
                               run_low_s=less(found.run_low_s, found.high_samples_per_s),
                               run_high_s=less(found.run_high_s, found.low_samples_per_s))


def world_rates(forecast: Forecast, ranks: int) -> Forecast:
    """A rank's forecast with the world's samples/s: its rate and interval × ``ranks`` (the ranks step together); its
    times, batch size and dataset stay this rank's."""
    if ranks == 1:
        return forecast

    def world(rate: float | None) -> float | None:
        return None if rate is None else rate * ranks

    return dataclasses.replace(forecast, ranks=ranks, samples_per_s=world(forecast.samples_per_s),
                               low_samples_per_s=world(forecast.low_samples_per_s),
                               high_samples_per_s=world(forecast.high_samples_per_s))


def world_text(forecast: Forecast) -> str:
    """`` for the world's 2 ranks (30.1 each)`` beside a DDP forecast's samples/s; empty for one process."""
    if forecast.ranks == 1:
        return ""
    return f" for the world's {forecast.ranks} ranks ({format_rate(forecast.samples_per_s / forecast.ranks)} each)"


def cut_steps(plan: Plan, dataset: Dataset) -> tuple[int, int | None]:
    """(optimizer steps per epoch of ``dataset``, the run's steps when max_steps ends it early, else None)."""
    per_epoch, max_steps = math.ceil(dataset.train_samples / plan.step_batch_size), plan.config.max_steps
    if not max_steps or max_steps >= plan.config.epochs * per_epoch:
        return per_epoch, None
    return per_epoch, max_steps


def forecast_line(forecast: Forecast, plan: Plan | None = None) -> str:
    """``forecast: 30.1 samples/s at batch_size 161, epoch 16.1 s (training 14.1 s + validation 2.0 s), 10 epochs 2.7
    min``; ``..., 40 steps (max_steps, in epoch 2) 9.5 s`` when max_steps stops it sooner; under DDP ``60.2 samples/s
    for the world's 2 ranks (30.1 each) at batch_size 161 per rank``; on documents ``31.2k tokens/s (52.0
    documents/s) over 341 batches of the token budget, ...``."""
    val = "validation not counted" if forecast.val_s is None else f"validation {format_duration(forecast.val_s)}"
    run, steps = f"{forecast.epochs} epoch{'s' * (forecast.epochs != 1)}", None
    if forecast.tokens_per_s is not None and plan is not None:
        per_epoch, steps = int(plan.data_stats["train_batches"]), plan.config.max_steps
        steps = steps if steps and steps < plan.config.epochs * per_epoch else None
        by = "token budget" if plan.data_stats["batching"]["mode"] == "budget" else "bucket table"
        what = (f"{format_rate(forecast.tokens_per_s)} tokens/s ({format_rate(forecast.samples_per_s)} documents/s) "
                f"over {per_epoch} batches of the {by}")
    else:
        steps = cut_steps(plan, forecast.dataset)[1] if plan is not None and forecast.dataset is not None else None
        what = (f"{format_rate(forecast.samples_per_s)} samples/s{world_text(forecast)} at batch_size "
                f"{forecast.batch_size}{' per rank' * (forecast.ranks > 1)}")
    run = run if steps is None else f"{steps} step{'s' * (steps != 1)} (max_steps, in epoch {forecast.epochs})"
    return (f"forecast: {what}, epoch {format_duration(forecast.epoch_s)} (training "
            f"{format_duration(forecast.train_s)} + {val}), {run} {format_duration(forecast.run_s)}")


def line_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """(intercept, slope) of ``y = a + b x`` (:func:`vramcal.estimate.result.line`, the intercept at least 0); None
    with fewer than two distinct x or a slope that is not positive (time must grow with tokens)."""
    if len({x for x, _ in points}) < 2:
        return None
    intercept, slope = line([x for x, _ in points], [y for _, y in points])
    return (max(0.0, intercept), slope) if slope > 0 else None


def timed(profile: Profile) -> list[tuple[int, Trial]]:
    """(tokens per step, trial) of the profile's training trials that finished and timed their steps."""
    surface = profile.surface
    reference = surface.reference_seq_len if surface is not None else profile.model.params.get("seq_len")
    return [(t.batch_size * (t.seq_len or reference), t) for t in profile.trials
            if t.ok and t.step_times_s and (t.seq_len or reference)]


def step_model(profile: Profile) -> tuple[tuple[float, float], float, int] | None:
    """The step-time fit (t0, t_token), the steps' spread about it and their number; None: too few timings."""
    trials = timed(profile)
    fit = line_fit([(tokens, statistics.median(t.step_times_s)) for tokens, t in trials])
    if fit is None:
        return None
    ratios = [s / (fit[0] + fit[1] * tokens) - 1 for tokens, t in trials for s in t.step_times_s]
    return fit, statistics.stdev(ratios) if len(ratios) > 1 else 0.0, len(ratios)


def val_model(profile: Profile) -> tuple[float, float] | None:
    """The validation-pass fit (t0, t_token), or None where the trials timed too few passes."""
    return line_fit([(tokens, statistics.median(t.val_times_s)) for tokens, t in timed(profile) if t.val_times_s])


def documents_forecast(plan: Plan) -> Forecast | None:
    """The forecast of a run on documents (module docstring): ``samples_per_s`` documents per second,
    ``tokens_per_s`` unpadded tokens per second, ``step_fit`` (t0, t_token); None without a profile or timings."""
    try:
        profile = load_profile(plan.profile_path)
    except (ProfileError, TypeError):
        return None
    found, val = step_model(profile), val_model(profile)
    if found is None:
        return None
    (t0, per_token), spread, n_steps = found
    stats = plan.data_stats
    train_s = stats["train_batches"] * t0 + per_token * stats["train_padded_tokens"]
    val_s = None if val is None else stats["val_batches"] * val[0] + val[1] * stats["val_padded_tokens"]
    epoch_s = train_s + (val_s or 0.0)
    steps, per_epoch = plan.config.max_steps, int(stats["train_batches"])
    epochs = plan.config.epochs if not steps else min(plan.config.epochs, math.ceil(steps / per_epoch))
    run_steps = min(steps or math.inf, epochs * per_epoch)
    run_s = run_steps / per_epoch * train_s + epochs * (val_s or 0.0)
    dataset = Dataset(int(stats["train_windows"]), int(stats["val_windows"]), f"--text {stats['text']}")
    return Forecast(profile.device.name, True, epochs, dataset, int(stats["worst"]["batch_size"]), "worst batch",
                    samples_per_s=stats["train_windows"] / train_s, step_spread=spread, n_steps=n_steps,
                    train_s=train_s, val_s=val_s, epoch_s=epoch_s, run_s=run_s,
                    tokens_per_s=stats["train_tokens"] / train_s, step_fit=(t0, per_token))


def epoch_steps(row: dict[str, Any]) -> int:
    """The optimizer steps of an epoch row (0 without its batch size); with gradient accumulation the band
    :func:`vramcal.forecast.time_band` gives on them is up to √k too wide (looser, never stricter)."""
    if row.get("epoch_steps"):  # a language model's: its batches vary
        return int(row["epoch_steps"])
    return math.ceil(row["samples"] / row["batch_size"]) if row.get("batch_size") else 0


def expected_s(forecast: Forecast, row: dict[str, Any]) -> float:
    """The forecast's time for what an epoch row ran: the epoch, or the steps a ``max_steps`` ran (at the forecast's
    rate; on documents, on the step-time fit) and its validation pass."""
    if row.get("complete", True):
        return forecast.epoch_s
    if forecast.step_fit is not None and row.get("padded_tokens") is not None:
        t0, per_token = forecast.step_fit
        train_s = epoch_steps(row) * t0 + per_token * row["padded_tokens"]
    else:
        train_s = row["samples"] / forecast.samples_per_s
    return train_s + (forecast.val_s or 0.0)


def first_epoch_lines(forecast: Forecast, row: dict[str, Any], fresh: bool) -> list[str]:
    """The first epoch's measured time beside its forecast (:func:`expected_s`); a line when it is more than 25 % off
    inside the spread the calibration measured (:func:`vramcal.forecast.time_band`), a warning to recalibrate only
    outside it."""
    if not row.get("epoch_s") or forecast.epoch_s is None:
        return []
    expected = expected_s(forecast, row) + (forecast.first_s or 0.0) * fresh
    error = (row["epoch_s"] - expected) / expected
    steps, slower = epoch_steps(row), row["epoch_s"] > expected
    band = time_band(forecast, steps, slower)
    open_ = " (its rate's is open above)" if not slower and forecast.high_samples_per_s is None else ""
    spread = (f"its {steps} steps may vary by ±{band:.0%}" if band == noise_band(forecast, steps) else
              f"the forecast's 95 % interval reaches {'+' if slower else '−'}{band:.0%}{open_}")
    noise = f"; {spread}" if band > FAR_FRACTION else ""
    whole = row.get("complete", True)
    rate = (f"{format_rate(row['tokens_per_s'])} tokens/s" if row.get("tokens_per_s") else
            f"{format_rate(row['samples_per_s'])} samples/s{' for the world' * (forecast.ranks > 1)}")
    lines = [f"after {'the first epoch' if whole else f'its {steps} steps (max_steps, in epoch 1)'}: "
             f"{format_duration(row['epoch_s'])} (training {format_duration(row['train_s'])}, {rate}; validation "
             f"{format_duration(row['val_s'])}): forecast {format_duration(expected)} ({error:+.1%}{noise})"]
    took = "the epoch took" if whole else f"its {steps} steps took"
    if time_verdict(row["epoch_s"], expected, band) == FAR:
        short = ("; its rate rested on a short trial's few timed steps" if forecast.steady is False else "")
        lines.append(f"warning: {took} {error:+.0%} against the forecast, outside the spread the calibration "
                     f"measured: the profile's throughput does not describe this run (a busier machine, other "
                     f"software, another card?{short}); re-run `vramcal probe` here to measure it again")
    elif abs(error) > FAR_FRACTION:
        lines.append(f"{took} {error:+.0%} against the forecast, inside the spread the calibration measured "
                     f"({spread}): {NO_DIFFERENCE} from the forecast, nothing to recalibrate (more timed steps in "
                     f"the profile would narrow the forecast)")
    return lines


def observed(forecast: Forecast | None, rows: Sequence[dict[str, Any]], fresh: bool) -> dict[str, Any]:
    """The observation's time fields (:class:`vramcal.profile.Observation`) from the run's complete epochs: measured
    epoch time and samples/s, their forecast, the band on the side it landed, and the epoch counted."""
    done = [r for r in rows if r.get("complete", True) and r.get("epoch_s")]
    if not done:
        return {}
    train_s = sum(r["train_s"] for r in done)
    fields = {"epoch_s": statistics.fmean(r["epoch_s"] for r in done),
              "samples_per_s": sum(r["samples"] for r in done) / train_s if train_s > 0 else None}
    if forecast is not None and forecast.epoch_s is not None:
        first = (forecast.first_s or 0.0) if fresh and done[0].get("epoch") == 1 else 0.0
        expected = forecast.epoch_s + first / len(done)
        fields.update(forecast_epoch_s=expected, forecast_samples_per_s=forecast.samples_per_s,
                      time_band=time_band(forecast, sum(epoch_steps(r) for r in done), fields["epoch_s"] > expected))
    if forecast is not None and forecast.dataset is not None:
        fields.update(train_samples=forecast.dataset.train_samples, val_samples=forecast.dataset.val_samples,
                      data_source=forecast.dataset.source)
    return fields
