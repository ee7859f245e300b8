"""The search policy: which batch size to try next, as a pure function of the trials so far.

Separate from the code that runs trials (Accelerate's injectable back-off is the model), so it is
tested with recorded and fake trials. The policy:

1. **Grow** from ``start_batch_size`` while far from the limit: x8 with one point (the smallest batches
   sit on a flat start on CPUs, where the first samples fit in memory already mapped); then aim at half
   of the batch size where the line through the measured points (two points, or the fit once there are
   three) reaches usable memory, at most ``max_growth`` times the largest fitting batch, and never at or
   above a batch size that already failed. "Far" means the largest fitting batch is below
   ``far_fraction`` of that estimate.
2. **Fit** once at least three trials finished (over-budget ones included: they are measurements),
   and compute the limits (:mod:`vramcal.calibrate.limits`), with the safe batch size kept below the smallest
   batch size that failed (out of memory, over usable memory, timeout or crash).
3. **Verify** with real trials at the safe (a little below the computed size, within
   ``snap_tolerance / 2``, so the refit that the new point causes does not leave it above the moved
   limit), then the conservative batch size. A failure there is a
   data point: the limit comes down and the next call proposes the new sizes; when a real failure,
   not the fit, binds the limit, the safe size is found by bisection between the largest fitting
   batch and the smallest failed one. A limit is *settled*
   on a trial that fitted at, or at most ``snap_tolerance`` below, the computed size, so refits that
   move the limit by a sample or two do not chase it forever; the reported limit is that trial's
   batch size, which is never above the computed one.

The policy never reports an untested extrapolation: :func:`settle` marks each limit with the trial
behind it, and a limit without one is unverified.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from vramcal.calibrate.fit import Fit, fit_linear
from vramcal.calibrate.limits import Limits, LimitSettings, compute_limits
from vramcal.records import Trial


@dataclass(frozen=True)
class SearchSettings:
    """Knobs of the policy. ``total_bytes`` is the device's memory; limits derive usable from it."""

    total_bytes: int
    limits: LimitSettings = LimitSettings()
    start_batch_size: int = 1
    max_growth: int = 64
    far_fraction: float = 0.4
    snap_tolerance: float = 0.05
    max_trials: int = 16
    max_batch_size: int = 2**20

    @property
    def usable_bytes(self) -> int:
        return self.limits.usable_bytes(self.total_bytes)


@dataclass(frozen=True)
class Step:
    """The next trial to run: its batch size and why (``grow``, ``verify-conservative``, ``verify-safe``)."""

    batch_size: int
    purpose: str


@dataclass(frozen=True)
class Settled:
    """The state of a calibration: fit, limits, and the trials that verify them (None = unverified)."""

    fit: Fit | None
    limits: Limits | None
    safe_trial: Trial | None
    conservative_trial: Trial | None
    failed_batch_size: int | None


def failed_batch_size(trials: Sequence[Trial], usable_bytes: int) -> int | None:
    """The smallest batch size that did not fit (any status but a fitting ``ok``), or None."""
    failed = [t.batch_size for t in trials if not t.fits(usable_bytes)]
    return min(failed) if failed else None


def fit_trials(trials: Sequence[Trial]) -> Fit | None:
    """The fit through every finished trial, or None with fewer than 3 points over 2 batch sizes."""
    points = [t for t in trials if t.ok]
    if len(points) < 3 or len({t.batch_size for t in points}) < 2:
        return None
    return fit_linear([t.batch_size for t in points], [t.peak_bytes for t in points])


def settle(trials: Sequence[Trial], settings: SearchSettings) -> Settled:
    """Fit, limits and verifying trials for the trials so far (module docstring, steps 2 and 3)."""
    usable = settings.usable_bytes
    failed = failed_batch_size(trials, usable)
    fit = fit_trials(trials)
    if fit is None or fit.slope_bytes_per_sample <= 0:
        return Settled(fit, None, None, None, failed)
    limits = compute_limits(fit, settings.total_bytes, settings.limits, failed)
    target = limits.safe_batch_size
    if failed is not None and target >= failed - 1:
        target = _bisect_below(trials, failed, settings)  # the failure binds, not the fit
    safe_trial = _snap(trials, target, settings)
    safe = safe_trial.batch_size if safe_trial else target
    conservative_target = math.floor(settings.limits.conservative_fraction * safe)
    conservative_trial = _snap(trials, conservative_target, settings)
    conservative = conservative_trial.batch_size if conservative_trial else conservative_target
    limits = dataclasses.replace(limits, safe_batch_size=safe, conservative_batch_size=conservative)
    return Settled(fit, limits, safe_trial, conservative_trial, failed)


