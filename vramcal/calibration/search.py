"""The search policy: which batch size to try next, as a pure function of the trials so far (Accelerate's
injectable back-off is the model; tested with recorded and synthetic trials). Its rules:

1. **Grow** from ``start_batch_size``: x8 while the peaks do not rise measurably (a *flat start*), then to half
   the batch size where the line through the rising points reaches usable memory, at most ``max_growth`` times
   the largest fitting batch, never at or above a failure. With an :class:`Aim` (:mod:`vramcal.estimate.learned`) the
   line before two trials rise is the largest fitting peak plus the aim's worst slope.
2. **Fit locally** (:func:`fit_points`): without the flat start and the points below ``1/local_span`` of the
   largest measured batch (peaks bend); over-budget trials count. Until there are three points, **fill** below
   the limit and between what fitted and what failed.
3. **Measure the boundary**: a peak-only trial (``TrialRequest.peak_only``) at ``boundary_fraction`` of where
   the fit reaches the whole memory, so the out-of-memory boundary is interpolated, not extrapolated (a second
   when the first fails or lands far below; a third when of two one fitted and one failed).
4. **Verify** the safe size with two trials (their spread enters the fit's residuals), then the conservative
   size with one. A failure lowers the limit; when a real failure binds it, the safe size is bisected between
   the largest fitting batch and the smallest failure.
5. **Never less than the evidence**: the safe size is at least the largest size below the smallest failure whose
   trials all fitted with room for the noise they were measured with (:mod:`vramcal.calibration.noise`; read as
   the truth, a pair 1 % low passed sizes 1.5 % over usable memory: ``bench/results/search-curves``).
6. **Measure the step creep** once the safe size is verified: one steady trial of at most ``steady_steps``
   steps at the conservative size (:mod:`vramcal.calibration.creep`), its first steps that size's verification
   when no trial has verified it (``steady_verifies``). From then on every rule reads steady-equivalent peaks;
   when that moves the conservative size by more than ``snap_tolerance``, a second steady trial measures there.
7. **Only memory sets a limit**: out of memory, or a finish above usable memory, is a failure at its size; an
   ``error`` or a ``timeout`` measured nothing and is run once more (``retry``); a size unmeasured twice is no
   limit and no proposal reaches it. A first trial that measured nothing ends the calibration.

A limit is *settled* on fitting trials at, or at most ``snap_tolerance`` below, the computed size;
:func:`settle` marks each limit with its trial, and a limit without one is unverified.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from vramcal.calibration.creep import STEADY, short_trials, steady_equivalent
from vramcal.calibration.fit import Fit, fit_linear
from vramcal.calibration.limits import Limits, LimitSettings, compute_limits, safe_ceiling
from vramcal.calibration.noise import Noise, measure_noise, near_limit
from vramcal.records import Trial, TrialSettings

FLAT_FRACTION = 0.02  # peaks within 2 % (or FLAT_BYTES) of each other are not a measurable rise
FLAT_BYTES = 8 * 2**20
FLAT_START_SPAN = 2  # a flat start spans at least this factor; closer sizes at one peak are verifications, fitted


@dataclass(frozen=True)
class Aim:
    """An estimate's bytes per sample to aim with before a slope is measured (rule 1); ``low``, ``high``: its
    errors (``estimated / measured − 1``, :class:`vramcal.estimate.learned.ErrorBound`); ``source``: for people."""

    slope_bytes_per_sample: float
    low: float
    high: float
    source: str

    @property
    def worst_slope(self) -> float:
        """The slope the search aims with: ``slope / (1 + min(low, 0))``, the estimate's worst under-prediction."""
        return self.slope_bytes_per_sample / (1 + min(self.low, 0.0))


