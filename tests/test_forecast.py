"""The run forecast (issue 22): the epoch, run and cost arithmetic against hand-worked values, cards without a
profile shown as unknown, prices matched to devices, the fastest and the cheapest, sizing for throughput, the
window counts of a dataset, and the closed loop's pure parts."""

from __future__ import annotations

import dataclasses

import pytest

from vramcal.calibration.throughput import Rate
from vramcal.forecast import (
    DEFAULT_EPOCHS,
    FAR,
    Dataset,
    Forecast,
    Price,
    calibration_dataset,
    cost_table,
    epoch_seconds,
    forecast_profile,
    forecast_rate,
    match_price,
    parse_prices,
    time_verdict,
)
from vramcal.sizing import SizeRequest, size

from profiles_for_tests import build_profile, gpu_device, gpu_profile, gpu_trial, seed_peak, timed, timed_profile

RATE = Rate(batch_size=100, samples_per_s=50.0, low_samples_per_s=40.0, high_samples_per_s=62.5, step_s=2.0,
            step_sd_s=0.1, n_steps=40, n_trials=3, steady=True, first_step_s=5.0, val_s=0.5)


def test_the_forecast_arithmetic_by_hand():
    dataset = Dataset(train_samples=1000, val_samples=200, source="test")
    train_s, val_s = epoch_seconds(RATE, dataset)
    assert train_s == 1000 / 50  # samples / samples/s: 20 s
    assert val_s == 200 * 0.5 / 100  # two chunks of 100 at 0.5 s each: 1 s
    figures = forecast_rate(RATE, dataset, epochs=50, price_per_hour=0.59)
    assert figures["epoch_s"] == 21.0 and figures["first_s"] == 3.0  # the first step: 5 s instead of 2 s
    assert figures["run_s"] == 50 * 21.0 + 3.0
    assert figures["cost"] == pytest.approx(0.59 * 1053 / 3600)
    # the interval of the rate carries through: 1000 / 62.5 = 16 s and 1000 / 40 = 25 s of training per epoch
    assert figures["run_low_s"] == 50 * 17.0 + 3.0 and figures["run_high_s"] == 50 * 26.0 + 3.0
    assert figures["cost_low"] < figures["cost"] < figures["cost_high"]


def test_the_issue_notes_figures_come_out_of_the_formula():
    """The notes' RTX A4000 at $0.25/h: 9.88 h costs $2.47; at a rate giving 710 s per epoch, 50 epochs is 9.86 h."""
    rate = dataclasses.replace(RATE, samples_per_s=100.0, first_step_s=None, val_s=None, high_samples_per_s=None,
                               low_samples_per_s=None)
    figures = forecast_rate(rate, Dataset(71_000, 0, "notes"), epochs=50, price_per_hour=0.25)
    assert figures["epoch_s"] == 710.0 and figures["run_s"] / 3600 == pytest.approx(9.86, abs=0.01)
    assert figures["cost"] == pytest.approx(0.25 * 9.861, abs=0.001) and figures["run_low_s"] is None


def test_unknown_validation_is_not_counted_and_said_so():
    profile = timed_profile()
    row = forecast_profile(profile, Dataset(424, None, "test"), 10)
    assert row.val_s is None and any("validation pass is not counted" in n for n in row.notes)
    assert row.epoch_s == pytest.approx(row.train_s)


def test_a_profile_forecast_uses_the_conservative_size_at_the_steady_rate_of_the_safe_size():
    """The conservative size (90 % of safe) ran two timed steps; the safe size 4 + 40 (the steady trial): the
    forecast reads the safe size's steady rate per sample, and says so."""
    profile = timed_profile()
    dataset = calibration_dataset(profile)
    assert (dataset.train_samples, dataset.val_samples) == (424, 105)
    row = forecast_profile(profile, dataset, 10, price_per_hour=0.59)
    conservative, safe = profile.limits.conservative_batch_size, profile.limits.safe_batch_size
    at_safe = [t for t in profile.trials if t.batch_size == safe]
    times = [s for t in at_safe for s in t.step_times_s]
    per_sample = sum(times) / len(times) / safe
    val_per_sample = sum(t.val_times_s[0] for t in at_safe) / len(at_safe) / safe
    assert (row.batch_size, row.batch_source, row.steady) == (conservative, "conservative", True)
    assert row.samples_per_s == pytest.approx(1 / per_sample)
    assert row.train_s == pytest.approx(424 * per_sample)
    assert row.val_s == pytest.approx(105 * val_per_sample)
    assert row.cost == pytest.approx(0.59 * row.run_s / 3600)
    assert f"steady trial at batch size {safe}, read per sample" in " ".join(row.notes)


