"""Features and windows of OHLCV bars for the regressor: what a trial and the trainer feed the model.

Features of bar t (:data:`FEATURE_NAMES`), relative to the previous close: ``log(C[t]/C[t-1])``,
``log(O[t]/C[t-1])``, ``log(H[t]/C[t-1])``, ``log(L[t]/C[t-1])``, ``log1p(V[t])``, each standardised with the
training split's mean and std. Target: the next return ``log(C[t+1]/C[t]) / std_r``, scaled, not centred. Of n
bars, ``M = n - 2`` rows (row i = bar i + 1); the split is chronological, training rows ``[0, s)`` with
``s = round(M * (1 - val_fraction))``; windows of ``seq_len`` rows start every ``stride`` rows (default
``seq_len // 2``: every bar in some window's second half) and never cross ``s`` or a gap.

Gaps (session breaks): a spacing over ``GAP_FACTOR`` x the median *and* over ``GAP_MIN_S``: the relative part is
issue 10's "far longer than the bar spacing"; the absolute part keeps quiet seconds of trade-driven bars out, and
catches the shortest regular exchange break (CME Globex's hour-long daily halt) twice over. Rows reaching across a
gap are zeroed, in no window and out of the statistics. A target without spread is refused; a feature without
spread is centred, not scaled (std taken as 1), and named in ``flat_features``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from vramcal.models.regressor.bars import DataError
from vramcal.words import word

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

FEATURE_NAMES = ("log_return", "log_open_gap", "log_high", "log_low", "log1p_volume")
GAP_FACTOR = 10  # a gap is longer than this many median bar spacings ...
GAP_MIN_S = 30 * 60  # ... and longer than this (module docstring: the rule and its sources)


@dataclass(frozen=True)
class Windows:
    """Standardised rows and the window starts of each split (module docstring).

    Attributes:
        features: (M, N_FEATURES) float32, standardised (0 in rows across a gap).
        targets: (M,) float32, next-bar log return / std_r (0 in rows across a gap).
        train_starts, val_starts: (n_windows,) int64 first rows of the windows of each split.
        seq_len, stride: window length and spacing, bars; split_row: s, the first validation row.
        feature_mean, feature_std: (N_FEATURES,) the training statistics; target_scale: std_r.
        first_val_timestamp: when the validation split begins (ISO text).
        gaps, longest_gap_s, gap_threshold_s: the gaps' count, the longest and the threshold, seconds.
        flat_features: the features without spread on the training split.
    """

    features: np.ndarray
    targets: np.ndarray
    train_starts: np.ndarray
    val_starts: np.ndarray
    seq_len: int
    stride: int
    split_row: int
    feature_mean: np.ndarray
    feature_std: np.ndarray
    target_scale: float
    first_val_timestamp: str
    gaps: int = 0
    longest_gap_s: float = 0.0
    gap_threshold_s: float = 0.0
    flat_features: tuple[str, ...] = ()

    @property
    def pipeline_bytes(self) -> int:
        """Bytes the trainer's pipeline holds: rows, targets, starts and one epoch's permutation (the data term)."""
        return int(self.features.nbytes + self.targets.nbytes + self.train_starts.nbytes * 2 + self.val_starts.nbytes)

    def stats(self) -> dict:
        """The normalisation, for checkpoints and run records (plain JSON types)."""
        return {"feature_names": list(FEATURE_NAMES), "feature_mean": self.feature_mean.tolist(),
                "feature_std": self.feature_std.tolist(), "target_scale": self.target_scale,
                "rows": len(self.targets), "split_row": self.split_row, "seq_len": self.seq_len,
                "stride": self.stride, "train_windows": len(self.train_starts),
                "val_windows": len(self.val_starts), "first_val_timestamp": self.first_val_timestamp,
                "gaps": self.gaps, "longest_gap_s": self.longest_gap_s, "gap_threshold_s": self.gap_threshold_s,
                "flat_features": list(self.flat_features)}


def gap_notice(stats: dict) -> str | None:
    """The line telling people how many gaps the data have (from :meth:`Windows.stats`), or None."""
    n = int(stats.get("gaps", 0))
    if n == 0:
        return None
    return (f"data: {n} gap{'' if n == 1 else 's'} between bars (session breaks: pauses over "
            f"{_duration(stats['gap_threshold_s'])}; the longest {_duration(stats['longest_gap_s'])}): no window "
            f"spans one, and the return across each is neither a target nor in the statistics")


def _duration(seconds: float) -> str:
    for unit, size in (("days", 86400), ("hours", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def find_gaps(timestamps: pd.Series) -> tuple[np.ndarray, float]:
    """The bars j (ascending int64) after a gap in ``timestamps`` (n,), and the threshold, seconds."""
    stamps = np.asarray(timestamps, dtype="datetime64[ns]").astype(np.int64)
    spacing_s = np.diff(stamps) / 1e9  # (n - 1,)
    if len(spacing_s) == 0:
        return np.zeros(0, dtype=np.int64), float(GAP_MIN_S)
    threshold = max(GAP_FACTOR * float(np.median(spacing_s)), float(GAP_MIN_S))
    return (np.flatnonzero(spacing_s > threshold) + 1).astype(np.int64), threshold


def raw_features(bars: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Unstandardised features (n - 2, 5) float64 of bars 1..n-2, and their targets' log returns (n - 2,)."""
    close = bars["close"].to_numpy()
    prev = close[:-1]
    per_bar = np.stack([np.log(close[1:] / prev), np.log(bars["open"].to_numpy()[1:] / prev),
                        np.log(bars["high"].to_numpy()[1:] / prev), np.log(bars["low"].to_numpy()[1:] / prev),
                        np.log1p(bars["volume"].to_numpy()[1:])], axis=1)  # (n - 1, 5), bars 1..n-1
    return per_bar[:-1], per_bar[1:, 0]


