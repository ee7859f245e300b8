"""Calibration over several sequence lengths (issue 13): the policy against synthetic memory surfaces, the
profile's record and the answers at any length, sizing at a length, and bad input."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from vramcal.calibration.fit2d import fit_2d, longest_seq_len, safe_batch_size_2d
from vramcal.calibration.search import SearchSettings
from vramcal.calibration.surface import (
    INTERPOLATION_ERROR,
    LengthLimits,
    Surface,
    answer_at,
    longest_at,
    next_trial,
    reference_length,
    settle_surface,
)
from vramcal.records import Trial

from fakes import GIB

MIB = 2**20


def run(memory, settings, seq_lens, noise=0.0, seed=0):
    """Drive the real 2-D policy with a fake trial runner: peak = memory(batch_size, seq_len)."""
    rng, trials = np.random.default_rng(seed), []
    while (chosen := next_trial(trials, seq_lens, settings)) is not None:
        seq_len, step = chosen
        peak = int(memory(step.batch_size, seq_len) * (1 + rng.normal(0, noise)))
        status = "oom" if peak > settings.total_bytes else "ok"
        trials.append(Trial(step.batch_size, status, peak if status == "ok" else None, purpose=step.purpose,
                            seq_len=seq_len))
    return trials


def surface_memory(overhead, per_token, per_sample):
    return lambda b, length: overhead + per_token * b * length + per_sample * b


def largest_within(memory, length, budget):
    low, high = 0, 1
    while memory(high, length) <= budget:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if memory(middle, length) <= budget else (low, middle)
    return low


@pytest.mark.parametrize("total, noise", [(80 * GIB, 0.0), (80 * GIB, 0.01), (4 * GIB, 0.01)])
def test_three_lengths_end_verified_with_fewer_trials_than_three_calibrations(total, noise):
    settings = SearchSettings(total_bytes=total, max_trials=16 + 8)
    usable = settings.usable_bytes
    memory = surface_memory(0.1 * usable, usable / 3e6, usable / 3e4)  # per-sample memory matters at 128
    seq_lens = (128, 512, 2048)
    trials = run(memory, settings, seq_lens, noise)
    surface, fit, limits = settle_surface(trials, seq_lens, 64, settings)
    assert surface is not None and surface.reference_seq_len == 512
    for entry in surface.lengths:
        assert entry.verified, entry
        truth = largest_within(memory, entry.seq_len, usable)
        assert memory(entry.safe_batch_size, entry.seq_len) <= usable * (1 + 2 * noise)
        assert entry.safe_batch_size >= 0.75 * truth - 1 and entry.conservative_batch_size <= entry.safe_batch_size
    per_length = [len([t for t in trials if t.seq_len == length]) for length in (128, 2048)]
    assert all(n <= 5 for n in per_length), per_length  # each other length: its verifications only
    assert len(trials) < 3 * len([t for t in trials if t.seq_len == 512])


def test_the_model_predicts_lengths_between_the_calibrated_ones_within_5_percent():
    settings = SearchSettings(total_bytes=80 * GIB, max_trials=24)
    usable = settings.usable_bytes
    memory = surface_memory(0.1 * usable, usable / 3e6, usable / 3e4)
    trials = run(memory, settings, (128, 512, 2048), noise=0.005)
    surface, _, _ = settle_surface(trials, (128, 512, 2048), 64, settings)
    for length in (256, 1024):
        safe, conservative, basis = answer_at(surface, length, usable, 0.9)
        assert "interpolated" in basis
        assert abs(surface.fit.predict(safe, length) - memory(safe, length)) / memory(safe, length) < 0.05
        assert memory(safe, length) <= usable and conservative == math.floor(0.9 * safe)


def test_the_longest_length_at_a_batch_size_is_within_one_chunk_of_the_truth():
    settings = SearchSettings(total_bytes=80 * GIB, max_trials=24)
    usable = settings.usable_bytes
    memory = surface_memory(0.1 * usable, usable / 3e6, usable / 3e4)
    trials = run(memory, settings, (128, 512, 2048))
    surface, _, _ = settle_surface(trials, (128, 512, 2048), 64, settings)
    for batch in (600, 2000):
        answer = longest_at(surface, batch, usable)
        truth = max(length for length in range(64, 2049, 64) if memory(batch, length) <= usable)
        assert answer % 64 == 0 and memory(batch, answer) <= usable and truth - answer <= 64


def test_the_reference_is_the_middle_length():
    assert reference_length((2048, 128, 512)) == 512
    assert reference_length((128, 256)) == 128


def make_surface() -> Surface:
    batches, lengths = [100, 400, 200, 800, 50, 100], [512, 512, 128, 128, 2048, 2048]
    peaks = [int(GIB + 20_000 * b * n + 3 * MIB * b) for b, n in zip(batches, lengths)]
    fit = fit_2d(batches, lengths, [p + (i % 3) * MIB for i, p in enumerate(peaks)])
    entries = (LengthLimits(128, 900, 810, 9 * GIB, 8 * GIB), LengthLimits(512, 400, 360, 9 * GIB, 8 * GIB + MIB),
               LengthLimits(2048, 100, 90, None, None))
    return Surface(fit, 512, 64, entries)


def test_answers_inside_outside_and_between_the_calibrated_lengths():
    surface = make_surface()
    assert answer_at(surface, 128, 75 * GIB, 0.9) == (900, 810, "verified")
    assert answer_at(surface, 2048, 75 * GIB, 0.9)[2] == "not verified"
    safe, _, basis = answer_at(surface, 1024, 75 * GIB, 0.9)
    assert basis.startswith("interpolated") and safe <= 400  # never above the shorter calibrated length's
    with pytest.raises(ValueError, match="outside the calibrated range 128-2048: calibrate it"):
        answer_at(surface, 4096, 75 * GIB, 0.9)
    with pytest.raises(ValueError, match="seq_len 100 is not a multiple of chunk_size 64"):
        answer_at(surface, 100, 75 * GIB, 0.9)
    assert Surface.from_dict(surface.to_dict()) == surface


def test_between_calibrated_lengths_the_bound_is_widened_by_the_measured_interpolation_error():
    """Issue 59 item 3: an answer between calibrated lengths is held to the fit's bound plus the interpolation error
    measured on the committed profiles (bench/interpolation.py); at a calibrated length, to the bound alone."""
    surface, usable = make_surface(), 9 * GIB
    assert surface.widening(1024) == INTERPOLATION_ERROR > 0 and surface.widening(512) == 0
    assert surface.upper(300, 1024) == surface.fit.upper(300, 1024) + INTERPOLATION_ERROR * surface.fit.predict(
        300, 1024)
    safe, _, _ = answer_at(surface, 1024, usable, 0.9)
    assert surface.upper(safe, 1024) <= usable < surface.upper(safe + 1, 1024)
    assert safe < safe_batch_size_2d(surface.fit, usable, 1024)  # the plain bound would take more
    for batch in (200, 300, 500):
        length = longest_at(surface, batch, usable)
        assert surface.upper(batch, length) <= usable and length not in surface.seq_lens
        assert surface.upper(batch, length + 64) > usable
    # a calibrated length that fits by its own bound is the answer, though the widened bound would stop short of it
    just = int(surface.fit.upper(100, 2048)) + 1
    assert longest_seq_len(surface.fit, just, 100, 64, 128, 2048, INTERPOLATION_ERROR) < 2048
    assert longest_at(surface, 100, just) == 2048


def test_a_profile_over_lengths_covers_its_range_and_sizes_at_a_length(tmp_path):
    """A profile as the calibration over 128, 512 and 2048 writes it (trials faked at the hardware boundary)."""
    from vramcal.models.regressor.spec import RegressorSpec
    from vramcal.profile import load_profile, save_profile
    from vramcal.sizing import SizeRequest, SizingError, size

    from fakes import fake_calibration
    from profiles_for_tests import gpu_profile

    base = gpu_profile()
    profile = fake_calibration(lambda b, n: GIB + 20_000 * b * n + 3 * MIB * b, 12 * GIB, max_trials=40,
                               seq_lens=(128, 512, 2048), kind="cuda")
    assert profile.verified and profile.surface.seq_lens == (128, 512, 2048)
    assert profile.covers(RegressorSpec(seq_len=256).ref("transformers"))
    assert not profile.covers(RegressorSpec(seq_len=4096).ref("transformers"))
    assert not profile.covers(RegressorSpec(d_model=64, seq_len=256).ref("transformers"))
    assert load_profile(save_profile(profile, tmp_path / "p.json")) == profile
    at_128, entry = size(profile, SizeRequest(limit="safe", seq_len=128)), profile.surface.at(128)
    assert at_128.safe_batch_size == entry.safe_batch_size > profile.surface.at(2048).safe_batch_size
    assert at_128.predicted_peak_bytes == int(profile.surface.fit.predict(entry.safe_batch_size, 128))
    between = size(profile, SizeRequest(seq_len=1024))
    assert between.notices[-1] == "the profile's limits at this seq_len are interpolated (not verified at this length)"
    with pytest.raises(SizingError, match="outside the calibrated range"):
        size(profile, SizeRequest(seq_len=8192))
    # a run's length is needed: without it, the reference length's limits would size a longer run too large
    with pytest.raises(SizingError, match="the profile covers seq_len 128-2048: give the run's seq_len"):
        size(profile)
    import vramcal

    assert vramcal.batch_size(profile, "safe", seq_len=128) == entry.safe_batch_size
    assert vramcal.batch_size(profile, "safe", seq_len=2048) < entry.safe_batch_size
    with pytest.raises(SizingError, match="calibrated at seq_len 128, not 256"):  # one length is one length
        size(base, SizeRequest(seq_len=256))
    assert size(base, SizeRequest(seq_len=128)) == size(base)


def test_limits_states_its_answer_in_one_sentence_in_text_and_json(tmp_path):
    """issue 42 item 7: ``limits --batch-size N`` printed figures but never the answer in words; the sentence says
    where the length sits among the calibrated ones and what it rests on (the faked calibration of the test
    above: 128, 512 and 2048, chunk_size 64)."""
    import json

    from click.testing import CliRunner

    from vramcal.cli import main
    from vramcal.profile import save_profile

    from fakes import fake_calibration
    from profiles_for_tests import gpu_profile

    path = save_profile(fake_calibration(lambda b, n: GIB + 20_000 * b * n + 3 * MIB * b, 12 * GIB, max_trials=40,
                                         seq_lens=(128, 512, 2048), kind="cuda"), tmp_path / "p.json")

    def said(*options: str) -> tuple[str, dict]:
        text = CliRunner().invoke(main, ["limits", str(path), *options])
        as_json = CliRunner().invoke(main, ["limits", str(path), *options, "--json"])
        assert text.exit_code == as_json.exit_code == 0, text.output + as_json.output
        found = json.loads(as_json.output)
        assert text.output.splitlines()[0] == found["sentence"]  # the answer first, then its figures
        return found["sentence"], found

    sentence, found = said("--batch-size", "1000")
    assert sentence.startswith(f"the longest seq_len at batch_size 1000 is {found['seq_len']} (between the "
                               f"calibrated lengths 128 and 512; interpolated by the 2-D fit, not verified at this "
                               f"length): the longest multiple of chunk_size 64 whose upper 95 % bound"), sentence
    assert 128 < found["seq_len"] < 512 and found["seq_len"] % 64 == 0
    sentence, found = said("--batch-size", "50")  # the range ends before memory does
    assert sentence.startswith("the longest seq_len at batch_size 50 is 2048, the longest calibrated length (its "
                               "limits verified by real trials)") and "outside the calibrated range" in sentence
    safe = found["safe_batch_size"]
    sentence, _ = said("--seq-len", "2048")
    assert sentence == (f"at seq_len 2048 (a calibrated length; its limits verified by real trials) the safe "
                        f"batch_size is {safe} and the conservative {found['conservative_batch_size']}")
    one = save_profile(gpu_profile(), tmp_path / "one.json")
    own = gpu_profile().model.params["seq_len"]
    text = CliRunner().invoke(main, ["limits", str(one), "--seq-len", str(own)]).output  # (after a staleness line)
    assert (f"\nat seq_len {own} (the profile's one calibrated length; its limits verified by real trials) the safe "
            f"batch_size is {gpu_profile().limits.safe_batch_size} and") in text, text


def test_a_negative_fitted_term_is_explained_where_the_probe_and_the_report_show_it():
    """issue 42 item 7: the probe's summary and the report's lengths section say what a negative term means."""
    from vramcal.cli.console import summary
    from vramcal.report.markdown import lengths_section

    from fakes import fake_calibration

    profile = fake_calibration(lambda b, n: GIB + 20_000 * b * n - 1200 * b, 12 * GIB, max_trials=40,
                               seq_lens=(128, 512, 2048), kind="cuda")
    fit = profile.surface.fit
    assert fit.bytes_per_sample < 0 and fit.formula().endswith(" × batch_size") and " - " in fit.formula()
    note = fit.negative_terms()
    assert note.startswith("the negative per-sample term gives no memory back") and "outside 128-2048" in note
    lines = summary(profile).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("over seq_len: "))
    assert lines[at + 1] == f"  ({note})"
    assert f"Signs: {note}." in "\n".join(lengths_section(profile, "##"))


def test_the_report_draws_safe_batch_against_seq_len_and_tables_each_length(tmp_path):
    import struct

    from vramcal.report import write_report

    from profiles_for_tests import gpu_profile

    base, surface = gpu_profile(), make_surface()
    evidence = [Trial(e.safe_batch_size, "ok", e.safe_peak_bytes, seq_len=e.seq_len) for e in surface.lengths
                if e.safe_peak_bytes] + [Trial(e.conservative_batch_size, "ok", e.conservative_peak_bytes,
                                               seq_len=e.seq_len) for e in surface.lengths if e.safe_peak_bytes]
    profile = dataclasses.replace(base, model=base.model.without("seq_len"), surface=surface,
                                  trials=base.trials + tuple(evidence))
    png, markdown = write_report([profile], tmp_path)
    text = markdown.read_text()
    assert "## Sequence lengths" in text and "a full search at seq_len 512" in text
    assert "|    2048 |  100 |           90 | **no**   |           — |      0 | verifications" in text
    width, height = struct.unpack(">II", png.read_bytes()[16:24])
    assert (width, height) == (1820, 760)  # three panels: memory, throughput, safe batch against seq_len


def test_probe_limits_and_train_over_lengths_for_real(tmp_path):
    """A real calibration at three lengths of the tiny model, answers between them (one verified by a real
    trial), and a training run at an uncalibrated length sized by the surface."""
    import json

    from click.testing import CliRunner
    from host_budget import capacity

    from vramcal.cli import main
    from vramcal.profile import load_profile

    tiny = ["--d-model", "32", "--n-layers", "1", "--d-state", "16", "--headdim", "16", "--chunk-size", "16"]
    out = tmp_path / "p.json"
    result = CliRunner().invoke(main, ["probe", "--gpu", "none", "--capacity", capacity(640 * 2**20, 0.05),
                                       "--reserve", "0", "--margin", "0.05", *tiny, "--seq-len", "16,32,64",
                                       "--no-boundary", "--out", str(out), "--no-report"])
    assert result.exit_code == 0, result.output
    profile = load_profile(out)
    assert profile.verified and profile.surface.seq_lens == (16, 32, 64) and "seq_len" not in profile.model.params
    assert "seq_len     64  safe" in result.output and "over seq_len: peak = " in result.output
    assert "at seq_len 16, 32, 64 on" in result.output
    reference = [t for t in profile.trials if t.seq_len == 32]
    assert len(profile.trials) - len(reference) <= 10  # the other lengths: their verifications only
    # lengths that vary (issue 41): the bucket table and the token budget, both verified at their worst case by the
    # calibration (a budget check, or a search trial at the same batch and length), carried in the profile
    sized = profile.lengths
    assert sized.verified and [b.longest_seq_len for b in sized.buckets] == [16, 32, 64]
    assert len(sized.trials) <= 2 and all(t.purpose.startswith("verify-budget") for t in sized.trials)
    assert "token budget  " in result.output
    table = json.loads(CliRunner().invoke(main, ["limits", str(out), "--buckets", "auto", "--token-budget",
                                                 "--json"]).output)
    budget = table["token_budget"]
    assert budget["tokens"] == sized.budget.tokens and all(case["verified"] for case in table["worst_cases"])
    worst = table["worst_cases"][1]
    assert worst["batch_size"] == budget["tokens"] // budget["worst_seq_len"] and worst["seq_len"] % 16 == 0
    # other boundaries: the longest bucket, 40 tokens padded to 48, is an interpolation: --verify runs its trial
    custom = CliRunner().invoke(main, ["limits", str(out), "--buckets", "20,40", "--verify"])
    assert custom.exit_code in (0, 3) and "worst case, the longest bucket: batch_size" in custom.output
    assert "at seq_len 48: verified by a real trial now (ok)" in custom.output or custom.exit_code == 3, custom.output
    unread = CliRunner().invoke(main, ["limits", str(out), "--buckets", "x,1"])  # a bad value: click's exit 2
    assert unread.exit_code == 2 and "Invalid value for '--buckets': cannot read the buckets 'x,1'" in unread.output
    refused = CliRunner().invoke(main, ["limits", str(out), "--buckets", "32,128"])
    assert refused.exit_code == 1 and "the bucket 128 is longer than the profile's longest seq_len 64" in refused.output
    answer = CliRunner().invoke(main, ["limits", str(out), "--seq-len", "48", "--json"])
    found = json.loads(answer.output)
    assert found["basis"].startswith("interpolated") and found["upper_bytes"] <= found["usable_bytes"]
    # the answer sits at the edge of its 95 % interval: its real trial fits (exit 0), or misses usable memory by
    # no more than 1 % and says so (exit 3; seen: 609.10 MiB against 608.00 once in about ten runs)
    checked = CliRunner().invoke(main, ["limits", str(out), "--batch-size", str(found["safe_batch_size"]),
                                        "--verify"])
    if checked.exit_code != 0:
        import re

        from vramcal.units import parse_bytes

        shown = re.search(r"NOT verified: ok, peak ([\d.]+) ([KMG]iB)", checked.output)
        peak = parse_bytes(shown.group(1) + shown.group(2))
        assert checked.exit_code == 3 and peak <= 1.01 * found["usable_bytes"], checked.output
    else:
        assert "verified: peak" in checked.output, checked.output
    bars = tmp_path / "bars.parquet"
    from test_train_data import synthetic_bars

    synthetic_bars(3000).to_parquet(bars)
    trained = CliRunner().invoke(main, ["train", "--gpu", "none", *tiny, "--seq-len", "48", "--profile", str(out),
                                        "--data", str(bars), "--stride", "1", "--max-steps", "2", "--run-dir",
                                        str(tmp_path / "run")])
    assert trained.exit_code == 0, trained.output
    assert "interpolated (not verified at this length)" in trained.output
    assert f"batch_size {found['conservative_batch_size']} (conservative" in trained.output


def test_a_run_forecast_over_lengths_reads_the_trials_at_the_runs_length():
    from vramcal.forecast import Dataset, forecast_profile

    from profiles_for_tests import gpu_profile

    base, surface = gpu_profile(), make_surface()
    step_s = {128: 1.0, 512: 2.0}  # the trials at 128 and 512 (none ran at 2048)
    evidence = [Trial(size, "ok", peak, seq_len=e.seq_len, step_s=step_s[e.seq_len], step_times_s=(step_s[e.seq_len],))
                for e in surface.lengths for size, peak in ((e.safe_batch_size, e.safe_peak_bytes),
                                                            (e.conservative_batch_size, e.conservative_peak_bytes))
                if peak]
    profile = dataclasses.replace(base, model=base.model.without("seq_len"), surface=surface,
                                  trials=base.trials + tuple(evidence))
    dataset = Dataset(8100, 0, "test")
    at_128, at_2048 = (forecast_profile(profile, dataset, 1, seq_len=n) for n in (128, 2048))
    assert (at_128.batch_size, at_128.samples_per_s, at_128.epoch_s) == (810, 810.0, 10.0)
    # no trial timed a step at 2048: no rate there, none borrowed from another length
    assert at_2048.batch_size == 90 and at_2048.samples_per_s is None
    assert any("no throughput measured" in note for note in at_2048.notes)
    unsized = forecast_profile(profile, dataset, 1)
    assert unsized.run_s is None and "give the run's seq_len" in unsized.notes[0]


def test_a_calibration_over_lengths_further_apart_than_measured_says_so():
    """Issue 59 item 3: a list of lengths the user wrote is calibrated as written, but where two neighbours are
    further apart than the interpolation error was measured over (LENGTH_RATIO), the profile warns, with the fix."""
    from pathlib import Path

    from vramcal.calibration.limits import LimitSettings
    from vramcal.measure.device import host_device
    from vramcal.models.registry import model_ref
    from vramcal.records import Device, TrialSettings
    from vramcal.service.calibrator import CalibrationPlan, run_trials

    from fakes import FakeTrialRunner

    config = Path(__file__).resolve().parents[1] / "configs" / "mamba2-lm-tiny.json"
    device = Device(**{**host_device().to_dict(), "total_bytes": GIB, "total_source": "--capacity"})
    model = model_ref("lm", {"config": str(config), "seq_len": 16}, device=device,
                      implementation="transformers").without("seq_len")
    memory = surface_memory(400 * MIB, 32 * 1024, 16 * 1024)
    warned = {}
    for seq_lens in ((32, 1024), (64, 1024)):
        plan = CalibrationPlan(device, model, LimitSettings(reserve_bytes=0), {}, Path("p.json"), seq_lens=seq_lens,
                               trials=TrialSettings(max_trials=40))
        warned[seq_lens] = [w for w in run_trials(plan, FakeTrialRunner(memory, GIB)).warnings if "times apart" in w]
    assert warned[(32, 1024)] == ["seq_len 32 and 1024 are 32 times apart: answers between them interpolate over a "
                                  "wider gap than the 16 times the interpolation error was measured over; add a "
                                  "length between them, or give a range (32:1024) to have them placed"]
    assert warned[(64, 1024)] == []
