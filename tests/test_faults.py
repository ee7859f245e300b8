"""Full disk, ``kill -9`` and truncated checkpoints, with ``vramcal train`` in real processes (issue 10, item 4).

Faults are the operating system's own: a file-size limit (``RLIMIT_FSIZE``, what ``ulimit -f`` sets; a
write past it fails with ``EFBIG``, as a full disk fails with ``ENOSPC``), ``SIGKILL`` to the whole process
group (the command, its fork server and the training worker), and a checkpoint cut short on disk.
The promises: one line naming the file and the last good checkpoint, exit 1, no traceback; the folder is
always resumable (a readable checkpoint) or reusable (none); ``metrics.jsonl`` never lists an epoch no
checkpoint holds; a kill loses at most ``--checkpoint-steps`` steps.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_train import SPEC, SPEC_ARGS, make_profile
from test_train_data import synthetic_bars

from vramcal.cli import main
from vramcal.measure.device import host_device
from vramcal.profile import profile_path, save_profile
from vramcal.train import checkpoint

# Below any checkpoint of the tiny model (half its fp32 weights; AdamW's state doubles them again), above
# config.json, run.json and metrics.jsonl.
FILE_LIMIT_BYTES = SPEC.n_params() * 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    synthetic_bars(400).to_parquet(tmp / "bars.parquet")
    profile = make_profile(host_device())
    save_profile(profile, profile_path(tmp / "profiles", profile.device, profile.model, "transformers"))
    return tmp


def train_args(tmp: Path, run: str, *extra: str) -> list[str]:
    return ["train", "--data", str(tmp / "bars.parquet"), "--profiles-dir", str(tmp / "profiles"), "--gpu", "none",
            "--run-dir", str(tmp / run), *SPEC_ARGS, "--batch-size", "8", *extra]


def vramcal(tmp: Path, args: list[str], file_limit: int | None = None, **popen) -> subprocess.CompletedProcess:
    """``python -m vramcal ARGS`` in a process of its own (under ``ulimit -f`` when ``file_limit``)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

    return subprocess.run([sys.executable, "-m", "vramcal", *args], cwd=tmp, capture_output=True, text=True,
                          timeout=300, preexec_fn=limit if file_limit else None, **popen)


def one_line_error(process: subprocess.CompletedProcess) -> str:
    assert process.returncode == 1, process.stdout + process.stderr
    assert "Traceback" not in process.stdout + process.stderr, process.stderr
    errors = [line for line in process.stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and process.stderr.rstrip().endswith(errors[0]), process.stderr
    return errors[0]


def epochs(run_dir: Path) -> list[int]:
    path = run_dir / checkpoint.METRICS
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r["epoch"] for r in rows if r["kind"] == "epoch"]


def saved_progress(path: Path) -> dict:
    return checkpoint.load_checkpoint(path)["progress"]


@pytest.mark.slow  # two fresh `vramcal train` processes (each imports torch): 20-50 s on 2 shared cores
def test_a_full_disk_stops_in_one_line_and_the_folder_stays_usable(setup):
    run = setup / "full"
    # the first save fails: no checkpoint, so the folder takes a new run
    line = one_line_error(vramcal(setup, train_args(setup, "full", "--epochs", "2"), FILE_LIMIT_BYTES))
    assert f"cannot write {run / checkpoint.LAST} (File too large): stopped at step 3, unsaved" in line
    assert "no checkpoint was saved; start the run again (the same --run-dir" in line
    assert not checkpoint.has_checkpoint(run) and epochs(run) == []
    assert not list(run.glob(".*.tmp"))  # the half-written temporary file is gone
    result = CliRunner().invoke(main, ["train", "--resume", "--run-dir", str(run)])
    assert result.exit_code == 1 and "nothing to resume" in result.output  # resumable: no; reusable: yes
    result = CliRunner().invoke(main, train_args(setup, "full", "--epochs", "1"))
    assert result.exit_code == 0, result.output
    assert epochs(run) == [1]
    # a later save fails: the folder resumes from the last good checkpoint; metrics never run ahead of it
    line = one_line_error(vramcal(setup, ["train", "--resume", "--run-dir", str(run), "--epochs", "3"],
                                  FILE_LIMIT_BYTES))
    assert f"cannot write {run / checkpoint.LAST} (File too large): stopped at step 6, unsaved" in line
    assert (f"the last good checkpoint is {run / checkpoint.LAST}; continue with `vramcal train --resume "
            f"--run-dir {run}` once there is space") in line
    assert epochs(run) == [1] and saved_progress(run / checkpoint.LAST)["epoch"] == 1
    result = CliRunner().invoke(main, ["train", "--resume", "--run-dir", str(run), "--epochs", "2"])
    assert result.exit_code == 0, result.output
    assert epochs(run) == [1, 2] and saved_progress(run / checkpoint.LAST)["epoch"] == 2