@dataclass(frozen=True)
class SearchSettings:
    """Knobs of the policy (the module docstring's rules name them); ``total_bytes``: the device's memory.
    ``boundary_fraction`` 0 runs no boundary trial, ``steady_steps`` 0 no steady trial, ``aim`` None climbs."""

    total_bytes: int
    limits: LimitSettings = LimitSettings()
    start_batch_size: int = 1
    max_growth: int = 64
    far_fraction: float = 0.4
    snap_tolerance: float = 0.05
    local_span: int = 16
    boundary_fraction: float = 0.97
    repeat_safe: bool = True
    max_trials: int = TrialSettings.max_trials
    max_batch_size: int = 2**20
    steady_steps: int = TrialSettings.steady_steps
    steady_verifies: bool = True
    aim: Aim | None = None

    @property
    def usable_bytes(self) -> int:
        return self.limits.usable_bytes(self.total_bytes)


@dataclass(frozen=True)
class Step:
    """The next trial and why: ``grow``, ``fill``, ``boundary``, ``retry``, ``verify-safe``, ``verify-safe-repeat``,
    ``verify-conservative`` or ``steady``; ``verifies``: a steady trial that records a ``verify-conservative``
    trial first (rule 6)."""

    batch_size: int
    purpose: str
    verifies: bool = False


@dataclass(frozen=True)
class Settled:
    """The state of a calibration: fit, limits, and the trials that verify them (None = unverified)."""

    fit: Fit | None
    limits: Limits | None
    safe_trial: Trial | None
    conservative_trial: Trial | None
    failed_batch_size: int | None


def memory_failure(trial: Trial, usable_bytes: int) -> bool:
    """The trial ran out of memory, or finished above ``usable_bytes`` (rule 7: what sets a limit)."""
    return trial.status == "oom" or (trial.ok and not trial.fits(usable_bytes))


def unmeasured(trial: Trial) -> bool:
    """The trial ended in an ``error`` or a ``timeout``: it measured nothing about memory (rule 7)."""
    return trial.status in ("error", "timeout")


def unmeasured_ceiling(trials: Sequence[Trial]) -> int | None:
    """The smallest batch size whose trials ended unmeasured twice (rule 7): no proposal reaches it."""
    sizes = [b for b in {t.batch_size for t in trials} if sum(unmeasured(t) for t in trials if t.batch_size == b) >= 2]
    return min(sizes) if sizes else None


def proposal_ceiling(trials: Sequence[Trial], usable_bytes: int) -> int | None:
    """The smallest batch size no proposal may reach: a memory failure, or a size unmeasured twice (rule 7)."""
    ends = [b for b in (failed_batch_size(trials, usable_bytes), unmeasured_ceiling(trials)) if b is not None]
    return min(ends) if ends else None


def failed_batch_size(trials: Sequence[Trial], usable_bytes: int) -> int | None:
    """The smallest batch size with a memory failure (rule 7), or None."""
    failed = [t.batch_size for t in trials if memory_failure(t, usable_bytes)]
    return min(failed) if failed else None


def fits_at(trials: Sequence[Trial], batch_size: int, usable_bytes: int) -> list[Trial]:
    """The trials at ``batch_size`` when every one of them fitted, else []."""
    at = [t for t in trials if t.batch_size == batch_size]
    return at if at and all(t.fits(usable_bytes) for t in at) else []


def largest_fitting(trials: Sequence[Trial], usable_bytes: int) -> int | None:
    """The largest batch size below the smallest failure whose trials all fitted (rule 5)."""
    failed = failed_batch_size(trials, usable_bytes)
    sizes = [t.batch_size for t in trials if (failed is None or t.batch_size < failed)
             and fits_at(trials, t.batch_size, usable_bytes)]
    return max(sizes) if sizes else None


def rises(low: Trial, high: Trial) -> bool:
    """Whether ``high``'s peak is measurably above ``low``'s (more than the noise of one trial)."""
    return high.peak_bytes - low.peak_bytes > max(FLAT_FRACTION * low.peak_bytes, FLAT_BYTES)  # type: ignore[operator]


