"""``vramcal tune`` end to end on CPU: a real optuna study of real tiny Mamba-2 trainings.

The profile is built in memory (conservative batch size 10, safe 12) as in test_train; the data are
synthetic bars (18 training windows). One tune is run once per module: interrupted in its second trial
(as a Ctrl-C would), then resumed; the tests read its study, files and output.
"""

from __future__ import annotations

import dataclasses
import json
import os

import optuna
import pytest
from click.testing import CliRunner
from optuna.trial import TrialState
from test_train import SPEC, SPEC_ARGS, make_profile, one_line_failure
from test_train_data import synthetic_bars

from vramcal.cli import main
from vramcal.measure.device import host_device
from vramcal.profile import profile_path, save_profile
from vramcal.train import checkpoint, runner
from vramcal.tune.storage import STUDY_DB
from vramcal.tune.study import BEST_CONFIG, DEFAULT_STUDY_NAME, PLOT, TRIALS_TABLE

CONSERVATIVE, SAFE = 10, 12


def tune(paths, *extra: str, run: str = "tune"):
    args = ["tune", "--data", str(paths["data"]), "--profiles-dir", str(paths["profiles"]), "--gpu", "none",
            "--run-dir", str(paths["tmp"] / run), *SPEC_ARGS, "--epochs", "2", "--max-steps", "3", *extra]
    return CliRunner().invoke(main, args)


def load(paths, run: str = "tune") -> optuna.Study:
    return optuna.load_study(study_name=DEFAULT_STUDY_NAME,
                             storage=f"sqlite:///{paths['tmp'] / run / STUDY_DB}")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tune")
    data = tmp / "bars.parquet"
    synthetic_bars(400).to_parquet(data)
    profile = make_profile(host_device())
    assert (profile.limits.conservative_batch_size, profile.limits.safe_batch_size) == (CONSERVATIVE, SAFE)
    save_profile(profile, profile_path(tmp / "profiles", profile.device, profile.model, "transformers"))
    return {"data": data, "profiles": tmp / "profiles", "tmp": tmp}


