"""One calibration for several sequence lengths: the policy and the record of the 2-D memory model
(:mod:`vramcal.calibration.fit2d`). Its rules:

1. **One full calibration at the reference length** (:func:`reference_length`, the middle requested one): the
   one-length search (:mod:`vramcal.calibration.search`), so the other lengths are interpolated from it.
2. **Each other length costs its verifications only**, longest first: a first trial at the safe size the model
   predicts (before the 2-D fit, the reference slope scaled by the length: it over-predicts a longer length, so
   the guess fits, and its point splits the per-token and per-sample terms), then the safe size twice and the
   conservative once, bisected below a failure as in the one-length search.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from vramcal.calibration.creep import steady_equivalent
from vramcal.calibration.fit import Fit
from vramcal.calibration.fit2d import Fit2D, fit_2d, longest_seq_len, safe_batch_size_2d
from vramcal.calibration.limits import Limits, line_limits
from vramcal.calibration.search import (
    SearchSettings,
    Step,
    bisect_below,
    failed_batch_size,
    fit_points,
    largest_fitting,
    next_batch_size,
    settle,
    snap_trial,
    verify_safe,
)
from vramcal.records import Trial
from vramcal.schema import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, Record, read_list

INTERPOLATED = "interpolated (not verified at this length)"  # the basis of limits between calibrated lengths
# What the fit may under-predict between calibrated lengths, a share of the prediction added to the bound there
# (Surface.upper): the worst interpolated answer of bench/interpolation.py (bench/README.md), rounded up.
INTERPOLATION_ERROR = 0.005


@dataclass(frozen=True)
class LengthLimits(Record):
    """The limits at one calibrated ``seq_len`` (as :class:`~vramcal.calibration.limits.Limits`'), the peaks of
    the trials that verified them (None: not verified), the smallest size that did not fit there (or None)."""

    seq_len: int
    safe_batch_size: int
    conservative_batch_size: int
    safe_peak_bytes: int | None
    conservative_peak_bytes: int | None
    failed_batch_size: int | None = None

    @property
    def verified(self) -> bool:
        return self.safe_peak_bytes is not None and self.conservative_peak_bytes is not None

    WHERE = "surface.lengths[0]"
    RANGES = {"seq_len": AT_LEAST_ONE, "safe_batch_size": NON_NEGATIVE, "conservative_batch_size": NON_NEGATIVE,
              "safe_peak_bytes": POSITIVE, "conservative_peak_bytes": POSITIVE, "failed_batch_size": AT_LEAST_ONE}


@dataclass(frozen=True)
class Surface(Record):
    """The 2-D model ``fit`` of a profile calibrated at several lengths (multiples of ``chunk_size``), the length
    calibrated in full (``reference_seq_len``) and the limits at each, shortest first (``lengths``)."""

    fit: Fit2D
    reference_seq_len: int
    chunk_size: int
    lengths: tuple[LengthLimits, ...]

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(entry.seq_len for entry in self.lengths)

    def covers(self, seq_len: int) -> bool:
        """Whether ``seq_len`` lies inside the calibrated range (interpolation, not extrapolation)."""
        return min(self.seq_lens) <= seq_len <= max(self.seq_lens)

    def at(self, seq_len: int) -> LengthLimits | None:
        return next((entry for entry in self.lengths if entry.seq_len == seq_len), None)

    def widening(self, seq_len: int) -> float:
        """What the bound adds at ``seq_len``, a fraction of the prediction: :data:`INTERPOLATION_ERROR` between
        calibrated lengths, 0 at one."""
        return 0.0 if self.at(seq_len) is not None else INTERPOLATION_ERROR

    def upper(self, batch_size: float, seq_len: int) -> float:
        """The bound limits are held to (bytes): the fit's 95 % upper bound plus :meth:`widening` × prediction."""
        fit = self.fit
        return fit.upper(batch_size, seq_len) + self.widening(seq_len) * fit.predict(batch_size, seq_len)

    WHERE, RANGES = "surface", {"reference_seq_len": AT_LEAST_ONE, "chunk_size": AT_LEAST_ONE}
    READERS = {"fit": Fit2D.from_dict, "lengths": lambda value, path: read_list(value, path, LengthLimits.from_dict)}


def reference_length(seq_lens: Sequence[int]) -> int:
    """The length calibrated in full: the middle of the requested ones (the lower middle of an even count)."""
    ordered = sorted(seq_lens)
    return ordered[(len(ordered) - 1) // 2]


def at_length(trials: Sequence[Trial], seq_len: int) -> list[Trial]:
    return [t for t in trials if t.seq_len == seq_len]


def surface_fit(trials: Sequence[Trial], settings: SearchSettings) -> Fit2D | None:
    """The 2-D fit through each length's :func:`~vramcal.calibration.search.fit_points`, or None while it has
    fewer than 4 points over 2 lengths and 2 batch sizes."""
    trials = steady_equivalent(trials)
    points = [t for length in {t.seq_len for t in trials} for t in fit_points(at_length(trials, length), settings)]
    if len({t.seq_len for t in points}) < 2 or len({t.batch_size for t in points}) < 2 or len(points) < 4:
        return None
    try:
        return fit_2d([t.batch_size for t in points], [t.seq_len for t in points], [t.peak_bytes for t in points])
    except ValueError:  # collinear designs: wait for another point
        return None


def predicted_safe(trials: Sequence[Trial], seq_len: int, reference: int, settings: SearchSettings) -> int:
    """The safe batch size the model gives at ``seq_len``: from the 2-D fit, or before there is one, from the
    reference length's fit with its slope scaled by ``seq_len / reference`` (all memory per token)."""
    usable = settings.usable_bytes
    fit2 = surface_fit(trials, settings)
    if fit2 is not None:
        return safe_batch_size_2d(fit2, usable, seq_len)
    state = settle(at_length(trials, reference), settings)
    fit = state.fit
    if fit is None or fit.slope_bytes_per_sample <= 0:
        return 0
    slope = fit.slope_bytes_per_sample * seq_len / reference
    return max(0, math.floor((usable - fit.overhead_bytes) / slope * (1 - settings.snap_tolerance)))


def length_limits(trials: Sequence[Trial], seq_len: int, reference: int, settings: SearchSettings) -> LengthLimits:
    """The limits at one other length: the model's safe size, at least the largest that fitted there, bisected
    below a failure that binds (search rules 4 and 5)."""
    usable = settings.usable_bytes
    here = at_length(steady_equivalent(trials), seq_len)
    failed = failed_batch_size(here, usable)
    target = max(predicted_safe(trials, seq_len, reference, settings), largest_fitting(here, usable) or 0)
    if failed is not None and target >= failed - 1:
        target = bisect_below(here, failed, settings)
    wide = 2 * settings.snap_tolerance  # the window a limit settles in at a non-reference length
    safe_trial = snap_trial(here, target, settings, 2 if settings.repeat_safe else 1, wide)
    safe = safe_trial.batch_size if safe_trial else target
    conservative = math.floor(settings.limits.conservative_fraction * safe)
    conservative_trial = snap_trial(here, conservative, settings, 1, wide)
    if conservative_trial is not None:
        conservative = conservative_trial.batch_size
    return LengthLimits(seq_len, safe, conservative, safe_trial and safe_trial.peak_bytes,
                        conservative_trial and conservative_trial.peak_bytes, failed)


def next_trial(trials: Sequence[Trial], seq_lens: Sequence[int], settings: SearchSettings) -> tuple[int, Step] | None:
    """The next (seq_len, step) over ``seq_lens`` (module docstring), or None when done; ``trials`` carry their
    ``seq_len``, ``settings.max_trials`` bounds them all."""
    if len(trials) >= settings.max_trials:
        return None
    reference = reference_length(seq_lens)
    step = next_batch_size(at_length(trials, reference), dataclasses.replace(settings, max_trials=10**6))
    if step is not None:
        return reference, step
    if settle(at_length(trials, reference), settings).safe_trial is None:
        return None  # the reference length did not settle: nothing to scale from
    # longest first (module docstring, 2)
    for seq_len in sorted((length for length in seq_lens if length != reference), reverse=True):
        step = _verify_length(trials, seq_len, reference, settings)
        if step is not None:
            return seq_len, step
    return None


def _verify_length(trials: Sequence[Trial], seq_len: int, reference: int, settings: SearchSettings) -> Step | None:
    here = at_length(trials, seq_len)
    if here and not any(t.fits(settings.usable_bytes) for t in here) and min(t.batch_size for t in here) == 1:
        return None  # one sample does not fit at this length
    limits = length_limits(trials, seq_len, reference, settings)
    tried = {t.batch_size for t in here}
    if limits.safe_batch_size < 1:
        return Step(1, "verify-safe") if 1 not in tried else None
    if limits.safe_peak_bytes is None:
        return verify_safe(here, limits.safe_batch_size, settings, 2 * settings.snap_tolerance)
    if limits.conservative_peak_bytes is None and limits.conservative_batch_size >= 1:
        if limits.conservative_batch_size not in tried:
            return Step(limits.conservative_batch_size, "verify-conservative")
    return None


def settle_surface(trials: Sequence[Trial], seq_lens: Sequence[int], chunk_size: int,
                   settings: SearchSettings) -> tuple[Surface | None, Fit | None, Limits | None]:
    """The surface (None without a 2-D fit) and the reference length's one-length fit and limits."""
    reference = reference_length(seq_lens)
    state = settle(at_length(trials, reference), settings)
    fit2 = surface_fit(trials, settings)
    if fit2 is None or state.limits is None:
        return None, state.fit, state.limits
    entries = []
    for seq_len in sorted(seq_lens):
        if seq_len == reference:
            entries.append(LengthLimits(seq_len, state.limits.safe_batch_size, state.limits.conservative_batch_size,
                                        state.safe_trial and state.safe_trial.peak_bytes,
                                        state.conservative_trial and state.conservative_trial.peak_bytes,
                                        state.failed_batch_size))
        else:
            entries.append(length_limits(trials, seq_len, reference, settings))
    return Surface(fit2, reference, chunk_size, tuple(entries)), state.fit, state.limits


def answer_at(surface: Surface, seq_len: int, usable_bytes: int, conservative_fraction: float) -> tuple[int, int, str]:
    """(safe, conservative, basis) at ``seq_len``: a calibrated length's limits, else the model's safe size under
    :meth:`Surface.upper`, never above the next shorter calibrated length's (memory grows with length).

    Raises:
        ValueError: ``seq_len`` outside the calibrated range, or not a multiple of chunk_size.
    """
    if seq_len % surface.chunk_size:
        raise ValueError(f"seq_len {seq_len} is not a multiple of chunk_size {surface.chunk_size}")
    if not surface.covers(seq_len):
        raise ValueError(f"seq_len {seq_len} is outside the calibrated range {min(surface.seq_lens)}-"
                         f"{max(surface.seq_lens)}: calibrate it (vramcal probe --seq-len ...)")
    entry = surface.at(seq_len)
    if entry is not None:
        return entry.safe_batch_size, entry.conservative_batch_size, "verified" if entry.verified else "not verified"
    shorter = max((e for e in surface.lengths if e.seq_len < seq_len), key=lambda e: e.seq_len)
    model = safe_batch_size_2d(surface.fit, usable_bytes, seq_len, surface.widening(seq_len))
    safe = min(model, shorter.safe_batch_size)
    return safe, math.floor(conservative_fraction * safe), INTERPOLATED


def longest_at(surface: Surface, batch_size: int, usable_bytes: int) -> int:
    """The longest calibrated-range multiple of chunk_size whose :meth:`Surface.upper` at ``batch_size`` fits in
    ``usable_bytes``; 0 when none does."""
    low, high, fit = min(surface.seq_lens), max(surface.seq_lens), surface.fit
    between = longest_seq_len(fit, usable_bytes, batch_size, surface.chunk_size, low, high, INTERPOLATION_ERROR)
    plain = longest_seq_len(fit, usable_bytes, batch_size, surface.chunk_size, low, high)
    return max(between, max((n for n in surface.seq_lens if n <= plain), default=0))


def limits_at(surface: Surface, seq_len: int, total_bytes: int, settings) -> Limits:
    """A :class:`~vramcal.calibration.limits.Limits` record at ``seq_len`` (for sizing and reports)."""
    usable = settings.usable_bytes(total_bytes)
    safe, conservative, _ = answer_at(surface, seq_len, usable, settings.conservative_fraction)
    fit, entry = surface.fit, surface.at(seq_len)
    return line_limits(fit.overhead_bytes, fit.bytes_per_token * seq_len + fit.bytes_per_sample, total_bytes, usable,
                       safe, conservative, entry.failed_batch_size if entry else None)


