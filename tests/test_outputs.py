"""Output for the tools people already run: ``train --json`` and ``tune --json`` (one JSON object on stdout),
TensorBoard event files read back by TensorBoard's own reader, the time left, and shell completion.

Real runs of the tiny Mamba-2 of tests/test_train.py on CPU, against its in-memory profile (conservative batch
size 10) and synthetic bars (18 training windows: 3 steps an epoch at batch size 8).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from click.testing import CliRunner
from optuna.trial import TrialState
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_train import SPEC_ARGS, rows, training_folder

from vramcal.cli import main
from vramcal.train import tracking
from vramcal.tune.storage import STUDY_DB
from vramcal.tune.study import DEFAULT_STUDY_NAME

VRAMCAL = Path(sys.executable).with_name("vramcal")  # the console script, as a user runs it


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("outputs")
    training_folder(tmp)
    return tmp


def invoke(home: Path, command: str, run: str, *extra: str):
    args = [command, "--data", str(home / "bars.parquet"), "--profiles-dir", str(home / "profiles"), "--gpu", "none",
            "--run-dir", str(home / run), *SPEC_ARGS, *extra]
    return CliRunner().invoke(main, args)


def scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_train_json_and_tensorboard_and_a_resume_that_appends(home):
    first = invoke(home, "train", "run", "--epochs", "1", "--batch-size", "8", "--json")
    assert first.exit_code == 0, first.output
    done = json.loads(first.stdout)  # stdout is the JSON alone: every line for people went to stderr
    run_dir = home / "run"
    (epoch,) = rows(run_dir)
    assert done["batch_size"] == done["sizing"]["batch_size"] == 8 and done["steps"] == epoch["step"] == 3
    assert done["peak_bytes"] == epoch["peak_bytes"] > 0 and done["rank_peak_bytes"] is None
    assert done["predicted_peak_bytes"] == done["sizing"]["predicted_peak_bytes"] > 0
    assert done["val_loss"] == epoch["val_loss"] and done["metrics"] == str(run_dir / "metrics.jsonl")
    assert "done: 3 steps" in first.stderr and f"TensorBoard {run_dir / 'tensorboard'}" in first.stderr
    log_dir = Path(done["tensorboard"])
    (event_file,) = log_dir.iterdir()
    written = event_file.read_bytes()
    assert scalars(log_dir, "train/train_loss") == [(3, pytest.approx(epoch["train_loss"]))]

    resumed = invoke(home, "train", "run", "--resume", "--epochs", "2", "--json")
    assert resumed.exit_code == 0, resumed.output
    assert json.loads(resumed.stdout)["steps"] == 6
    assert len(list(log_dir.iterdir())) == 2 and event_file.read_bytes() == written  # appended, not rewritten
    epochs = rows(run_dir)
    assert scalars(log_dir, "train/train_loss") == [(r["step"], pytest.approx(r["train_loss"])) for r in epochs]
    assert [s for s, _ in scalars(log_dir, "val/val_loss")] == [s for s, _ in scalars(log_dir, "train/lr")] == [3, 6]
    assert scalars(log_dir, "memory/peak_bytes")[-1][1] == pytest.approx(epochs[-1]["peak_bytes"], rel=1e-6)


def test_train_says_the_time_left_after_each_epoch_but_the_last(home):
    result = invoke(home, "train", "left", "--epochs", "3", "--batch-size", "8")
    assert result.exit_code == 0, result.output
    left = [line for line in result.stderr.splitlines() if " left: " in line]
    assert [line.split(" left: ")[1].split(" at ")[0] for line in left] == ["6 steps and 2 validations",
                                                                          "3 steps and 1 validation"]
    assert "done: 9 steps" in result.stdout  # no --json: the closing line stays on stdout


def test_mlflow_gets_the_run_through_its_own_client_and_a_resume_logs_into_the_same_run(home, monkeypatch):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{home / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "vramcal-test")
    first = invoke(home, "train", "mlflow", "--epochs", "1", "--batch-size", "8", "--report-to", "mlflow,tensorboard")
    assert first.exit_code == 0, first.output
    run_dir = home / "mlflow"
    run_id = (run_dir / tracking.MLFLOW_RUN_ID).read_text().strip()
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "mlflow"
    assert client.get_experiment(run.info.experiment_id).name == "vramcal-test"
    assert run.data.params["batch_size_used"] == "8" and run.data.params["spec.d_model"] == "32"
    assert run.data.params["report_to"] == "mlflow,tensorboard" and float(run.data.params["lr_used"]) > 0

    resumed = invoke(home, "train", "mlflow", "--resume", "--epochs", "2")
    assert resumed.exit_code == 0, resumed.output
    epochs = rows(run_dir)
    history = client.get_metric_history(run_id, "train/train_loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r["train_loss"])) for r in epochs]
    assert client.get_run(run_id).info.status == "FINISHED" and (run_dir / tracking.TENSORBOARD).is_dir()
    assert len(client.search_runs([run.info.experiment_id])) == 1  # the resume went on in the same MLflow run


def test_a_tracker_that_cannot_be_reached_is_one_warning_within_its_bound_and_the_process_ends(tmp_path):
    """Issue 59 item 11: MLflow at an address nothing answers (``http://127.0.0.1:9``) held a finished run for minutes
    in its client's retries. Each call into a tracker has a bounded time (here 2 s): past it, one warning, later
    calls return at once, and the process ends without waiting for the client's thread."""
    code = f"""
import time, types
from pathlib import Path
from vramcal.train.config import TrainConfig
from vramcal.train.tracking import MlflowTracker
plan = types.SimpleNamespace(run_dir=Path({str(tmp_path / 'run')!r}), resume=False, config=TrainConfig(),
                             batch_size=8, step_batch_size=8, lr=1e-4)
tracker, started = MlflowTracker(plan, print, timeout_s=2), time.monotonic()
for step in (1, 2):
    tracker.epoch({{"kind": "epoch", "step": step, "train_loss": 1.0}})
tracker.close("FINISHED")
print(f"returned after {{time.monotonic() - started:.1f}} s")
"""
    env = {**os.environ, "MLFLOW_TRACKING_URI": "http://127.0.0.1:9"}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    warnings = [line for line in done.stdout.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "no answer within 2 s" in warnings[0] and "MLflow logging of" in warnings[0]
    assert float(done.stdout.split("returned after ")[1].split()[0]) < 4  # the bound, once: later calls skipped
    assert time.monotonic() - started < 60  # the process ended (imports included), the client's retries left


def test_report_to_none_writes_metrics_jsonl_alone_and_a_bad_or_missing_reporter_is_refused(home, monkeypatch):
    result = invoke(home, "train", "plain", "--epochs", "1", "--batch-size", "8", "--report-to", "none")
    assert result.exit_code == 0, result.output
    assert rows(home / "plain") and not (home / "plain" / tracking.TENSORBOARD).exists()
    bad = invoke(home, "train", "bad", "--report-to", "wandb")
    assert bad.exit_code == 2 and "name each of tensorboard, mlflow at most once" in bad.output
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else found(name, *a))
    missing = invoke(home, "train", "missing", "--batch-size", "8", "--report-to", "mlflow")
    assert missing.exit_code != 0 and "Traceback" not in missing.output
    assert "the mlflow package is not installed: pip install mlflow" in missing.output
    assert not (home / "missing").exists()  # refused before the run folder was made


def test_a_failing_writer_is_one_warning_and_the_run_goes_on(home, monkeypatch):
    import torch.utils.tensorboard

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", no_space)
    result = invoke(home, "train", "full-disk", "--epochs", "2", "--batch-size", "8")
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if "TensorBoard logging" in line]
    assert len(warnings) == 1 and "No space left on device" in warnings[0] and "metrics.jsonl" in warnings[0]
    assert [r["step"] for r in rows(home / "full-disk")] == [3, 6]


