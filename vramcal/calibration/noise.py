"""How much one trial's peak varies, and what that leaves of a limit (search rules 5 and 6).

Read as the truth, single trials settled limits above usable memory (``bench/results/search-curves/``): the
evidence rule's sizes and the creep (a difference of two trials) carry the trials' noise. :func:`measure_noise`
measures it: ``s``, the residual standard error of the line through :func:`near_limit`'s short trials (``n − 2``
degrees of freedom; the whole fit's where fewer than three lie there), ``t = t(0.975, dof)``::

    creep half-width(b) = t · s · sqrt(1 + 1/n_c) · b / c     (c: the steady trial's batch size, n_c: the short
                                                              trials there; 0 before a creep is measured)
    upper(b)            = fit.predict(b) + sqrt(fit.half_width(b)² + creep half-width(b)²)
    evidence at b       : mean(steady-equivalent peaks at b) + t · s · sqrt(1/n_b + (1 + 1/n_c) · (b/c)²) <= usable

The creep term is the standard error of one steady trial minus the mean of ``n_c`` short ones, scaled per sample;
independent errors add in quadrature (Montgomery & Runger, *Applied Statistics and Probability for Engineers*,
§5-4); the evidence test is the upper end of the 95 % interval of a mean of ``n_b`` trials (§8-2).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from vramcal.calibration.creep import measure_creep, short_trials
from vramcal.calibration.fit import Fit, t_quantile
from vramcal.records import Trial


def near_limit(trials: Sequence[Trial]) -> list[Trial]:
    """The finished trials in the top third of the measured batch sizes (at least two sizes), else the top half:
    peaks bend, so the boundary and the noise are read near the limit."""
    finished = [t for t in trials if t.ok]
    top = max((t.batch_size for t in finished), default=0)
    near = [t for t in finished if t.batch_size >= top * 2 / 3]
    if len({t.batch_size for t in near}) < 2:
        near = [t for t in finished if t.batch_size >= top / 2]
    return near


@dataclass(frozen=True)
class Noise:
    """The noise of one trial's peak and of the measured creep (module docstring): ``stderr_bytes`` ``s`` and its
    ``dof``; ``creep_batch_size`` ``c`` (None: no creep) and ``creep_short_trials`` ``n_c``."""

    stderr_bytes: float
    dof: int
    creep_batch_size: int | None = None
    creep_short_trials: int = 0

    @property
    def t(self) -> float:
        """t(0.975, :attr:`dof`)."""
        return t_quantile(max(1, self.dof))

    def creep_share(self, batch_size: float) -> float:
        """``(1 + 1/n_c) · (b/c)²``: the creep's variance at ``batch_size`` in units of ``s²`` (0 without one)."""
        if self.creep_batch_size is None:
            return 0.0
        return (1 + 1 / max(1, self.creep_short_trials)) * (batch_size / self.creep_batch_size) ** 2

    def upper(self, fit: Fit, batch_size: float) -> float:
        """The fit's upper 95 % prediction bound at ``batch_size`` with the creep's error added (bytes)."""
        creep = self.t * self.stderr_bytes * math.sqrt(self.creep_share(batch_size))
        return fit.predict(batch_size) + math.hypot(fit.half_width(batch_size), creep)

    def holds(self, peaks: Sequence[int], batch_size: int, usable_bytes: int) -> bool:
        """The module docstring's evidence test for steady-equivalent ``peaks`` (bytes) at ``batch_size``."""
        if not peaks:
            return False
        spread = self.t * self.stderr_bytes * math.sqrt(1 / len(peaks) + self.creep_share(batch_size))
        return statistics.fmean(peaks) + spread <= usable_bytes


def residual_stderr(batch_sizes: Sequence[int], peak_bytes: Sequence[int]) -> float:
    """``s`` of the least-squares line through the points (bytes; at least 3 points over 2 sizes), as
    :func:`vramcal.calibration.fit.fit_linear` computes it, without the rest of a fit."""
    b, y = [float(v) for v in batch_sizes], [float(v) for v in peak_bytes]
    b_mean, y_mean = math.fsum(b) / len(b), math.fsum(y) / len(y)
    sxx = math.fsum((v - b_mean) ** 2 for v in b)
    slope = math.fsum((u - b_mean) * (v - y_mean) for u, v in zip(b, y, strict=True)) / sxx
    ssr = math.fsum((v - y_mean - slope * (u - b_mean)) ** 2 for u, v in zip(b, y, strict=True))
    return math.sqrt(ssr / (len(b) - 2))


def measure_noise(trials: Sequence[Trial], fit: Fit) -> Noise:
    """The noise of ``trials`` (as recorded: short and steady ones) whose fit is ``fit`` (module docstring)."""
    near = near_limit(short_trials(trials))
    if len(near) >= 3 and len({t.batch_size for t in near}) >= 2:
        stderr = residual_stderr([t.batch_size for t in near], [t.peak_bytes for t in near])  # type: ignore[misc]
        dof = len(near) - 2
    else:
        stderr, dof = fit.residual_stderr_bytes, fit.n_points - 2
    creep = measure_creep(trials)
    if creep is None:
        return Noise(stderr, dof)
    short = sum(1 for t in short_trials(trials) if t.ok and t.batch_size == creep.batch_size
                and t.seq_len == creep.seq_len)
    return Noise(stderr, dof, creep.batch_size, short)
