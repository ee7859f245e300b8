"""From a profile and a :class:`~vramcal.sizing.request.SizeRequest` to a :class:`~vramcal.sizing.request.Sizing`:
the profile's model at the run's length, the limits moved by the run's terms, the batch size chosen and an
effective batch reached by accumulation (the rules: :mod:`vramcal.sizing`)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from vramcal.calibration.fit2d import safe_batch_size_2d
from vramcal.calibration.limits import Limits, safe_batch_size
from vramcal.calibration.surface import answer_at, limits_at
from vramcal.profile import Profile
from vramcal.sizing.request import (
    GradientsHeld,
    Limit,
    NoLimitsError,
    SizeRequest,
    Sizing,
    SizingError,
    Source,
    check_counts,
    check_profile,
)
from vramcal.sizing.terms import (
    extra_bytes,
    gradient_term,
    length_trials,
    missing,
    process_notice,
    process_spread,
    repeat_spread,
)
from vramcal.sizing.throughput import throughput_choice
from vramcal.units import format_bytes
from vramcal.words import Info, given, word


@dataclass(frozen=True)
class LengthModel:
    """What sizing needs from a profile at one sequence length: the peak's prediction and upper 95 % bound at a
    batch size (bytes), the largest batch whose bound fits a number of bytes (``safe_for``), the limits, the safe
    size's verified peak (None: not verified here), an interpolation's ``basis`` note, :func:`fitted_from`, and
    the verified peaks by batch size."""

    predict: Callable[[int], float]
    upper: Callable[[int], float]
    safe_for: Callable[[int], int]
    limits: Limits
    safe_peak_bytes: int | None
    verified: bool
    basis: str | None = None
    fitted_from: int | None = None
    verified_peaks: dict[int, int] = field(default_factory=dict)

    def expected(self, batch_size: int) -> float:
        """The prediction at ``batch_size``, never below a verified peak there (bytes)."""
        return max(self.predict(batch_size), self.verified_peaks.get(batch_size, 0))


def length_model(profile: Profile, seq_len: int | None = None) -> LengthModel:
    """The profile's model at ``seq_len``: the one-length fit, or the 2-D model there
    (:mod:`vramcal.calibration.surface`).

    Raises:
        SizingError: no limits; a one-length profile asked about another length; a several-length profile
            asked without a length, or at one outside its range or not a multiple of chunk_size.
    """
    limits, fit, surface = profile.limits, profile.fit, profile.surface
    if limits is None or fit is None or limits.safe_batch_size < 1:
        raise NoLimitsError(f"{NoLimitsError.NO_LIMITS}: re-run `vramcal probe` with a larger budget")
    own = profile.model.params.get("seq_len")
    if surface is None and seq_len is not None and own is not None and seq_len != own:
        raise SizingError(f"the profile was calibrated at seq_len {own}, not {seq_len}: calibrate {seq_len} (`vramcal "
                          f"probe --seq-len {seq_len}`, or several lengths: `--seq-len {min(own, seq_len)},"
                          f"{max(own, seq_len)}`)")
    if surface is not None and seq_len is None:
        raise SizingError(f"the profile covers seq_len {min(surface.seq_lens)}-{max(surface.seq_lens)}: give the "
                          f"run's {word('seq_len')} (its memory depends on it)")
    if surface is None or seq_len == surface.reference_seq_len:
        check = profile.verification.get("safe")
        peaks = {v.batch_size: v.peak_bytes for v in profile.verification.values() if v.passed and v.peak_bytes}
        return LengthModel(fit.predict, fit.upper, lambda usable: safe_batch_size(fit, usable), limits,
                           check.peak_bytes if check is not None and check.passed else None, profile.verified,
                           fitted_from=fitted_from(profile), verified_peaks=peaks)

    try:
        at = limits_at(surface, seq_len, limits.total_bytes, profile.settings)
        basis = answer_at(surface, seq_len, at.usable_bytes, profile.settings.conservative_fraction)[2]
    except ValueError as error:
        raise SizingError(str(error)) from None
    entry, fit2, widen = surface.at(seq_len), surface.fit, surface.widening(seq_len)
    return LengthModel(lambda b: fit2.predict(b, seq_len), lambda b: surface.upper(b, seq_len),
                       lambda usable: safe_batch_size_2d(fit2, usable, seq_len, widen), at,
                       entry.safe_peak_bytes if entry else None, bool(entry and entry.verified),
                       None if entry else basis)


def fitted_from(profile: Profile) -> int | None:
    """The smallest batch size among the one-length fit's points (None: no fit, or a profile over lengths)."""
    if profile.fit is None or profile.surface is not None or not profile.fit.batch_sizes:
        return None
    return min(profile.fit.batch_sizes)


