"""One memory model for every sequence length::

    peak_bytes = overhead_bytes + bytes_per_token * (batch_size * seq_len) + bytes_per_sample * batch_size

With chunk_size fixed, a Mamba-2 training step grows with tokens = batch_size × seq_len, plus a
per-sample term. Ordinary least squares over (batch_size, seq_len, peak_bytes) points, with design row
x = (1, batch_size·seq_len, batch_size), coefficient standard errors sqrt(diag((XᵀX)⁻¹) · s²) and the
95 % prediction interval for a new trial at x0 (Montgomery & Runger, *Applied Statistics and
Probability for Engineers*, multiple regression, eq. 12-37)::

    x0ᵀβ ± t(0.975, n-p) · s · sqrt(1 + x0ᵀ (XᵀX)⁻¹ x0)

where p = 3 and s² = SSR / (n - p). A partial F-test (same source, section 12-2) against an extended
model with tokens² and seq_len alone warns when the line is not enough.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vramcal.calibration.fit import f_test_p, t_quantile
from vramcal.schema import AT_LEAST_ONE, FRACTION, NON_NEGATIVE, POSITIVE, Range, Record, SchemaError
from vramcal.units import format_bytes

N_COEFFICIENTS = 3
_MIN_SLOPE_BYTES = 1.0  # growth under one byte per sample (or per position) is rounding noise, not memory
# What a 2-D fit's numbers can be (the coefficients take any sign; a profile relates them to the points).
FIT2D_RANGES = {"overhead_stderr_bytes": NON_NEGATIVE, "stderr_bytes_per_token": NON_NEGATIVE,
                "stderr_bytes_per_sample": NON_NEGATIVE, "residual_stderr_bytes": NON_NEGATIVE, "r_squared": FRACTION,
                "n_points": Range(N_COEFFICIENTS + 1), "t_critical": POSITIVE, "batch_sizes": AT_LEAST_ONE,
                "seq_lens": AT_LEAST_ONE, "peak_bytes": POSITIVE}
_EXTRA_TERMS = ("tokens² (batch_size·seq_len)²", "a per-seq_len term independent of batch_size")
# The widest gap between neighbouring calibrated lengths (SeqLens.design) whose interpolated answers were measured
# against real trials (bench/interpolation.py, bench/README.md).
LENGTH_RATIO = 16


@dataclass(frozen=True)
class Fit2D(Record):
    """A fitted plane in (tokens, batch_size) with what is needed to predict and bound new trials (module docstring).

    Attributes:
        overhead_bytes, bytes_per_token, bytes_per_sample: β; their standard errors beside them.
        residual_stderr_bytes: s (n - 3 degrees of freedom); t_critical: t(0.975, n - 3).
        xtx_inverse: (XᵀX)⁻¹ for the columns (1, batch_size·seq_len, batch_size), row by row.
        batch_sizes, seq_lens, peak_bytes: the points.
        extra_terms: a warning when tokens² or seq_len alone explain the points better, else None.
    """

    overhead_bytes: float
    bytes_per_token: float
    bytes_per_sample: float
    overhead_stderr_bytes: float
    stderr_bytes_per_token: float
    stderr_bytes_per_sample: float
    residual_stderr_bytes: float
    r_squared: float
    n_points: int
    t_critical: float
    xtx_inverse: tuple[tuple[float, ...], ...]
    batch_sizes: tuple[int, ...]
    seq_lens: tuple[int, ...]
    peak_bytes: tuple[int, ...]
    extra_terms: str | None = None

    WHERE, RANGES = "surface.fit", FIT2D_RANGES

    def predict(self, batch_size: float, seq_len: float) -> float:
        """Point estimate x0ᵀβ of peak bytes at (batch_size, seq_len)."""
        return self.overhead_bytes + self.bytes_per_token * batch_size * seq_len + self.bytes_per_sample * batch_size

    def half_width(self, batch_size: float, seq_len: float) -> float:
        """Half-width in bytes of the 95 % prediction interval at (batch_size, seq_len) (module docstring)."""
        x0 = (1.0, batch_size * seq_len, batch_size)
        leverage = sum(x0[i] * self.xtx_inverse[i][j] * x0[j] for i in range(3) for j in range(3))
        return self.t_critical * self.residual_stderr_bytes * math.sqrt(max(1 + leverage, 0.0))

    def upper(self, batch_size: float, seq_len: float) -> float:
        """Upper 95 % prediction bound of peak bytes at (batch_size, seq_len)."""
        return self.predict(batch_size, seq_len) + self.half_width(batch_size, seq_len)

    def lower(self, batch_size: float, seq_len: float) -> float:
        return self.predict(batch_size, seq_len) - self.half_width(batch_size, seq_len)

    def formula(self) -> str:
        """``peak = 0.51 GiB + 12.30 KiB × batch_size·seq_len + 1.20 MiB × batch_size``."""
        def term(value: float, name: str) -> str:
            return f" {'-' if value < 0 else '+'} {format_bytes(abs(value))} × {name}"
        return (f"peak = {self.overhead_bytes / 2**30:.3g} GiB" + term(self.bytes_per_token, "batch_size·seq_len")
                + term(self.bytes_per_sample, "batch_size"))

    def negative_terms(self) -> str | None:
        """What a negative coefficient of :meth:`formula` means, for people (the plane is used only inside the
        calibrated lengths, where a sample adds ``bytes_per_token × seq_len + bytes_per_sample``); None if none."""
        shortest, longest = min(self.seq_lens), max(self.seq_lens)
        notes = []
        for value, stderr, what in ((self.bytes_per_sample, self.stderr_bytes_per_sample, "per-sample"),
                                    (self.bytes_per_token, self.stderr_bytes_per_token, "per-token"),
                                    (self.overhead_bytes, self.overhead_stderr_bytes, "overhead")):
            if value >= 0:
                continue
            noise = (f"; it is within two standard errors of 0 (±{format_bytes(2 * stderr)}): the points cannot tell "
                     f"it from none" if abs(value) <= 2 * stderr else "")
            if what == "overhead":
                notes.append("the negative overhead is the plane's intercept at batch_size 0, below the smallest "
                             "batch measured: it holds no memory, only the peaks over the measured sizes are "
                             "predicted" + noise)
                continue
            other = "per-token" if what == "per-sample" else "per-sample"
            notes.append(f"the negative {what} term gives no memory back: it corrects the {other} term, which alone "
                         f"would over-cover what each sample adds within the calibrated lengths; a sample adds "
                         f"{self._per_sample(shortest)} at seq_len {shortest} and {self._per_sample(longest)} at "
                         f"{longest} (the model is not used outside {shortest}-{longest})" + noise)
        return "; ".join(notes) or None

    def _per_sample(self, seq_len: int) -> str:
        return format_bytes(self.bytes_per_token * seq_len + self.bytes_per_sample)

    def describe(self) -> str:
        return (f"{self.formula()}  (r² = {self.r_squared:.4f}, n = {self.n_points} over "
                f"{len(set(self.seq_lens))} seq_len values, s = {format_bytes(self.residual_stderr_bytes)})")

    @classmethod
    def from_dict(cls, data: dict, where: str | None = None) -> Fit2D:
        """Raises: SchemaError: a field missing, unknown, of the wrong type or out of range (named), or an
        ``xtx_inverse`` that is not 3 × 3."""
        where = where or cls.WHERE
        fit = super().from_dict(data, where)
        if len(fit.xtx_inverse) != N_COEFFICIENTS or any(len(row) != N_COEFFICIENTS for row in fit.xtx_inverse):
            raise SchemaError(f"{where}.xtx_inverse", f"{where}.xtx_inverse is not a {N_COEFFICIENTS} x "
                                                      f"{N_COEFFICIENTS} matrix")
        return fit


def fit_2d(batch_sizes: Sequence[int], seq_lens: Sequence[int], peak_bytes: Sequence[int]) -> Fit2D:
    """Least-squares plane through (batch_size, seq_len, peak_bytes) points (module docstring).

    Args:
        batch_sizes: samples per step of each successful trial (positive).
        seq_lens: tokens per sample of each trial (positive).
        peak_bytes: the matching peaks, bytes.

    Returns:
        The :class:`Fit2D`, with an ``extra_terms`` warning when tokens² or seq_len alone is significant
        (partial F-test, p < 0.01, needs >= 7 points and a full-rank extended design) and changes the
        prediction at the largest tokens point by more than 2 %.

    Raises:
        ValueError: mismatched lengths, non-positive sizes, fewer than 4 points over 2 seq_len values and
            2 batch sizes, or points that do not determine the three coefficients.
    """
    import numpy as np

    if not len(batch_sizes) == len(seq_lens) == len(peak_bytes):
        raise ValueError("batch_sizes, seq_lens and peak_bytes differ in length")
    if min(list(batch_sizes) + list(seq_lens), default=1) < 1:
        raise ValueError("batch sizes and seq_lens must be positive")
    n, n_lens, n_batches = len(batch_sizes), len(set(seq_lens)), len(set(batch_sizes))
    if n < N_COEFFICIENTS + 1 or n_lens < 2 or n_batches < 2:
        raise ValueError(f"a 2-D fit needs at least 4 points over 2 seq_len values and 2 batch sizes; got {n} "
                         f"points over {n_lens} seq_len values and {n_batches} batch sizes")
    b, length = np.asarray(batch_sizes, dtype=float), np.asarray(seq_lens, dtype=float)
    y = np.asarray(peak_bytes, dtype=float)
    design = np.column_stack([np.ones(n), b * length, b])
    solved = _least_squares(design, y)
    if solved is None:
        raise ValueError("the points do not separate the per-token and per-sample terms (batch_size·seq_len "
                         "is collinear with batch_size): vary batch_size at each seq_len")
    beta, ssr, inverse = solved
    s = math.sqrt(ssr / (n - N_COEFFICIENTS))
    sst = float(np.sum((y - y.mean()) ** 2))
    stderr = [math.sqrt(max(float(v), 0.0)) * s for v in np.diag(inverse)]
    return Fit2D(
        overhead_bytes=float(beta[0]), bytes_per_token=float(beta[1]), bytes_per_sample=float(beta[2]),
        overhead_stderr_bytes=stderr[0], stderr_bytes_per_token=stderr[1], stderr_bytes_per_sample=stderr[2],
        residual_stderr_bytes=s, r_squared=1 - ssr / sst if sst > 0 else 1.0, n_points=n,
        t_critical=t_quantile(n - N_COEFFICIENTS),
        xtx_inverse=tuple(tuple(float(v) for v in row) for row in inverse),
        batch_sizes=tuple(int(v) for v in batch_sizes), seq_lens=tuple(int(v) for v in seq_lens),
        peak_bytes=tuple(int(v) for v in peak_bytes), extra_terms=_extra_terms(design, length, y, beta, ssr))


def _least_squares(design, y):
    """(β, SSR, (XᵀX)⁻¹) by QR on unit-scaled columns (tokens reach 1e5, tokens² 1e10), or None if rank-deficient."""
    import numpy as np

    scale = np.abs(design).max(axis=0)
    scale[scale == 0] = 1.0
    scaled = design / scale
    if np.linalg.matrix_rank(scaled) < design.shape[1]:
        return None
    q, r = np.linalg.qr(scaled)
    beta_scaled = np.linalg.solve(r, q.T @ y)
    r_inverse = np.linalg.inv(r)
    inverse = (r_inverse @ r_inverse.T) / np.outer(scale, scale)
    return beta_scaled / scale, float(np.sum((y - scaled @ beta_scaled) ** 2)), inverse


def _extra_terms(design, seq_lens, y, beta, ssr: float) -> str | None:
    import numpy as np

    n = len(y)
    candidates = np.column_stack([design[:, 1] ** 2, seq_lens])
    extended = np.column_stack([design, candidates])
    if n <= extended.shape[1] + 1:
        return None
    solved = _least_squares(extended, y)
    if solved is None:
        return None
    beta_extended, ssr_extended, _ = solved
    p_value = f_test_p(ssr, ssr_extended, candidates.shape[1], n - extended.shape[1])
    at = int(np.argmax(design[:, 1]))
    base, wider = float(design[at] @ beta), float(extended[at] @ beta_extended)
    deviation = abs(wider - base) / max(abs(base), 1.0)
    if p_value >= 0.01 or deviation <= 0.02:
        return None
    single = []  # each candidate alone, to say which one the points ask for
    for j, name in enumerate(_EXTRA_TERMS):
        one = _least_squares(np.column_stack([design, candidates[:, j]]), y)
        single.append((f_test_p(ssr, one[1], 1, n - N_COEFFICIENTS - 1) if one else 1.0, name))
    names = [name for p, name in single if p < 0.01] or [min(single)[1]]
    return (f"peaks need more than tokens and batch_size terms ({' and '.join(names)}: p = {p_value:.2g}, "
            f"{deviation:.1%} off at batch_size {design[at, 2]:.0f} × seq_len {seq_lens[at]:.0f}); "
            f"trust only verified limits")


def _argmin_convex(f: Callable[[int], float], low: int, high: int) -> int:
    """Smallest integer minimiser of a convex f on [low, high]: bisection on the sign of f(k + 1) - f(k)."""
    while low < high:
        middle = (low + high) // 2
        if f(middle + 1) >= f(middle):
            high = middle
        else:
            low = middle + 1
    return low


def _last_fitting(f: Callable[[int], float], limit: float, low: int, high: int) -> int:
    """Largest k in [low, high] with f(k) <= limit, given f(low) <= limit and f non-decreasing on [low, high]."""
    if f(high) <= limit:
        return high
    while high - low > 1:  # invariant: f(low) <= limit < f(high)
        middle = (low + high) // 2
        if f(middle) <= limit:
            low = middle
        else:
            high = middle
    return low


def safe_batch_size_2d(fit: Fit2D, usable_bytes: int, seq_len: int, widen: float = 0.0) -> int:
    """Largest integer batch_size >= 0 with ``fit.upper(batch_size, seq_len) + widen × fit.predict(batch_size,
    seq_len) <= usable_bytes`` (``widen``: :data:`vramcal.calibration.surface.INTERPOLATION_ERROR` between lengths).

    The bound is convex in batch_size (a line plus the root of a convex quadratic): bisection on the increasing
    side from its minimum. 0 when nothing fits or the slope at this length is under one byte per sample.

    Raises:
        ValueError: ``seq_len`` below 1.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    slope = fit.bytes_per_token * seq_len + fit.bytes_per_sample
    if slope < _MIN_SLOPE_BYTES:
        return 0
    high = max(1, math.floor((usable_bytes - fit.overhead_bytes) / slope)) + 1  # predict(high) > usable

    def bound(batch_size: int) -> float:
        return fit.upper(batch_size, seq_len) + widen * fit.predict(batch_size, seq_len)

    low = _argmin_convex(bound, 1, high)
    return _last_fitting(bound, usable_bytes, low, high) if bound(low) <= usable_bytes else 0