def _bisect_below(trials: Sequence[Trial], failed: int, settings: SearchSettings) -> int:
    """Safe target when a real failure binds: the largest fitting batch below ``failed`` once the gap is
    within ``snap_tolerance`` (or one sample), else the midpoint (the next bisection trial)."""
    below = max(t.batch_size for t in trials if t.fits(settings.usable_bytes) and t.batch_size < failed)
    if failed - below <= max(1, math.floor(settings.snap_tolerance * failed)):
        return below
    return (below + failed) // 2


def _snap(trials: Sequence[Trial], target: int, settings: SearchSettings) -> Trial | None:
    """The fitting trial with the largest batch size in ``[target * (1 - snap_tolerance), target]``."""
    low = math.floor(target * (1 - settings.snap_tolerance))
    near = [t for t in trials if t.fits(settings.usable_bytes) and low <= t.batch_size <= target]
    return max(near, key=lambda t: t.batch_size) if near and target >= 1 else None


def next_batch_size(trials: Sequence[Trial], settings: SearchSettings) -> Step | None:
    """The next trial to run, or None when the calibration is done (or cannot go on).

    Done means: both limits settled on fitting trials; or nothing fits; or ``max_trials`` were run;
    or no larger batch size can be tried while fewer than three trials finished.
    """
    if not trials:
        return Step(settings.start_batch_size, "grow")
    if len(trials) >= settings.max_trials:
        return None
    if not any(t.fits(settings.usable_bytes) for t in trials):
        return None  # the smallest batch already failed: nothing fits
    grow = _grow_target(trials, settings)
    if grow is not None:
        return Step(grow, "grow")
    state = settle(trials, settings)
    if state.limits is None or state.limits.safe_batch_size < 1:
        return None
    tried = {t.batch_size for t in trials}
    if state.safe_trial is None:
        # A little below the target, inside its snap window: the verification adds a point that moves
        # the refit, and a trial still inside the moved window settles the limit instead of chasing it.
        target = state.limits.safe_batch_size
        below = max(1, math.floor(target * (1 - settings.snap_tolerance / 2)))
        for batch_size in (below, target):
            if batch_size not in tried:
                return Step(batch_size, "verify-safe")
    conservative = state.limits.conservative_batch_size  # floor(fraction x the settled safe size)
    if state.conservative_trial is None and conservative >= 1 and conservative not in tried:
        return Step(conservative, "verify-conservative")
    return None


def _grow_target(trials: Sequence[Trial], settings: SearchSettings) -> int | None:
    """A larger batch size to try while far from the limit, or None when growth is over."""
    usable = settings.usable_bytes
    fitting = sorted((t for t in trials if t.fits(usable)), key=lambda t: t.batch_size)
    largest = fitting[-1].batch_size
    failed = failed_batch_size(trials, usable)
    estimate = _estimated_limit(trials, fitting, usable)
    n_points = len({t.batch_size for t in trials if t.ok})
    if estimate is None:
        target = largest * 8  # one point, or a line that does not rise yet: no estimate to aim at
    elif n_points >= 3 and largest >= settings.far_fraction * estimate:
        return None  # close enough: fit and verify
    else:
        target = max(2 * largest, math.floor(estimate / 2))
    target = min(target, settings.max_growth * largest, settings.max_batch_size)
    if failed is not None and target >= failed:
        target = (largest + failed) // 2
    if target <= largest or target in {t.batch_size for t in trials}:
        return None
    return target


def _estimated_limit(trials: Sequence[Trial], fitting: Sequence[Trial], usable_bytes: int) -> float | None:
    """Batch size where the line through the finished trials reaches usable memory; None if unknown.

    With three or more finished trials whose line rises measurably, the fit's point estimate; with two
    or more fitting trials whose peaks differ measurably (:func:`rises`), the line through the two largest;
    else unknown (a flat start: the first samples fit in memory the process already holds, and a line
    through them would extrapolate to an absurd limit).
    """
    fit = fit_trials(trials)
    if fit is not None and fit.slope_bytes_per_sample > 3 * fit.slope_stderr_bytes_per_sample:
        slope, overhead = fit.slope_bytes_per_sample, fit.overhead_bytes
    elif len(fitting) >= 2 and rises(fitting[-2], fitting[-1]):
        low, high = fitting[-2], fitting[-1]
        slope = (high.peak_bytes - low.peak_bytes) / (high.batch_size - low.batch_size)
        overhead = high.peak_bytes - slope * high.batch_size
    else:
        return None
    return (usable_bytes - overhead) / slope if slope > 0 else None


FLAT_FRACTION = 0.02  # peaks within 2 % (or FLAT_BYTES) of each other are not a measurable rise
FLAT_BYTES = 8 * 2**20


def rises(low: Trial, high: Trial) -> bool:
    """Whether ``high``'s peak is measurably above ``low``'s (more than the noise of one trial)."""
    return high.peak_bytes - low.peak_bytes > max(FLAT_FRACTION * low.peak_bytes, FLAT_BYTES)  # type: ignore[operator]