def test_a_batch_larger_than_the_data_is_cut_to_it_as_the_trainer_cuts_it():
    row = forecast_profile(timed_profile(), Dataset(100, 10, "small"), 1)
    assert (row.batch_size, row.batch_source) == (100, "conservative+data")
    assert row.samples_per_s is not None and "interpolated" in " ".join(row.notes)  # 64 and 128 were measured


def test_a_card_without_a_profile_has_no_throughput_and_no_cost_and_says_so():
    fast = timed_profile()  # RTX 4090
    slow = timed_profile("NVIDIA RTX A4000", 16376 * 2**20, fixed_s=0.03, per_sample_s=0.0025)
    prices = parse_prices("RTX 4090=0.59, rtx-a4000=0.25, H100=2.49")
    rows = cost_table([slow, fast], [calibration_dataset(slow), calibration_dataset(fast)], 50, prices)
    by_card = {r.card: r for r in rows}
    assert list(by_card) == ["NVIDIA GeForce RTX 4090", "NVIDIA RTX A4000", "H100"]  # by run time, unknown last
    h100 = by_card["H100"]
    assert not h100.measured and h100.samples_per_s is None and h100.run_s is None and h100.cost is None
    assert h100.price_per_hour == 2.49 and "no measured profile" in h100.notes[0]
    assert by_card["NVIDIA RTX A4000"].price_per_hour == 0.25 and by_card["NVIDIA GeForce RTX 4090"].fastest
    assert by_card["NVIDIA GeForce RTX 4090"].cheapest and not by_card["NVIDIA RTX A4000"].cheapest


def test_the_cheapest_card_need_not_be_the_fastest():
    fast = timed_profile()
    slow = timed_profile("NVIDIA RTX A4000", 16376 * 2**20, fixed_s=0.03, per_sample_s=0.0025)
    rows = cost_table([fast, slow], [calibration_dataset(fast)] * 2, 50, parse_prices("RTX 4090=5,RTX A4000=0.25"))
    fastest = [r.card for r in rows if r.fastest]
    cheapest = [r.card for r in rows if r.cheapest]
    assert fastest == ["NVIDIA GeForce RTX 4090"] and cheapest == ["NVIDIA RTX A4000"]


def test_prices_are_matched_to_devices_by_name():
    profiles = [timed_profile(), timed_profile("NVIDIA H100 80GB HBM3", 81559 * 2**20), gpu_profile()]
    assert match_price(Price("geforce rtx 4090", 1), profiles) == [0]
    assert match_price(Price("H100", 1), profiles) == [1]  # a whole-word prefix of one device
    assert match_price(Price("RTX", 1), profiles) == []  # a prefix of two different cards names neither
    assert match_price(Price("RTX 409", 1), profiles) == []  # not a whole word
    host = dataclasses.replace(gpu_profile(), device=dataclasses.replace(gpu_device(), kind="host", name="AMD EPYC"))
    assert match_price(Price("host", 0.1), [host, *profiles]) == [0]
    assert match_price(Price("cuda", 1), [host, *profiles]) == []  # "host" names the host's profiles; no kind else


@pytest.mark.parametrize(("text", "phrase"), [
    ("RTX 4090", "is not NAME=PRICE"), ("=0.5", "is not NAME=PRICE"), ("A=cheap", "is not a price per hour"),
    ("A=-1", "is not a price per hour"), ("A=nan", "is not a price per hour"), ("A=1,a=2", "given twice"),
    ("host=1=2", "one = each"), ("RTX 4090=0.59;host=0.05", "holds a ';': entries are separated by commas")])
