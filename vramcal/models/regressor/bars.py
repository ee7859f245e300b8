"""OHLCV bars for the regressor family: loading and checking a bar file (:data:`COLUMNS`, any capitalisation;
:data:`TIMESTAMP_ALIASES` or a datetime index for the time), and the E-mini tick sample."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from vramcal.files import atomic_write, os_advice
from vramcal.workload import first_line

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

COLUMNS = ("timestamp", "open", "high", "low", "close", "volume")
TIMESTAMP_ALIASES = ("timestamp", "datetime", "date", "time", "ts")
MLFINPY_TICKS = ("dataset", "data", "tick_data.csv")
PARQUET_MAGIC = b"PAR1"


class DataError(ValueError):
    """Bars the trainer cannot use; the one-line message names the file, the problem and the fix."""


def load_bars(path: Path | str) -> pd.DataFrame:
    """Read and check an OHLCV parquet file: :data:`COLUMNS` (timestamp naive datetime64, the rest float64),
    strictly increasing in time, a fresh RangeIndex.

    Raises:
        DataError: no readable parquet file (:func:`check_file`), a column missing or named twice, or bad values
            (:func:`check_bars`).
    """
    import pandas as pd

    path = Path(path)
    head = check_file(path, "bars", "build the E-mini sample with `vramcal data es-sample`")
    if head[:4] != PARQUET_MAGIC:
        raise DataError(f"{path}: not a readable parquet file (it does not start with parquet's PAR1 bytes: it "
                        f"starts with {head[:12]!r}): write the bars with pandas' to_parquet")
    try:
        frame = pd.read_parquet(path)
    except Exception as error:  # noqa: BLE001 - pyarrow raises many types for a bad file
        raise DataError(f"{path}: not a readable parquet file ({first_line(error)[:160]})") from None
    return check_bars(_normalise_columns(frame, path), path)


def check_file(path: Path, what: str, make: str) -> bytes:
    """The first bytes of ``path`` once it is a readable, non-empty regular file (``what`` names it, ``make``
    says how to get one). Raises: DataError: missing, a folder, a device or pipe, unreadable, or empty."""
    if not path.exists():
        raise DataError(f"{path}: no such file ({make})")
    if path.is_dir():
        raise DataError(f"{path}: is a folder, not a file of {what}: name the file")
    if not path.is_file():
        raise DataError(f"{path}: not a regular file (a device, pipe or socket), so no {what}: name a file of {what}")
    try:
        with open(path, "rb") as handle:
            head = handle.read(64)
    except OSError as error:
        raise DataError(f"{path}: cannot be read ({error.strerror or error}): check its permissions") from None
    if not head:
        raise DataError(f"{path}: the file is empty, so no {what} ({make})")
    return head


def _normalise_columns(frame: pd.DataFrame, path: Path) -> pd.DataFrame:
    import pandas as pd

    if not any(str(c).strip().lower() in TIMESTAMP_ALIASES for c in frame.columns) \
            and isinstance(frame.index, pd.DatetimeIndex):
        frame = frame.reset_index(names="timestamp")
    lower = column_names(frame, path, COLUMNS[1:] + TIMESTAMP_ALIASES)
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


def column_names(frame: pd.DataFrame, path: Path | str, wanted: tuple[str, ...]) -> dict[str, object]:
    """Lower-case name -> the frame's column (any capitalisation, spaces around).
    Raises: DataError: a ``wanted`` name given by two columns (``close`` and ``Close``)."""
    lower: dict[str, object] = {}
    for column in frame.columns:
        key = str(column).strip().lower()
        if key in wanted and key in lower:
            raise DataError(f"{path}: columns {lower[key]!r} and {column!r} both name {key}: keep one of them")
        lower[key] = column
    return lower


def check_bars(frame: pd.DataFrame, path: Path | str = "bars") -> pd.DataFrame:
    """Check normalised bars and convert dtypes.

    Raises:
        DataError: no rows, bad numbers or date-times, prices <= 0, negative volume, high/low inconsistent with the
            other prices, or unsorted or duplicate timestamps.
    """
    import pandas as pd

    if len(frame) == 0:
        raise DataError(f"{path}: the file holds no rows")
    stamps = timestamps(frame["timestamp"], path)
    values = {name: numbers(frame[name], name, path, stamps) for name in COLUMNS[1:]}
    prices = np.stack([values[c] for c in ("open", "high", "low", "close")])
    steps = np.r_[1, np.diff(stamps.to_numpy().astype("datetime64[ns]").astype(np.int64))]  # row i: since row i-1
    for bad, says in (((prices <= 0).any(axis=0), "non-positive price in row {row} ({stamp}): log returns need "
                                                   "prices > 0"),
                      (values["volume"] < 0, "negative volume in row {row} ({stamp})"),
                      ((values["high"] < prices.max(axis=0)) | (values["low"] > prices.min(axis=0)),
                       "bar in row {row} ({stamp}) has high below or low above its other prices"),
                      (steps < 0, "timestamps are not sorted: row {row} ({stamp}) is earlier than row {before}; sort "
                                  "the bars by time"),
                      (steps == 0, "duplicate timestamp {stamp} in rows {before} and {row}; keep one bar per time")):
        if bad.any():
            row = int(np.argmax(bad))
            raise DataError(f"{path}: " + says.format(row=row, stamp=stamps.iloc[row], before=row - 1))
    return pd.DataFrame({"timestamp": stamps.to_numpy(), **values})


def numbers(raw: pd.Series, name: str, path: Path | str, stamps: pd.Series | None = None) -> np.ndarray:
    """A column of numbers (or text that reads as numbers) as finite float64.
    Raises: DataError: true/false values, a value that is no number, NaN or infinities (the row named)."""
    import pandas as pd

    def where(row: int) -> str:
        return f"row {row}" + (f" ({stamps.iloc[row]})" if stamps is not None else "")

    if pd.api.types.is_bool_dtype(raw) or (raw.dtype == object and raw.map(type).eq(bool).any()):
        raise DataError(f"{path}: column {name} holds true/false values, not numbers; write numbers only")
    try:
        converted = pd.to_numeric(raw, errors="coerce")
    except (TypeError, ValueError):  # cells pandas cannot even try (lists, dicts)
        converted = pd.to_numeric(raw.map(lambda v: v if isinstance(v, (int, float, str)) else None), errors="coerce")
    not_numeric = (converted.isna() & raw.notna()).to_numpy()
    if not_numeric.any():
        row = int(np.argmax(not_numeric))
        raise DataError(f"{path}: column {name} is not numeric: {where(row)} holds {str(raw.iloc[row])[:40]!r}; "
                        f"write numbers only")
    column = converted.astype("float64").to_numpy()
    bad = ~np.isfinite(column)
    if bad.any():
        row = int(np.argmax(bad))
        raise DataError(f"{path}: column {name} has {int(bad.sum())} NaN or infinite value(s), first in "
                        f"{where(row)}; clean or drop those rows")
    return column


def timestamps(column: pd.Series, path: Path | str, name: str = "timestamp") -> pd.Series:
    """``column`` as naive datetime64, zone-aware stamps converted to UTC.

    Raises:
        DataError: numbers (epoch times of unknown unit: the message guesses it), true/false, text that is not a
            date-time, or a missing stamp.
    """
    import pandas as pd

    if pd.api.types.is_numeric_dtype(column) and not pd.api.types.is_bool_dtype(column):
        magnitude = float(np.nanmedian(np.abs(column.to_numpy(dtype="float64")))) if len(column) else 0.0
        unit, words = next((u, w) for u, w, low in (("ns", "nanoseconds", 1e17), ("us", "microseconds", 1e14),
                                                      ("ms", "milliseconds", 1e11), ("s", "seconds", 0.0))
                           if magnitude >= low)
        raise DataError(f"{path}: column {name} holds numbers, not date-times (they look like epoch {words}): "
                        f"convert them first, e.g. frame['{name}'] = pandas.to_datetime(frame['{name}'], "
                        f"unit='{unit}')")
    if not pd.api.types.is_datetime64_any_dtype(column):
        column = _parse_stamps(column, path, name)
    if isinstance(column.dtype, pd.DatetimeTZDtype):
        column = column.dt.tz_convert("UTC").dt.tz_localize(None)
    if column.isna().any():
        raise DataError(f"{path}: column {name}: the time is missing in row {int(np.argmax(column.isna().to_numpy()))}"
                        f"; drop the rows without one")
    return column


def _parse_stamps(column: pd.Series, path: Path | str, name: str) -> pd.Series:
    """Text as datetime64: the whole column in one format where it has one (fast), else stamp by stamp."""
    import pandas as pd

    try:
        if not pd.api.types.is_bool_dtype(column) and not column.map(type).eq(bool).any():
            parsed = pd.to_datetime(column)
            return parsed if pd.api.types.is_datetime64_any_dtype(parsed) else pd.to_datetime(column, utc=True)
    except (ValueError, TypeError, OverflowError):
        pass
    parsed = pd.to_datetime(column.map(lambda v: None if isinstance(v, bool) else v), errors="coerce",
                            format="mixed", utc=True)
    unreadable = (parsed.isna() & column.notna()).to_numpy()
    if unreadable.any():
        row = int(np.argmax(unreadable))
        raise DataError(f"{path}: column {name} is not a date-time: row {row} holds {str(column.iloc[row])[:40]!r} "
                        f"(write ISO 8601, e.g. 2024-01-02 09:30:00)")
    return parsed


def synthetic_bars(n_bars: int = 34_171, seed: int = 0) -> pd.DataFrame:
    """Random-walk bars (0.25-point ticks from 1600, one a second) the size of ``vramcal data es-sample``'s,
    for calibrating without a data file."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    close = 1600 + 0.25 * np.cumsum(rng.integers(-2, 3, n_bars))
    open_ = np.concatenate([[close[0]], close[:-1]]) + 0.25 * rng.integers(-1, 2, n_bars)
    high = np.maximum(open_, close) + 0.25 * rng.integers(0, 3, n_bars)
    low = np.minimum(open_, close) - 0.25 * rng.integers(0, 3, n_bars)
    return pd.DataFrame({"timestamp": pd.date_range("2024-01-02 09:30", periods=n_bars, freq="1s"),
                         "open": open_, "high": high, "low": low, "close": close,
                         "volume": rng.integers(0, 500, n_bars).astype(float)})