def longest_seq_len(fit: Fit2D, usable_bytes: int, batch_size: int, chunk_size: int, low: int, high: int,
                    widen: float = 0.0) -> int:
    """Largest multiple of chunk_size in [low, high] under :func:`safe_batch_size_2d`'s bound (convex in seq_len
    too: the same search over k = seq_len / chunk_size); 0 when none fits or bytes_per_token · batch_size < 1.

    Raises:
        ValueError: ``batch_size`` or ``chunk_size`` below 1.
    """
    if batch_size < 1 or chunk_size < 1:
        raise ValueError(f"batch_size and chunk_size must be positive, got {batch_size} and {chunk_size}")
    k_low, k_high = max(1, -(-low // chunk_size)), high // chunk_size
    if k_low > k_high or fit.bytes_per_token * batch_size < _MIN_SLOPE_BYTES:
        return 0

    def bound(k: int) -> float:
        return fit.upper(batch_size, k * chunk_size) + widen * fit.predict(batch_size, k * chunk_size)

    start = _argmin_convex(bound, k_low, k_high)
    return chunk_size * _last_fitting(bound, usable_bytes, start, k_high) if bound(start) <= usable_bytes else 0


def check_seq_lens(seq_lens: Sequence[int], chunk_size: int) -> tuple[int, ...]:
    """The requested lengths, sorted and de-duplicated; each must be a positive multiple of chunk_size.

    Raises:
        ValueError: no lengths, a non-positive chunk_size, or a length that is not a positive multiple of
            chunk_size (the message names the nearest valid lengths).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if not seq_lens:
        raise ValueError("give at least one seq_len")
    for value in seq_lens:
        if value < 1:
            raise ValueError(f"seq_len {value} is not positive: use a multiple of chunk_size {chunk_size}, "
                             f"such as {chunk_size}")
        if value % chunk_size:
            below = value // chunk_size * chunk_size
            nearest = f"{below} or {below + chunk_size}" if below else f"{chunk_size}"
            raise ValueError(f"seq_len {value} is not a multiple of chunk_size {chunk_size}: use {nearest}")
    return tuple(sorted({int(v) for v in seq_lens}))


def _parse_length(text: str) -> int:
    text = text.strip()
    if not re.fullmatch(r"[+-]?\d+", text):
        raise ValueError(f"seq_len {text!r} is not a whole number")
    if int(text) < 1:
        raise ValueError(f"seq_len {text} must be positive")
    return int(text)


@dataclass(frozen=True)
class SeqLens:
    """What a ``--seq-len`` text asks for, read once (:func:`parse_seq_lens`).

    Attributes:
        lengths: the lengths written, sorted and de-duplicated; for a range, its two ends (one value when
            they are equal).
        is_range: the text was a range ``low:high``, whose middle point :meth:`design` adds.
    """

    lengths: tuple[int, ...]
    is_range: bool = False

    def design(self, chunk_size: int) -> tuple[int, ...]:
        """The lengths to calibrate: a list as written; a range as its ends and geometrically spaced multiples of
        chunk_size between, neighbours at most :data:`LENGTH_RATIO` apart, at least one in the middle (three pin
        the 2-D model; the middle one is calibrated in full).

        Raises:
            ValueError: as :func:`check_seq_lens`.
        """
        lengths = check_seq_lens(self.lengths, chunk_size)
        if self.is_range and len(lengths) == 2:
            low, high = lengths
            gaps = max(2, math.ceil(math.log(high / low) / math.log(LENGTH_RATIO) - 1e-9))
            inside = {round(low * (high / low) ** (i / gaps) / chunk_size) * chunk_size for i in range(1, gaps)}
            lengths = tuple(sorted({low, high, *(min(max(n, low), high) for n in inside)}))
        return lengths


def wide_gaps(seq_lens: Sequence[int]) -> list[tuple[int, int]]:
    """Neighbouring lengths more than :data:`LENGTH_RATIO` apart (wider than the interpolation error was measured)."""
    ordered = sorted(seq_lens)
    return [(a, b) for a, b in zip(ordered, ordered[1:]) if b > LENGTH_RATIO * a]


def parse_seq_lens(text: str) -> SeqLens:
    """Read ``--seq-len``: a list ``"128,512,2048"`` or a range ``"128:2048"`` (:meth:`SeqLens.design` checks
    the multiples of chunk_size).

    Raises:
        ValueError: empty text, a non-integer, a zero or negative length, or a reversed range.
    """
    text = text.strip()
    if not text:
        raise ValueError("no seq_len given: write a list such as 128,512,2048 or a range such as 128:2048")
    if ":" in text:
        ends = text.split(":")
        if len(ends) != 2:
            raise ValueError(f"cannot read {text!r} as a range: write low:high, e.g. 128:2048")
        low, high = (_parse_length(end) for end in ends)
        if low > high:
            raise ValueError(f"the range is reversed: write {high}:{low}")
        return SeqLens((low,) if low == high else (low, high), is_range=low != high)
    return SeqLens(tuple(sorted({_parse_length(part) for part in text.split(",")})))