def test_bad_prices_are_refused_naming_the_entry(text, phrase):
    with pytest.raises(ValueError, match=phrase):
        parse_prices(text)


def test_prices_read_a_dollar_sign_and_skip_empty_entries():
    assert parse_prices("RTX 4090=$0.59,,") == [Price("RTX 4090", 0.59)]


def test_sizing_for_throughput_takes_the_knee_below_the_memory_limit():
    # steps of 0.01 s + 0.01 s per sample: 1 -> 50, 8 -> 89, 32 -> 97, 64 -> 98.5 samples/s: the knee is 32, its
    # rate measurably below the conservative size's (10 timed steps a trial: intervals of about ±1 %)
    profile = timed_profile(fixed_s=0.01, per_sample_s=0.01, sizes=(1, 8, 32, 64, 128), steps=10)
    memory = size(profile)
    throughput = size(profile, SizeRequest(size_for="throughput"))
    assert memory.source == "conservative" and throughput.source == "knee"
    assert throughput.batch_size == 32 < memory.batch_size
    assert any("throughput knee" in n and "batch_size 32" in n for n in throughput.notices)
    assert size(profile, SizeRequest(request=16, size_for="throughput")).batch_size == 16  # a request stays


def test_sizing_for_throughput_keeps_the_limit_when_the_knee_is_not_below_it():
    profile = timed_profile(fixed_s=1.0, per_sample_s=0.0001)  # the rate keeps growing with the batch
    sizing = size(profile, SizeRequest(size_for="throughput"))
    assert sizing.source == "conservative" and sizing.batch_size == profile.limits.conservative_batch_size
    assert any("is not below the conservative batch size" in n for n in sizing.notices)


def test_sizing_for_throughput_without_measured_rates_says_so():
    trials = [dataclasses.replace(gpu_trial(b, seed_peak(b, i)), step_s=None, samples_per_s=None)
              for i, b in enumerate((1, 2, 4, 8, 16))]
    profile = build_profile(gpu_device(), trials)
    profile = dataclasses.replace(profile, trials=tuple(dataclasses.replace(t, step_s=None) for t in profile.trials))
    sizing = size(profile, SizeRequest(size_for="throughput"))
    assert sizing.source == "conservative" and any("no measured throughput" in n for n in sizing.notices)


def test_a_forecast_at_the_knee_is_faster_per_sample():
    profile = timed_profile(fixed_s=0.5, per_sample_s=0.01, sizes=(1, 8, 32, 64, 128, 192))
    profile = dataclasses.replace(profile, trials=tuple(  # a host-like card: big batches get slower per sample
        timed(t, 0.1, 0.01 + 0.0001 * t.batch_size, len(t.step_times_s)) for t in profile.trials))
    dataset = calibration_dataset(profile)
    knee = forecast_profile(profile, dataset, 10, size_for="throughput")
    conservative = forecast_profile(profile, dataset, 10)
    assert knee.batch_source == "knee" and knee.batch_size < conservative.batch_size
    assert knee.samples_per_s > conservative.samples_per_s and knee.run_s < conservative.run_s


def test_window_counts_match_the_windows_of_bars_without_gaps():
    from test_train_data import synthetic_bars

    from vramcal.models.regressor.windows import make_windows, window_counts

    bars = synthetic_bars(700)
    for seq_len, stride, fraction in ((32, None, 0.2), (64, 8, 0.3), (16, 16, 0.5)):
        windows = make_windows(bars, seq_len, stride, fraction)
        assert windows.gaps == 0
        assert window_counts(700, seq_len, stride, fraction) == (len(windows.train_starts), len(windows.val_starts))
    assert window_counts(10, 32) == (0, 0)
    with pytest.raises(ValueError, match="val_fraction"):
        window_counts(100, 32, val_fraction=1.0)


