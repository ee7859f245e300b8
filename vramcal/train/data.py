"""OHLCV bars for the bundled trainer: loading and checking, the E-mini tick sample, features, windows.

Bars are a parquet file with columns ``timestamp, open, high, low, close, volume`` (any
capitalisation; ``datetime``/``date``/``time`` also name the timestamp, or a datetime index).
Time-zone-aware timestamps are converted to UTC and made naive; numeric (epoch) timestamps are refused,
as their unit cannot be known.

Features of bar t (``N_FEATURES = 5``), all relative to the previous close ``C[t-1]`` so they are
scale-free and stationary::

    log(C[t] / C[t-1])      the bar's log return
    log(O[t] / C[t-1])      the opening gap
    log(H[t] / C[t-1])      the intrabar high, relative to the previous close
    log(L[t] / C[t-1])      the intrabar low, relative to the previous close
    log1p(V[t])             log volume

each standardised as ``(f - mean) / std`` with the mean and standard deviation of the *training split
only*. The target at bar t is the next bar's log return, ``log(C[t+1] / C[t]) / std_r``, scaled by the
training-split standard deviation ``std_r`` of the return and not centred, so 0 still means "no move"
and its sign is the direction. A window is ``seq_len`` consecutive bars: ``x`` (seq_len, 5) and ``y``
(seq_len,), one target per position, as the model predicts one next-bar return per position.

Rows: of n bars, the first has no previous close and the last no next bar, so ``M = n - 2`` rows carry
both features and a target (row i = bar i + 1). The split is chronological: training rows
``[0, s)``, validation rows ``[s, M)`` with ``s = round(M * (1 - val_fraction))``; windows start every
``stride`` rows from the first row of each side (of each segment's part of it, when there are gaps, see
below) and never cross ``s``. The last training target is the return of the first validation bar, an
input there, never a validation target.

Gaps (session breaks): a spacing between consecutive bars longer than ``GAP_FACTOR`` (10) times the
median spacing *and* longer than ``GAP_MIN`` (30 minutes) is a gap. The relative part is issue 10's rule
(a break "far longer than the bar spacing"): it keeps a weekend out of daily bars' gaps. The absolute
part keeps quiet seconds out: trade-driven bars drop intervals without trades, and the one-second
E-mini sample has 2,941 spacings of 10 to 209 s (the market was open, just quiet) and one of 6.5 hours;
the shortest regular session break of the major exchanges is about an hour (CME Globex's daily
maintenance halt, 17:00-18:00 ET; the Tokyo and Hong Kong lunch breaks), so 30 minutes catches every
one of those with a factor of two to spare. The bars between gaps form segments; a window never spans a
gap (its rows and the bars its targets read lie in one segment), and the rows whose features or target
reach across a gap (the return across a gap) are in no window and left out of the training statistics
(they are zeroed). Of a segment of k bars, k - 2 rows carry in-segment features and targets, as a file
without gaps does.

A training split on which a feature or the target has zero spread (constant prices, zero volume) is
refused: it teaches nothing, and standardising it would divide by zero.

Default ``stride = seq_len // 2``: the loss covers every position of a window, so a stride of seq_len
already trains on every bar's target once; half of that puts every bar (but the first half-window) also
in the second half of some window, with at least seq_len/2 bars of context, at twice the samples and no
more. On the 34,171 one-second E-mini bars (one gap) with the default seq_len 128 that is 424 training
and 105 validation windows: an epoch of the default model is seconds on a GPU and about 10 s on a 2-core CPU
(about 60 samples/s), so a run of several epochs fits in minutes anywhere.
"""

from __future__ import annotations

import importlib.util
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from vramcal.files import atomic_write

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