def _starts(segments: list[tuple[int, int]], low: int, high: int, seq_len: int, stride: int) -> np.ndarray:
    """Window starts every ``stride`` rows in each segment's ``[first, end)`` part of ``[low, high)``."""
    starts = []
    for first, end in segments:
        first, end = max(first, low), min(end, high)
        if end - first >= seq_len:
            starts.append(np.arange(first, end - seq_len + 1, stride, dtype=np.int64))
    return np.concatenate(starts) if starts else np.zeros(0, dtype=np.int64)


def make_windows(bars: pd.DataFrame, seq_len: int, stride: int | None = None,
                 val_fraction: float = 0.2, source: str = "bars") -> Windows:
    """Features, targets and the chronological split (module docstring).

    Raises:
        DataError: fewer bars than one window, a split that leaves a side without a window (gaps
            included), or a target (the closes) without spread on the training split.
        ValueError: stride < 1 or val_fraction outside (0, 1).
    """
    stride = stride or max(1, seq_len // 2)
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_bars = len(bars)
    if n_bars < seq_len + 2:
        raise DataError(f"{source}: {n_bars} bars are fewer than one window: seq_len {seq_len} needs at least "
                        f"{seq_len + 2} bars (one before for the first return, one after for the last target)")
    features, returns = raw_features(bars)
    split = round(len(returns) * (1 - val_fraction))
    gaps, threshold = find_gaps(bars["timestamp"])
    segments, valid = _segments(gaps, n_bars)
    train_starts = _starts(segments, 0, split, seq_len, stride)
    val_starts = _starts(segments, split, len(returns), seq_len, stride)
    if len(train_starts) == 0 or len(val_starts) == 0:
        need = int(np.ceil(seq_len / min(val_fraction, 1 - val_fraction))) + 2
        within = f" between its {len(gaps)} gap(s)" if len(gaps) else ""
        raise DataError(f"{source}: {n_bars} bars give {len(train_starts)} training and {len(val_starts)} "
                        f"validation windows of {seq_len} bars{within} (val_fraction {val_fraction}); need about "
                        f"{need} bars{' without a gap' if len(gaps) else ''}, or a smaller {word('seq_len')}")
    mean, std, flat = _training_statistics(features[:split][valid[:split]], source)
    standardised, targets = ((features - mean) / std).astype(np.float32), (returns / std[0]).astype(np.float32)
    standardised[~valid], targets[~valid] = 0.0, 0.0
    spacing_s = np.diff(np.asarray(bars["timestamp"], dtype="datetime64[ns]").astype(np.int64)) / 1e9
    return Windows(
        features=standardised, targets=targets, train_starts=train_starts, val_starts=val_starts, seq_len=seq_len,
        stride=stride, split_row=split, feature_mean=mean, feature_std=std, target_scale=float(std[0]),
        first_val_timestamp=str(bars["timestamp"].iloc[split + 1]), gaps=len(gaps),
        longest_gap_s=float(spacing_s[gaps - 1].max()) if len(gaps) else 0.0, gap_threshold_s=threshold,
        flat_features=flat)


def window_counts(n_bars: int, seq_len: int, stride: int | None = None, val_fraction: float = 0.2) -> tuple[int, int]:
    """(training windows, validation windows) that :func:`make_windows` cuts from ``n_bars`` bars without gaps.
    Raises: ValueError: fewer than one bar, seq_len or stride below 1, or val_fraction outside (0, 1)."""
    stride = stride or max(1, seq_len // 2)
    if n_bars < 1 or seq_len < 1 or stride < 1 or not 0 < val_fraction < 1:
        raise ValueError(f"window counts need n_bars, seq_len and stride >= 1 and val_fraction in (0, 1), got "
                         f"{n_bars}, {seq_len}, {stride}, {val_fraction}")
    rows = max(0, n_bars - 2)
    split = round(rows * (1 - val_fraction))

    def count(n_rows: int) -> int:
        return (n_rows - seq_len) // stride + 1 if n_rows >= seq_len else 0

    return count(split), count(rows - split)


def _segments(gaps: np.ndarray, n_bars: int) -> tuple[list[tuple[int, int]], np.ndarray]:
    """The rows ``[a, b - 2)`` of each segment ``[a, b)`` of bars between gaps, and which rows lie in one."""
    edges = [0, *gaps.tolist(), n_bars]
    segments = [(a, b - 2) for a, b in itertools.pairwise(edges) if b - 2 > a]
    valid = np.zeros(n_bars - 2, dtype=bool)
    for first, end in segments:
        valid[first:end] = True
    return segments, valid


def _training_statistics(training: np.ndarray, source: str) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """Mean and std (N_FEATURES,) of the training rows, 1 for a feature without spread, and those features' names.
    Raises: DataError: the log return (the target's source) has no spread: the closes never move."""
    mean, std = training.mean(axis=0), training.std(axis=0)
    flat = tuple(name for name, m, sd in zip(FEATURE_NAMES, mean, std) if not sd > 1e-12 + 1e-9 * abs(m))
    if FEATURE_NAMES[0] in flat:
        raise DataError(f"{source}: the closes do not move on the training split ({len(training)} rows): a target "
                        f"with zero spread teaches nothing; use bars whose prices move")
    return mean, np.where([name in flat for name in FEATURE_NAMES], 1.0, std), flat


def flat_notice(stats: dict) -> str | None:
    """The line telling people which features do not vary (from :meth:`Windows.stats`), or None."""
    flat = stats.get("flat_features") or []
    if not flat:
        return None
    return (f"data: {', '.join(flat)} do{'es' if len(flat) == 1 else ''} not vary on the training split (e.g. opens "
            f"equal to the previous close, or zero volume): centred, not scaled, so the model sees a constant")


def data_notices(stats: dict) -> list[str]:
    """The lines about the data people should read before a run: its gaps and its flat features."""
    return [line for line in (gap_notice(stats), flat_notice(stats)) if line]
