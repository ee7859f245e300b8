"""The closed loop for time of a language-model run (:mod:`vramcal.train.lm_plan`): its epoch forecast from the
tokens/s its profile's trials measured, beside the tokens/s and the epoch time the run measures.

The trials of a calibration over several lengths time each measured step and each validation pass, at batch sizes
and lengths of every kind. A step's time is fitted as

    step_s = t0 + t_token × batch_size × seq_len

by least squares over the trials' median step times (seq_len as the trial ran it, a multiple of chunk_size), and a
validation pass's the same way over their validation times. An epoch of batches ``(b_i, L_i)`` (each longest
document padded to the chunk) is then ``Σ t0 + t_token × b_i × L_i`` = ``batches × t0 + t_token × padded tokens``,
and its validation pass the same over the validation batches: the terms :func:`vramcal.train.lm_plan.plan_run`
counted. The steps' spread about the fit (the coefficient of variation of ``measured / fitted``) and their number
give the band an epoch may land in with nothing wrong (:func:`vramcal.forecast.noise_band`), as for the regressor.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from vramcal.forecast import Dataset, Forecast
from vramcal.profile import Profile, ProfileError, load_profile
from vramcal.records import Trial
from vramcal.train.plan import Plan
from vramcal.units import format_duration, format_rate


def line_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """(intercept, slope) of ``y = a + b x`` by least squares (Montgomery & Runger, eq. 11-7/11-8); None with fewer
    than two distinct x or a slope that is not positive (time must grow with tokens)."""
    if len({x for x, _ in points}) < 2:
        return None
    mean_x, mean_y = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    if slope <= 0:
        return None
    return max(0.0, mean_y - slope * mean_x), slope


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


def forecast(plan: Plan) -> Forecast | None:
    """The run's forecast (module docstring): ``samples_per_s`` the training documents per second, ``tokens_per_s``
    their tokens (padding not counted) per second; None without a profile file or enough timed trials."""
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
                    tokens_per_s=stats["train_tokens"] / train_s)


def forecast_line(forecast: Forecast, plan: Plan) -> str:
    """``forecast: 31.2k tokens/s (52.0 documents/s) over 341 batches of the token budget, epoch 2.3 min (training
    2.0 min + validation 18.0 s), 300 steps (max_steps, in epoch 1) 2.1 min``."""
    stats, steps = plan.data_stats, plan.config.max_steps
    val = "validation not counted" if forecast.val_s is None else f"validation {format_duration(forecast.val_s)}"
    per_epoch = int(stats["train_batches"])
    run = (f"{steps} step{'s' * (steps != 1)} (max_steps, in epoch {forecast.epochs})"
           if steps and steps < plan.config.epochs * per_epoch else f"{forecast.epochs} epoch"
           f"{'s' * (forecast.epochs != 1)}")
    by = "token budget" if stats["batching"]["mode"] == "budget" else "bucket table"
    return (f"forecast: {format_rate(forecast.tokens_per_s)} tokens/s ({format_rate(forecast.samples_per_s)} "
            f"documents/s) over {per_epoch} batches of the {by}, epoch {format_duration(forecast.epoch_s)} (training "
            f"{format_duration(forecast.train_s)} + {val}), {run} {format_duration(forecast.run_s)}")