def test_the_report_forecasts_as_many_epochs_as_the_trainer_trains_by_default():
    from vramcal.train.config import TrainConfig

    assert DEFAULT_EPOCHS == TrainConfig().epochs


def test_a_language_model_profile_has_no_dataset_of_its_own():
    profile = dataclasses.replace(timed_profile(), model_info={"n_params": 1})
    assert calibration_dataset(profile) is None
    row = forecast_profile(profile, None, 10)
    assert row.samples_per_s is not None and row.run_s is None and "no dataset" in row.notes[0]


def test_time_verdicts_and_a_dataset_that_cannot_be():
    assert time_verdict(101, 80) == FAR and time_verdict(100, 81) == "within 25 %" and time_verdict(59, 80) == FAR
    with pytest.raises(ValueError, match="at least 1 training sample"):
        Dataset(0, 0, "empty")


def test_a_run_observes_its_complete_epochs_against_the_forecast_for_the_same_epochs():
    from vramcal.forecast import Forecast
    from vramcal.train.timing import first_epoch_lines, observed

    forecast = Forecast("card", True, 3, Dataset(100, 10, "t"), 10, "conservative", samples_per_s=50.0,
                        train_s=2.0, val_s=0.5, epoch_s=2.5, first_s=0.3, run_s=7.8)
    rows = [{"epoch": 1, "complete": True, "epoch_s": 3.0, "train_s": 2.6, "val_s": 0.4, "samples": 100,
             "samples_per_s": 100 / 2.6},
            {"epoch": 2, "complete": True, "epoch_s": 2.0, "train_s": 1.6, "val_s": 0.4, "samples": 100},
            {"epoch": 3, "complete": False, "epoch_s": 0.5, "train_s": 0.5, "val_s": 0.0, "samples": 20}]
    fields = observed(forecast, rows, fresh=True)
    assert fields["epoch_s"] == 2.5 and fields["samples_per_s"] == pytest.approx(200 / 4.2)
    assert fields["forecast_epoch_s"] == pytest.approx(2.5 + 0.3 / 2)  # the first step's extra, shared by 2 epochs
    assert observed(forecast, rows, fresh=False)["forecast_epoch_s"] == 2.5  # a resumed run has no first step
    assert observed(None, rows, fresh=True).keys() == {"epoch_s", "samples_per_s"}
    assert observed(forecast, rows[2:], fresh=True) == {}
    (line,) = first_epoch_lines(forecast, rows[0], fresh=True)
    assert "forecast 2.8 s (+7.1%)" in line
    far = first_epoch_lines(forecast, {**rows[0], "epoch_s": 4.0}, fresh=True)
    assert len(far) == 2 and far[1].startswith("warning: the epoch took +43%")


def test_an_epoch_of_few_noisy_steps_is_judged_against_their_own_noise():
    """A forecast resting on 8 step times spread 25 % (a busy 2-core host): an epoch of 3 steps 30 % slower is within
    what its steps may vary by (2 x 0.25 x sqrt(1/3 + 1/8) = 34 %), and says so without a warning or a probe; an epoch
    of 100 steps 30 % slower is far (the band is 25 % again); steps that repeat within 1 % keep the 25 % band."""
    from vramcal.forecast import Forecast, time_band
    from vramcal.train.timing import first_epoch_lines, observed

    forecast = Forecast("card", True, 1, Dataset(30, 0, "t"), 10, "conservative", samples_per_s=10.0, train_s=3.0,
                        val_s=0.0, epoch_s=3.0, first_s=0.0, run_s=3.0, step_spread=0.25, n_steps=8)
    assert time_band(forecast, 3) == pytest.approx(2 * 0.25 * (1 / 3 + 1 / 8) ** 0.5)
    assert time_band(forecast, 100) == 0.25 and time_band(dataclasses.replace(forecast, step_spread=0.01), 3) == 0.25
    row = {"epoch": 1, "complete": True, "epoch_s": 3.9, "train_s": 3.9, "val_s": 0.0, "samples": 30,
           "samples_per_s": 30 / 3.9, "batch_size": 10}
    line, inside = first_epoch_lines(forecast, row, fresh=True)
    assert line.endswith("forecast 3 s (+30.0%; its 3 steps may vary by ±34%)"), line
    assert inside.startswith("the epoch took +30% against the forecast, inside the spread the calibration measured")
    assert "no measurable difference" in inside and "probe" not in inside
    long = {**row, "samples": 1000, "epoch_s": 390.0, "train_s": 390.0}
    far = first_epoch_lines(dataclasses.replace(forecast, epoch_s=300.0, train_s=300.0), long, fresh=True)
    assert len(far) == 2 and far[1].startswith("warning: the epoch took +30%")
    assert observed(forecast, [row], fresh=True)["time_band"] == pytest.approx(0.34, abs=0.005)  # kept for show
    assert observed(forecast, [row] * 10, fresh=True)["time_band"] == 0.25  # 30 steps: 20 %, so 25 %