@pytest.fixture(scope="module")
def tuned(paths):
    """3 trials wanted; Ctrl-C in the second; then --resume finishes them. Returns both results."""
    real_train, calls = runner.train, []

    def train_then_interrupt(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_train(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner, "train", train_then_interrupt)
        first = tune(paths, "--trials", "3", "--n-initial", "2", "--batch-size-max", "500")
    after_first = [(t.number, t.state, t.params) for t in load(paths).trials]
    resumed = tune(paths, "--resume", "--trials", "3")
    return {"first": first, "after_first": after_first, "resumed": resumed, "run_dir": paths["tmp"] / "tune"}


def test_every_trial_batch_lies_inside_the_profile_bounds(tuned):
    assert "warning: --batch-size-max 500 is above the profile's conservative batch size" in tuned["first"].output
    assert f"batch_size in [1, {CONSERVATIVE}]" in tuned["first"].output
    trials = load_study_trials(tuned)
    ran = [t for t in trials if t.state != TrialState.FAIL]
    assert len(ran) == 3
    for t in ran:
        assert 1 <= t.params["batch_size"] <= CONSERVATIVE
        assert t.user_attrs["batch_size_used"] == t.params["batch_size"] and t.user_attrs["clamped"] is False
        assert t.user_attrs["samples_per_s"] > 0 and t.user_attrs["val_loss"] > 0
        run = json.loads((tuned["run_dir"] / "trials" / f"{t.number:04d}" / checkpoint.RUN).read_text())
        assert run["sizing"]["batch_size"] == t.params["batch_size"]  # the trainer trained what was suggested
        assert run["config"]["lr"] == t.params["lr"]


def load_study_trials(tuned):
    return optuna.load_study(study_name=DEFAULT_STUDY_NAME,
                             storage=f"sqlite:///{tuned['run_dir'] / STUDY_DB}").trials


def test_an_interrupted_tune_resumes_the_same_study(tuned):
    first = tuned["first"]
    assert first.exit_code == 130 and "interrupted" in first.output and "--resume" in first.output
    assert [(n, s) for n, s, _ in tuned["after_first"]] == [(0, TrialState.COMPLETE), (1, TrialState.FAIL)]
    resumed = tuned["resumed"]
    assert resumed.exit_code == 0, resumed.output
    assert f"resuming study '{DEFAULT_STUDY_NAME}' (2 trials so far)" in resumed.output
    trials = load_study_trials(tuned)
    assert len(trials) == 4  # 1 complete + 1 failed kept, then 2 more to reach 3 finished
    assert (trials[0].number, trials[0].params) == (0, tuned["after_first"][0][2])
    # the resumed sampler does not replay trial 0's random draw
    assert trials[2].params != trials[0].params


def test_results_table_plot_and_best_config_that_trains(tuned, paths):
    output, run_dir = tuned["resumed"].output, tuned["run_dir"]
    assert "| trial | state" in output and "samples/s" in output and "clamped" in output
    table = [line for line in (run_dir / TRIALS_TABLE).read_text().splitlines() if line.startswith("|")]
    assert len(table) == 1 + 1 + 4  # header, rule, 4 trials
    assert (run_dir / PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    best = min((t for t in load_study_trials(tuned) if t.state == TrialState.COMPLETE), key=lambda t: t.value)
    assert f"best: trial {best.number}" in output
    config = json.loads((run_dir / BEST_CONFIG).read_text())
    assert config["lr"] == best.params["lr"] and config["batch_size"] == best.user_attrs["batch_size_used"]
    assert config["max_grad_norm"] == best.params["max_grad_norm"]
    result = CliRunner().invoke(main, ["train", "--config", str(run_dir / BEST_CONFIG), "--gpu", "none",
                                       "--data", str(paths["data"]), "--profiles-dir", str(paths["profiles"]),
                                       "--run-dir", str(paths["tmp"] / "best-run"), "--max-steps", "1"])
    assert result.exit_code == 0, result.output
    run = json.loads((paths["tmp"] / "best-run" / checkpoint.RUN).read_text())
    assert run["sizing"] == {**run["sizing"], "batch_size": config["batch_size"], "source": "requested"}
    assert run["config"]["weight_decay"] == config["weight_decay"]


def test_look_back_windows_are_searched_each_within_its_own_batch_bounds(paths, tmp_path):
    """--seq-lens: one profile per length (the longer one's slope doubled); each trial picks a length and a
    batch size inside that length's bounds, and the trainer trains exactly that pair."""
    conservative = {}
    for length, slope in ((32, 24), (64, 48)):
        profile = make_profile(host_device(), dataclasses.replace(SPEC, seq_len=length), slope)
        save_profile(profile, profile_path(tmp_path / "profiles", profile.device, profile.model, "transformers"))
        conservative[length] = profile.limits.conservative_batch_size
    assert conservative[64] < conservative[32] == CONSERVATIVE
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(main, [
        "tune", "--data", str(paths["data"]), "--profiles-dir", str(tmp_path / "profiles"), "--gpu", "none",
        "--run-dir", str(run_dir), *SPEC_ARGS, "--epochs", "1", "--max-steps", "2", "--trials", "4",
        "--n-initial", "4", "--seq-lens", "32,64", "--seed", "2"])  # seeds 0 and 1 draw 64 four times
    assert result.exit_code == 0, result.output
    assert f"seq_len 32: batch_size in [1, {conservative[32]}]; seq_len 64: batch_size in [1, {conservative[64]}]" \
        in result.output
    trials = optuna.load_study(study_name=DEFAULT_STUDY_NAME, storage=f"sqlite:///{run_dir / STUDY_DB}").trials
    assert {t.params["seq_len"] for t in trials} == {32, 64}
    for t in trials:
        length, batch = t.params["seq_len"], t.user_attrs["batch_size"]
        assert 1 <= batch <= conservative[length] and t.user_attrs["batch_size_used"] == batch
        run = json.loads((run_dir / "trials" / f"{t.number:04d}" / checkpoint.RUN).read_text())
        assert (run["config"]["spec"]["seq_len"], run["sizing"]["batch_size"]) == (length, batch)
    assert "| seq_len |" in (run_dir / TRIALS_TABLE).read_text()
    best = min(trials, key=lambda t: t.value)
    config = json.loads((run_dir / BEST_CONFIG).read_text())
    assert (config["spec"]["seq_len"], config["batch_size"]) == (best.params["seq_len"], best.user_attrs["batch_size"])


# ------------------------------------------------------------------------------------------ bad input

@pytest.mark.parametrize("extra, message", [
    (("--lr-range", "1e-3", "1e-5"), "--lr-range: the low end 0.001 is above the high end 1e-05"),
    (("--batch-size-min", "8", "--batch-size-max", "4"), "the low end 8 is above the high end 4"),
    (("--max-grad-norm-range", "0", "1"), "bounds must be > 0"),
    (("--trials", "0"), "0 is not in the range x>=1"),
    (("--seq-lens", "32,40"), "seq_len 40 is not a multiple of chunk_size 16: use 32 or 48"),
    (("--seq-lens", "64:32"), "the range is reversed: write 32:64"),
])
def test_bad_values_exit_2_with_one_clear_line(paths, extra, message):
    result = tune(paths, *extra, run="bad")
    assert result.exit_code == 2 and "Traceback" not in result.output and message in result.output
    assert not (paths["tmp"] / "bad" / STUDY_DB).exists()


def test_a_batch_range_above_the_profile_is_refused_before_any_study(paths):
    line = one_line_failure(tune(paths, "--batch-size-min", "50", run="above"))
    assert f"--batch-size-min 50 is above the profile's conservative batch size {CONSERVATIVE}" in line
    assert not (paths["tmp"] / "above" / STUDY_DB).exists()


@pytest.mark.parametrize("storage", ["nosuchdb://x/y", "sqlite:////no/such/folder/study.db"])
def test_a_storage_that_cannot_be_opened_is_one_line(paths, storage):
    line = one_line_failure(tune(paths, "--storage", storage, run="storage"))
    assert line.startswith(f"Error: cannot open the study storage {storage}")


def test_an_existing_study_is_never_lost(tuned, paths):
    database = tuned["run_dir"] / STUDY_DB
    before = database.read_bytes()
    line = one_line_failure(tune(paths, "--trials", "5"))  # same --run-dir, no --resume
    assert "already holds a study: pass --resume" in line
    line = one_line_failure(tune(paths, "--resume", "--storage", f"sqlite:///{database}", "--study-name", "other"))
    assert "there is no study 'other' to resume" in line
    assert database.read_bytes() == before and len(load_study_trials(tuned)) == 4
    assert "nothing to resume" in one_line_failure(tune(paths, "--resume", run="empty"))


def test_a_trial_is_pruned_after_the_epoch_that_reports_it_hopeless(paths, tmp_path):
    """The trainer's on_epoch hook feeds trial.report; a pruner that prunes everything stops each trial
    after its first of two epochs, and the pruned trials keep their figures and count as finished."""
    from vramcal.train.config import TrainConfig
    from vramcal.tune.storage import open_storage
    from vramcal.tune.study import TuneSettings, open_study, run_study, search_space
    from vramcal.tune.workers import finished

    base = TrainConfig(data=str(paths["data"]), spec=SPEC, gpu="none", profiles_dir=str(paths["profiles"]),
                       epochs=2, batch_size_min=8)
    settings = TuneSettings(base=base, n_initial=1)
    storage = open_storage(f"sqlite:///{tmp_path / STUDY_DB}")
    study, _, existed = open_study(storage, "pruning", settings)
    study.pruner = optuna.pruners.ThresholdPruner(upper=0.0)  # every validation loss is above 0
    space = search_space(settings)
    assert not existed and run_study(study, settings, space, tmp_path, 2, echo=lambda _: None) == 2
    assert finished(study.trials) == 2
    for t in study.trials:
        assert t.state == TrialState.PRUNED and t.user_attrs["epochs"] == 1
        assert list(t.intermediate_values) == [1] and t.user_attrs["val_loss"] == t.intermediate_values[1]
        assert (tmp_path / "trials" / f"{t.number:04d}" / checkpoint.LAST).is_file()


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_trials_of_a_killed_worker_are_marked_failed_on_resume(tmp_path):
    """A RUNNING trial whose process on this host is gone (kill -9) is failed before the study goes on;
    one of a live worker is left running."""
    import subprocess
    import sys

    from vramcal.tune import study as studies
    from vramcal.tune.report import format_table
    from vramcal.tune.storage import open_storage
    from vramcal.tune.workers import worker_id

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = worker_id().rpartition(":")[0]
    storage = open_storage(f"sqlite:///{tmp_path / STUDY_DB}")
    study, settings, _ = studies.open_study(storage, "killed", studies.TuneSettings())
    study.ask().set_user_attr("worker", f"{host}:{int(dead.stdout)}")
    study.ask().set_user_attr("worker", f"{host}:{os.getppid()}")  # alive
    messages = []
    assert studies.run_study(study, settings, studies.SearchSpace(((64, None, studies.BatchBounds(1, 1, "p", 1, 1)),)),
                          tmp_path, 0, echo=messages.append) == 0
    assert [t.state for t in study.trials] == [TrialState.FAIL, TrialState.RUNNING]
    assert messages == ["trial 0: fail (its worker process is gone)"]
    assert format_table(study).splitlines()[2].split("|")[2].strip() == "fail"  # trial 0's row


def test_best_config_holds_absolute_paths(tuned, monkeypatch, tmp_path):
    from vramcal.train.config import TrainConfig
    from vramcal.tune.report import best_config
    from vramcal.tune.study import TuneSettings

    monkeypatch.chdir(tmp_path)
    study = optuna.load_study(study_name=DEFAULT_STUDY_NAME, storage=f"sqlite:///{tuned['run_dir'] / STUDY_DB}")
    config = best_config(study, TuneSettings(base=TrainConfig(data="bars.parquet", profiles_dir="profiles")))
    assert (config.data, config.profiles_dir) == (str(tmp_path / "bars.parquet"), str(tmp_path / "profiles"))


@pytest.mark.parametrize("extra", [("--lr-range", "1e-5", "inf"), ("--weight-decay-range", "0", "nan")])
def test_non_finite_ranges_exit_2(paths, extra):
    result = tune(paths, *extra, run="inf")
    assert result.exit_code == 2 and "bounds must be finite numbers" in result.output


@pytest.mark.parametrize("batches", [(3, 7, 40, 300, 1000), (30, 36, 45, 60), (10, 12)], ids=["wide", "narrow", "tune"])
def test_the_plots_tick_labels_do_not_print_over_each_other(batches):
    """The batch-size axis (log) labels a few plain numbers at any width (each minor tick labelled, a wide axis
    read "304056789100"); the history's axis labels whole trial numbers only."""
    from optuna.distributions import IntDistribution

    from vramcal.tune.report import study_figure

    study = optuna.create_study()
    for i, batch in enumerate(batches):
        study.add_trial(optuna.trial.create_trial(params={"batch_size": batch}, value=1.0 / (i + 1),
                                                  distributions={"batch_size": IntDistribution(1, 2048)},
                                                  user_attrs={"val_loss": 1.0 / (i + 1), "batch_size_used": batch}))
    figure = study_figure(study, None)
    renderer = figure.canvas.get_renderer()
    figure.draw(renderer)
    history, by_batch = figure.axes[:2]
    shown = [t for t in by_batch.get_xticklabels(minor=False) + by_batch.get_xticklabels(minor=True)
             if t.get_text() and t.get_visible() and by_batch.get_xlim()[0] <= t.get_position()[0]
             <= by_batch.get_xlim()[1]]
    assert len(shown) >= 2, [t.get_text() for t in shown]
    boxes = sorted((t.get_window_extent(renderer) for t in shown), key=lambda box: box.x0)
    assert all(left.x1 <= right.x0 for left, right in zip(boxes, boxes[1:])), [t.get_text() for t in shown]
    assert all(float(t.get_text().replace("\N{MINUS SIGN}", "-")).is_integer() for t in history.get_xticklabels()
               if t.get_text())
