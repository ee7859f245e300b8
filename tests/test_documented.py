"""Every documented command and option, run end to end on the tiny model (issue 10: "a documented path
that no test executes" is how ``vramcal train --probe`` shipped with a TypeError).

Each command of :data:`vramcal.cli.main` runs at least once here, through click's test runner, on the
tiny Mamba-2 of tests/test_train.py and synthetic bars. The meta-test at the end lists every option of
every command from click's own command objects and fails when one appears in no test under tests/, so a
new option cannot ship untried.

One probe runs real trials (``--max-trials 3``: it ends unverified, exit 3). The verified profile the
other commands read comes from a probe whose trials' *measurements* are faked at the hardware boundary
(:func:`fake_measurement`: peak memory as a known line in the batch size), so ``train --probe`` runs the
real calibration loop, printer, profile file and training run in seconds. Budgets that real trials or
training runs live under grow by what this torch build's workers hold beyond the CPU build's, and so does
the fake line (tests/host_budget.py): the limits and the runs' room are the same on every build.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import click
import pandas as pd
import pytest
from click.testing import CliRunner
from host_budget import capacity, extra_bytes
from test_train import SPEC_ARGS
from test_train_data import synthetic_bars

from vramcal.cli import main
from vramcal.cli.options import EXIT_UNVERIFIED
from vramcal.profile import load_profile, save_profile
from vramcal.records import Trial
from vramcal.units import format_bytes

MIB = 2**20
GIB = 2**30
TESTS = Path(__file__).parent


def commands(command: click.Command = main, path: tuple[str, ...] = ()):
    """(path, command) of ``vramcal`` and every command and subcommand below it."""
    yield path, command
    if isinstance(command, click.Group):
        for name, sub in sorted(command.commands.items()):
            yield from commands(sub, (*path, name))


def invoke(*args: str, code: int = 0, **kwargs):
    result = CliRunner().invoke(main, [str(a) for a in args], **kwargs)
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return result


def known_line(b: int, purpose: str) -> int:
    """The fake peaks: 550 MiB + 0.4 MiB per sample with a little noise, plus tests/host_budget.py's extra."""
    return extra_bytes() + 550 * MIB + int(0.4 * MIB * b) + (b * 7919 % 7) * 50_000