COLUMNS = ("timestamp", "open", "high", "low", "close", "volume")
TIMESTAMP_ALIASES = ("timestamp", "datetime", "date", "time", "ts")
FEATURE_NAMES = ("log_return", "log_open_gap", "log_high", "log_low", "log1p_volume")
MLFINPY_TICKS = ("dataset", "data", "tick_data.csv")
GAP_FACTOR = 10  # a gap is longer than this many median bar spacings ...
GAP_MIN_S = 30 * 60  # ... and longer than this (module docstring: the rule and its sources)


class DataError(ValueError):
    """Bars the trainer cannot use; the one-line message names the file, the problem and the fix."""


# ------------------------------------------------------------------------------------------- bars

def load_bars(path: Path | str) -> pd.DataFrame:
    """Read and check an OHLCV parquet file.

    Returns:
        A DataFrame with exactly :data:`COLUMNS`, a fresh RangeIndex, ``timestamp`` as datetime64 and
        the rest float64, strictly increasing in time.

    Raises:
        DataError: the file is missing, empty, not parquet, lacks a column, has NaN/infinite/non-positive
            prices, negative volume, inconsistent bars, or unsorted or duplicate timestamps.
    """

    import pandas as pd

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file (build the E-mini sample with `vramcal data es-sample`)")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty")
    try:
        frame = pd.read_parquet(path)
    except Exception as error:  # noqa: BLE001 - pyarrow raises many types for a bad file
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DataError(f"{path}: not a readable parquet file ({first[:160]})") from None
    return check_bars(_normalise_columns(frame, path), path)


def _normalise_columns(frame: pd.DataFrame, path: Path) -> pd.DataFrame:
    import pandas as pd

    lower = {str(c).strip().lower(): c for c in frame.columns}
    if not any(a in lower for a in TIMESTAMP_ALIASES) and isinstance(frame.index, pd.DatetimeIndex):
        frame = frame.reset_index(names="timestamp")
        lower = {str(c).strip().lower(): c for c in frame.columns}
    renamed = {}
    stamp = next((lower[a] for a in TIMESTAMP_ALIASES if a in lower), None)
    if stamp is not None:
        renamed["timestamp"] = frame[stamp]
    for name in COLUMNS[1:]:
        if name in lower:
            renamed[name] = frame[lower[name]]
    missing = [c for c in COLUMNS if c not in renamed]
    if missing:
        raise DataError(f"{path}: missing column(s) {', '.join(missing)}; found {', '.join(map(str, frame.columns))}"
                        f" (need {', '.join(COLUMNS)}, any capitalisation)")
    return pd.DataFrame(renamed).reset_index(drop=True)


def check_bars(frame: pd.DataFrame, path: Path | str = "bars") -> pd.DataFrame:
    """Check normalised bars (see :func:`load_bars`) and convert dtypes. Raises: DataError."""
    import pandas as pd

    if len(frame) == 0:
        raise DataError(f"{path}: the file holds no rows")
    stamps = _timestamps(frame["timestamp"], path)
    values = {}
    for name in COLUMNS[1:]:
        raw = frame[name]
        numbers = pd.to_numeric(raw, errors="coerce")
        not_numeric = (numbers.isna() & raw.notna()).to_numpy()
        if not_numeric.any():
            row = int(np.argmax(not_numeric))
            raise DataError(f"{path}: column {name} is not numeric: row {row} ({stamps.iloc[row]}) holds "
                            f"{str(raw.iloc[row])[:40]!r}; write numbers only")
        column = numbers.astype("float64").to_numpy()
        bad = ~np.isfinite(column)
        if bad.any():
            row = int(np.argmax(bad))
            raise DataError(f"{path}: column {name} has {int(bad.sum())} NaN or infinite value(s), first in "
                            f"row {row} ({stamps.iloc[row]}); clean or drop those bars")
        values[name] = column
    prices = np.stack([values[c] for c in ("open", "high", "low", "close")])
    if (prices <= 0).any():
        row = int(np.argmax((prices <= 0).any(axis=0)))
        raise DataError(f"{path}: non-positive price in row {row} ({stamps.iloc[row]}): log returns need prices > 0")
    if (values["volume"] < 0).any():
        row = int(np.argmax(values["volume"] < 0))
        raise DataError(f"{path}: negative volume in row {row} ({stamps.iloc[row]})")
    inconsistent = (values["high"] < prices.max(axis=0)) | (values["low"] > prices.min(axis=0))
    if inconsistent.any():
        row = int(np.argmax(inconsistent))
        raise DataError(f"{path}: bar in row {row} ({stamps.iloc[row]}) has high below or low above its "
                        f"other prices")
    steps = np.diff(stamps.to_numpy().astype("datetime64[ns]").astype(np.int64))
    if (steps < 0).any():
        row = int(np.argmax(steps < 0)) + 1
        raise DataError(f"{path}: timestamps are not sorted: row {row} ({stamps.iloc[row]}) is earlier than "
                        f"row {row - 1}; sort the bars by time")
    if (steps == 0).any():
        row = int(np.argmax(steps == 0)) + 1
        raise DataError(f"{path}: duplicate timestamp {stamps.iloc[row]} in rows {row - 1} and {row}; "
                        f"keep one bar per time")
    return pd.DataFrame({"timestamp": stamps.to_numpy(), **values})


