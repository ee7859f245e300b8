"""The trainer's data: bar checks, the E-mini tick sample, features, targets and the chronological split."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from vramcal.models.regressor import bars as data_module
from vramcal.models.regressor import windows as windows_module
from vramcal.models.regressor.bars import (
    DataError,
    check_bars,
    es_sample,
    few_bars_notice,
    load_bars,
    mlfinpy_tick_path,
    ticks_to_bars,
    write_parquet,
)
from vramcal.models.regressor.spec import N_FEATURES
from vramcal.models.regressor.windows import FEATURE_NAMES, make_windows, raw_features


def synthetic_bars(n: int = 400, seed: int = 0) -> pd.DataFrame:
    return data_module.synthetic_bars(n, seed)


def test_load_bars_accepts_capitalised_columns_and_a_datetime_index(tmp_path):
    bars = synthetic_bars(50)
    capital = bars.rename(columns=str.capitalize)
    capital.to_parquet(tmp_path / "a.parquet")
    upper = bars.rename(columns=str.upper).set_index("TIMESTAMP")
    upper.to_parquet(tmp_path / "b.parquet")
    for name in ("a.parquet", "b.parquet"):
        loaded = load_bars(tmp_path / name)
        assert list(loaded.columns) == ["timestamp", "open", "high", "low", "close", "volume"]
        np.testing.assert_array_equal(loaded["close"].to_numpy(), bars["close"].to_numpy())
        assert loaded["timestamp"].iloc[-1] == bars["timestamp"].iloc[-1]


@pytest.mark.parametrize(("change", "phrase"), [
    (lambda b: b.drop(columns="volume"), "missing column(s) volume"),
    (lambda b: b.assign(close=b["close"].where(b.index != 7)), "column close has 1 NaN or infinite"),
    (lambda b: b.assign(high=b["high"].where(b.index != 3, np.inf)), "column high has 1 NaN or infinite"),
    (lambda b: b.iloc[[0, 2, 1, *range(3, len(b))]], "timestamps are not sorted: row 2"),
    (lambda b: b.assign(timestamp=b["timestamp"].where(b.index != 5, b["timestamp"][4])), "duplicate timestamp"),
    (lambda b: b.assign(low=b["low"].where(b.index != 9, 0.0)), "non-positive price in row 9"),
    (lambda b: b.assign(high=b["low"] - 1), "high below or low above"),
    (lambda b: b.iloc[:0], "holds no rows"),
])
def test_bad_bars_are_refused_with_the_reason(tmp_path, change, phrase):
    path = tmp_path / "bars.parquet"
    change(synthetic_bars(30)).reset_index(drop=True).to_parquet(path)
    with pytest.raises(DataError, match=None) as caught:
        load_bars(path)
    assert phrase in str(caught.value)
    assert "\n" not in str(caught.value)


def _text_close(b):
    b = b.assign(close=b["close"].astype(object))
    b.loc[7, "close"] = "1601.5x"
    return b


def _text_stamp(b):
    b = b.assign(timestamp=b["timestamp"].astype(str))
    b.loc[5, "timestamp"] = "yesterday-ish"
    return b


@pytest.mark.parametrize(("change", "phrase"), [
    (_text_close, "column close is not numeric: row 7 (2024-01-02 09:30:07) holds '1601.5x'"),
    (_text_stamp, "column timestamp is not a date-time: row 5 holds 'yesterday-ish' (write ISO 8601"),
    (lambda b: b.assign(timestamp=b["timestamp"].astype("datetime64[us]").astype("int64")),
     "holds numbers, not date-times (they look like epoch microseconds): convert them first, e.g. "
     "frame['timestamp'] = pandas.to_datetime(frame['timestamp'], unit='us')"),
    (lambda b: b.assign(timestamp=b["timestamp"].astype("datetime64[s]").astype("int64")), "unit='s'"),
])
def test_bad_columns_are_named_in_our_own_one_line_message(change, phrase):
    with pytest.raises(DataError) as caught:
        check_bars(change(synthetic_bars(30)))
    assert phrase in str(caught.value) and "\n" not in str(caught.value)
    assert "You might want to try" not in str(caught.value)


def test_time_zone_aware_timestamps_become_naive_utc_without_a_warning(tmp_path, recwarn):
    bars = synthetic_bars(30)
    bars.assign(timestamp=bars["timestamp"].dt.tz_localize("America/New_York")).to_parquet(tmp_path / "tz.parquet")
    loaded = load_bars(tmp_path / "tz.parquet")
    assert loaded["timestamp"].dt.tz is None
    assert loaded["timestamp"].iloc[0] == pd.Timestamp("2024-01-02 14:30")  # 09:30 EST = 14:30 UTC
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]


def test_write_parquet_under_a_file_is_one_data_error(tmp_path):
    (tmp_path / "afile").write_text("")
    where = r"cannot write .*afile/x.parquet \(File exists\): a file stands in the way: choose another --out"
    with pytest.raises(DataError, match=where) as caught:
        write_parquet(synthetic_bars(5), tmp_path / "afile" / "x.parquet")
    assert caught.value.__context__ is None or not isinstance(caught.value.__context__, NotADirectoryError)
    assert caught.value.__suppress_context__


def test_missing_empty_and_corrupt_files(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_bars(tmp_path / "none.parquet")
    (tmp_path / "empty.parquet").write_bytes(b"")
    with pytest.raises(DataError, match="the file is empty"):
        load_bars(tmp_path / "empty.parquet")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet at all")
    with pytest.raises(DataError, match="not a readable parquet file"):
        load_bars(tmp_path / "bad.parquet")


def test_features_follow_the_documented_formulas():
    bars = synthetic_bars(40)
    features, returns = raw_features(bars)
    assert features.shape == (38, N_FEATURES) == (38, len(FEATURE_NAMES))
    c, o, h, lo, v = (bars[k].to_numpy() for k in ("close", "open", "high", "low", "volume"))
    t = 5  # row 5 is bar 6
    np.testing.assert_allclose(features[t], [np.log(c[6] / c[5]), np.log(o[6] / c[5]), np.log(h[6] / c[5]),
                                             np.log(lo[6] / c[5]), np.log1p(v[6])])
    np.testing.assert_allclose(returns[t], np.log(c[7] / c[6]))  # the next bar's log return


def test_windows_split_chronologically_with_training_statistics_only():
    bars = synthetic_bars(400)
    windows = make_windows(bars, seq_len=32, val_fraction=0.2)
    rows = len(bars) - 2
    assert windows.split_row == round(rows * 0.8)
    assert windows.stride == 16
    assert (windows.train_starts + 32 <= windows.split_row).all()
    assert (windows.val_starts >= windows.split_row).all() and (windows.val_starts + 32 <= rows).all()
    train = windows.features[:windows.split_row]
    np.testing.assert_allclose(train.mean(axis=0), 0, atol=1e-5)
    np.testing.assert_allclose(train.std(axis=0), 1, atol=1e-4)
    # Changing only validation-period bars leaves the training statistics and features untouched.
    shocked = bars.copy()
    late = shocked.index >= windows.split_row + 3
    shocked.loc[late, ["open", "high", "low", "close"]] *= 1.5
    shocked.loc[late, "volume"] *= 100
    again = make_windows(shocked, seq_len=32, val_fraction=0.2)
    np.testing.assert_array_equal(again.feature_mean, windows.feature_mean)
    np.testing.assert_array_equal(again.features[:windows.split_row], train)
    # The target is the next row's return feature, unscaled by the mean (0 stays "no move").
    _, returns = raw_features(bars)
    np.testing.assert_allclose(windows.targets * windows.target_scale, returns, rtol=1e-5, atol=1e-9)


def test_too_few_bars_for_a_window_or_a_split():
    with pytest.raises(DataError, match="fewer than one window: seq_len 32 needs at least 34 bars"):
        make_windows(synthetic_bars(33), seq_len=32)
    with pytest.raises(DataError, match="validation windows"):
        make_windows(synthetic_bars(60), seq_len=32, val_fraction=0.2)


def test_ticks_to_bars_ohlcv():
    ticks = pd.DataFrame({"DateTime": pd.to_datetime(["2013-09-01 17:00:00.1", "2013-09-01 17:00:00.5",
                                                      "2013-09-01 17:00:00.9", "2013-09-01 17:00:03.2"]),
                          "Price": [10.0, 12.0, 11.0, 9.0], "Volume": [1, 2, 3, 4]})
    bars = ticks_to_bars(ticks, "1s")
    assert len(bars) == 2  # seconds without trades are dropped, not filled
    assert bars.iloc[0][["open", "high", "low", "close", "volume"]].tolist() == [10, 12, 10, 11, 6]
    assert bars.iloc[1]["timestamp"] == pd.Timestamp("2013-09-01 17:00:03")
    with pytest.raises(DataError, match="not a pandas time offset"):
        ticks_to_bars(ticks, "fortnightly-ish")
    for bar in ("0s", "-5s"):
        with pytest.raises(DataError, match=f"--bar '{bar}' is not a positive length of time"):
            ticks_to_bars(ticks, bar)
    assert "only 3 1D bars, fewer than one window of the default seq_len 128" in few_bars_notice(3, "1D", 128)
    assert few_bars_notice(130, "1s", 128) is None


def test_es_sample_builds_real_emini_bars(tmp_path):
    try:
        mlfinpy_tick_path()
    except DataError:
        pytest.skip("mlfinpy is not installed (pip install --no-deps mlfinpy==0.1.2)")
    out = tmp_path / "es_1min.parquet"
    bars = es_sample("1min", out)
    loaded = load_bars(out)
    assert len(loaded) == len(bars) > 2000  # ~45 hours of trading in September 2013
    assert 1600 < loaded["close"].median() < 1700  # the E-mini S&P 500 then
    assert loaded["volume"].sum() > 500_000


# ------------------------------------------------------------------------- data that ruins training

def two_sessions(n: int = 300, days_apart: float = 3.0, jump: float = 1.3) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Two sessions of 1 s bars, the second ``days_apart`` days after the first ends and ``jump`` x higher."""
    first, second = synthetic_bars(n, seed=1), synthetic_bars(n, seed=2)
    second[["open", "high", "low", "close"]] *= jump
    second["timestamp"] = first["timestamp"].iloc[-1] + pd.Timedelta(days=days_apart) + (
        second["timestamp"] - second["timestamp"].iloc[0])
    return first, second