def limits_for_data(model: LengthModel, profile: Profile, delta: int, cause: str = "the data hold",
                    seq_len: int | None = None) -> tuple[int, int, list[str]]:
    """(safe, conservative, notices) with ``delta`` bytes more than the calibration held (:mod:`vramcal.sizing`'s
    rule; ``cause`` names them), capped by :func:`run_failure_cap`.

    Raises:
        SizingError: ``delta`` leaves no room for one sample; no trial ran below a recorded failure.
    """
    limits = model.limits
    safe, conservative, notices = limits.safe_batch_size, limits.conservative_batch_size, []
    room = limits.usable_bytes - delta
    still_fits = model.safe_peak_bytes is not None and max(model.safe_peak_bytes, model.expected(safe)) <= room
    if delta > 0 and not still_fits:
        safe = min(safe, max(model.safe_for(room), _moved_down(model, delta)))
        while safe >= 1 and model.expected(safe) > room:  # the run's own prediction fits too: the verified peak
            safe -= 1  # moved down carries no step creep, which the prediction does
        if safe < 1:
            raise SizingError(f"{cause} {format_bytes(delta)} more than the calibration's, which leaves no room for "
                              f"one sample in {format_bytes(limits.usable_bytes)}: calibrate the way this run holds "
                              f"it, or hold less")
        conservative = min(conservative, math.floor(profile.settings.conservative_fraction * safe))
        if safe < limits.safe_batch_size:
            notices.append(Info(f"{cause} {format_bytes(delta)} more than the calibration's: safe batch size "
                                f"{limits.safe_batch_size} -> {safe}, conservative {limits.conservative_batch_size} "
                                f"-> {conservative}"))
    cap, why = run_failure_cap(profile, seq_len)
    if cap is not None and cap < safe:
        safe, conservative = cap, min(conservative, cap)
        notices.append(why)
    if model.basis:
        notices.append(basis_notice(model.basis))
    elif not model.verified:
        notices.append("the profile's limits were not verified by real trials: they are extrapolations; "
                       "re-run `vramcal probe` to verify them")
    return safe, conservative, notices


def run_failure_cap(profile: Profile, seq_len: int | None = None) -> tuple[int | None, str]:
    """(cap, notice) after recorded runs ran out of memory: the largest batch size a trial ran and fitted in below
    the smallest failed run's (at ``seq_len``); (None, "") when no run failed.

    Raises:
        SizingError: no trial ran below it.
    """
    failed = [o for o in profile.observations if o.out_of_memory]
    if not failed:
        return None, ""
    first = min(failed, key=lambda o: o.batch_size)
    usable = profile.settings.usable_bytes(profile.device.total_bytes)
    below = [t.batch_size for t in length_trials(profile, seq_len)
             if t.fits(usable) and t.batch_size < first.batch_size]
    if not below:
        raise SizingError(f"a run ran out of memory at batch_size {first.batch_size} (step {first.steps}) and no trial "
                          f"of the profile ran below it: train at a batch size below {first.batch_size} unchecked, or "
                          f"calibrate with less held beside the model")
    return max(below), (f"a run ran out of memory at batch_size {first.batch_size} (step {first.steps}, peak "
                        f"{format_bytes(first.peak_bytes)}, predicted {format_bytes(first.predicted_peak_bytes)}): "
                        f"batch sizes up to {max(below)}, the largest below it that a trial ran")


def basis_notice(basis: str) -> str:
    """The notice of limits read at a length not verified as such (``basis``:
    :func:`vramcal.calibration.surface.answer_at`'s)."""
    return f"the profile's limits at this seq_len are {basis}"


def _moved_down(model: LengthModel, delta: int) -> int:
    """The largest batch size up to the safe one whose verified peak, moved down the fit, fits with ``delta``."""
    top = model.limits.safe_batch_size
    if model.safe_peak_bytes is None:
        return 0
    excess = model.safe_peak_bytes + delta - model.limits.usable_bytes
    # predict() rises with b: the largest b whose prediction lies at least `excess` below the safe size's
    return bisect.bisect_right(range(top + 1), -excess, key=lambda b: model.predict(b) - model.predict(top)) - 1