def _timestamps(column: pd.Series, path: Path | str) -> pd.Series:
    """``column`` as naive datetime64: time-zone-aware stamps are converted to UTC and made naive.

    Raises:
        DataError: numbers (epoch times, whose unit cannot be known: the message guesses it and shows
            the conversion), text that is not a date-time (names the row), or a missing stamp.
    """
    import pandas as pd

    if pd.api.types.is_numeric_dtype(column) and not pd.api.types.is_bool_dtype(column):
        magnitude = float(np.nanmedian(np.abs(column.to_numpy(dtype="float64")))) if len(column) else 0.0
        unit, words = next((u, w) for u, w, low in (("ns", "nanoseconds", 1e17), ("us", "microseconds", 1e14),
                                                      ("ms", "milliseconds", 1e11), ("s", "seconds", 0.0))
                           if magnitude >= low)
        raise DataError(f"{path}: column timestamp holds numbers, not date-times (they look like epoch {words}): "
                        f"convert them first, e.g. frame['timestamp'] = pandas.to_datetime(frame['timestamp'], "
                        f"unit='{unit}')")
    if not (pd.api.types.is_datetime64_any_dtype(column)):
        parsed = pd.to_datetime(column, errors="coerce", format="mixed")
        unreadable = (parsed.isna() & column.notna()).to_numpy()
        if unreadable.any():
            row = int(np.argmax(unreadable))
            raise DataError(f"{path}: column timestamp is not a date-time: row {row} holds "
                            f"{str(column.iloc[row])[:40]!r} (write ISO 8601, e.g. 2024-01-02 09:30:00)")
        column = parsed
    if isinstance(column.dtype, pd.DatetimeTZDtype):
        column = column.dt.tz_convert("UTC").dt.tz_localize(None)
    if column.isna().any():
        raise DataError(f"{path}: timestamp is missing in row {int(np.argmax(column.isna().to_numpy()))}")
    return column


def synthetic_bars(n_bars: int = 34_171, seed: int = 0) -> pd.DataFrame:
    """Random-walk bars with the E-mini sample's size and shape, for calibrating without a data file.

    A random walk on the 0.25-point tick grid from 1600, one bar per second, consistent OHLC and integer
    volume; ``n_bars`` defaults to the number of 1-second bars of ``vramcal data es-sample``, so the data
    a calibration holds matches the sample's.
    """
    import pandas as pd

    rng = np.random.default_rng(seed)
    close = 1600 + 0.25 * np.cumsum(rng.integers(-2, 3, n_bars))
    open_ = np.concatenate([[close[0]], close[:-1]]) + 0.25 * rng.integers(-1, 2, n_bars)
    high = np.maximum(open_, close) + 0.25 * rng.integers(0, 3, n_bars)
    low = np.minimum(open_, close) - 0.25 * rng.integers(0, 3, n_bars)
    return pd.DataFrame({"timestamp": pd.date_range("2024-01-02 09:30", periods=n_bars, freq="1s"),
                         "open": open_, "high": high, "low": low, "close": close,
                         "volume": rng.integers(0, 500, n_bars).astype(float)})


