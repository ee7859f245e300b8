"""Estimated limits (issue 38): a card you do not have, from a fake-tensor trace plus a baseline and an error bound
learned from real profiles; ``vramcal estimate``, and ``vramcal limits`` of a host profile, which is never carried
to a GPU.

The pure parts (the leave-one-out bound, the baseline, the limits' formula) run on hand-made calibrations; the
rest traces real steps on fake tensors and holds them against the project's committed measurements and one real
host trial.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner
from host_budget import capacity

from vramcal.calibration.limits import LimitSettings
from vramcal.cli import main
from vramcal.environment import software_versions
from vramcal.estimate.learned import (
    BENCH_BOUND,
    CUDA_BASELINE,
    GPU_BOUND,
    HOST_BASELINE,
    HOST_CUDA_BUILD_BASELINE,
    Baseline,
    Calibrated,
    ErrorBound,
    estimated_limits,
    held_against,
    learned_baseline,
    learned_bound,
    leave_one_out,
)
from vramcal.profile import load_profile
from vramcal.service import size as api  # size_for's gate reads free_bytes there
from vramcal.sizing.staleness import recorded_software

MIB, GIB = 2**20, 2**30
MEASURED = Path(__file__).resolve().parents[1] / "examples" / "measured" / "profiles"
TINY = ["--d-model", "32", "--n-layers", "1", "--d-state", "16", "--headdim", "16", "--chunk-size", "16",
        "--seq-len", "32"]


def calibrated(path: str, baseline_mib: float, peak_mib: float, kind: str = "host") -> Calibrated:
    """A calibration whose trace is 10 MiB + 1 MiB per sample at a safe size of 100, data 0, held ``baseline_mib``
    beyond the trace, and measured ``peak_mib`` at its safe size."""
    return Calibrated(path, kind, (baseline_mib + 10) * MIB, 0, 100, int(peak_mib * MIB), 10 * MIB, MIB)


def test_the_bound_is_never_narrower_than_the_calibrations_repeat_their_trials():
    """Two near-identical calibrations taught a bound of −0.20 % to −0.02 %, and a held-out trial landed +0.07 %: a
    trial repeated at one size spreads that much (bench/results/estimate-builds). The bound covers that spread."""
    import dataclasses

    three = [dataclasses.replace(calibrated(name, 500, 610), repeat=0.004) for name in ("a", "b", "c")]
    bound = learned_bound(three, "host")
    assert (bound.low, bound.high) == (pytest.approx(-0.004), pytest.approx(0.004))  # every error 0: the spread
    assert learned_bound([calibrated(name, 500, 610) for name in "abc"], "host").high == 0
    assert learned_bound(three[:2], "host") is BENCH_BOUND  # two errors are no spread


def test_the_bound_holds_each_calibration_against_the_others_baseline():
    found = [calibrated("a", 500, 610), calibrated("b", 520, 630), calibrated("c", 540, 650)]
    assert learned_baseline(found, "host").bytes == 520 * MIB
    bound = learned_bound(found, "host")
    # a: the others' median baseline 530 -> estimated 530 + 10 + 100 = 640 against 610 measured
    errors = [(530 + 110) / 610 - 1, (520 + 110) / 630 - 1, (510 + 110) / 650 - 1]
    assert (bound.low, bound.high, bound.n) == (pytest.approx(min(errors)), pytest.approx(max(errors)), 3)
    assert bound.says().startswith("estimated, not measured: on the 3 calibrations here this estimate was -4.6% to")


def test_with_too_little_to_learn_from_the_defaults_are_said_as_such():
    one = [calibrated("a", 500, 610)]
    assert learned_bound(one, "host") is BENCH_BOUND and learned_bound([], "cuda") is GPU_BOUND
    assert learned_baseline(one, "host").bytes == 500 * MIB  # one calibration is a baseline, not a bound
    assert learned_baseline(one, "cuda") is CUDA_BASELINE and learned_baseline([], "host") is HOST_BASELINE
    assert "project's benchmark" in BENCH_BOUND.says() and "CUDA context" in CUDA_BASELINE.source
    assert learned_bound(one, "cuda") is GPU_BOUND  # a GPU row never carries the host's bound


def test_the_limits_hold_the_worst_error_against_usable_memory():
    settings, bound = LimitSettings(), ErrorBound(-0.05, 0.02, 4, "four")
    row = estimated_limits("card", 16 * GIB, (100 * MIB, 10 * MIB), 0, settings, Baseline(500 * MIB, "b"), bound)
    usable = settings.usable_bytes(16 * GIB)
    worst = lambda b: (600 * MIB + 10 * MIB * b) / 0.95  # noqa: E731 - the estimate under-predicting by 5 %
    assert worst(row.safe_batch_size) <= usable < worst(row.safe_batch_size + 1)
    assert row.conservative_batch_size == math.floor(0.9 * row.safe_batch_size)
    assert row.worst_bytes == int(worst(row.safe_batch_size))
    assert row.peak_bytes == 600 * MIB + 10 * MIB * row.safe_batch_size
    over = estimated_limits("card", 16 * GIB, (100 * MIB, 10 * MIB), 0, settings, Baseline(500 * MIB, "b"),
                            ErrorBound(0.01, 0.03, 4, "four"))  # only ever over-predicted: not lowered
    assert over.safe_batch_size == math.floor((usable - 600 * MIB) / (10 * MIB))
    tiny = estimated_limits("tiny", 1 * GIB, (100 * MIB, 10 * MIB), 0, settings, Baseline(500 * MIB, "b"), bound)
    assert tiny.safe_batch_size == 0 and tiny.to_dict()["verified"] is False
    with pytest.raises(ValueError, match="does not rise"):
        estimated_limits("card", GIB, (100 * MIB, 0.0), 0, settings, Baseline(0, "b"), bound)


def test_the_committed_calibrations_teach_the_estimate_within_its_benchmark_bound():
    """The estimate of each committed host profile's own model, with the others' baseline, against its measured peak
    at the safe size: within the benchmark's bound, which they are part of (``python -m bench.estimate --bound``)."""
    profiles = [(p, load_profile(p)) for p in sorted(MEASURED.glob("*/*.json"))]
    found, notices = held_against(profiles)
    assert len(found) == len(profiles) >= 3 and notices == []
    bound = learned_bound(found, "host")
    assert BENCH_BOUND.low <= bound.low <= bound.high <= BENCH_BOUND.high
    assert all(450 * MIB < c.baseline_bytes < 650 * MIB for c in found)  # a process of libraries, not of tensors