def test_where_a_run_begins_purging_and_what_it_writes(tmp_path):
    assert tracking.purge_step(tmp_path, resume=False) == 0
    (tmp_path / "metrics.jsonl").write_text('{"kind": "epoch", "step": 3}\n{"kind": "oom", "step": 5}\n')
    assert tracking.purge_step(tmp_path, resume=True) == 4  # after the last epoch row, not the last event
    row = {"kind": "epoch", "epoch": 1, "step": 3, "complete": True, "train_loss": 0.5, "val_loss": 0.25,
           "peak_bytes": 7, "rank_peak_bytes": [7, 6], "step_s_median": None}
    assert tracking.epoch_scalars(row) == {"train/epoch": 1.0, "train/train_loss": 0.5, "val/val_loss": 0.25,
                                           "memory/peak_bytes": 7.0, "memory/rank_peak_bytes/rank0": 7.0,
                                           "memory/rank_peak_bytes/rank1": 6.0}


def test_tune_json_names_the_best_trial_and_each_trial_is_in_tensorboard(home):
    result = invoke(home, "tune", "tune", "--trials", "2", "--n-initial", "1", "--epochs", "1", "--max-steps", "2",
                    "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    storage = f"sqlite:///{home / 'tune' / STUDY_DB}"
    study = optuna.load_study(study_name=DEFAULT_STUDY_NAME, storage=storage)
    best = min((t for t in study.trials if t.state == TrialState.COMPLETE), key=lambda t: t.value)
    assert summary["study_name"] == DEFAULT_STUDY_NAME and summary["storage"] == storage
    assert summary["best"]["number"] == best.number and summary["best"]["value"] == best.value
    assert summary["best"]["params"] == best.params and set(best.params) >= {"lr", "batch_size"}
    assert summary["trials"]["complete"] + summary["trials"]["pruned"] == 2 and summary["trials"]["fail"] == 0
    assert Path(summary["files"]["best"]).is_file() and "| trial | state" in result.stderr
    assert "1 of 2 finished, about" in result.stderr and "2 of 2 finished" in result.stderr
    log_dir = Path(best.user_attrs["run_dir"]) / tracking.TENSORBOARD
    assert scalars(log_dir, tracking.OBJECTIVE) == [(best.user_attrs["steps"], pytest.approx(best.value))]
    events = EventAccumulator(str(log_dir))
    events.Reload()
    assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")
    assert [s for s, _ in scalars(log_dir, "val/val_loss")] == [2]  # the trial's own epoch, beside its hparams


@pytest.mark.slow
def test_a_ddp_run_gives_the_same_json_from_what_rank_0_wrote(home):
    """Two gloo ranks through torchrun's agent, unchecked (no world profile): the JSON has both ranks' peaks, and
    rank 0 alone wrote TensorBoard."""
    args = [sys.executable, "-m", "vramcal", "train", "--data", str(home / "bars.parquet"), "--profiles-dir",
            str(home / "no-profiles"), "--gpu", "none", "--run-dir", str(home / "ddp"), *SPEC_ARGS,
            "--nproc-per-node", "2", "--batch-size", "4", "--max-steps", "2", "--json"]
    result = subprocess.run(args, cwd=home, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    done = json.loads(result.stdout)
    assert done["batch_size"] == 4 and done["step_batch_size"] == 8 and done["steps"] == 2
    assert len(done["rank_peak_bytes"]) == 2 and done["peak_bytes"] == done["rank_peak_bytes"][0] > 0
    assert done["sizing"] is None and done["predicted_peak_bytes"] is None  # unchecked: nothing predicted
    assert len(list(Path(done["tensorboard"]).iterdir())) == 1
    assert [s for s, _ in scalars(Path(done["tensorboard"]), "memory/rank_peak_bytes/rank1")] == [2]


@pytest.mark.skipif(not VRAMCAL.exists(), reason="the vramcal console script is not installed in this environment")
@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_shell_completion_scripts_and_answers(shell):
    source = subprocess.run([str(VRAMCAL)], env={**os.environ, "_VRAMCAL_COMPLETE": f"{shell}_source"},
                            capture_output=True, text=True, timeout=60)
    assert source.returncode == 0 and "_vramcal_completion" in source.stdout, source.stderr
    if shell == "bash":
        answer = subprocess.run([str(VRAMCAL)], capture_output=True, text=True, timeout=60, env={
            **os.environ, "_VRAMCAL_COMPLETE": "bash_complete", "COMP_WORDS": "vramcal train --js", "COMP_CWORD": "2"})
        assert answer.stdout.split() == ["plain,--json"], answer.stderr
