"""Batch-size limits from a fit, as DESIGN.md defines them.

* ``usable_bytes = total_bytes - reserve_bytes - margin * total_bytes`` (defaults 0.5 GiB and 10 %, the
  seed documents' "system overhead + safety margin").
* ``safe_batch_size``: the largest batch whose *upper 95 % prediction bound* fits in usable_bytes, so
  noise makes it smaller, never larger; never at or above a batch size that already failed.
* ``point_safe_batch_size = floor((usable_bytes - overhead_bytes) / slope_bytes_per_sample)``, the
  seeds' point formula, shown beside it.
* ``conservative_batch_size = floor(conservative_fraction * safe_batch_size)`` (default 0.9, the seeds'
  "90 % of safe max").
* ``boundary_batch_size``: where the point estimate reaches the whole of total_bytes (for comparison
  with a measured out-of-memory boundary).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from vramcal.calibration.fit import Fit
from vramcal.schema import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, Record
from vramcal.units import format_bytes
from vramcal.words import word

DEFAULT_RESERVE_BYTES = 2**29
DEFAULT_MARGIN = 0.10
DEFAULT_CONSERVATIVE_FRACTION = 0.9


@dataclass(frozen=True)
class LimitSettings(Record):
    """The user's knobs: ``--reserve`` bytes, ``--margin`` fraction, ``--conservative`` fraction.

    Raises (on construction):
        ValueError: a margin or fraction outside its range, or a negative reserve. TypeError: a reserve that is no
            whole number of bytes, a margin or fraction that is no number.
    """

    reserve_bytes: int = DEFAULT_RESERVE_BYTES
    margin: float = DEFAULT_MARGIN
    conservative_fraction: float = DEFAULT_CONSERVATIVE_FRACTION

    WHERE, RANGES = "settings", {"reserve_bytes": NON_NEGATIVE}

    def __post_init__(self) -> None:
        if isinstance(self.reserve_bytes, bool) or not isinstance(self.reserve_bytes, int):
            raise TypeError(f"reserve_bytes= takes a whole number of bytes, not {type(self.reserve_bytes).__name__} "
                            f"{self.reserve_bytes!r:.40}")
        for name in ("margin", "conservative_fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"{name}= takes a fraction, not {type(value).__name__} {value!r:.40}")
        if self.reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be >= 0, got {self.reserve_bytes}")
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")
        if not 0 < self.conservative_fraction <= 1:
            raise ValueError(f"conservative_fraction must be in (0, 1], got {self.conservative_fraction}")

    def usable_bytes(self, total_bytes: int) -> int:
        """``total_bytes - reserve_bytes - margin * total_bytes`` (may be <= 0 for tiny devices)."""
        return int(total_bytes - self.reserve_bytes - self.margin * total_bytes)

    def total_for(self, usable_bytes: int) -> int:
        """The least ``total_bytes`` whose :meth:`usable_bytes` is at least ``usable_bytes`` (its inverse, rounded
        up to a whole MiB)."""
        return math.ceil((usable_bytes + self.reserve_bytes) / (1 - self.margin) / 2**20) * 2**20

    def check(self, total_bytes: int) -> None:
        """Raises: ValueError when the reserve and the margin leave no usable memory of ``total_bytes``."""
        if self.usable_bytes(total_bytes) <= 0:
            raise ValueError(f"{format_bytes(total_bytes)} leaves no usable memory after the reserve of "
                             f"{format_bytes(self.reserve_bytes)} and the {self.margin:.0%} margin: give a larger "
                             f"{word('capacity')} or a smaller {word('reserve')}/{word('margin')}")



@dataclass(frozen=True)
class Limits(Record):
    """Limits for one device and fit. Batch sizes are samples; 0 means nothing fits."""

    total_bytes: int
    usable_bytes: int
    safe_batch_size: int
    point_safe_batch_size: int
    conservative_batch_size: int
    boundary_batch_size: float
    failed_batch_size: int | None = None

    WHERE = "limits"
    RANGES = {"total_bytes": POSITIVE, "usable_bytes": POSITIVE, "safe_batch_size": NON_NEGATIVE,
              "point_safe_batch_size": NON_NEGATIVE, "conservative_batch_size": NON_NEGATIVE,
              "failed_batch_size": AT_LEAST_ONE}


def safe_batch_size(fit: Fit, usable_bytes: int, upper: Callable[[float], float] | None = None) -> int:
    """Largest integer batch_size >= 0 with ``upper(batch_size) <= usable_bytes`` (default ``fit.upper``; the
    search's, :meth:`vramcal.calibration.noise.Noise.upper`). ``upper`` is convex (a line plus the norm of an affine
    function): bisection on its increasing side. 0 when batch 1 does not fit or the slope is not positive."""
    if fit.slope_bytes_per_sample <= 0:
        return 0
    upper = upper or fit.upper
    # The interval's left end may lie above 1 when the points are far from 1 (a wide interval there).
    starts = [b for b in (1, max(1, math.floor(fit.batch_mean))) if upper(b) <= usable_bytes]
    if not starts:
        return 0
    low = starts[0]
    high = max(1, math.floor((usable_bytes - fit.overhead_bytes) / fit.slope_bytes_per_sample)) + 1
    while upper(high) <= usable_bytes:  # point estimate <= upper bound, so this rarely runs
        high *= 2
    while high - low > 1:  # invariant: upper(low) <= usable < upper(high)
        middle = (low + high) // 2
        if upper(middle) <= usable_bytes:
            low = middle
        else:
            high = middle
    return low


def point_safe_batch_size(fit: Fit, usable_bytes: int) -> int:
    """The seeds' point formula ``floor((usable_bytes - overhead_bytes) / slope_bytes_per_sample)``, at least 0;
    0 when the slope is not positive.

    Raises:
        OverflowError: a slope so small that the quotient is no number (a line no trial could have fitted).
    """
    return _point(fit.overhead_bytes, fit.slope_bytes_per_sample, usable_bytes)


def _point(overhead_bytes: float, slope: float, usable_bytes: int) -> int:
    return max(0, math.floor((usable_bytes - overhead_bytes) / slope)) if slope > 0 else 0


def safe_ceiling(fit: Fit, usable_bytes: int, largest_fitting: int | None, failed_batch_size: int | None) -> int:
    """The largest safe batch size a calibration may settle on (samples): the larger of the point estimate
    (:func:`point_safe_batch_size`) and ``largest_fitting``, below ``failed_batch_size``. None of
    :func:`vramcal.calibration.search.settle`'s rules goes above it; a reader of the limits checks them against it.

    Raises:
        OverflowError: see :func:`point_safe_batch_size`.
    """
    ceiling = max(point_safe_batch_size(fit, usable_bytes), largest_fitting or 0)
    return ceiling if failed_batch_size is None else min(ceiling, failed_batch_size - 1)


def compute_limits(fit: Fit, total_bytes: int, settings: LimitSettings, failed_batch_size: int | None = None,
                   upper: Callable[[float], float] | None = None) -> Limits:
    """Limits from a fit and the device's ``total_bytes`` (module docstring has the formulas); the safe size stays
    below ``failed_batch_size``, held to ``upper`` (:func:`safe_batch_size`)."""
    usable = settings.usable_bytes(total_bytes)
    safe = safe_batch_size(fit, usable, upper)
    if failed_batch_size is not None:
        safe = min(safe, failed_batch_size - 1)
    safe = max(0, safe)
    return line_limits(fit.overhead_bytes, fit.slope_bytes_per_sample, total_bytes, usable, safe,
                       math.floor(settings.conservative_fraction * safe), failed_batch_size)


def line_limits(overhead_bytes: float, slope: float, total_bytes: int, usable_bytes: int, safe: int,
                conservative: int, failed: int | None) -> Limits:
    """The :class:`Limits` of the line ``overhead_bytes + slope * batch_size`` (bytes per sample) with the given
    safe, conservative and failed batch sizes: its point and boundary sizes by the module docstring's formulas."""
    boundary = (total_bytes - overhead_bytes) / slope if slope > 0 else math.inf
    return Limits(total_bytes, usable_bytes, safe, _point(overhead_bytes, slope, usable_bytes), conservative,
                  boundary, failed)