# ------------------------------------------------------------------------------------ E-mini sample

def mlfinpy_tick_path() -> Path:
    """The E-mini S&P 500 tick CSV shipped inside the ``mlfinpy`` package, located without importing it.

    (Importing mlfinpy pulls numba; the file is data, so only its location is needed.)

    Raises:
        DataError: mlfinpy is not installed, or the file is not in it.
    """
    spec = importlib.util.find_spec("mlfinpy")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the E-mini tick sample comes with mlfinpy: pip install --no-deps mlfinpy==0.1.2")
    for root in spec.submodule_search_locations:
        path = Path(root).joinpath(*MLFINPY_TICKS)
        if path.is_file():
            return path
    raise DataError(f"mlfinpy is installed but has no {'/'.join(MLFINPY_TICKS)}: "
                    f"pip install --no-deps --force-reinstall mlfinpy==0.1.2")


def ticks_to_bars(ticks: pd.DataFrame, bar: str) -> pd.DataFrame:
    """Time bars from trades.

    Args:
        ticks: columns ``DateTime`` (or ``timestamp``), ``Price``, ``Volume`` (any capitalisation).
        bar: a pandas offset such as ``1s``, ``5s``, ``1min``.

    Returns:
        Bars with :data:`COLUMNS`: open/high/low/close of the trade prices in each interval (pandas
        ``resample(bar).ohlc()``, left-labelled), volume = summed traded contracts; intervals without
        trades are dropped, not forward-filled.

    Raises:
        DataError: missing columns or a bar string pandas cannot read.
    """
    import pandas as pd

    lower = {str(c).lower(): c for c in ticks.columns}
    stamp = lower.get("datetime") or lower.get("timestamp")
    if stamp is None or "price" not in lower or "volume" not in lower:
        raise DataError(f"ticks need DateTime, Price and Volume columns, found {', '.join(map(str, ticks.columns))}")
    try:
        offset = pd.tseries.frequencies.to_offset(bar)
    except ValueError:
        raise DataError(f"--bar {bar!r} is not a pandas time offset: use e.g. 1s, 5s, 1min") from None
    if offset.n <= 0:
        raise DataError(f"--bar {bar!r} is not a positive length of time: use e.g. 1s, 5s, 1min")
    series = ticks.set_index(pd.to_datetime(ticks[stamp])).sort_index()
    resampled = series.resample(offset)
    bars = resampled[lower["price"]].ohlc()
    bars["volume"] = resampled[lower["volume"]].sum().astype("float64")
    bars = bars.dropna(subset=["open"])
    return bars.reset_index(names="timestamp")[list(COLUMNS)]


def write_parquet(frame: pd.DataFrame, path: Path | str) -> Path:
    """Write ``frame`` as parquet atomically (:func:`vramcal.files.atomic_write`: a temporary file in the same
    folder, fsynced, then renamed over ``path``).

    Raises:
        DataError: the folder cannot be created or written (e.g. a part of the path is a file).
    """
    path = Path(path)
    try:
        atomic_write(path, lambda handle: frame.to_parquet(handle, index=False))
    except OSError as error:
        raise DataError(f"cannot write {path} ({error.strerror or error}): choose another --out") from None
    return path