def mlfinpy_tick_path() -> Path:
    """The E-mini S&P 500 tick CSV inside ``mlfinpy``, located without importing it (which pulls numba).
    Raises: DataError: mlfinpy is not installed, or the file is not in it."""
    spec = importlib.util.find_spec("mlfinpy")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the E-mini tick sample comes with mlfinpy: pip install --no-deps mlfinpy==0.1.2")
    for root in spec.submodule_search_locations:
        path = Path(root).joinpath(*MLFINPY_TICKS)
        if path.is_file():
            return path
    raise DataError(f"mlfinpy is installed but has no {'/'.join(MLFINPY_TICKS)}: "
                    f"pip install --no-deps --force-reinstall mlfinpy==0.1.2")


TICK_STAMPS = ("datetime", "timestamp")  # the tick file's time column, any capitalisation


def check_ticks(ticks: pd.DataFrame, path: Path | str = "ticks") -> pd.DataFrame:
    """Ticks (``DateTime`` or ``timestamp``, ``Price`` > 0, ``Volume`` >= 0; any capitalisation) as a frame
    ``timestamp, price, volume`` sorted by time.

    Raises:
        DataError: a missing or doubled column, no trades, or a bad value.
    """
    import pandas as pd

    lower = column_names(ticks, path, TICK_STAMPS + ("price", "volume"))
    stamp = next((lower[a] for a in TICK_STAMPS if a in lower), None)
    if stamp is None or "price" not in lower or "volume" not in lower:
        raise DataError(f"{path}: ticks need DateTime, Price and Volume columns, found "
                        f"{', '.join(map(str, ticks.columns)) or 'none'}")
    if len(ticks) == 0:
        raise DataError(f"{path}: the file holds no trades (a header only): give a tick file with trades")
    stamps = timestamps(ticks[stamp].reset_index(drop=True), path, str(stamp))
    price = numbers(ticks[lower["price"]].reset_index(drop=True), str(lower["price"]), path, stamps)
    volume = numbers(ticks[lower["volume"]].reset_index(drop=True), str(lower["volume"]), path, stamps)
    for name, values, bad, need in ((lower["price"], price, price <= 0, "> 0"), (lower["volume"], volume, volume < 0,
                                                                              ">= 0")):
        if bad.any():
            row = int(np.argmax(bad))
            raise DataError(f"{path}: column {name} holds {values[row]:g} in row {row} ({stamps.iloc[row]}): it must "
                            f"be {need}; clean or drop that trade")
    frame = pd.DataFrame({"timestamp": stamps.to_numpy(), "price": price, "volume": volume})
    return frame.sort_values("timestamp", kind="stable").reset_index(drop=True)