def fake_measurement(monkeypatch, peak=known_line):
    """Trials measured by ``peak(batch_size, purpose)`` (bytes; None = out of memory) instead of a device.

    Only the measurement is fake: the search, the fit, the limits, the verification, the profile file
    and whatever reads it are the real ones.
    """
    from vramcal.measure.trial import TrialRunner

    def run(self, request, purpose=""):
        b = request.batch_size
        purposes = ("verify-conservative", purpose) if request.verifies else (purpose,)  # a steady trial's two records
        values = [peak(b, each) for each in purposes]
        if values[-1] is None:
            return (Trial(b, "oom", purpose=purpose, error="DefaultCPUAllocator: can't allocate memory", wall_s=0.0),)
        return tuple(Trial(b, "ok", value, rss_peak_bytes=value, step_s=0.01, samples_per_s=b / 0.01, purpose=each,
                           wall_s=0.0) for each, value in zip(purposes, values))

    monkeypatch.setattr(TrialRunner, "run", run)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """Bars, a tick CSV, and a verified profile written by ``vramcal probe`` (fake measurements)."""
    tmp = tmp_path_factory.mktemp("documented")
    synthetic_bars(400).to_parquet(tmp / "bars.parquet")
    stamps = pd.date_range("2013-09-01 17:00:00", periods=300, freq="700ms")
    pd.DataFrame({"DateTime": stamps.strftime("%Y-%m-%d %H:%M:%S.%f"), "Price": 1600 + 0.25 * (pd.Series(range(300))
                  % 7), "Volume": 1 + pd.Series(range(300)) % 5}).to_csv(tmp / "ticks.csv", index=False)
    with pytest.MonkeyPatch.context() as patch:
        fake_measurement(patch)
        invoke("probe", "--gpu", "none", "--capacity", capacity(3 * GIB // 2), *SPEC_ARGS, "--data",
               tmp / "bars.parquet", "--profiles-dir", tmp / "profiles", "--no-report")
    (profile,) = (tmp / "profiles").rglob("*.json")
    return {"tmp": tmp, "bars": tmp / "bars.parquet", "profiles": tmp / "profiles", "profile": profile}


# ------------------------------------------------------------------------------------------ commands

def test_help_and_version_of_every_command():
    for path, _ in commands():
        assert "Usage: " in invoke(*path, "--help").output
        assert invoke(*path, "-h").output == invoke(*path, "--help").output
    assert re.match(r"vramcal, version \S+", invoke("--version").output)
    shown = subprocess.run([sys.executable, "-m", "vramcal", "--help"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "probe" in shown.stdout


def test_probe_with_every_option_and_real_trials(home):
    """Three real trials cannot verify a limit: the profile is written, the reason is one line, exit 3."""
    tmp = home["tmp"]
    result = invoke("probe", "--gpu", "none", "--impl", "transformers", "--capacity", capacity(2 * GIB), "--model",
                    "regressor", *SPEC_ARGS, "--expand", "2", "--dtype", "fp32", "--data", home["bars"],
                    "--stride", "16", "--val-fraction", "0.2", "--data-on-device", "--reserve", "0", "--margin", "0.1",
                    "--conservative", "0.9", "--warmup-steps", "1", "--measured-steps", "2", "--val-steps", "1",
                    "--steady-steps", "5", "--max-trials", "3", "--timeout", "120", "--profiles-dir", tmp / "p",
                    "--out", tmp / "real.json",
                    "--reports-dir", tmp / "reports", "--json", code=EXIT_UNVERIFIED)
    profile = json.loads(result.stdout)
    assert len(profile["trials"]) == 3 and profile["data"]["options"]["data_on_device"] is True
    assert profile["run"]["steady_steps"] == 5 and profile["creep"] is None  # three trials: none was steady
    assert not profile.get("verification", {}).get("safe", {}).get("passed")
    last = result.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"not verified: .{20,} \(exit 3\)", last), result.stderr
    assert list((tmp / "reports").glob("*.md")) and (tmp / "real.json").is_file()
    invoke("probe", "--model", "regressor", "--model-arg", "d_model=32", code=2)  # the regressor takes spec options


def test_show_report_and_limits(home):
    profile, tmp = home["profile"], home["tmp"]
    assert "verified: peak" in invoke("show", profile).output
    assert json.loads(invoke("show", profile, "--json").output)["model"]["params"]["d_model"] == 32
    written = json.loads(invoke("report", profile, home["profiles"], "--out", tmp / "r", "--name", "doc",
                                "--gpus", "L4=22.5GiB", "--json").output)
    assert Path(written["markdown"]).name == "doc.md" and Path(written["png"]).is_file()
    assert "report: " in invoke("report", profile, "--out", tmp / "r2").output
    gpus = invoke("limits", profile, "--gpus", "L4=22.5GiB", "--profiles-dir", home["profiles"]).output
    assert "\nL4 " in gpus and "estimated, not measured" in gpus  # a host profile: its GPUs estimated
    table = json.loads(invoke("limits", profile, "--json").output)
    assert table["verified"] is True and table["gpus"]


def test_train_with_every_option_then_resume(home):
    tmp = home["tmp"]
    config = tmp / "settings.json"
    config.write_text(json.dumps({"seed": 3, "lr_scaling": "none"}))
    run = tmp / "run"
    result = invoke("train", "--config", config, "--data", home["bars"], "--gpu", "none", "--impl", "transformers",
                    "--capacity", capacity(3 * GIB // 2), *SPEC_ARGS, "--expand", "2", "--dtype", "fp32", "--profile",
                    home["profile"], "--profiles-dir", home["profiles"], "--batch-size-min", "1", "--lr-scaling",
                    "linear",
                    "--reference-batch-size", "8", "--warmup-steps", "1", "--max-steps", "3", "--seed", "1",
                    "--stride", "16", "--val-fraction", "0.2", "--data-on-device", "--checkpoint-steps", "1",
                    "--checkpoint-minutes", "0.5", "--run-dir", run, "--batch-size", "4", "--lr", "1e-4",
                    "--weight-decay", "0.01", "--max-grad-norm", "1.0", "--epochs", "1")
    assert "done: 3 steps" in result.output
    budget = format_bytes(int(capacity(3 * GIB // 2)))  # what the budget binds, and what it does not (issue 23)
    assert f"host budget: the training process may hold at most {budget} of data segment (RLIMIT_DATA: heap " \
           f"and private mappings" in result.stderr and "the worker fork server are outside it" in result.stderr
    saved = json.loads((run / "config.json").read_text())
    assert (saved["seed"], saved["lr_scaling"], saved["checkpoint_steps"], saved["batch_size"]) == (1, "linear", 1, 4)
    assert "done: 4 steps" in invoke("train", "--resume", "--run-dir", run, "--max-steps", "4").output


def test_train_probe_calibrates_then_trains(home, monkeypatch):
    """``train --probe``: the calibration (trials printed on stderr), its profile, then the run with it."""
    fake_measurement(monkeypatch)
    profiles = home["tmp"] / "probed"
    result = invoke("train", "--probe", "--gpu", "none", "--capacity", capacity(3 * GIB // 2), *SPEC_ARGS, "--data",
                    home["bars"],
                    "--profiles-dir", profiles, "--run-dir", home["tmp"] / "probed-run", "--max-steps", "2")
    assert "calibrating regressor d_model=32" in result.stderr and "verify-conservative" in result.stderr
    (profile,) = profiles.rglob("*.json")
    assert f"profile: {profile}" in result.stderr and "done: 2 steps" in result.stdout
    run = json.loads((home["tmp"] / "probed-run" / "run.json").read_text())
    assert run["profile"] == str(profile) and run["sizing"]["source"].startswith("conservative")


def test_train_and_tune_size_for_throughput_and_the_run_is_shown_beside_its_forecast(home):
    """A profile whose trials ran fastest per sample at small batches (as on this project's host): ``train
    --size-for throughput`` trains at the knee and says why; the run's epoch time lands beside the forecast in the
    profile (here far from it: the profile's step times are made up), ``show`` lists it, the report's section
    carries it; ``tune --size-for throughput`` searches up to the knee; ``cost`` forecasts both sizes."""
    tmp = home["tmp"]

    def timed(t: Trial) -> Trial:  # rates: 1 -> 1.99, 8 -> 6.02 (the best), 64 -> 4.27 samples/s, slower above:
        # a hundredth of what this host runs, so the run is far from them on any machine (602 was within 25 %)
        step = 100 * (0.004 + 0.001 * t.batch_size + 0.00002 * t.batch_size**2)
        return t if not t.ok else dataclasses.replace(t, step_s=step, samples_per_s=t.batch_size / step,
                                                      step_times_s=(step, step), val_times_s=(step / 3,))

    profile = load_profile(home["profile"])
    path = save_profile(dataclasses.replace(profile, trials=tuple(map(timed, profile.trials)), observations=()),
                        tmp / "knee" / "profile.json")
    run = tmp / "knee-run"
    result = invoke("train", "--data", home["bars"], "--gpu", "none", *SPEC_ARGS, "--profile", path, "--size-for",
                    "throughput", "--epochs", "1", "--run-dir", run)
    assert "batch_size 8 (knee;" in result.stderr and "sizing for throughput: batch_size 8" in result.stderr
    assert "forecast: 6.02 samples/s at batch_size 8" in result.stderr and "after the first epoch: " in result.stderr
    assert "against the forecast" in result.stderr  # made-up step times: the run is far from them, and says so
    (observation,) = load_profile(path).observations
    assert observation.batch_size == 8 and observation.epoch_s > 0 and observation.forecast_epoch_s > 0
    assert observation.forecast_samples_per_s == pytest.approx(8 / 1.328)
    assert "FAR FROM THE FORECAST" in invoke("show", path).output
    section = invoke("cost", path, "--out", tmp / "knee-cost", "--size-for", "throughput").output
    assert "8 (knee)" in section
    tune = invoke("tune", "--data", home["bars"], "--gpu", "none", "--profiles-dir", tmp / "knee", *SPEC_ARGS,
                  "--run-dir", tmp / "knee-tune", "--size-for", "throughput", "--trials", "1", "--n-initial", "1",
                  "--epochs", "1", "--max-steps", "1")
    assert "batch_size in [1, 8]" in tune.output


def test_data_es_sample_from_a_tick_file(home):
    out = home["tmp"] / "bars-1s.parquet"
    result = invoke("data", "es-sample", "--ticks", home["tmp"] / "ticks.csv", "--bar", "1s", "--out", out)
    assert result.output == f"210 bars of 1s from 2013-09-01 17:00:00 to 2013-09-01 17:03:29 -> {out}\n"
    assert pd.read_parquet(out)["volume"].sum() == sum(1 + i % 5 for i in range(300))


def test_tune_one_trial_then_resume(home):
    tmp = home["tmp"]
    args = ["tune", "--data", home["bars"], "--gpu", "none", "--profiles-dir", home["profiles"], *SPEC_ARGS,
            "--run-dir", tmp / "tune", "--epochs", "1", "--max-steps", "2", "--batch-size-max", "4",
            "--lr-range", "1e-4", "1e-3", "--weight-decay-range", "0", "0.1", "--max-grad-norm-range", "0.5", "2",
            "--storage", f"sqlite:///{tmp / 'tune.db'}", "--study-name", "doc"]
    result = invoke(*args, "--trials", "1", "--n-initial", "1")
    assert "best: trial 0" in result.output and (tmp / "tune" / "best-config.json").is_file()
    resumed = invoke(*args, "--resume", "--trials", "1")
    assert "resuming study 'doc' (1 trials so far)" in resumed.output and "best: trial 0" in resumed.output


# -------------------------------------------------------------------------------------------- meta

def test_every_option_of_every_command_is_run_by_some_test():
    """Each option string of each command (click's own objects) appears quoted in some test under tests/."""
    sources = "\n".join(p.read_text() for p in TESTS.rglob("*.py"))
    options = {(" ".join(path) or "vramcal", opt) for path, command in commands() for param in command.params
               if isinstance(param, click.Option) for opt in (*param.opts, *param.secondary_opts)}
    assert len(options) > 80  # the walk found the commands' options
    untried = sorted((where, opt) for where, opt in options if f'"{opt}"' not in sources and f"'{opt}'" not in sources)
    assert untried == [], f"options no test runs: {untried}"
