"""Throughput: samples per second at each measured batch size, from the trials' own step times, and the knee.

The finished trials at one batch size pool their measured step times (``Trial.step_times_s``; older profiles
have each trial's median ``step_s`` only):

    samples_per_s(b)      b / mean step time (the mean: an epoch's time is the sum of its steps')
    95 % interval         b / (mean ± t(0.975, n − 1) × sd / √n): Student's t interval of a mean (Montgomery &
                          Runger, *Applied Statistics and Probability for Engineers*, 6th ed., eq. 8-7), in rates;
                          its upper end is open when the lower step time is ≤ 0

A rate is **steady** when a steady trial ran there or :data:`STEADY_MIN_STEPS` steps were timed. The **knee** (the
shared DESIGN.md's "throughput knee", :func:`find_knee`) is refused where a rate it compares has no finite interval.
Two figures differ measurably only when their 95 % intervals do not overlap (:func:`overlap`, the one rule for
advice). No rate is extrapolated: :func:`rate_at` interpolates between measured sizes, :func:`rate_for_run` reads
a nearby steady rate per sample.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from vramcal.calibration.creep import STEADY
from vramcal.records import Trial
from vramcal.schema import Record
from vramcal.units import format_rate

KNEE_FRACTION = 0.95  # the knee: the smallest batch size reaching this fraction of the best samples/s
STEADY_MIN_STEPS = 10  # timed steps at one batch size that make its rate steady without a steady trial
CONFIDENCE = 0.95
NEAR_FRACTION = 0.25  # a steady rate stands in, per sample, for a size this close to its own (rate_for_run)
NO_DIFFERENCE = "no measurable difference"  # what advice says instead where the intervals overlap (overlap)
EXTRA_TIMED_STEPS = 4  # at most this many steps a short trial times beyond its measured ones (timing_done)
# Student's t(0.975, df) for df = 1..30 (scipy.stats.t.ppf to 5 decimals; Montgomery & Runger, Table V): the rates'
# intervals and timing_done, which runs in the trial's worker (no scipy there), read the same quantile (t_975)
T_975 = (12.7062, 4.30265, 3.18245, 2.77645, 2.57058, 2.44691, 2.36462, 2.306, 2.26216, 2.22814, 2.20099, 2.17881,
         2.16037, 2.14479, 2.13145, 2.11991, 2.10982, 2.10092, 2.09302, 2.08596, 2.07961, 2.07387, 2.06866, 2.0639,
         2.05954, 2.05553, 2.05183, 2.04841, 2.04523, 2.04227)
Z_975 = 1.959963984540054  # the normal distribution's 0.975 quantile


Interval = tuple[float | None, float | None]  # (low, high) of a 95 % interval; None: open (or unknown) there


def t_975(dof: int) -> float:
    """Student's t(0.975, ``dof``) for ``dof`` >= 1: :data:`T_975` up to 30, beyond it the Cornish-Fisher
    expansion in 1/dof to its third term (Abramowitz & Stegun 26.7.5; within 2e-6 of scipy's from 31 on).

    Raises:
        ValueError: ``dof`` below 1.
    """
    if dof < 1:
        raise ValueError(f"Student's t needs at least 1 degree of freedom, not {dof}")
    if dof <= len(T_975):
        return T_975[dof - 1]
    z = Z_975
    return (z + (z**3 + z) / (4 * dof) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * dof**3))


def finite_interval(times: Sequence[float]) -> bool:
    """Whether step times give a rate with a finite 95 % interval: two or more, and their mean above
    ``t(0.975, n − 1) × sd / √n`` (:func:`_rate`'s interval; its upper end is open otherwise)."""
    n = len(times)
    if n < 2:
        return False
    return statistics.fmean(times) > t_975(n - 1) * statistics.stdev(times) / math.sqrt(n)


def timing_done(times: Sequence[float], measured_steps: int) -> bool:
    """Whether a short trial may stop timing steps: its ``measured_steps`` ran and their times give a finite
    interval (:func:`finite_interval`; a knee needs one), or it timed :data:`EXTRA_TIMED_STEPS` more."""
    return len(times) >= measured_steps and (finite_interval(times)
                                             or len(times) >= measured_steps + EXTRA_TIMED_STEPS)


def overlap(a: Interval, b: Interval) -> bool:
    """Whether two 95 % intervals overlap: then the figures show :data:`NO_DIFFERENCE` and no advice names either.
    An end None is open (−∞ low, +∞ high)."""
    (a_low, a_high), (b_low, b_high) = a, b
    return ((a_low is None or b_high is None or a_low <= b_high)
            and (b_low is None or a_high is None or b_low <= a_high))


@dataclass(frozen=True)
class Rate(Record):
    """The measured throughput at one batch size (module docstring). Seconds and samples per second.

    Attributes:
        samples_per_s: ``batch_size / step_s``, with its 95 % interval ``low_samples_per_s``,
            ``high_samples_per_s`` (None: unknown, one step time; ``high`` alone None: open above).
        step_s, step_sd_s: the mean measured step time and its standard deviation (None with one).
        n_steps, n_trials: the step times pooled, the trials that finished at this size.
        steady: a steady trial ran here, or at least :data:`STEADY_MIN_STEPS` steps were timed.
        per_step: every trial recorded each step's time (False: older profiles, medians only).
        first_step_s, val_s: the mean first warm-up step (the optimizer's state allocated) and validation pass.
        interpolated_from: the two measured sizes :func:`rate_at` read it from; per_sample_from: the steady
            size :func:`rate_for_run` read it from per sample.
    """

    batch_size: int
    samples_per_s: float
    low_samples_per_s: float | None
    high_samples_per_s: float | None
    step_s: float
    step_sd_s: float | None
    n_steps: int
    n_trials: int
    steady: bool
    per_step: bool = True
    first_step_s: float | None = None
    val_s: float | None = None
    interpolated_from: tuple[int, int] | None = None
    per_sample_from: int | None = None

    @property
    def interval(self) -> Interval:
        """The 95 % interval of ``samples_per_s`` as (low, high), for :func:`overlap`."""
        return self.low_samples_per_s, self.high_samples_per_s

    @property
    def bounded(self) -> bool:
        """The rate has a finite 95 % interval (two step times or more, and an upper end that is not open)."""
        return self.low_samples_per_s is not None and self.high_samples_per_s is not None

    @property
    def spread(self) -> float | None:
        """The coefficient of variation of the step times (sd / mean), None with one."""
        return None if self.step_sd_s is None else self.step_sd_s / self.step_s


@dataclass(frozen=True)
class Knee(Record):
    """The throughput knee: the smallest measured ``batch_size`` whose ``rate`` reaches ``fraction`` of the
    ``best``; it lies in ``(below, batch_size]`` (``below`` None: the smallest measured). ``refused``: why no knee
    is called (rates without a finite interval; ``batch_size`` then only the point estimates'), else None."""

    batch_size: int
    rate: Rate
    best: Rate
    fraction: float
    below: int | None
    refused: str | None = None


def rate_text(rate: Rate) -> str:
    """``30.1 (27.2–33.5)``: samples/s with its 95 % interval (``∞`` for an open end) when there is one."""
    if rate.low_samples_per_s is None:
        return format_rate(rate.samples_per_s)
    high = "∞" if rate.high_samples_per_s is None else format_rate(rate.high_samples_per_s)
    return f"{format_rate(rate.samples_per_s)} ({format_rate(rate.low_samples_per_s)}–{high})"


def step_times(trial: Trial) -> tuple[float, ...]:
    """A finished trial's measured step times: each step's, or its median alone (older profiles), or none."""
    if not trial.ok:
        return ()
    if trial.step_times_s:
        return trial.step_times_s
    return (trial.step_s,) if trial.step_s else ()


def measured_rates(trials: Iterable[Trial]) -> list[Rate]:
    """One :class:`Rate` per batch size that finished with step times, smallest first (module docstring)."""
    by_size: dict[int, list[Trial]] = {}
    for trial in trials:
        if step_times(trial):
            by_size.setdefault(trial.batch_size, []).append(trial)
    return [_rate(b, group) for b, group in sorted(by_size.items())]


def _rate(batch_size: int, trials: Sequence[Trial]) -> Rate:
    times = [s for t in trials for s in step_times(t)]
    mean = statistics.fmean(times)
    sd = statistics.stdev(times) if len(times) > 1 else None
    low = high = None
    if sd is not None:
        half = t_975(len(times) - 1) * sd / math.sqrt(len(times))
        low = batch_size / (mean + half)
        high = batch_size / (mean - half) if mean > half else None
    first = [t.warmup_times_s[0] for t in trials if t.warmup_times_s]
    val = [s for t in trials for s in (t.val_times_s or ())]
    steady = any(t.purpose == STEADY for t in trials) or len(times) >= STEADY_MIN_STEPS
    return Rate(batch_size, batch_size / mean, low, high, mean, sd, len(times), len(trials), steady,
                all(t.step_times_s for t in trials), statistics.fmean(first) if first else None,
                statistics.fmean(val) if val else None)


def find_knee(rates: Sequence[Rate], low: int = 1, high: int | None = None,
              fraction: float = KNEE_FRACTION) -> Knee | None:
    """The knee among the rates at batch sizes in ``[low, high]`` (``high`` None: no bound); None without one."""
    usable = [r for r in rates if r.batch_size >= low and (high is None or r.batch_size <= high)]
    if not usable:
        return None
    best = max(usable, key=lambda r: (r.samples_per_s, -r.batch_size))
    knee = min((r for r in usable if r.samples_per_s >= fraction * best.samples_per_s), key=lambda r: r.batch_size)
    below = [r.batch_size for r in usable if r.batch_size < knee.batch_size]
    return Knee(knee.batch_size, knee, best, fraction, max(below) if below else None, knee_refusal(usable))


def knee_refusal(rates: Sequence[Rate]) -> str | None:
    """Why no knee is called from ``rates``, or None: each has a finite interval."""
    open_ = [r for r in rates if not r.bounded]
    if not open_:
        return None
    if not any(r.per_step for r in open_):
        return "the profile predates per-step times, so its rates have no interval; a knee needs a new calibration"
    steps, many = sorted({r.n_steps for r in open_}), len(open_) > 1
    counts = (f"{steps[0]} timed step{'s' * (steps[0] != 1)}{' each' * many}" if len(steps) == 1 else
              f"{', '.join(map(str, steps[:-1]))} or {steps[-1]} timed steps")
    sizes = ", ".join(str(r.batch_size) for r in open_)
    return (f"the samples/s at batch size{'s' * many} {sizes} ({counts}) {'have' if many else 'has'} no finite 95 % "
            f"interval, so any of them may be the best; a knee needs more timed steps there (a steady trial, or "
            f"{STEADY_MIN_STEPS} steps)")


def rate_at(rates: Sequence[Rate], batch_size: int) -> Rate | None:
    """The rate at ``batch_size``: measured there, or interpolated between the nearest measured sizes on each
    side (time per sample linear in the batch size, the interval's ends likewise; steady only when both are);
    None outside the measured range: a rate is never extrapolated."""
    for rate in rates:
        if rate.batch_size == batch_size:
            return rate
    below = [r for r in rates if r.batch_size < batch_size]
    above = [r for r in rates if r.batch_size > batch_size]
    if not below or not above:
        return None
    a, b = max(below, key=lambda r: r.batch_size), min(above, key=lambda r: r.batch_size)
    w = (batch_size - a.batch_size) / (b.batch_size - a.batch_size)

    def per_sample(x: float | None, y: float | None, size_x: int, size_y: int) -> float | None:
        return None if x is None or y is None else (1 - w) * x / size_x + w * y / size_y

    def end(x: float | None, y: float | None) -> float | None:  # a rate's end: seconds per sample mixed
        return None if x is None or y is None else 1 / ((1 - w) / x + w / y)

    step = batch_size * per_sample(a.step_s, b.step_s, a.batch_size, b.batch_size)
    first = per_sample(a.first_step_s, b.first_step_s, a.batch_size, b.batch_size)
    val = per_sample(a.val_s, b.val_s, a.batch_size, b.batch_size)
    return Rate(batch_size, batch_size / step, end(a.low_samples_per_s, b.low_samples_per_s),
                end(a.high_samples_per_s, b.high_samples_per_s), step, None, 0, 0, a.steady and b.steady,
                a.per_step and b.per_step, None if first is None else first * batch_size,
                None if val is None else val * batch_size, (a.batch_size, b.batch_size))


def rate_for_run(rates: Sequence[Rate], batch_size: int) -> Rate | None:
    """The rate a run at ``batch_size`` is forecast at: a steady rate there, else the nearest steady rate within
    :data:`NEAR_FRACTION` read per sample (its samples/s, times scaled by the sizes' ratio), else :func:`rate_at`."""
    own = rate_at(rates, batch_size)
    if own is not None and own.steady:
        return own
    near = [r for r in rates if r.steady and abs(r.batch_size - batch_size) <= NEAR_FRACTION * r.batch_size]
    if not near:
        return own
    steady = min(near, key=lambda r: (abs(r.batch_size - batch_size), r.batch_size))
    scale = batch_size / steady.batch_size

    def scaled(seconds: float | None) -> float | None:
        return None if seconds is None else seconds * scale

    return dataclasses.replace(steady, batch_size=batch_size, step_s=steady.step_s * scale,
                               step_sd_s=scaled(steady.step_sd_s), first_step_s=scaled(steady.first_step_s),
                               val_s=scaled(steady.val_s), per_sample_from=steady.batch_size)