@pytest.mark.slow  # a fresh `vramcal train` process and two more runs: 20-40 s on 2 shared cores
def test_a_run_killed_mid_epoch_resumes_from_its_mid_epoch_checkpoint(setup):
    """``--checkpoint-steps 2``: SIGKILL to the whole process group in the middle of the only epoch; the
    resumed run starts at the saved step (not at the epoch's start) and ends with a straight run's weights."""
    args = ["--epochs", "1", "--stride", "2", "--batch-size", "4", "--checkpoint-steps", "2"]  # 36 steps
    run, log = setup / "killed", setup / "killed.log"
    with open(log, "w") as output:
        process = subprocess.Popen([sys.executable, "-m", "vramcal", *train_args(setup, "killed", *args)], cwd=setup,
                                   stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline, progress = time.monotonic() + 120, {}
        while time.monotonic() < deadline and progress.get("step", 0) < 6 and process.poll() is None:
            time.sleep(0.05)
            try:
                progress = saved_progress(run / checkpoint.LAST)
            except (checkpoint.RunDirError, FileNotFoundError):
                pass
    finally:
        ended = process.poll()
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert ended is None and progress.get("step", 0) >= 6, (
        f"the run {'ended (exit ' + str(ended) + ')' if ended is not None else 'saved no step 6 in 120 s'} "
        f"before the kill:\n{log.read_text()[-2000:]}")
    kept = saved_progress(run / checkpoint.LAST)
    assert kept["epoch"] == 0 and 6 <= kept["step"] < 36 and kept["batch_in_epoch"] == kept["step"]
    assert kept["step"] % 2 == 0 and epochs(run) == []  # saved every 2 steps; no epoch finished
    result = CliRunner().invoke(main, ["train", "--resume", "--run-dir", str(run)])
    assert result.exit_code == 0, result.output
    assert f"0 epoch(s) and {kept['step']} step(s) done, batch {kept['step']} of epoch 1" in result.output
    assert "done: 36 steps" in result.output and epochs(run) == [1]
    straight = setup / "straight"
    assert CliRunner().invoke(main, train_args(setup, "straight", *args)).exit_code == 0
    resumed, plain = (checkpoint.load_checkpoint(d / checkpoint.LAST)["model"] for d in (run, straight))
    assert all(torch.equal(plain[k], resumed[k]) for k in plain)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_a_truncated_last_checkpoint_falls_back_to_the_previous_one(setup):
    run = setup / "truncated"
    assert CliRunner().invoke(main, train_args(setup, "truncated", "--epochs", "2")).exit_code == 0
    truncate(run / checkpoint.LAST)
    result = CliRunner().invoke(main, ["train", "--resume", "--run-dir", str(run), "--epochs", "3"])
    assert result.exit_code == 0, result.output
    assert (f"warning: {run / checkpoint.LAST} is not a readable checkpoint (") in result.output
    assert f"truncated?): resuming from {run / checkpoint.PREV} (epoch 1, step 3)" in result.output
    assert "the unreadable checkpoint-last.pt is kept as checkpoint-last.pt.unreadable" in result.output
    assert epochs(run) == [1, 2, 3]
    # the next save kept the good checkpoint as the previous one, not the truncated file
    assert saved_progress(run / checkpoint.PREV)["epoch"] == 2 and saved_progress(run / checkpoint.LAST)["epoch"] == 3


def test_a_folder_of_unreadable_checkpoints_takes_a_new_run(setup):
    run = setup / "all-bad"
    assert CliRunner().invoke(main, train_args(setup, "all-bad", "--epochs", "2")).exit_code == 0
    for name in checkpoint.CHECKPOINTS:
        truncate(run / name)
    result = CliRunner().invoke(main, ["train", "--resume", "--run-dir", str(run)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"no readable checkpoint in {run}" in result.output and "start a new run there without --resume" \
        in result.output
    result = CliRunner().invoke(main, train_args(setup, "all-bad", "--epochs", "1"))
    assert result.exit_code == 0, result.output
    assert epochs(run) == [1] and sorted(p.name for p in run.glob("*.unreadable")) == sorted(
        f"{name}.unreadable" for name in checkpoint.CHECKPOINTS)


def test_a_kill_during_a_save_leaves_a_temporary_file_that_the_next_start_removes(setup):
    run = setup / "stale"
    assert CliRunner().invoke(main, train_args(setup, "stale", "--max-steps", "1")).exit_code == 0
    stale = run / f".{checkpoint.LAST}.abc123.tmp"
    stale.write_bytes(b"half a checkpoint")
    result = CliRunner().invoke(main, ["train", "--resume", "--run-dir", str(run), "--max-steps", "2"])
    assert result.exit_code == 0, result.output
    assert not stale.exists()


def test_checkpoint_minutes_saves_within_an_epoch(tmp_path):
    """``--checkpoint-minutes``: a save is due whenever that much time passed since the last one (here a
    microsecond: every step), so the save before the epoch's end holds a mid-epoch step."""
    from test_train import in_process

    from vramcal.train import loop

    synthetic_bars(400).to_parquet(tmp_path / "bars.parquet")
    profile = make_profile(host_device())
    save_profile(profile, profile_path(tmp_path / "profiles", profile.device, profile.model, "transformers"))
    plan, step = in_process({"data": tmp_path / "bars.parquet", "profiles": tmp_path / "profiles", "tmp": tmp_path},
                            "minutes", batch_size=4, max_steps=None, checkpoint_minutes=1e-8)  # 5 steps
    loop.Trainer(plan, step, echo=lambda line: None).run()
    previous = saved_progress(plan.run_dir / checkpoint.PREV)
    assert (previous["epoch"], previous["step"], previous["batch_in_epoch"]) == (0, 4, 4)