def test_windows_never_span_a_session_break_and_its_return_is_no_target():
    """Issue 10, item 6: two sessions three days apart, the second 30 % higher. Without the gap rule the one
    return across the gap inflated the target scale 55x (a 49-sigma target)."""
    first, second = two_sessions()
    bars = pd.concat([first, second], ignore_index=True)
    windows = make_windows(bars, seq_len=32, stride=8, val_fraction=0.2)
    j = len(first)  # bar j is the second session's first: the return of bar j crosses the gap
    assert windows.gaps == 1 and windows.longest_gap_s == pytest.approx(3 * 86400)
    for start in np.concatenate([windows.train_starts, windows.val_starts]):
        bars_read = range(start, start + 32 + 2)  # row i reads bars i (previous close), i + 1 and i + 2 (target)
        assert max(bars_read) < j or min(bars_read) >= j, f"the window at row {start} spans the gap"
    assert any(s >= j for s in windows.train_starts)  # the second session trains too
    # the target scale is the first session's and the second's return spread, not the gap's
    alone = [float(raw_features(b)[0][:, 0].std()) for b in (first, second)]
    assert min(alone) * 0.9 < windows.target_scale < max(alone) * 1.1
    rows = np.concatenate([windows.train_starts[:, None] + np.arange(32)])
    assert np.abs(windows.targets[rows]).max() < 8  # no many-sigma target in any training window
    assert windows.targets[j - 2] == 0 and not windows.features[j - 1].any()  # cross-gap rows are zeroed
    assert "1 gap between bars (session breaks: pauses over 30 min; the longest 3 days)" in \
        windows_module.gap_notice(windows.stats())


