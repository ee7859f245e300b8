"""Sizing: from a profile to the batch size a run uses and what the profile predicts for it — decided once.

Pure functions over a :class:`~vramcal.profile.Profile`; ``vramcal train``, ``vramcal tune``, the
Lightning callback and the public API all size through :func:`size`, and pass its :class:`Sizing` on.

The data term. A profile records the bytes of data its trials held in the measured memory
(``Profile.pool_data_bytes``: on the host, the whole dataset; on a GPU, only data placed on the device).
A run that holds more there has that much less for everything else, so every prediction adds
``delta = run's bytes − calibration's bytes``; when the safe size's verification peak plus ``delta`` no
longer fits, the limits are recomputed against ``usable − delta`` (never above the profile's verified sizes):

    predicted(b) = overhead + slope × b + delta          upper(b) = fit.upper(b) + delta
    safe = min(profile safe, largest b with upper(b) ≤ usable)      conservative = ⌊fraction × safe⌋
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from vramcal.calibration.limits import Limits, safe_batch_size
from vramcal.calibration.throughput import find_knee, measured_rates, rate_at
from vramcal.profile import Profile
from vramcal.records import Trial
from vramcal.units import format_bytes

Limit = Literal["conservative", "safe"]  # which of the profile's limits a run takes
SizeFor = Literal["memory", "throughput"]  # what a run without a requested batch size is sized for


class SizingError(ValueError):
    """No usable profile or batch size; the one-line message says which command or option fixes it."""


@dataclass(frozen=True)
class Sizing:
    """The batch size a run uses, why, and what the profile predicts for it. Bytes are integers.

    Attributes:
        batch_size: samples per optimizer step.
        source: ``conservative`` or ``safe`` (the profile's), ``knee`` (the throughput knee, sizing for
            throughput: :func:`throughput_choice`), ``requested`` (the caller's, within bounds) or ``clamped``
            (the caller's, moved into [batch_size_min, safe]).
        safe_batch_size, conservative_batch_size: the limits in force (after the data term).
        predicted_peak_bytes, upper_bytes: point prediction and upper 95 % bound of the run's peak.
        usable_bytes, total_bytes: the profile's memory figures.
        data_delta_bytes: the run's data bytes in the measured memory minus the calibration's.
        verified: the profile's limits were verified by real trials.
        notices: one line each, for people: clamping, the data term, an unverified profile.
        fitted_from: the smallest batch size of the fitted points (None: a 2-D model); below it the
            prediction is an extrapolation (:func:`verdict`).
    """

    batch_size: int
    source: str
    safe_batch_size: int
    conservative_batch_size: int
    predicted_peak_bytes: int
    upper_bytes: int
    usable_bytes: int
    total_bytes: int
    data_delta_bytes: int
    verified: bool
    notices: tuple[str, ...] = ()
    fitted_from: int | None = None


@dataclass(frozen=True)
class LengthModel:
    """What sizing needs from a profile at one sequence length.

    Attributes:
        predict, upper: point prediction and upper 95 % bound of the peak at a batch size (bytes).
        safe_for: the largest batch size whose upper bound fits in a given number of bytes.
        limits: the limits at this length.
        safe_peak_bytes: the safe size's verification peak (None: not verified at this length).
        verified: both limits verified by real trials at this length.
        basis: a note when the limits are not a calibrated length's own (an interpolation).
        fitted_from: the smallest batch size of the one-length fit's points (None: the 2-D model).
    """

    predict: Callable[[int], float]
    upper: Callable[[int], float]
    safe_for: Callable[[int], int]
    limits: Limits
    safe_peak_bytes: int | None
    verified: bool
    basis: str | None = None
    fitted_from: int | None = None


def length_model(profile: Profile, seq_len: int | None = None) -> LengthModel:
    """The profile's model at the run's ``seq_len``: the one-length fit (a profile of one length: ``seq_len``
    is its own, or None), or, for a profile calibrated over several lengths, the 2-D model there
    (:mod:`vramcal.calibration.surface`), which needs the length.

    Raises:
        SizingError: no limits; a one-length profile asked about another length; a several-length profile
            asked without a length, or at one outside its range or not a multiple of chunk_size.
    """
    limits, fit, surface = profile.limits, profile.fit, profile.surface
    if limits is None or fit is None or limits.safe_batch_size < 1:
        raise SizingError("the profile has no usable limits (nothing fitted or nothing fits): re-run `vramcal probe`")
    own = profile.model.params.get("seq_len")
    if surface is None and seq_len is not None and own is not None and seq_len != own:
        raise SizingError(f"the profile was calibrated at seq_len {own}, not {seq_len}: calibrate {seq_len} (vramcal "
                          f"probe --seq-len {seq_len}, or several lengths: --seq-len {min(own, seq_len)},"
                          f"{max(own, seq_len)})")
    if surface is not None and seq_len is None:
        raise SizingError(f"the profile covers seq_len {min(surface.seq_lens)}-{max(surface.seq_lens)}: give the "
                          f"run's seq_len (its memory depends on it)")
    if surface is None or seq_len == surface.reference_seq_len:
        check = profile.verification.get("safe")
        return LengthModel(fit.predict, fit.upper, lambda usable: safe_batch_size(fit, usable), limits,
                           check.peak_bytes if check is not None and check.passed else None, profile.verified,
                           fitted_from=fitted_from(profile))
    from vramcal.calibration.fit2d import safe_batch_size_2d
    from vramcal.calibration.surface import answer_at, limits_at

    try:
        at = limits_at(surface, seq_len, limits.total_bytes, profile.settings)
        basis = answer_at(surface, seq_len, at.usable_bytes, profile.settings.conservative_fraction)[2]
    except ValueError as error:
        raise SizingError(str(error)) from None
    entry, fit2 = surface.at(seq_len), surface.fit
    return LengthModel(lambda b: fit2.predict(b, seq_len), lambda b: fit2.upper(b, seq_len),
                       lambda usable: safe_batch_size_2d(fit2, usable, seq_len), at,
                       entry.safe_peak_bytes if entry else None, bool(entry and entry.verified),
                       None if entry else basis)


def limits_for_data(model: LengthModel, profile: Profile,
                    pool_data_bytes: int | None) -> tuple[int, int, int, list[str]]:
    """(safe, conservative, data delta, notices) with the data term applied (module docstring).

    Raises:
        SizingError: the data leave no room for one sample.
    """
    limits = model.limits
    delta = 0 if pool_data_bytes is None else pool_data_bytes - profile.pool_data_bytes
    safe, conservative, notices = limits.safe_batch_size, limits.conservative_batch_size, []
    still_fits = model.safe_peak_bytes is not None and model.safe_peak_bytes + delta <= limits.usable_bytes
    if delta > 0 and not still_fits:  # the safe size's own trial, plus the extra data, no longer fits
        safe = min(safe, model.safe_for(limits.usable_bytes - delta))
        if safe < 1:
            raise SizingError(f"the data hold {format_bytes(delta)} more than the calibration's, which leaves no "
                              f"room for one sample in {format_bytes(limits.usable_bytes)}: calibrate with this "
                              f"data (vramcal probe --data ...), or keep the data off the device")
        conservative = min(conservative, math.floor(profile.settings.conservative_fraction * safe))
        if safe < limits.safe_batch_size:
            notices.append(f"the data hold {format_bytes(delta)} more than the calibration's: safe batch size "
                           f"{limits.safe_batch_size} -> {safe}, conservative {limits.conservative_batch_size} -> "
                           f"{conservative}")
    if model.basis:
        notices.append(f"the profile's limits at this seq_len are {model.basis}")
    elif not model.verified:
        notices.append("the profile's limits were not verified by real trials: they are extrapolations; "
                       "re-run `vramcal probe` to verify them")
    return safe, conservative, delta, notices


def size(profile: Profile, request: int | None = None, *, limit: Limit = "conservative",
         batch_size_min: int = 1, pool_data_bytes: int | None = None, seq_len: int | None = None,
         size_for: SizeFor = "memory") -> Sizing:
    """The batch size for a run and the profile's prediction for it.

    Args:
        profile: a checked profile (:func:`vramcal.profile.load_profile`).
        request: the caller's batch size, clamped to ``[batch_size_min, safe]``; None = ``limit``.
        limit: which limit to use when nothing is requested.
        batch_size_min: the smallest batch size acceptable.
        pool_data_bytes: the run's data bytes in the measured memory (None: as in the calibration).
        seq_len: the run's sequence length, for a profile calibrated over several (:func:`length_model`).
        size_for: ``memory`` takes ``limit``; ``throughput`` takes the throughput knee when it lies below
            ``limit`` (:func:`throughput_choice`), the limit otherwise.

    The seed documents clamp the user's batch size to [min, max] before any allocation; here max is the
    profile's safe batch size (the largest whose upper prediction bound fits in usable memory).

    Raises:
        SizingError: no limits, min above the safe batch size, the ``limit`` below min, or a
            ``seq_len`` the profile does not cover.
    """
    model = length_model(profile, seq_len)
    safe, conservative, delta, notices = limits_for_data(model, profile, pool_data_bytes)
    if batch_size_min > safe:
        raise SizingError(f"--batch-size-min {batch_size_min} is above the profile's safe batch size {safe}: "
                          f"lower --batch-size-min, or use a smaller model or a larger device")
    if request is None:
        batch, source = (conservative, "conservative") if limit == "conservative" else (safe, "safe")
        if batch < batch_size_min:
            raise SizingError(f"the profile's {limit} batch size {batch} is below --batch-size-min "
                              f"{batch_size_min}: pass --batch-size between {batch_size_min} and {safe}")
        if size_for == "throughput":
            batch, source, why = throughput_choice(profile, seq_len, batch, source, batch_size_min, safe)
            notices.append(why)
    else:
        batch = min(max(request, batch_size_min), safe)
        source = "requested" if batch == request else "clamped"
        if batch != request:
            notices.insert(0, f"--batch-size {request} is outside [{batch_size_min}, {safe}] (--batch-size-min, "
                              f"the profile's safe batch size): using {batch}")
    if model.fitted_from is not None and batch < model.fitted_from:
        notices.append(f"batch_size {batch} is below the fitted range (from batch_size {model.fitted_from}): its "
                       f"predicted peak extrapolates a line fitted near the limit, and small batches can peak above it")
    return Sizing(batch_size=batch, source=source, safe_batch_size=safe, conservative_batch_size=conservative,
                  predicted_peak_bytes=int(model.predict(batch) + delta), upper_bytes=int(model.upper(batch) + delta),
                  usable_bytes=model.limits.usable_bytes, total_bytes=model.limits.total_bytes,
                  data_delta_bytes=delta, verified=model.verified, notices=tuple(notices),
                  fitted_from=model.fitted_from)


def length_trials(profile: Profile, seq_len: int | None = None) -> list[Trial]:
    """The trials at the run's length: all of them for a one-length profile; for a profile over several
    lengths those at ``seq_len`` (the reference length's when None)."""
    if profile.surface is None:
        return list(profile.trials)
    wanted = seq_len or profile.surface.reference_seq_len
    return [t for t in profile.trials
            if t.seq_len == wanted or (t.seq_len is None and wanted == profile.surface.reference_seq_len)]


def throughput_choice(profile: Profile, seq_len: int | None, limit_batch: int, limit_name: str,
                      batch_size_min: int = 1, safe: int | None = None) -> tuple[int, str, str]:
    """(batch size, source, why) sizing for throughput: the throughput knee
    (:func:`vramcal.calibration.throughput.find_knee`, among the measured sizes a run may use: ``[batch_size_min,
    safe]``, ``safe`` default the profile's) when it is below ``limit_batch``, else the limit itself (``limit_name``).
    """
    rates = measured_rates(length_trials(profile, seq_len))
    high = safe if safe is not None else profile.limits.safe_batch_size if profile.limits else limit_batch
    knee = find_knee(rates, batch_size_min, max(high, limit_batch))
    at_limit = rate_at(rates, limit_batch)
    there = f" ({at_limit.samples_per_s:.3g} samples/s)" if at_limit else ""
    if knee is None:
        return limit_batch, limit_name, (f"sizing for throughput: no measured throughput up to batch_size "
                                         f"{limit_batch}: using the {limit_name} batch size {limit_batch}")
    reach = (f"the throughput knee, the smallest measured batch size reaching {knee.fraction * 100:g} % of the best "
             f"{knee.best.samples_per_s:.3g} samples/s (at batch_size {knee.best.batch_size})")
    if knee.batch_size < limit_batch:
        gain = knee.best.samples_per_s / knee.rate.samples_per_s - 1
        beyond = (f"no measured size gains more than {gain:.1%} over it" if knee.best is not knee.rate
                  else "no measured size is faster")
        if not knee.rate.steady:
            beyond += (f" (its rate rests on {knee.rate.n_steps} timed step{'s' * (knee.rate.n_steps != 1)} of short "
                       f"trials: the first epoch's time against the forecast will tell)")
        return knee.batch_size, "knee", (f"sizing for throughput: batch_size {knee.batch_size} "
                                         f"({knee.rate.samples_per_s:.3g} samples/s) is {reach}, below the "
                                         f"{limit_name} batch size {limit_batch}{there}; {beyond}")
    return limit_batch, limit_name, (f"sizing for throughput: {reach}, batch_size {knee.batch_size}, is not below "
                                     f"the {limit_name} batch size {limit_batch}: using {limit_batch}")


def fitted_from(profile: Profile) -> int | None:
    """The smallest batch size among the one-length fit's points (None: no fit, or a profile over lengths)."""
    if profile.fit is None or profile.surface is not None or not profile.fit.batch_sizes:
        return None
    return min(profile.fit.batch_sizes)


def verdict(peak_bytes: int, upper_bytes: int, usable_bytes: int, batch_size: int, fitted_from: int | None) -> str:
    """How a training run's measured peak compares with the profile's figures for it (bytes; batch sizes in
    samples): ``above usable``; ``above the bound`` (the upper 95 % bound: the profile under-predicts the
    run); ``below the fitted range`` (above the bound at a batch size smaller than every fitted point, where
    the line, fitted near the limit, is an extrapolation: on the host, peaks at small batches sit above it);
    else ``within the bound``."""
    if peak_bytes > usable_bytes:
        return "above usable"
    if peak_bytes <= upper_bytes:
        return "within the bound"
    return "below the fitted range" if fitted_from is not None and batch_size < fitted_from else "above the bound"


def scaled_lr(lr: float, batch_size: int, reference_batch_size: int, scaling: str) -> float:
    """Peak learning rate for ``batch_size`` given ``lr`` at ``reference_batch_size``.

    ``none``: lr. ``linear``: lr x b / ref (Goyal et al. 2017, for SGD). ``sqrt``: lr x sqrt(b / ref),
    the square-root scaling rule for Adam (Malladi et al. 2022, "On the SDEs and Scaling Rules for
    Adaptive Gradient Algorithms").
    """
    ratio = batch_size / reference_batch_size
    if scaling == "none":
        return lr
    if scaling == "linear":
        return lr * ratio
    if scaling == "sqrt":
        return lr * math.sqrt(ratio)
    raise ValueError(f"lr scaling must be none, linear or sqrt, got {scaling!r}")