def few_bars_notice(n_bars: int, bar: str, seq_len: int) -> str | None:
    """A warning when ``n_bars`` make no window of ``seq_len`` bars (the default model's), else None."""
    need = seq_len + 2
    if n_bars >= need:
        return None
    return (f"only {n_bars} {bar} bar{'' if n_bars == 1 else 's'}, fewer than one window of the default "
            f"seq_len {seq_len} (needs {need}): "
            f"`vramcal train` will refuse them; use a shorter --bar")


def es_sample(bar: str, out: Path | str, ticks_csv: Path | str | None = None) -> pd.DataFrame:
    """Build OHLCV bars from the E-mini tick sample (or another tick CSV) and write them to ``out``."""
    import pandas as pd

    source = Path(ticks_csv) if ticks_csv else mlfinpy_tick_path()
    try:
        ticks = pd.read_csv(source)
    except (OSError, ValueError) as error:
        raise DataError(f"cannot read ticks from {source}: {str(error).splitlines()[0][:160]}") from None
    bars = check_bars(ticks_to_bars(ticks, bar), source)
    write_parquet(bars, out)
    return bars


# ------------------------------------------------------------------------------ features, windows

@dataclass(frozen=True)
class Windows:
    """Standardised rows and the window starts of each split.

    Attributes:
        features: (M, N_FEATURES) float32, standardised with training-split statistics (0 in rows that
            reach across a gap).
        targets: (M,) float32, next-bar log return / training std of the log return (0 in rows whose
            target is the return across a gap: never a target, as no window holds them).
        train_starts, val_starts: (n_windows,) int64 first rows of the windows of each split.
        seq_len, stride: window length and spacing, bars.
        split_row: s, the first validation row.
        feature_mean, feature_std: (N_FEATURES,) the training statistics; target_scale: std_r.
        first_val_timestamp: when the validation split begins (ISO text).
        gaps: the number of gaps (session breaks) between bars; longest_gap_s: the longest, seconds (0.0
            without gaps); gap_threshold_s: the spacing above which a pause is a gap, seconds.
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

    def stats(self) -> dict:
        """The normalisation, for checkpoints and run records (plain JSON types)."""
        return {"feature_names": list(FEATURE_NAMES), "feature_mean": self.feature_mean.tolist(),
                "feature_std": self.feature_std.tolist(), "target_scale": self.target_scale,
                "rows": len(self.targets), "split_row": self.split_row, "seq_len": self.seq_len,
                "stride": self.stride, "train_windows": len(self.train_starts),
                "val_windows": len(self.val_starts), "first_val_timestamp": self.first_val_timestamp,
                "gaps": self.gaps, "longest_gap_s": self.longest_gap_s, "gap_threshold_s": self.gap_threshold_s}


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
    """Where the bars pause for a session break (module docstring: the rule and its sources).

    Args:
        timestamps: (n,) strictly increasing bar times.

    Returns:
        The bar indices j (ascending int64) such that the pause between bar j - 1 and bar j is a gap,
        and the threshold in seconds (``max(GAP_FACTOR x median spacing, GAP_MIN_S)``).
    """
    stamps = np.asarray(timestamps, dtype="datetime64[ns]").astype(np.int64)
    spacing_s = np.diff(stamps) / 1e9  # (n - 1,)
    if len(spacing_s) == 0:
        return np.zeros(0, dtype=np.int64), float(GAP_MIN_S)
    threshold = max(GAP_FACTOR * float(np.median(spacing_s)), float(GAP_MIN_S))
    return (np.flatnonzero(spacing_s > threshold) + 1).astype(np.int64), threshold


def raw_features(bars: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Unstandardised features and next-bar log returns.

    Returns:
        features (n - 2, 5) float64 for bars 1..n-2, and returns (n - 2,) float64, the log return of
        bars 2..n-1 (the target of each row, before scaling).
    """
    close = bars["close"].to_numpy()
    prev = close[:-1]
    per_bar = np.stack([np.log(close[1:] / prev), np.log(bars["open"].to_numpy()[1:] / prev),
                        np.log(bars["high"].to_numpy()[1:] / prev), np.log(bars["low"].to_numpy()[1:] / prev),
                        np.log1p(bars["volume"].to_numpy()[1:])], axis=1)  # (n - 1, 5), bars 1..n-1
    return per_bar[:-1], per_bar[1:, 0]