@pytest.fixture(scope="module")
def this_builds_profiles(tmp_path_factory) -> Path:
    """The committed host calibrations, and where they were made under another torch build than this process's (the
    CUDA build: issue 62), two calibrations of small models under this one: the estimate learns its baseline from the
    same build first, and each calibration left out needs another of its build to be held against."""
    folder = tmp_path_factory.mktemp("estimated") / "profiles"
    shutil.copytree(MEASURED, folder)
    builds = {recorded_software(load_profile(path))["torch"] for path in folder.glob("*/*.json")}
    if builds == {software_versions()["torch"]}:
        return folder
    for d_model, n_layers in ((64, 1), (32, 2)):
        result = CliRunner().invoke(main, ["probe", "--gpu", "none", "--capacity", capacity(3 * GIB // 2), *TINY,
                                           "--d-model", str(d_model), "--n-layers", str(n_layers), "--no-report",
                                           "--no-boundary", "--steady-steps", "0", "--profiles-dir", str(folder)])
        assert result.exit_code == 0, result.output
    return folder


def test_estimate_prints_cards_from_the_catalogue_and_by_size_and_the_host_against_a_real_trial(this_builds_profiles):
    """The tiny spec estimated for a catalogued card, a card by size and this host, learning from the host calibrations
    of this torch build; its conservative host size then runs as a real trial, whose peak the estimate must be within
    10 % of. The budget grows by what a worker of this build holds beyond the CPU build's (tests/host_budget.py)."""
    from vramcal.api import model_ref, select_devices, worker_pool
    from vramcal.measure.trial import TrialRequest, TrialRunner

    budget = capacity(3 * GIB // 2)
    args = ["estimate", *TINY, "--gpus", "H200,Mine=12GiB", "--capacity", budget, "--profiles-dir",
            str(this_builds_profiles), "--reserve", "512MiB", "--margin", "0.1", "--conservative", "0.9"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert result.output.startswith("estimated, not measured: regressor d_model=32")
    same = [p for p in this_builds_profiles.glob("*/*.json")
            if recorded_software(load_profile(p))["torch"] == software_versions()["torch"]]
    assert (f"on the {len(same)} calibrations here" if len(same) >= 3 else "on the project's benchmark") in \
        result.output
    assert "no GPU profile to learn from" in result.output
    assert "made with torch" not in result.output  # the host's baseline is this build's
    printed = json.loads(CliRunner().invoke(main, [*args, "--json"]).stdout)  # the same traces, kept by the process
    cards = {row["card"]: row for row in printed["cards"]}
    assert list(cards)[:2] == ["H200 141 GB", "Mine"] and cards["Mine"]["total_bytes"] == 12 * GIB
    assert all(row["verified"] is False and row["bound"]["n"] for row in cards.values())
    host = next(row for name, row in cards.items() if name.startswith("host: "))
    batch = host["conservative_batch_size"]
    assert 100 < batch < cards["Mine"]["conservative_batch_size"]
    device = select_devices("none", int(budget))[0][0]
    ref = model_ref("regressor", {"d_model": 32, "n_layers": 1, "d_state": 16, "headdim": 16, "chunk_size": 16,
                                  "seq_len": 32}, device=device, implementation="transformers")
    (trial,) = TrialRunner(worker_pool()).run(TrialRequest(ref, batch, device))
    estimated = host["fixed_bytes"] + host["slope_bytes_per_sample"] * batch
    assert trial.ok and abs(estimated / trial.peak_bytes - 1) < 0.10, (estimated, trial.peak_bytes)


def test_estimate_refuses_what_it_cannot_trace_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "opaque_models.py").write_text(textwrap.dedent('''
        import torch
        import vramcal

        @torch.library.custom_op("opaque_models::double", mutates_args=())
        def double(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        def make_step(device):
            model = torch.nn.Linear(4, 1).to(device)
            optimizer = torch.optim.AdamW(model.parameters())
            return vramcal.TrainingStep(model=model, optimizer=optimizer,
                                        batch=lambda b: torch.randn(b, 4, device=device),
                                        loss=lambda m, x: double(m(x)).mean())
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["estimate", "--model", "opaque_models:make_step", "--gpus", "H200"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.startswith("Error: cannot trace the step on fake tensors: opaque_models::double has no fake "
                                    "implementation") and len(result.output.strip().splitlines()) == 1
    for bad, hint in ((["--seq-len", "64,128"], "one --seq-len"),
                      (["--dtype", "bf16-autocast", "--capacity", capacity(2 * GIB)], "the host trains in fp32"),
                      (["--gpus", "A100"], "names several catalogued cards"), (["--gpus", "H200,h200"], "twice")):
        refused = CliRunner().invoke(main, ["estimate", *bad])
        assert refused.exit_code == 2 and hint in refused.output, refused.output
    monkeypatch.delitem(sys.modules, "opaque_models", raising=False)


def test_a_bf16_step_is_estimated_for_gpus_as_the_card_runs_it(tmp_path):
    """bf16 autocast runs on CUDA only; the estimate traces the GPU's step on CPU tensors with CUDA's autocast lists:
    the matrix products' outputs, most of a Mamba-2 step's activations, are half the bytes, so the slope falls below
    fp32's; the card's choices are named, and a row per kernel path is shown (--impl picks one); --batch-size gives
    each row's peak there, its parts apart."""
    from vramcal.estimate import estimate_step
    from vramcal.models.regressor.spec import RegressorSpec

    spec = RegressorSpec(d_model=32, n_layers=1, d_state=16, headdim=16, chunk_size=16, seq_len=32)
    fp32 = estimate_step(spec.ref("transformers"), (64, 256), device_kind="cuda")
    bf16 = estimate_step(dataclasses.replace(spec, dtype="bf16-autocast").ref("transformers"), (64, 256),
                         device_kind="cuda")
    assert any(line.startswith("autocast: CUDA's bfloat16 op lists") for line in bf16.choices)
    assert bf16.slope_bytes_per_sample < 0.9 * fp32.slope_bytes_per_sample, (bf16, fp32)
    assert bf16.points[0].parameter_bytes == fp32.points[0].parameter_bytes  # fp32 weights under autocast

    args = ["estimate", *TINY, "--dtype", "bf16-autocast", "--gpus", "H200", "--profiles-dir", str(tmp_path),
            "--impl", "transformers", "--batch-size", "100"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "bf16-autocast" in result.output.splitlines()[0] and "as the card runs it: autocast" in result.output
    assert "at batch_size 100 on H200 141 GB (transformers): peak" in result.output
    (card,) = json.loads(CliRunner().invoke(main, [*args, "--json"]).stdout)["cards"]
    assert card["card"] == "H200 141 GB" and card["verified"] is False and card["safe_batch_size"] > 0
    asked = card["at_batch_size"]
    assert asked["peak_bytes"] == asked["baseline_bytes"] + asked["reserved_bytes"] and asked["fits"] is True
    assert asked["allocated_bytes"] <= asked["reserved_bytes"] and card["bound"]["low"] == GPU_BOUND.low


def test_limits_of_a_host_profile_estimates_the_gpus_asked_each_once_from_traces_kept_on_disk(tmp_path,
                                                                                           monkeypatch):
    """Issue 59: ``limits --gpus`` of a host profile listed the whole catalogue with the card asked for a second time,
    headed its table of the host alone "GPU", and traced again where ``estimate`` had traced the same model. Now: the
    cards asked, each once, a device heading, and the traces an earlier command (another process) kept on disk."""
    from vramcal.estimate import learned as estimated
    from vramcal.estimate import step

    path = MEASURED / "host-amd-epyc-2-cores" / "regressor-transformers-6e644469.json"
    monkeypatch.setenv("VRAMCAL_CACHE_DIR", str(tmp_path / "traces"))
    monkeypatch.setattr(estimated, "_TRACED", {})  # an earlier test's traces in this process would skip the disk
    made = CliRunner().invoke(main, ["limits", str(path), "--gpus", "RTX 4090,L4=22.5GiB", "--profiles-dir",
                                     str(tmp_path / "none")])
    assert made.exit_code == 0, made.output
    monkeypatch.setattr(estimated, "_TRACED", {})  # another process: only the disk's traces
    monkeypatch.setattr(step, "trace_point", lambda *a, **k: pytest.fail("traced again"))
    result = CliRunner().invoke(main, ["limits", str(path), "--gpus", "RTX 4090,L4=22.5GiB", "--profiles-dir",
                                       str(tmp_path / "none")])
    assert result.exit_code == 0, result.output
    table, _, estimate = result.output.partition("estimated, not measured:")
    assert "| host: AMD EPYC (2 cores) |" in table and "| L4" not in table and "A host profile is not carried" in table
    assert "| device " in table and "| GPU " not in table
    cards = [line.split()[0] for line in estimate.splitlines()
             if line.startswith(("L4 ", "RTX 4090", "H200")) and "peak ≈" not in line]  # the table's rows
    assert cards == ["RTX", "L4"]  # each card once, nothing else of the catalogue
    assert "RTX 4090 24 GB, transformers (this install runs it): peak ≈" in estimate  # traced as itself (sm_89)
    assert "mamba_ssm: the fused mamba_ssm path is not estimated: mamba_ssm" in estimate  # not installed: one line
    monkeypatch.undo()
    printed = json.loads(CliRunner().invoke(main, ["limits", str(path), "--json", "--profiles-dir",
                                                   str(tmp_path / "none")]).stdout)
    labels = [row["card"] for row in printed["estimated"]["cards"] if row["path"] == "transformers"]
    assert [row["measured"] for row in printed["gpus"]] == [True] and len(labels) == len(set(labels)) == 8


def test_cost_gives_a_priced_card_without_a_profile_its_estimated_batch_size(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no profiles/ here: the bound is the benchmark's
    path = MEASURED / "host-amd-epyc-2-cores" / "regressor-transformers-6e644469.json"
    result = CliRunner().invoke(main, ["cost", str(path), "--price", "H200=3.5,Foo=1", "--out", str(tmp_path),
                                       "--json"])
    assert result.exit_code == 0, result.output
    rows = {f["card"]: f for f in json.loads(result.stdout)["forecasts"]}
    assert rows["H200"]["batch_source"] == "estimated" and rows["H200"]["batch_size"] > 1000
    assert rows["H200"]["run_s"] is None and "published GPU run" in rows["H200"]["notes"][0]  # a GPU's bound
    assert rows["Foo"]["batch_size"] is None and rows["Foo"]["batch_source"] is None  # not catalogued: unknown


def test_probe_aims_with_the_estimate_and_verifies_its_limits(tmp_path):
    """``--aim``: the step is traced first and the second trial lands near half the limit instead of at 8; the
    profile records the aim and is verified, as without it (``--no-aim``, the default, climbs)."""
    profile = tmp_path / "aimed.json"
    result = CliRunner().invoke(main, ["probe", "--gpu", "none", "--capacity", capacity(3 * GIB // 2), *TINY,
                                       "--no-report", "--max-trials", "12", "--steady-steps", "0", "--no-boundary",
                                       "--out", str(profile), "--aim", "--profiles-dir", str(tmp_path / "none")])
    assert result.exit_code == 0, result.output
    assert "aimed with " in result.output and "per sample (the fake-tensor trace" in result.output
    aimed = json.loads(profile.read_text())
    assert aimed["verified"] and aimed["run"]["aim"]["slope_bytes_per_sample"] > 0
    assert aimed["trials"][1]["batch_size"] > 300  # climbing: 8
    assert not any("estimate's" in w for w in aimed["warnings"])  # the measured slope is the estimate's
    plain = CliRunner().invoke(main, ["probe", "--gpu", "none", "--capacity", capacity(3 * GIB // 2), *TINY,
                                      "--no-report",
                                      "--max-trials", "3", "--out", str(tmp_path / "plain.json"), "--no-aim"])
    climbed = json.loads((tmp_path / "plain.json").read_text())["trials"]
    assert "aimed with" not in plain.output and [t["batch_size"] for t in climbed][:2] == [1, 8]


def test_a_measured_slope_far_from_the_estimate_is_reported():
    from vramcal.calibration.search import Aim
    from vramcal.service.calibrator import _off_aim

    from profiles_for_tests import host_profile

    profile = host_profile()
    slope = profile.fit.slope_bytes_per_sample
    assert _off_aim(profile, Aim(slope * 1.05, -0.04, 0.04, "a test")) == []  # within twice the bound
    above = _off_aim(profile, Aim(slope / 1.5, -0.04, 0.04, "a test"))
    assert len(above) == 1 and "50% above the estimate's" in above[0] and "a leak" in above[0]
    below = _off_aim(profile, Aim(slope * 1.5, -0.04, 0.04, "a test"))
    assert len(below) == 1 and "33% below" in below[0]
    assert _off_aim(profile, None) == []


def test_size_answers_from_the_matching_profile_and_calibrates_when_none_holds(tmp_path):
    """``vramcal size``: the first call calibrates and prints the batch size alone; the second, with nothing changed,
    prints the same from the profile with no trial; a profile whose recorded torch is another is calibrated again,
    and the line says why."""
    args = ["size", "--gpu", "none", "--capacity", capacity(3 * GIB // 2), *TINY, "--profiles-dir", str(tmp_path),
            "--no-boundary", "--steady-steps", "0", "--limit", "conservative"]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    assert first.stdout.strip().isdigit() and "calibrating: no profile of this model" in first.stderr
    (path,) = tmp_path.glob("*/*.json")
    trials = json.loads(path.read_text())["trials"]
    again = CliRunner().invoke(main, [*args, "--json"])
    answered = json.loads(again.stdout)
    assert again.exit_code == 0 and answered["calibrated"] is False and answered["profile"] == str(path)
    assert answered["batch_size"] == int(first.stdout) and json.loads(path.read_text())["trials"] == trials
    assert "from the matching profile" in again.stderr
    profile = load_profile(path)  # the gate: another process took memory since (the device's reading faked)
    room = profile.device.total_bytes - profile.settings.reserve_bytes
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(api, "free_bytes", lambda device: (room * 4 // 5, "MemAvailable (faked)"))
        gated = CliRunner().invoke(main, [*args, "--json"])
    assert gated.exit_code == 0 and json.loads(gated.stdout)["batch_size"] < answered["batch_size"]
    assert "free now (MemAvailable (faked))" in gated.stderr and "less than the profile's" in gated.stderr
    record = json.loads(path.read_text())
    record["software"]["torch"] = "2.0.0"
    path.write_text(json.dumps(record))
    third = CliRunner().invoke(main, args)
    assert third.exit_code == 0 and "calibrating again:" in third.stderr and "torch 2.0.0 ->" in third.stderr
    assert json.loads(path.read_text())["software"]["torch"] != "2.0.0"  # the new calibration replaced it


def test_the_baseline_is_this_devices_where_it_has_calibrations():
    """Another machine's libraries hold another amount: the AMD host's profiles taught 86 where this Xeon measured 83
    (the default spec at 2.5 GiB); a calibration of the same device comes first, the kind of device after."""
    import dataclasses

    others = [dataclasses.replace(calibrated(name, 500, 610), device="AMD") for name in ("a", "b")]
    mine = dataclasses.replace(calibrated("c", 560, 670), device="Xeon")
    assert learned_baseline([*others, mine], "host", device="Xeon").bytes == 560 * MIB
    assert "of this device" in learned_baseline([*others, mine], "host", device="Xeon").source
    assert learned_baseline([*others, mine], "host", device="EPYC").bytes == 500 * MIB  # none there: the kind's
    assert learned_baseline(others, "host", leave_out="a", device="AMD").bytes == 500 * MIB


def test_a_host_baseline_comes_from_the_same_thread_setting_first_and_says_when_it_cannot():
    """Each OpenMP thread holds its own arena and stack: the tiny spec's worker held 484 MiB at batch_size 1 with two
    threads and 402 MiB with OMP_NUM_THREADS=1, and the estimate learned from two-thread profiles missed a one-thread
    trial by 13.9 % (a test run with OMP_NUM_THREADS=1). Profiles made with a worker's thread setting come first;
    where there are none, the source names the settings it learned under."""
    import dataclasses

    two = [dataclasses.replace(calibrated(name, 560, 670), device="EPYC", settings={"OMP_NUM_THREADS": None})
           for name in ("a", "b")]
    one = dataclasses.replace(calibrated("c", 480, 590), device="EPYC", settings={"OMP_NUM_THREADS": "1"})
    assert learned_baseline([*two, one], "host", device="EPYC", settings={"OMP_NUM_THREADS": "1"}).bytes == 480 * MIB
    assert learned_baseline([*two, one], "host", device="EPYC", settings={"OMP_NUM_THREADS": None}).bytes == 560 * MIB
    assert "OMP_NUM_THREADS" not in learned_baseline([*two, one], "host", device="EPYC",
                                                     settings={"OMP_NUM_THREADS": "1"}).source
    other = learned_baseline(two, "host", device="EPYC", settings={"OMP_NUM_THREADS": "1"})
    assert other.bytes == 560 * MIB and other.source.endswith(
        "made with OMP_NUM_THREADS unset where a worker now gets '1': a process's baseline moves with them (not in "
        "the bound)")
    assert learned_baseline(two, "cuda") is CUDA_BASELINE  # a GPU's memory: threads not compared
    # left out, c has no calibration of its own setting to learn from: the two-thread baseline misses it, in the bound
    bound = learned_bound([*two, one], "host")
    assert (bound.n, bound.low, bound.high) == (3, 0, pytest.approx((560 + 110) / 590 - 1))


def test_a_baseline_comes_from_the_same_torch_build_first_even_of_another_device():
    """A host worker of torch's CUDA build holds about 1.00 GiB at batch_size 1 where one of the CPU build holds
    0.48 GiB (issue 62): a baseline learned from profiles of this build comes first, before this device's of another
    build and before the thread setting; with none of this build, the stated default of this build, whose source names
    the builds left out (learned from the CPU build's, a CUDA build's estimate missed a real trial by −41 %:
    bench/results/estimate-builds)."""
    import dataclasses

    cpu, cuda = {"torch": "2.13.0+cpu", "OMP_NUM_THREADS": None}, {"torch": "2.13.0+cu130", "OMP_NUM_THREADS": None}
    here = [dataclasses.replace(calibrated(name, 500, 610), device="EPYC", settings=cpu) for name in ("a", "b")]
    there = dataclasses.replace(calibrated("c", 1040, 1150), device="Xeon", settings={**cuda, "OMP_NUM_THREADS": "1"})
    learned = learned_baseline([*here, there], "host", device="EPYC", settings=cuda)
    assert learned.bytes == 1040 * MIB and "of this kind of device" in learned.source
    assert "made with OMP_NUM_THREADS '1' where a worker now gets unset" in learned.source
    assert "torch" not in learned.source
    under_cpu = learned_baseline(here, "host", device="EPYC", settings=cuda)
    assert under_cpu.bytes == HOST_CUDA_BUILD_BASELINE.bytes and under_cpu.source.endswith(
        "the profiles of torch '2.13.0+cpu' here left out: another build's process holds another amount")
    assert learned_baseline([], "host", settings=cuda) is HOST_CUDA_BUILD_BASELINE
    assert learned_baseline([], "host", settings=cpu) is HOST_BASELINE
    # each left out learns from its own build only: c, alone of its build, is held against its build's default
    errors = dict((c.path, error) for c, error in leave_one_out([*here, there], "host"))
    assert errors["a"] == pytest.approx((500 + 110) / 610 - 1)
    assert errors["c"] == pytest.approx((HOST_CUDA_BUILD_BASELINE.bytes / MIB + 110) / 1150 - 1)
    # the bound is its build's: the CPU build's two, or the benchmark's for the CUDA build's one
    assert learned_bound([*here, there], "host", cuda) is BENCH_BOUND
    assert learned_bound([*here, there], "host", cpu) is BENCH_BOUND  # two of the CPU build: too few to learn from


def made_under(folder: Path, torch_version: str) -> Path:
    """The committed host calibrations, copied to ``folder`` as if made under ``torch_version``."""
    shutil.copytree(MEASURED, folder)
    for path in folder.glob("*/*.json"):
        record = json.loads(path.read_text())
        record["software"]["torch"] = record["environment"]["torch_version"] = torch_version
        path.write_text(json.dumps(record))
    return folder


def test_estimate_names_the_settings_its_host_baseline_was_learned_under(tmp_path, monkeypatch):
    """Under another thread setting, or another torch build (issue 62: a CUDA build's process learning from CPU
    build profiles missed a real trial by -39 %), the host's baseline line names what it was learned under."""
    here = software_versions()["torch"]
    other = "2.13.0+cu130" if here.endswith("+cpu") else "2.13.0+cpu"

    def estimate(folder: Path) -> str:
        result = CliRunner().invoke(main, ["estimate", *TINY, "--capacity", capacity(3 * GIB // 2), "--profiles-dir",
                                           str(folder)])
        assert result.exit_code == 0, result.output
        return result.output

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    said = estimate(made_under(tmp_path / "here", here))
    assert "made with OMP_NUM_THREADS unset where a worker now gets '1': a process's baseline moves" in said, said
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert "made with" not in estimate(tmp_path / "here")
    said = estimate(made_under(tmp_path / "other", other))
    assert f"the profiles of torch '{other}' here left out: another build's process holds another amount" in said, said