def test_quiet_seconds_and_weekends_are_not_gaps():
    """Seconds without trades (the E-mini sample has thousands of 10-209 s pauses) and weekends in daily
    bars are the data's own rhythm, not session breaks."""
    quiet = synthetic_bars(400)
    quiet.loc[100:, "timestamp"] += pd.Timedelta(seconds=200)  # a 201 s pause among 1 s bars
    assert make_windows(quiet, seq_len=32).gaps == 0
    daily = synthetic_bars(400).assign(timestamp=pd.bdate_range("2020-01-01", periods=400))  # weekends: 3 days
    assert make_windows(daily, seq_len=32).gaps == 0
    assert windows_module.gap_notice(make_windows(daily, seq_len=32).stats()) is None
    holiday = daily.copy()
    holiday.loc[200:, "timestamp"] += pd.Timedelta(days=30)  # a month without data is a gap in daily bars
    assert make_windows(holiday, seq_len=32).gaps == 1


def test_sessions_too_short_for_a_window_say_so():
    first, second = two_sessions(n=30)
    with pytest.raises(DataError, match="between its 1 gap") as caught:
        make_windows(pd.concat([first, second], ignore_index=True), seq_len=32)
    assert "\n" not in str(caught.value)


def test_constant_prices_are_refused_in_one_line():
    """Closes that never move give all-zero targets: nothing to learn."""
    flat = synthetic_bars(400).assign(open=1600.0, high=1600.0, low=1600.0, close=1600.0, volume=0.0)
    with pytest.raises(DataError) as caught:
        make_windows(flat, seq_len=32, source="flat.parquet")
    line = str(caught.value)
    assert line.startswith("flat.parquet: the closes do not move") and "zero spread" in line and "\n" not in line