def fit_points(trials: Sequence[Trial], settings: SearchSettings) -> list[Trial]:
    """The trials the line is fitted through (rule 2; all finished ones without the flat start when the local
    span leaves fewer than three)."""
    finished = sorted((t for t in trials if t.ok), key=lambda t: t.batch_size)
    if not finished:
        return []
    first = finished[0]
    flat = [t.batch_size for t in finished if not rises(first, t)]
    if max(flat) >= FLAT_START_SPAN * first.batch_size:  # sizes far apart at one peak: a flat start, not a slope
        finished = [t for t in finished if rises(first, t)]
    if not finished:
        return []
    low = finished[-1].batch_size / settings.local_span
    local = [t for t in finished if t.batch_size >= low]
    return local if _enough(local) else finished


def _enough(points: Sequence[Trial]) -> bool:
    return len(points) >= 3 and len({t.batch_size for t in points}) >= 2


def fit_trials(trials: Sequence[Trial], settings: SearchSettings | None = None) -> Fit | None:
    """The fit through :func:`fit_points`, or None with fewer than 3 points over 2 batch sizes."""
    points = fit_points(trials, settings or SearchSettings(total_bytes=1))
    if not _enough(points):
        return None
    return fit_linear([t.batch_size for t in points], [t.peak_bytes for t in points])


