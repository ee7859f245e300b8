"""The memory model: ``peak_bytes = overhead_bytes + slope_bytes_per_sample * batch_size``.

Ordinary least squares through the successful trials (``scipy.stats.linregress``), with r², standard
errors and the 95 % prediction interval for a new trial at batch size b (Montgomery & Runger,
*Applied Statistics and Probability for Engineers*, eq. 11-33)::

    peak(b) ± t(0.975, n-2) · s · sqrt(1 + 1/n + (b - mean_b)² / Sxx)

where s is the residual standard error and Sxx = Σ (b_i - mean_b)². The seed documents report
``VRAM = 0.529 GB + 0.088 GB x batch_size`` from two points; vramcal needs at least three.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vramcal.schema import AT_LEAST_ONE, FRACTION, NON_NEGATIVE, POSITIVE, Range, Record
from vramcal.units import format_bytes

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Fit(Record):
    """A fitted line with what is needed to predict and bound new trials (module docstring). Bytes are floats.

    Attributes:
        overhead_bytes, slope_bytes_per_sample: intercept (weights, optimizer state, context...) and slope;
            ``*_stderr_*`` their standard errors.
        residual_stderr_bytes: s (n - 2 degrees of freedom); t_critical: t(0.975, n - 2).
        n_points, batch_mean, batch_sxx: n, mean_b and Sxx; batch_sizes, peak_bytes: the points.
        nonlinearity: a warning when a quadratic explains the points better (F-test), else None.
    """

    overhead_bytes: float
    slope_bytes_per_sample: float
    overhead_stderr_bytes: float
    slope_stderr_bytes_per_sample: float
    residual_stderr_bytes: float
    r_squared: float
    n_points: int
    batch_mean: float
    batch_sxx: float
    t_critical: float
    batch_sizes: tuple[int, ...]
    peak_bytes: tuple[int, ...]
    nonlinearity: str | None = None

    def predict(self, batch_size: float) -> float:
        """Point estimate of peak bytes at ``batch_size``."""
        return self.overhead_bytes + self.slope_bytes_per_sample * batch_size

    def half_width(self, batch_size: float) -> float:
        """Half-width in bytes of the 95 % prediction interval at ``batch_size`` (module docstring)."""
        leverage = 1 + 1 / self.n_points + (batch_size - self.batch_mean) ** 2 / self.batch_sxx
        return self.t_critical * self.residual_stderr_bytes * math.sqrt(leverage)

    def upper(self, batch_size: float) -> float:
        """Upper 95 % prediction bound of peak bytes at ``batch_size``."""
        return self.predict(batch_size) + self.half_width(batch_size)

    def lower(self, batch_size: float) -> float:
        return self.predict(batch_size) - self.half_width(batch_size)

    def formula(self) -> str:
        """``peak = 0.529 GiB + 90.11 MiB × batch_size`` (the slope in its own unit)."""
        slope = self.slope_bytes_per_sample
        return (f"peak = {self.overhead_bytes / 2**30:.3g} GiB {'-' if slope < 0 else '+'} "
                f"{format_bytes(abs(slope))} × batch_size")

    def describe(self) -> str:
        return (f"{self.formula()}  (r² = {self.r_squared:.4f}, n = {self.n_points}, "
                f"s = {format_bytes(self.residual_stderr_bytes)})")

    # What a fit's numbers can be (the coefficients take any sign; a profile relates them to the points).
    WHERE = "fit"
    RANGES = {"overhead_stderr_bytes": NON_NEGATIVE, "slope_stderr_bytes_per_sample": NON_NEGATIVE,
              "residual_stderr_bytes": NON_NEGATIVE, "r_squared": FRACTION, "n_points": Range(3),
              "batch_mean": AT_LEAST_ONE, "batch_sxx": POSITIVE, "t_critical": POSITIVE,
              "batch_sizes": AT_LEAST_ONE, "peak_bytes": POSITIVE}


def fit_linear(batch_sizes: Sequence[int], peak_bytes: Sequence[int]) -> Fit:
    """Least-squares line through (batch_size, peak_bytes) points.

    Args:
        batch_sizes: samples per step of each successful trial (at least 3 points, 2 distinct sizes).
        peak_bytes: the matching peaks, bytes.

    Returns:
        The :class:`Fit`, with a non-linearity warning when a quadratic term is significant
        (F-test, p < 0.01, needs >= 4 points over >= 3 distinct sizes) and changes the prediction at the
        largest batch by more than 2 %.

    Raises:
        ValueError: fewer than 3 points, fewer than 2 distinct batch sizes, or mismatched lengths.
    """
    if len(batch_sizes) != len(peak_bytes):
        raise ValueError("batch_sizes and peak_bytes differ in length")
    if len(batch_sizes) < 3 or len(set(batch_sizes)) < 2:
        raise ValueError(f"a fit needs at least 3 points over 2 batch sizes, got {len(batch_sizes)} points")
    # the textbook formulas scipy.stats.linregress uses, in Python floats (no BLAS: see _quadratic)
    b, y = [float(v) for v in batch_sizes], [float(v) for v in peak_bytes]
    n = len(b)
    b_mean, y_mean = math.fsum(b) / n, math.fsum(y) / n
    sxx = math.fsum((v - b_mean) ** 2 for v in b)
    syy = math.fsum((v - y_mean) ** 2 for v in y)
    sxy = math.fsum((u - b_mean) * (v - y_mean) for u, v in zip(b, y, strict=True))
    slope = sxy / sxx
    intercept = y_mean - slope * b_mean
    ssr = math.fsum((v - intercept - slope * u) ** 2 for u, v in zip(b, y, strict=True))
    s = math.sqrt(ssr / (n - 2))
    return Fit(
        overhead_bytes=intercept, slope_bytes_per_sample=slope,
        overhead_stderr_bytes=s * math.sqrt(1 / n + b_mean**2 / sxx), slope_stderr_bytes_per_sample=s / math.sqrt(sxx),
        residual_stderr_bytes=s, r_squared=0.0 if syy == 0 else min(1.0, sxy**2 / (sxx * syy)), n_points=n,
        batch_mean=b_mean, batch_sxx=sxx, t_critical=t_quantile(n - 2),
        batch_sizes=tuple(int(v) for v in batch_sizes), peak_bytes=tuple(int(v) for v in peak_bytes),
        nonlinearity=_nonlinearity(b, y, ssr, intercept + slope * max(b)))


@functools.lru_cache(maxsize=64)
def t_quantile(dof: int) -> float:
    """Student's t(0.975, ``dof``), cached (the search settles many times a step)."""
    from scipy import stats  # deferred: scipy is heavy

    return float(stats.t.ppf(0.5 + CONFIDENCE / 2, dof))