def _starts(segments: list[tuple[int, int]], low: int, high: int, seq_len: int, stride: int) -> np.ndarray:
    """Window starts every ``stride`` rows from the first row of each segment's part of ``[low, high)``,
    each window inside it. ``segments``: ``[first row, end row)`` of the rows of each segment."""
    starts = []
    for first, end in segments:
        first, end = max(first, low), min(end, high)
        if end - first >= seq_len:
            starts.append(np.arange(first, end - seq_len + 1, stride, dtype=np.int64))
    return np.concatenate(starts) if starts else np.zeros(0, dtype=np.int64)


def make_windows(bars: pd.DataFrame, seq_len: int, stride: int | None = None,
                 val_fraction: float = 0.2, source: str = "bars") -> Windows:
    """Features, targets and the chronological split (module docstring has the formulas and the gap rule).

    Raises:
        DataError: fewer bars than one window, a split that leaves a side without a window (gaps
            included), or a feature or the target with zero spread on the training split.
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
    rows = len(returns)
    split = round(rows * (1 - val_fraction))
    gaps, threshold = find_gaps(bars["timestamp"])
    # Bars [a, b) of a segment give rows [a, b - 2): row i reads bars i..i+2 (previous close, bar, target).
    edges = [0, *gaps.tolist(), n_bars]
    segments = [(a, b - 2) for a, b in itertools.pairwise(edges) if b - 2 > a]
    valid = np.zeros(rows, dtype=bool)
    for first, end in segments:
        valid[first:end] = True
    train_starts = _starts(segments, 0, split, seq_len, stride)
    val_starts = _starts(segments, split, rows, seq_len, stride)
    if len(train_starts) == 0 or len(val_starts) == 0:
        need = int(np.ceil(seq_len / min(val_fraction, 1 - val_fraction))) + 2
        within = f" between its {len(gaps)} gap(s)" if len(gaps) else ""
        raise DataError(f"{source}: {n_bars} bars give {len(train_starts)} training and {len(val_starts)} "
                        f"validation windows of {seq_len} bars{within} (val_fraction {val_fraction}); need about "
                        f"{need} bars{' without a gap' if len(gaps) else ''}, or a smaller --seq-len")
    training = features[:split][valid[:split]]
    mean, std = training.mean(axis=0), training.std(axis=0)
    flat = [name for name, m, sd in zip(FEATURE_NAMES, mean, std) if not sd > 1e-12 + 1e-9 * abs(m)]
    if flat:
        raise DataError(f"{source}: {', '.join(flat)} do{'es' if len(flat) == 1 else ''} not vary on the training "
                        f"split ({len(training)} rows; constant prices or volume?): a feature or target with "
                        f"zero spread teaches nothing; use bars whose prices and volume move")
    scale = float(std[0])
    standardised = ((features - mean) / std).astype(np.float32)
    targets = (returns / scale).astype(np.float32)
    standardised[~valid], targets[~valid] = 0.0, 0.0
    spacing_s = np.diff(np.asarray(bars["timestamp"], dtype="datetime64[ns]").astype(np.int64)) / 1e9
    return Windows(
        features=standardised, targets=targets, train_starts=train_starts, val_starts=val_starts, seq_len=seq_len,
        stride=stride, split_row=split, feature_mean=mean, feature_std=std, target_scale=scale,
        first_val_timestamp=str(bars["timestamp"].iloc[split + 1]), gaps=len(gaps),
        longest_gap_s=float(spacing_s[gaps - 1].max()) if len(gaps) else 0.0, gap_threshold_s=threshold)