def size(profile: Profile, ask: SizeRequest = SizeRequest(), *, pool_data_bytes: int | None = None,
         process_bytes: int | None = None, free_bytes: int | None = None, free_source: str = "free now") -> Sizing:
    """The batch size for a run and the profile's prediction for it (:mod:`vramcal.sizing`).

    Args:
        profile: a checked profile (:func:`vramcal.profile.load_profile`).
        ask: what the run asks (:class:`~vramcal.sizing.request.SizeRequest`).
        pool_data_bytes: the run's data bytes in the measured memory (None: as in the calibration).
        process_bytes: what the run's process holds at the start of training (the process term); it replaces
            ``pool_data_bytes``.
        free_bytes: what the device has free before the run (the gate; ``free_source`` says whose figure).

    Raises:
        SizingError: no limits, min above the safe batch size, the ``limit`` below min, or a ``seq_len`` the
            profile does not cover; a byte count below 0. TypeError: a profile that is no Profile, an ``ask``
            that is no SizeRequest, a byte count that is no whole number.
    """
    check_profile(profile)
    if not isinstance(ask, SizeRequest):
        raise TypeError(f"ask= takes what the run asks as a vramcal.SizeRequest, not {type(ask).__name__} "
                        f"{ask!r:.40}: size(profile, SizeRequest(request=64)) for a batch size")
    check_counts(pool_data_bytes=pool_data_bytes, process_bytes=process_bytes, free_bytes=free_bytes)
    if not isinstance(free_source, str):
        raise TypeError(f"free_source= takes where free_bytes came from, as a str, not {type(free_source).__name__} "
                        f"{free_source!r:.40}")
    model = length_model(profile, ask.seq_len)
    extra = extra_bytes(profile, pool_data_bytes, process_bytes)
    gone = missing(model.limits, profile.settings, free_bytes, free_source)
    sizing = _size(profile, model, extra, process_bytes, ask, gone=gone)
    if ask.gradients is None and sizing.accumulation_steps > 1:
        sizing = _size(profile, model, extra, process_bytes, ask.replace(gradients=GradientsHeld.ACCUMULATION),
                       sizing.accumulation_steps, gone)
    return sizing


def _size(profile: Profile, model: LengthModel, extra: tuple[int, int, str], process_bytes: int | None,
          ask: SizeRequest, accumulation_steps: int = 1, gone: tuple[int, str | None] = (0, None)) -> Sizing:
    """:func:`size` with the terms found (``gone``: :func:`~vramcal.sizing.terms.missing`'s)."""
    data_delta, process_delta, cause = extra
    gradient_delta, gradient_notice = gradient_term(profile, ask.gradients, accumulation_steps)
    terms = [(size, name) for size, name in ((data_delta, "data"), (process_delta, "process"),
                                              (gradient_delta, "gradient"), (gone[0], "missing memory")) if size]
    if len(terms) > 1:  # name each term that moved the limits, not the last one alone
        cause = "this run holds (" + ", ".join(f"{name} term {size / 2**20:+.1f} MiB" for size, name in terms) + ")"
    elif gradient_delta:
        cause = "with the gradients held through the forward pass, this run holds"
    elif gone[0]:
        cause = "with the memory missing now, this run needs"
    safe, conservative, notices = limits_for_data(model, profile, data_delta + process_delta + gradient_delta + gone[0],
                                                  cause, ask.seq_len)
    if gone[1]:
        notices.insert(0, gone[1])
    if gradient_notice:
        notices.insert(0, gradient_notice)
    if process_bytes is not None:
        notices.insert(0, process_notice(profile, process_bytes, process_delta))
    batch, source = _chosen(ask.request, ask.limit, safe, conservative, ask.batch_size_min, notices)
    if ask.request is None and ask.size_for == "throughput":
        batch, source, why = throughput_choice(profile, ask.seq_len, batch, source, ask.batch_size_min, safe)
        notices.append(Info(why))
    steps = 1
    if ask.effective_batch_size is not None:
        batch, steps = accumulation(ask.effective_batch_size, batch, ask.exact)
    if model.fitted_from is not None and batch < model.fitted_from:
        notices.append(f"batch_size {batch} is below the fitted range (from batch_size {model.fitted_from}): its "
                       f"predicted peak extrapolates a line fitted near the limit, and small batches can peak above it")
    delta = data_delta + process_delta + gradient_delta
    expected = model.expected(batch)
    upper = max(model.upper(batch), expected)
    spread, basis = repeat_spread(profile, ask.seq_len)
    term = process_spread(profile) if process_bytes is not None and profile.held_bytes is not None else 0
    if term:
        basis += f", plus {format_bytes(term)}: what the process term may be off by"
    return Sizing(batch_size=batch, source=source, safe_batch_size=safe, conservative_batch_size=conservative,
                  predicted_peak_bytes=int(expected + delta), upper_bytes=int(upper + delta),
                  warn_bytes=int(max(upper + delta, (expected + delta) * (1 + spread)) + term), warn_basis=basis,
                  usable_bytes=model.limits.usable_bytes, total_bytes=model.limits.total_bytes,
                  data_delta_bytes=data_delta, verified=model.verified, notices=tuple(notices),
                  fitted_from=model.fitted_from, process_delta_bytes=process_delta, accumulation_steps=steps,
                  effective_batch_size=batch * steps if ask.effective_batch_size is None else ask.effective_batch_size,
                  gradient_delta_bytes=gradient_delta, missing_bytes=gone[0])