def f_test_p(ssr_reduced: float, ssr_full: float, n_extra: int, df_full: int) -> float:
    """p-value of the partial F-test ((SSR_r - SSR_f) / k) / (SSR_f / df_f) ~ F(k, df_f) (Montgomery & Runger §12-2)."""
    from scipy import stats  # deferred: scipy is heavy

    if ssr_full <= 0:
        return 0.0 if ssr_reduced > 0 else 1.0
    return float(stats.f.sf(((ssr_reduced - ssr_full) / n_extra) / (ssr_full / df_full), n_extra, df_full))


def _nonlinearity(b: list[float], y: list[float], ssr_linear: float, linear_at_max: float) -> str | None:
    n = len(b)
    if n < 4 or len(set(b)) < 3:
        return None
    quadratic = _quadratic(b, y)
    ssr_quadratic = math.fsum((v - quadratic(x)) ** 2 for x, v in zip(b, y, strict=True))
    p_value = f_test_p(ssr_linear, ssr_quadratic, 1, n - 3)
    b_max = max(b)
    deviation = abs(quadratic(b_max) - linear_at_max) / max(abs(linear_at_max), 1.0)
    if p_value < 0.01 and deviation > 0.02:
        return (f"peaks are not linear in batch_size (quadratic term p = {p_value:.2g}, "
                f"{deviation:.1%} off the line at batch_size {b_max:.0f}); trust only verified limits")
    return None


def _quadratic(b: list[float], y: list[float]) -> Callable[[float], float]:
    """The least-squares parabola through (b, y) in z = (b - mean) / spread, by Gaussian elimination in Python
    floats: NumPy's LAPACK would map OpenBLAS's 32 MiB buffer in every process that loads a profile, which a
    framework's process measures against the trials' (:mod:`vramcal.integrations.run`)."""
    mean = sum(b) / len(b)
    spread = max(abs(v - mean) for v in b)
    z = [(v - mean) / spread for v in b]
    power = [sum(v ** k for v in z) for k in range(5)]
    rows = [[power[i + j] for j in range(3)] + [sum(v ** i * w for v, w in zip(z, y, strict=True))]
            for i in range(3)]
    for i in range(3):  # elimination with partial pivoting, then back substitution
        pivot = max(range(i, 3), key=lambda r: abs(rows[r][i]))
        rows[i], rows[pivot] = rows[pivot], rows[i]
        for r in range(i + 1, 3):
            factor = rows[r][i] / rows[i][i]
            rows[r] = [a - factor * c for a, c in zip(rows[r], rows[i], strict=True)]
    c = [0.0, 0.0, 0.0]
    for i in (2, 1, 0):
        c[i] = (rows[i][3] - sum(rows[i][j] * c[j] for j in range(i + 1, 3))) / rows[i][i]
    return lambda v: c[0] + c[1] * ((v - mean) / spread) + c[2] * ((v - mean) / spread) ** 2