def bar_offset(bar: str) -> pd.DateOffset:
    """``bar`` (``1s``, ``5s``, ``1min``) as a pandas offset. Raises: DataError: unreadable, or not positive."""
    import pandas as pd

    try:
        offset = pd.tseries.frequencies.to_offset(bar)
    except ValueError:
        raise DataError(f"--bar {bar!r} is not a pandas time offset: use e.g. 1s, 5s, 1min") from None
    if offset.n <= 0:
        raise DataError(f"--bar {bar!r} is not a positive length of time: use e.g. 1s, 5s, 1min")
    return offset


def ticks_to_bars(ticks: pd.DataFrame, bar: str, path: Path | str = "ticks") -> pd.DataFrame:
    """Time bars (:data:`COLUMNS`) from trades (:func:`check_ticks`): pandas ``resample(bar).ohlc()``,
    left-labelled, volume summed; intervals without trades dropped.

    Raises:
        DataError: bad ticks or a bar string pandas cannot read.
    """
    offset = bar_offset(bar)
    series = check_ticks(ticks, path).set_index("timestamp")
    resampled = series.resample(offset)
    bars = resampled["price"].ohlc()
    bars["volume"] = resampled["volume"].sum().astype("float64")
    bars = bars.dropna(subset=["open"])
    return bars.reset_index(names="timestamp")[list(COLUMNS)]


def write_parquet(frame: pd.DataFrame, path: Path | str) -> Path:
    """Write ``frame`` as parquet atomically (:func:`vramcal.files.atomic_write`).
    Raises: DataError: the folder cannot be created or written."""
    path = Path(path)
    try:
        atomic_write(path, lambda handle: frame.to_parquet(handle, index=False))
    except OSError as error:
        raise DataError(f"cannot write {path} ({error.strerror or error}): {os_advice(error, '--out')}") from None
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
    check_file(source, "ticks", "give --ticks a tick CSV (DateTime, Price, Volume)")
    try:
        ticks = pd.read_csv(source)
    except (OSError, ValueError) as error:  # pandas' EmptyDataError and ParserError are ValueErrors
        raise DataError(f"{source}: cannot read ticks ({' '.join(str(error).split())[:160]}): give a CSV with "
                        f"DateTime, Price and Volume columns") from None
    bars = check_bars(ticks_to_bars(ticks, bar, source), source)
    write_parquet(bars, out)
    return bars