@pytest.mark.parametrize(("change", "flat"), [
    (lambda b: b.assign(volume=0.0), ("log1p_volume",)),  # zero volume: a real case for some instruments
    (lambda b: b.assign(volume=123.0), ("log1p_volume",)),
    (lambda b: b.assign(open=b["close"].shift(1).fillna(b["close"].iloc[0]),
                        high=lambda f: f[["open", "high", "close"]].max(axis=1),
                        low=lambda f: f[["open", "low", "close"]].min(axis=1)), ("log_open_gap",)),
])
def test_a_feature_without_spread_is_the_datas_fact_not_an_error(change, flat):
    """Contiguous bars (each open the previous close) and zero volume train: the flat feature is centred and
    named, the others standardised as usual."""
    windows = make_windows(change(synthetic_bars(400)), seq_len=32)
    assert windows.flat_features == flat and windows.stats()["flat_features"] == list(flat)
    index = [FEATURE_NAMES.index(name) for name in flat]
    training = windows.features[:windows.split_row]
    assert np.allclose(training[:, index], 0.0) and np.all(np.isfinite(windows.features))
    others = [i for i in range(len(FEATURE_NAMES)) if i not in index]
    assert np.allclose(training[:, others].std(axis=0), 1.0, atol=0.05)
    assert flat[0] in windows_module.flat_notice(windows.stats())


def test_train_prints_the_gap_notice(tmp_path):
    from click.testing import CliRunner
    from test_train import SPEC_ARGS, make_profile

    from vramcal.cli import main
    from vramcal.measure.device import host_device
    from vramcal.profile import profile_path, save_profile

    first, second = two_sessions()
    pd.concat([first, second], ignore_index=True).to_parquet(tmp_path / "bars.parquet")
    profile = make_profile(host_device())
    save_profile(profile, profile_path(tmp_path / "profiles", profile.device, profile.model, "transformers"))
    result = CliRunner().invoke(main, ["train", "--data", str(tmp_path / "bars.parquet"), "--gpu", "none",
                                       "--profiles-dir", str(tmp_path / "profiles"), "--run-dir",
                                       str(tmp_path / "run"), "--max-steps", "1", *SPEC_ARGS])
    assert result.exit_code == 0, result.output
    assert "data: 1 gap between bars" in result.output