def test_the_best_cards_are_marked_among_each_models_rows_and_the_labels_name_the_models():
    """Profiles of two models (here on two cards) are two runs: each model's fastest and cheapest card is marked,
    not the small model's card over the large one's; the rows name what differs between the models, and the
    notes say how the marks read."""
    from vramcal.cli.cost import _labels
    from vramcal.report.cost import forecast_notes
    from vramcal.workload import ModelRef

    small = timed_profile()
    large = timed_profile("NVIDIA H100 80GB HBM3", total_bytes=80 * 2**30, per_sample_s=0.002)
    large = dataclasses.replace(large, model=ModelRef.make(large.model.factory, {**large.model.params, "d_model": 512}))
    other = timed_profile("NVIDIA L4", per_sample_s=0.004)  # the small model on a slower card
    profiles = [small, large, other]
    labels = _labels(profiles)
    assert labels == [f"NVIDIA GeForce RTX 4090 · d_model={small.model.params['d_model']}",
                      "NVIDIA H100 80GB HBM3 · d_model=512", f"NVIDIA L4 · d_model={small.model.params['d_model']}"]
    rows = cost_table(profiles, [calibration_dataset(p) for p in profiles], 10,
                      [Price("RTX 4090", 0.59), Price("H100", 2.49), Price("L4", 0.8)], labels=labels)
    marks = {f.card.split(" · ")[0]: (f.fastest, f.cheapest) for f in rows}
    assert marks == {"NVIDIA GeForce RTX 4090": (True, True), "NVIDIA H100 80GB HBM3": (True, True),
                     "NVIDIA L4": (False, False)}
    assert any("2 models: the fastest and the cheapest are marked among each model's cards" in line
               for line in forecast_notes(rows))
    same = cost_table([small, other], [calibration_dataset(p) for p in (small, other)], 10)  # one model: one mark
    assert sum(f.fastest for f in same) == 1 and _labels([small, other]) == ["NVIDIA GeForce RTX 4090", "NVIDIA L4"]