def _chosen(request: int | None, limit: Limit, safe: int, conservative: int, batch_size_min: int,
            notices: list[str]) -> tuple[int, Source]:
    """The batch size and its source: the ``limit``, or ``request`` within ``[batch_size_min, safe]``.

    Raises:
        SizingError: the bounds are empty, or the limit is below ``batch_size_min``.
    """
    if batch_size_min > safe:
        raise SizingError(f"{given('batch_size_min', batch_size_min)} is above the profile's safe batch size "
                          f"{safe}: lower {word('batch_size_min')}, or use a smaller model or a larger device")
    if request is None:
        batch, source = (conservative, "conservative") if limit == "conservative" else (safe, "safe")
        if batch < batch_size_min:
            raise SizingError(f"the profile's {limit} batch size {batch} is below "
                              f"{given('batch_size_min', batch_size_min)}: ask for a batch size "
                              f"({word('batch_size')}) between {batch_size_min} and {safe}")
        return batch, source
    batch = min(max(request, batch_size_min), safe)
    if batch != request:
        notices.insert(0, f"{given('batch_size', request)} is outside [{batch_size_min}, {safe}] "
                          f"({word('batch_size_min')}, the profile's safe batch size): using {batch}")
    return batch, "requested" if batch == request else "clamped"


def accumulation(effective_batch_size: int, micro_limit: int, exact: bool = False) -> tuple[int, int]:
    """(micro-batch, accumulation steps) reaching ``effective_batch_size`` samples per optimizer step with
    micro-batches of at most ``micro_limit``: the fewest steps, ``ceil(effective / limit)``; ``exact``: the largest
    micro-batch that divides the effective batch.

    Raises:
        SizingError: an effective batch below 1.
    """
    if effective_batch_size < 1:
        raise SizingError(f"the effective batch size must be >= 1, got {effective_batch_size}")
    if effective_batch_size <= micro_limit:
        return effective_batch_size, 1
    if exact:
        micro = max(d for d in range(1, micro_limit + 1) if effective_batch_size % d == 0)
        return micro, effective_batch_size // micro
    steps = math.ceil(effective_batch_size / micro_limit)
    return math.ceil(effective_batch_size / steps), steps


def scaled_lr(lr: float, batch_size: int, reference_batch_size: int, scaling: str) -> float:
    """Peak learning rate for ``batch_size`` given ``lr`` at ``reference_batch_size``: ``none`` lr; ``linear``
    lr × b / ref (Goyal et al. 2017, for SGD); ``sqrt`` lr × √(b / ref), for Adam (Malladi et al. 2022, "On the SDEs
    and Scaling Rules for Adaptive Gradient Algorithms").

    Raises:
        ValueError: another ``scaling``.
    """
    ratio = batch_size / reference_batch_size
    if scaling == "none":
        return lr
    if scaling == "linear":
        return lr * ratio
    if scaling == "sqrt":
        return lr * math.sqrt(ratio)
    raise ValueError(f"lr scaling must be none, linear or sqrt, got {scaling!r}")
