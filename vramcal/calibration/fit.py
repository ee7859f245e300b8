"""The memory model: ``peak_bytes = overhead_bytes + slope_bytes_per_sample * batch_size``.

Ordinary least squares through the successful trials (``scipy.stats.linregress``), with r², standard
errors and the 95 % prediction interval for a new trial at batch size b (Montgomery & Runger,
*Applied Statistics and Probability for Engineers*, eq. 11-33)::

    peak(b) ± t(0.975, n-2) · s · sqrt(1 + 1/n + (b - mean_b)² / Sxx)

where s is the residual standard error and Sxx = Σ (b_i - mean_b)². The seed documents report
``VRAM = 0.529 GB + 0.088 GB x batch_size`` from two points; vramcal needs at least three.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from vramcal.schema import AT_LEAST_ONE, FRACTION, NON_NEGATIVE, POSITIVE, Range, read_record
from vramcal.units import format_bytes

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Fit:
    """A fitted line with what is needed to predict and bound new trials. Bytes are floats here.

    Attributes:
        overhead_bytes: intercept (bytes at batch_size 0: weights, optimizer state, CUDA context...).
        slope_bytes_per_sample: bytes added per sample of batch.
        overhead_stderr_bytes, slope_stderr_bytes_per_sample: standard errors of the two coefficients.
        residual_stderr_bytes: s, the residual standard error (n - 2 degrees of freedom).
        r_squared: coefficient of determination.
        n_points: trials used. batch_mean: their mean batch size. batch_sxx: Σ (b - mean)².
        t_critical: Student's t quantile for the two-sided 95 % interval with n - 2 degrees of freedom.
        batch_sizes, peak_bytes: the points, for reports.
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
        """The line as people say it: ``peak = 0.53 GiB + 0.088 GiB × batch_size``."""
        gib = 2**30
        overhead, slope = self.overhead_bytes / gib, self.slope_bytes_per_sample / gib
        return f"peak = {overhead:.3g} GiB + {slope:.3g} GiB × batch_size"

    def describe(self) -> str:
        return (f"{self.formula()}  (r² = {self.r_squared:.4f}, n = {self.n_points}, "
                f"s = {format_bytes(self.residual_stderr_bytes)})")

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["batch_sizes"], data["peak_bytes"] = list(self.batch_sizes), list(self.peak_bytes)
        return data

    @classmethod
    def from_dict(cls, data: dict, where: str = "fit") -> Fit:
        """The record as a file holds it, each field typed and ranged (:data:`FIT_RANGES`).

        Raises:
            SchemaError: a field missing, unknown, of the wrong type or out of range (named).
        """
        return read_record(cls, data, where, FIT_RANGES)


# What a fit's numbers can be (the coefficients themselves take any sign; a profile relates them to the points).
FIT_RANGES = {"overhead_stderr_bytes": NON_NEGATIVE, "slope_stderr_bytes_per_sample": NON_NEGATIVE,
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
    import numpy as np
    from scipy import stats

    if len(batch_sizes) != len(peak_bytes):
        raise ValueError("batch_sizes and peak_bytes differ in length")
    if len(batch_sizes) < 3 or len(set(batch_sizes)) < 2:
        raise ValueError(f"a fit needs at least 3 points over 2 batch sizes, got {len(batch_sizes)} points")
    b = np.asarray(batch_sizes, dtype=float)
    y = np.asarray(peak_bytes, dtype=float)
    result = stats.linregress(b, y)
    n = len(b)
    residuals = y - (result.intercept + result.slope * b)
    ssr = float(np.sum(residuals**2))
    s = math.sqrt(ssr / (n - 2))
    return Fit(
        overhead_bytes=float(result.intercept), slope_bytes_per_sample=float(result.slope),
        overhead_stderr_bytes=float(result.intercept_stderr), slope_stderr_bytes_per_sample=float(result.stderr),
        residual_stderr_bytes=s, r_squared=float(result.rvalue**2), n_points=n, batch_mean=float(b.mean()),
        batch_sxx=float(np.sum((b - b.mean()) ** 2)), t_critical=float(stats.t.ppf(0.5 + CONFIDENCE / 2, n - 2)),
        batch_sizes=tuple(int(v) for v in batch_sizes), peak_bytes=tuple(int(v) for v in peak_bytes),
        nonlinearity=_nonlinearity(b, y, ssr))


def _nonlinearity(b, y, ssr_linear: float) -> str | None:
    import numpy as np
    from scipy import stats

    n = len(b)
    if n < 4 or len(set(b.tolist())) < 3:
        return None
    coefficients = np.polyfit(b, y, 2)
    ssr_quadratic = float(np.sum((y - np.polyval(coefficients, b)) ** 2))
    if ssr_quadratic <= 0:
        p_value = 0.0 if ssr_linear > 0 else 1.0
    else:
        f_stat = (ssr_linear - ssr_quadratic) / (ssr_quadratic / (n - 3))
        p_value = float(stats.f.sf(f_stat, 1, n - 3))
    b_max = float(b.max())
    linear_at_max = np.polyval(np.polyfit(b, y, 1), b_max)
    deviation = abs(np.polyval(coefficients, b_max) - linear_at_max) / max(abs(linear_at_max), 1.0)
    if p_value < 0.01 and deviation > 0.02:
        return (f"peaks are not linear in batch_size (quadratic term p = {p_value:.2g}, "
                f"{deviation:.1%} off the line at batch_size {b_max:.0f}); trust only verified limits")
    return None