def settle(trials: Sequence[Trial], settings: SearchSettings) -> Settled:
    """Fit, limits and verifying trials of ``trials`` as recorded (rules 2, 4, 5, 6): read steady-equivalent,
    but the boundary from the trials as measured (bisection compares it with them)."""
    measured, raw, trials = short_trials(trials), trials, steady_equivalent(trials)
    usable = settings.usable_bytes
    failed = failed_batch_size(trials, usable)
    fit = fit_trials(trials, settings)
    if fit is None or fit.slope_bytes_per_sample <= 0:
        return Settled(fit, None, None, None, failed)
    noise = measure_noise(raw, fit)
    limits = compute_limits(fit, settings.total_bytes, settings.limits, failed, lambda b: noise.upper(fit, b))
    evidence = evidence_batch_size(trials, usable, noise) or 0
    target = max(limits.safe_batch_size, evidence)
    point = limits.point_safe_batch_size if failed is None else min(limits.point_safe_batch_size, failed - 1)
    if target < (1 - 3 * settings.snap_tolerance) * point:  # a wide interval: halve the gap to the point estimate
        target = max(target, (evidence + point + 1) // 2)
    if failed is not None and target >= failed - 1:
        target = bisect_below(trials, failed, settings)  # the failure binds, not the fit
    target = min(target, safe_ceiling(fit, usable, largest_fitting(trials, usable), failed))  # a reader's check
    safe_trial = snap_trial(trials, target, settings, repeats=2 if settings.repeat_safe else 1,
                       tolerance=_settle_tolerance(trials, settings))
    safe = safe_trial.batch_size if safe_trial else target
    conservative_target = math.floor(settings.limits.conservative_fraction * safe)
    conservative_trial = snap_trial(trials, conservative_target, settings, repeats=1)
    conservative = conservative_trial.batch_size if conservative_trial else conservative_target
    boundary = boundary_batch_size(measured, settings)
    limits = dataclasses.replace(limits, safe_batch_size=safe, conservative_batch_size=conservative,
                                 boundary_batch_size=boundary)
    return Settled(fit, limits, safe_trial, conservative_trial, failed)


def evidence_batch_size(trials: Sequence[Trial], usable_bytes: int, noise: Noise) -> int | None:
    """Rule 5's size (:meth:`vramcal.calibration.noise.Noise.holds`), from steady-equivalent ``trials``, or None."""
    failed = failed_batch_size(trials, usable_bytes)
    sizes = sorted({t.batch_size for t in trials if failed is None or t.batch_size < failed}, reverse=True)
    for size in sizes:
        at = fits_at(trials, size, usable_bytes)
        if at and noise.holds([t.peak_bytes for t in at], size, usable_bytes):  # type: ignore[misc]
            return size
    return None


def boundary_batch_size(trials: Sequence[Trial], settings: SearchSettings) -> float:
    """Where a trial's peak (as measured, no creep) reaches the whole memory: the line through
    :func:`~vramcal.calibration.noise.near_limit`'s trials (peaks bend), else the fit's; below any OOM."""
    near = near_limit(trials)
    slope = overhead = 0.0
    if len({t.batch_size for t in near}) >= 2:
        import numpy as np

        slope, overhead = np.polyfit([t.batch_size for t in near], [t.peak_bytes for t in near], 1)
    if slope <= 0 and (fit := fit_trials(trials, settings)) is not None:  # no line near the boundary
        slope, overhead = fit.slope_bytes_per_sample, fit.overhead_bytes
    boundary = float((settings.total_bytes - overhead) / slope) if slope > 0 else math.inf
    hard_failed = min((t.batch_size for t in trials if t.status == "oom"), default=None)
    return boundary if hard_failed is None else min(boundary, hard_failed - 1)


def bisect_below(trials: Sequence[Trial], failed: int, settings: SearchSettings) -> int:
    """Rule 4's bisection below ``failed``: the largest fitting batch once the gap is within ``snap_tolerance``
    (or one sample), else the midpoint."""
    below = largest_fitting(trials, settings.usable_bytes) or 0
    if failed - below <= max(1, math.floor(settings.snap_tolerance * failed)):
        return below
    return (below + failed) // 2


def _settle_tolerance(trials: Sequence[Trial], settings: SearchSettings) -> float:
    """How far below the computed safe size a verified one may settle: ``snap_tolerance``, after one verified
    round 3x that, after two anything (each verification moves a bending fit: the chase ends in two rounds)."""
    repeats = settings.repeat_safe + 1
    rounds = sum(1 for size in {t.batch_size for t in trials if t.purpose.startswith("verify-safe")}
                 if len(fits_at(trials, size, settings.usable_bytes)) >= repeats)
    return settings.snap_tolerance if rounds == 0 else 3 * settings.snap_tolerance if rounds == 1 else 1.0


def snap_trial(trials: Sequence[Trial], target: int, settings: SearchSettings, repeats: int,
                tolerance: float | None = None) -> Trial | None:
    """The last trial of the largest batch size in ``[target * (1 - tolerance), target]`` (default
    ``snap_tolerance``) with at least ``repeats`` trials, all fitting; None when there is none."""
    if target < 1:
        return None
    low = math.floor(target * (1 - (settings.snap_tolerance if tolerance is None else tolerance)))
    sizes = sorted({t.batch_size for t in trials if low <= t.batch_size <= target}, reverse=True)
    for size in sizes:
        at = fits_at(trials, size, settings.usable_bytes)
        if len(at) >= repeats:
            return at[-1]
    return None


def next_batch_size(trials: Sequence[Trial], settings: SearchSettings) -> Step | None:
    """The next trial, or None when done: limits settled and creep measured, nothing fits, ``max_trials`` run,
    or no batch size left to try."""
    if not trials:
        return Step(settings.start_batch_size, "grow")
    if len(trials) >= settings.max_trials:
        return None
    last, fitted = trials[-1], any(t.fits(settings.usable_bytes) for t in trials)
    if fitted and unmeasured(last) and sum(unmeasured(t) for t in trials if t.batch_size == last.batch_size) == 1:
        return Step(last.batch_size, "retry")  # rule 7: an error or a timeout is run once more
    raw, trials = trials, steady_equivalent(trials)
    if not any(t.fits(settings.usable_bytes) for t in trials):
        return None  # the smallest batch already failed (or could not be measured): nothing fits
    tried, ceiling = {t.batch_size for t in trials}, unmeasured_ceiling(trials)
    steps = (_grow(trials, settings), _fill(trials, settings), _boundary(raw, settings), _verify(trials, settings, raw),
             _steady(raw, settings))
    for step in steps:
        if step is None or (ceiling is not None and step.batch_size >= ceiling):
            continue
        if step.batch_size not in tried or step.purpose in ("verify-safe-repeat", "verify-conservative", "steady"):
            return step
    return None


def _grow(trials: Sequence[Trial], settings: SearchSettings) -> Step | None:
    """A larger batch size to try while far from the limit (rule 1), or None when growth is over."""
    usable = settings.usable_bytes
    fitting = sorted((t for t in trials if t.fits(usable)), key=lambda t: t.batch_size)
    largest = fitting[-1].batch_size
    failed = proposal_ceiling(trials, usable)
    estimate, aimed = _estimated_limit(trials, fitting, settings)
    if estimate is None:
        target = largest * 8  # one point, or peaks that do not rise yet: no estimate to aim at
    elif largest >= settings.far_fraction * estimate:
        return None  # close enough: fill in points, fit and verify
    else:
        target = max(2 * largest, math.floor(estimate / 2))
    growth = math.inf if aimed else settings.max_growth * largest  # an aim's slope is the step's own, not a guess
    target = min(target, growth, settings.max_batch_size)
    if failed is not None and target >= failed:
        if estimate is None and len(fitting) >= 2:
            return None  # the failure came before any slope: fill points below it instead
        target = (largest + failed) // 2
    if target <= largest or target in {t.batch_size for t in trials}:
        return None
    return Step(target, "grow")


def _estimated_limit(trials: Sequence[Trial], fitting: Sequence[Trial],
                     settings: SearchSettings) -> tuple[float | None, bool]:
    """(batch size where the line reaches usable memory, None if unknown; whether the line is the aim's).
    The line: the fit's when its slope is clear of 3 standard errors; else through the two largest fitting
    trials when they rise; else the aim's worst slope from the largest fitting trial (rule 1)."""
    fit, aimed = fit_trials(trials, settings), False
    if fit is not None and fit.slope_bytes_per_sample > 3 * fit.slope_stderr_bytes_per_sample:
        slope, overhead = fit.slope_bytes_per_sample, fit.overhead_bytes
    elif len(fitting) >= 2 and rises(fitting[-2], fitting[-1]):
        low, high = fitting[-2], fitting[-1]
        slope = (high.peak_bytes - low.peak_bytes) / (high.batch_size - low.batch_size)
        overhead = high.peak_bytes - slope * high.batch_size
    elif settings.aim is not None and fitting:
        slope, aimed = settings.aim.worst_slope, True
        overhead = fitting[-1].peak_bytes - slope * fitting[-1].batch_size
    else:
        return None, False
    return ((settings.usable_bytes - overhead) / slope if slope > 0 else None), aimed


def _fill(trials: Sequence[Trial], settings: SearchSettings) -> Step | None:
    """A point that pins the line down when the fit has fewer than three (rule 2), or None."""
    points = fit_points(trials, settings)
    if _enough(points):
        return None
    usable = settings.usable_bytes
    largest = largest_fitting(trials, usable) or 0
    failed = proposal_ceiling(trials, usable)
    ceiling = (failed - 1) if failed is not None else settings.max_batch_size
    estimate, _ = _estimated_limit(trials, sorted((t for t in trials if t.fits(usable)), key=lambda t: t.batch_size),
                                   settings)
    tried = {t.batch_size for t in trials}
    candidates = []
    if estimate is not None:
        # below the limit; aimed, outside the window a limit settles on, so it is verified where the fit puts it
        below = settings.snap_tolerance * (2 if settings.aim is not None else 1)
        candidates.append(math.floor(min(estimate, ceiling) * (1 - below)))
    if failed is not None:
        candidates.append((largest + ceiling + 1) // 2)  # between what fitted and what failed
    lowest_rising = min((t.batch_size for t in points), default=largest)
    candidates.append(math.ceil((lowest_rising + largest) / 2))  # between the points that rise
    for batch in candidates:
        if 1 <= batch <= ceiling and batch not in tried:
            return Step(batch, "grow" if batch > largest else "fill")
    return None


def _boundary(trials: Sequence[Trial], settings: SearchSettings) -> Step | None:
    """A trial just under the predicted out-of-memory boundary (rule 3), or None."""
    if settings.boundary_fraction <= 0:
        return None
    trials = short_trials(trials)
    probes = [t for t in trials if t.purpose == "boundary"]
    third = len(probes) == 2 and sum(t.ok for t in probes) == 1  # one fitted, one failed: far from the boundary?
    if len(probes) >= (3 if third else 2):
        return None
    state = settle(trials, settings)
    if state.limits is None:
        return None
    boundary = state.limits.boundary_batch_size
    measured = max((t.batch_size for t in trials if t.ok), default=0)
    if measured >= settings.boundary_fraction * boundary / (1 + 2 * settings.snap_tolerance):
        return None  # a trial already measured near the boundary
    failed = min((b for b in (min((t.batch_size for t in trials if t.status == "oom"), default=None),
                              unmeasured_ceiling(trials)) if b is not None), default=None)
    target = math.floor(settings.boundary_fraction * boundary)
    if failed is not None:
        target = min(target, (measured + failed) // 2)
    if target <= measured or target > settings.max_batch_size:
        return None
    return Step(target, "boundary")


def _verify(trials: Sequence[Trial], settings: SearchSettings, raw: Sequence[Trial]) -> Step | None:
    """Rule 4's trials (the conservative one by a steady trial's first steps when due, rule 6); ``trials``
    steady-equivalent, ``raw`` as recorded."""
    state = settle(raw, settings)
    if state.limits is None or state.limits.safe_batch_size < 1:
        return None
    if state.safe_trial is None:
        return verify_safe(trials, state.limits.safe_batch_size, settings)
    tried = {t.batch_size for t in trials}
    conservative = state.limits.conservative_batch_size  # floor(fraction x the settled safe size)
    if state.conservative_trial is None and conservative >= 1 and conservative not in tried:
        if settings.steady_verifies and len(raw) + 2 <= settings.max_trials and _steady_due(raw, conservative,
                                                                                            settings):
            return Step(conservative, STEADY, verifies=True)
        return Step(conservative, "verify-conservative")
    return None


def verify_safe(trials: Sequence[Trial], target: int, settings: SearchSettings,
                tolerance: float | None = None) -> Step | None:
    """Rule 4's safe-size trial toward ``target``: a repeat of one that fitted within :func:`snap_trial`'s window,
    else one a little below ``target`` (inside the window the refit it causes moves), then ``target``."""
    once = snap_trial(trials, target, settings, repeats=1, tolerance=tolerance)
    if once is not None and settings.repeat_safe:
        return Step(once.batch_size, "verify-safe-repeat")
    tried, below = {t.batch_size for t in trials}, max(1, math.floor(target * (1 - settings.snap_tolerance / 2)))
    return next((Step(size, "verify-safe") for size in (below, target) if size not in tried), None)


def _steady(trials: Sequence[Trial], settings: SearchSettings) -> Step | None:
    """Rule 6's steady trial at the verified conservative size, or None."""
    state = settle(trials, settings)
    if state.safe_trial is None or state.conservative_trial is None:
        return None
    target = state.conservative_trial.batch_size
    return Step(target, STEADY) if _steady_due(trials, target, settings) else None


def _steady_due(trials: Sequence[Trial], target: int, settings: SearchSettings) -> bool:
    """A steady trial at ``target`` is due: switched on, fewer than two run, none measured within
    ``snap_tolerance`` of ``target``."""
    steady = [t for t in trials if t.purpose == STEADY]
    if settings.steady_steps <= 0 or len(steady) >= 2:
        return False
    measured = [t for t in steady if t.ok]
    return not (measured and abs(measured[-1].batch_size - target) <= max(1, settings.snap_tolerance * target))