def test_cost_marks_an_unverified_profile_and_refuses_a_length_it_does_not_cover(tmp_path):
    """Issue 43: an unverified profile's row says its batch size is an extrapolation; ``--seq-len`` outside a
    profile's lengths is one line naming the probe that covers it, not a row of dashes."""
    import json

    from click.testing import CliRunner

    from vramcal.cli import main
    from vramcal.profile import save_profile

    path = save_profile(gpu_profile(verify=False), tmp_path / "unverified.json")
    result = CliRunner().invoke(main, ["cost", str(path), "--samples", "1000", "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)["forecasts"]
    assert row["notes"][0].startswith("the profile's limits were not verified by real trials")
    other = CliRunner().invoke(main, ["cost", str(path), "--seq-len", "64", "--out", str(tmp_path)])
    assert other.exit_code == 1 and "Traceback" not in other.output
    assert "calibrated at seq_len" in other.output and "vramcal probe --seq-len 64" in other.output


# ------------------------------------------------------------------------------------------ advice from noise

def test_sizing_for_throughput_names_no_knee_whose_interval_overlaps_the_limits():
    """Two timed steps a size (intervals of about ±15 %): the knee's 96.5 samples/s and the conservative size's
    100 are no measurable difference, so the run keeps the conservative size and says so; two step times 30 %
    apart leave an interval open above, and no knee is called at all."""
    from vramcal.calibration.throughput import NO_DIFFERENCE

    profile = timed_profile(fixed_s=0.01, per_sample_s=0.01, sizes=(1, 8, 32, 64, 128))
    sizing = size(profile, SizeRequest(size_for="throughput"))
    assert (sizing.source, sizing.batch_size) == ("conservative", profile.limits.conservative_batch_size)
    (why,) = [n for n in sizing.notices if n.startswith("sizing for throughput")]
    assert f"{NO_DIFFERENCE} in samples/s between batch_size 32 at 96.5 (85.7–110)" in why
    assert "their 95 % intervals overlap; using the conservative batch size" in why
    noisy = dataclasses.replace(profile, trials=tuple(
        dataclasses.replace(t, step_times_s=(t.step_times_s[0], 1.3 * t.step_times_s[0])) if t.batch_size == 8 else t
        for t in profile.trials))
    refused = size(noisy, SizeRequest(size_for="throughput"))
    assert refused.source == "conservative" and any(
        "no throughput knee: the samples/s at batch size 8 (2 timed steps) has no finite 95 % interval" in n
        for n in refused.notices)


def row(card: str, run_s: float, low: float | None, high: float | None, batch: int = 8, **more) -> Forecast:
    return Forecast(card, True, 10, Dataset(100, 0, "t"), batch, "conservative", run_s=run_s, run_low_s=low,
                    run_high_s=high, model="m", **more)


def test_no_card_is_marked_fastest_where_the_run_times_intervals_overlap():
    """The issue's report: 13 min (9.9–16) against 13.9 min (8.9–18.9) named the first "fastest"."""
    from vramcal.forecast import mark_best

    minute = 60.0
    rows = mark_best([row("B", 13.9 * minute, 8.9 * minute, 18.9 * minute, 76),
                      row("A", 13 * minute, 9.9 * minute, 16 * minute, 45)])
    assert [r.card for r in rows] == ["A", "B"] and not any(r.fastest for r in rows)
    assert rows[0].notes == ("no measurable difference in run time from B at batch size 76: the 95 % intervals "
                             "overlap, so none is marked fastest",)
    apart = mark_best([row("A", 13 * minute, 12 * minute, 14 * minute), row("B", 20 * minute, 19 * minute, None)])
    assert [r.fastest for r in apart] == [True, False] and apart[0].notes == ()
    unknown = mark_best([row("A", 13 * minute, 12 * minute, 14 * minute), row("B", 20 * minute, None, None)])
    assert not unknown[0].fastest and "B at batch size 8 (it has no interval)" in unknown[0].notes[0]
    priced = mark_best([row("A", 10.0, 9.0, 11.0, cost=1.0, cost_low=0.9, cost_high=1.1),
                        row("B", 20.0, 19.0, 21.0, cost=1.05, cost_low=1.0, cost_high=1.1)])
    assert priced[0].fastest and not any(r.cheapest for r in priced)
    assert "no measurable difference in cost from B" in priced[0].notes[0]


def test_a_forecast_miss_inside_the_forecasts_interval_says_so_and_asks_for_no_probe():
    """The issue's misses: a forecast resting on a rate whose interval is open above (two step times, "(15.6–∞)")
    may be −43 % or −56 % off with nothing wrong: inside its interval; +477 % is outside it, and only that warns
    and suggests recalibrating."""
    from vramcal.train.timing import first_epoch_lines, observed

    forecast = Forecast("card", True, 1, Dataset(300, 0, "t"), 10, "knee", samples_per_s=30.0,
                        low_samples_per_s=15.6, high_samples_per_s=None, steady=False, step_spread=0.3, n_steps=2,
                        train_s=10.0, val_s=0.0, epoch_s=10.0, first_s=0.0, run_s=10.0)
    for error in (-0.43, -0.56):
        lines = first_epoch_lines(forecast, {"epoch_s": 10.0 * (1 + error), "train_s": 10.0 * (1 + error),
                                             "val_s": 0.0, "samples": 300, "samples_per_s": 30.0, "batch_size": 10},
                                  fresh=False)
        assert len(lines) == 2 and not any("probe" in line or line.startswith("warning") for line in lines), lines
        assert ("inside the spread the calibration measured (the forecast's 95 % interval reaches −100% (its "
                "rate's is open above))") in lines[1]
    slow = {"epoch_s": 57.7, "train_s": 57.7, "val_s": 0.0, "samples": 300, "samples_per_s": 5.2, "batch_size": 10}
    lines = first_epoch_lines(forecast, slow, fresh=False)  # +477 %: past the interval's 30 / 15.6 − 1 = +92 %
    assert lines[1].startswith("warning: the epoch took +477% against the forecast, outside the spread")
    assert "re-run `vramcal probe`" in lines[1] and "the forecast's 95 % interval reaches +92%" in lines[0]
    assert observed(forecast, [{**slow, "epoch": 1}], fresh=False)["time_band"] == pytest.approx(30 / 15.6 - 1)


def test_the_report_forecasts_at_the_windows_of_the_run_recorded_not_the_calibrations(tmp_path):
    """A run at --stride 16 records the windows its forecast counted; the report and ``vramcal cost`` then forecast
    that epoch, not the calibration's (stride seq_len // 2), and say whose it is."""
    from click.testing import CliRunner

    from vramcal.cli import main
    from vramcal.forecast import default_dataset, profile_forecasts
    from vramcal.profile import Observation, append_observation, load_profile, save_profile

    profile = timed_profile()
    assert default_dataset(profile).train_samples == 424  # no run yet: the calibration's data
    path = save_profile(profile, tmp_path / "p.json")
    source = "es_1s.parquet, windows of 128 bars, stride 16"
    usable = profile.limits.usable_bytes
    append_observation(path, Observation("2026-12-02T21:24:15Z", "0.2.0", 76, 0, 2**30, 2**30, 2**30, usable, 23,
                                         "run", train_samples=1748, val_samples=430, data_source=source))
    profile = load_profile(path)
    dataset = default_dataset(profile)
    assert (dataset.train_samples, dataset.val_samples) == (1748, 430) and "stride 16" in dataset.source
    assert all(r.dataset == dataset for r in profile_forecasts(profile) if r.measured)
    shown = CliRunner().invoke(main, ["cost", str(path), "--out", str(tmp_path)])
    assert shown.exit_code == 0 and "1,748 training samples" in shown.output, shown.output


def test_vramcal_cost_says_no_measurable_difference_between_two_cards_of_one_speed(tmp_path):
    from click.testing import CliRunner

    from vramcal.cli import main
    from vramcal.profile import save_profile

    # two cards 0.1 % apart per sample, each rate's interval about ±0.4 %: neither is measurably faster
    paths = [save_profile(timed_profile(name, per_sample_s=per_sample_s), tmp_path / f"{i}.json")
             for i, (name, per_sample_s) in enumerate((("NVIDIA GeForce RTX 4090", 0.0004),
                                                       ("NVIDIA RTX A5000", 0.0004004)))]
    shown = CliRunner().invoke(main, ["cost", *map(str, paths), "--samples", "10000", "--out", str(tmp_path)])
    assert shown.exit_code == 0, shown.output
    text = " ".join(shown.output.split())
    assert "fastest" not in text.replace("none is marked fastest", "")
    assert "no measurable difference in run time from NVIDIA RTX A5000 at batch size" in text
    knee = CliRunner().invoke(main, ["cost", str(paths[0]), "--size-for", "throughput", "--out", str(tmp_path)])
    assert "sizing for throughput: no measurable difference in samples/s" in " ".join(knee.output.split())
