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
from host_budget import SIZE, capacity
from test_train import SPEC, SPEC_ARGS, make_profile, training_folder
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
    training_folder(tmp)
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
    # what --resume reads: the last checkpoint, or the previous one when the kill fell between a save's two renames
    kept = checkpoint.load_resumable(run)[0]["progress"]
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
    folder = "deep-" * 40 + "/all-bad"  # the message names the folder and each file: a long path is not cut
    run = setup / folder
    assert CliRunner().invoke(main, train_args(setup, folder, "--epochs", "2")).exit_code == 0
    for name in checkpoint.CHECKPOINTS:
        truncate(run / name)
    result = CliRunner().invoke(main, ["train", "--resume", "--run-dir", str(run)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"no readable checkpoint in {run}" in result.output and "start a new run there without --resume" \
        in result.output
    result = CliRunner().invoke(main, train_args(setup, folder, "--epochs", "1"))
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


# ------------------------------------------------------------------ two runs in one folder (issue 25, item 7b)

def wait_for(condition, seconds: float, process: subprocess.Popen | None = None) -> bool:
    """Poll ``condition()`` until it holds, ``seconds`` pass, or ``process`` ends."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and (process is None or process.poll() is None):
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.mark.slow  # three `vramcal train` processes (each imports torch): 30-60 s on 2 shared cores
def test_a_run_folder_takes_one_run_at_a_time_and_a_killed_one_leaves_it_to_the_next(setup):
    """A second run (new or resumed) in a folder a run is going on in is refused in one line naming the first
    run's pid, and changes nothing there; once the first is killed, the folder resumes."""
    # 36 steps an epoch, and epochs enough that the first run is still going whatever the machine's speed
    args = ["--epochs", "1000", "--stride", "2", "--batch-size", "4", "--checkpoint-steps", "2"]
    run, log = setup / "shared", setup / "shared.log"
    with open(log, "w") as output:
        first = subprocess.Popen([sys.executable, "-m", "vramcal", *train_args(setup, "shared", *args)], cwd=setup,
                                 stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        saved = wait_for(lambda: (run / checkpoint.LAST).is_file(), 120, first)
        assert saved, f"the first run saved nothing in 120 s:\n{log.read_text()[-2000:]}"
        holder = (run / checkpoint.LOCK).read_text().strip()
        assert holder == str(first.pid)
        config = (run / checkpoint.CONFIG).read_text()
        resumed = ["train", "--resume", "--run-dir", str(run)]
        for second in (train_args(setup, "shared", *args, "--lr", "1e-3"), resumed):
            line = one_line_error(vramcal(setup, second))
            assert line == (f"Error: {run} is in use by another run (pid {first.pid}): a run folder takes one run at "
                            f"a time; wait for it to end, or choose another --run-dir")
        assert (run / checkpoint.CONFIG).read_text() == config  # the second run wrote nothing
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    done = checkpoint.load_checkpoint(run / checkpoint.LAST)["progress"]["step"]
    result = CliRunner().invoke(main, ["train", "--resume", "--run-dir", str(run), "--max-steps", str(done + 2)])
    assert result.exit_code == 0, result.output
    assert f"done: {done + 2} steps" in result.output


@pytest.mark.slow  # a `vramcal train` process of its own, stopped after its first checkpoint: ~15 s
def test_sigterm_to_a_run_stops_it_in_one_line_and_leaves_no_worker_training_on(setup):
    """``kill PID`` (and ``timeout``, a scheduler's cancel) sends SIGTERM to the command alone. Its default ended
    the command at once, without a line, and left its worker (whose parent is the fork server) training to the
    end; now it takes Ctrl-C's way out: the worker killed, one line saying how to resume, exit 143."""
    from test_cli import processes_tagged

    args = ["--epochs", "1000", "--stride", "2", "--batch-size", "4", "--checkpoint-steps", "2"]
    run, log, tag = setup / "terminated", setup / "terminated.log", f"sigterm-{os.getpid()}"
    with open(log, "w") as output:
        process = subprocess.Popen([sys.executable, "-m", "vramcal", *train_args(setup, "terminated", *args)],
                                   cwd=setup, stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "VRAMCAL_TEST_TAG": tag})
    try:
        assert wait_for(lambda: (run / checkpoint.LAST).is_file(), 120, process), log.read_text()[-2000:]
        process.send_signal(signal.SIGTERM)  # the command's process only, as kill does
        assert process.wait(timeout=60) == 143, log.read_text()[-2000:]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert wait_for(lambda: not processes_tagged(tag), 5), processes_tagged(tag)  # no worker, no fork server
    text = log.read_text()  # ... and multiprocessing's resource tracker has said all it had to
    assert "Traceback" not in text and "leaked semaphore" not in text and [
        line for line in text.splitlines() if line.startswith("Error")] == [
        f"Error: stopped by SIGTERM: the checkpoints in {run} are kept; continue with `vramcal train --resume "
        f"--run-dir {run}`"]
    assert checkpoint.load_resumable(run)[0]["progress"]["step"] >= 2


def children(pid: int) -> list[int]:
    """The pids of ``pid``'s child processes (``/proc/*/stat``'s parent field)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                if int(stat.read().rpartition(")")[2].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


def as_a_terminal_starts_it() -> None:
    """In the child before it runs the command: SIGINT's default action and no signal blocked, as a shell leaves
    them, whatever this test process inherited or changed (an ignored SIGINT is inherited through exec, and a
    Python started with it ignored never raises KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def ended(process: subprocess.Popen, tag: str, log: Path, timeout_s: float = 60) -> int:
    """``process``'s exit status once it ends; a failure after ``timeout_s`` that says where each of its tagged
    processes was (state and kernel wait channel, from /proc) and what the command printed. (The Ctrl-C case once
    did not end within 60 s in a fresh clone's two-process run, and left nothing to say why.)"""
    from test_cli import processes_tagged

    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        where = []
        for pid in sorted(processes_tagged(tag)):
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
                channel = Path(f"/proc/{pid}/wchan").read_text()
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120].decode()
                masks = " ".join(line.replace("\t", "") for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                                 if line.split(":")[0] in ("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt"))
            except OSError:
                continue
            where.append(f"{pid} {state} {channel or '-'} {masks} {command}")
        pytest.fail(f"not ended {timeout_s} s after the fault:\n" + "\n".join(where) + "\n" + log.read_text()[-2000:])


@pytest.mark.slow  # a `vramcal train` process of its own for each fault, stopped after its first checkpoint: ~15 s each
@pytest.mark.parametrize("fault", ["kill -9 of the worker", "Ctrl-C"])
def test_a_killed_or_interrupted_run_leaves_no_leaked_semaphore(setup, fault):
    """The training worker's progress bar held tqdm's default lock, a multiprocessing semaphore that a worker killed
    (from outside, or by its caller on Ctrl-C) never unlinks: multiprocessing's resource tracker warned "There
    appear to be 1 leaked semaphore objects" as the command ended. Ctrl-C here is SIGINT to the process group, as a
    terminal sends it."""
    from test_cli import processes_tagged

    args = ["--epochs", "1000", "--stride", "2", "--batch-size", "4", "--checkpoint-steps", "2"]
    name = fault.split()[0].lower().replace("-", "")
    run, log, tag = setup / name, setup / f"{name}.log", f"{name}-{os.getpid()}"
    unchecked = ["--profiles-dir", str(setup / "none")]  # no usable memory: the kill is no out-of-memory one
    with open(log, "w") as output:
        process = subprocess.Popen([sys.executable, "-m", "vramcal", *train_args(setup, name, *args), *unchecked],
                                   cwd=setup, stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "VRAMCAL_TEST_TAG": tag}, preexec_fn=as_a_terminal_starts_it)
    try:
        assert wait_for(lambda: (run / checkpoint.LAST).is_file(), 120, process), log.read_text()[-2000:]
        if fault == "Ctrl-C":
            os.killpg(process.pid, signal.SIGINT)
        else:
            (worker,) = [pid for server in children(process.pid) for pid in children(server)]
            os.kill(worker, signal.SIGKILL)
        assert ended(process, tag, log) == (130 if fault == "Ctrl-C" else 1), log.read_text()[-2000:]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert wait_for(lambda: not processes_tagged(tag), 5), processes_tagged(tag)
    text = log.read_text()
    assert "Traceback" not in text and "leaked semaphore" not in text, text[-2000:]
    (line,) = [line for line in text.splitlines() if line.startswith("Error")]
    assert line.endswith(f"continue with `vramcal train --resume --run-dir {run}`"), line
    if fault != "Ctrl-C":
        assert f"Killed: killed by SIGKILL (pid {worker})" in line, line


@pytest.mark.slow  # a `vramcal train` process of its own, stopped as its worker starts: ~10 s
def test_sigterm_before_the_first_checkpoint_says_nothing_was_saved(setup):
    """SIGTERM as the run starts, before any checkpoint: the line promised ``--resume``, which then found nothing;
    it says what is on disk now, and the same folder takes the run again."""
    run, log = setup / "early", setup / "early.log"
    with open(log, "w") as output:
        process = subprocess.Popen([sys.executable, "-m", "vramcal", *train_args(setup, "early", "--epochs", "1000")],
                                   cwd=setup, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert wait_for(lambda: (run / checkpoint.RUN).is_file(), 120, process), log.read_text()[-2000:]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 143, log.read_text()[-2000:]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    text = log.read_text()
    assert not checkpoint.has_checkpoint(run), "the run saved a checkpoint before the signal: the case is not tested"
    assert "Traceback" not in text and [line for line in text.splitlines() if line.startswith("Error")] == [
        f"Error: stopped by SIGTERM before the first checkpoint: nothing was saved; run the command again (the same "
        f"--run-dir {run} can be used)"]
    assert checkpoint.check_run_dir(run, resume=False) == run  # ... as it says


def kill_the_worker(row: dict) -> None:
    """``on_epoch`` of a one-process run: SIGKILL its training worker while the caller handles the epoch's row."""
    import multiprocessing

    (worker,) = multiprocessing.active_children()  # the training worker (its fork server is no Process of ours)
    os.kill(worker.pid, signal.SIGKILL)
    assert wait_for(lambda: not worker.is_alive(), 10)


def killed_at_an_epochs_end(setup, run: Path, profiles: str, usable_bytes: int | None = None) -> str:
    """The one line of a 2-epoch run whose worker :func:`kill_the_worker` kills at its first epoch's end (its plan's
    usable memory set to ``usable_bytes`` when given)."""
    import dataclasses

    from vramcal.train.config import TrainConfig
    from vramcal.train.loop import TrainError
    from vramcal.train.plan import plan_run, resolve
    from vramcal.train.runner import train

    config = TrainConfig(data=str(setup / "bars.parquet"), spec=SPEC, gpu="none", profiles_dir=str(setup / profiles),
                         batch_size=8, epochs=2)
    plan = plan_run(config, run, resolve(config, unchecked=True))
    if usable_bytes is not None:
        plan = dataclasses.replace(plan, sizing=dataclasses.replace(plan.sizing, usable_bytes=usable_bytes))
    with pytest.raises(TrainError) as failed:
        train(plan, echo=lambda line: None, on_epoch=kill_the_worker)
    assert saved_progress(run / checkpoint.LAST)["epoch"] == 1
    return str(failed.value)


def test_a_training_worker_killed_while_its_epoch_is_handled_is_named_as_killed(setup):
    """``kill -9`` of the one-process training worker at an epoch's end, while the caller handles the epoch's row
    (the worker waits for the answer): answering it met a closed pipe, and the run ended in "cannot read or write
    a file (Broken pipe)". It is a kill like any other: the signal, the pid, the checkpoint to resume from. (No
    profile: no usable memory whose reading would make the kill an out-of-memory one.)"""
    import re

    run = setup / "epoch-end"
    line = killed_at_an_epochs_end(setup, run, "none")
    assert re.fullmatch(rf"the training process failed \(Killed: killed by SIGKILL \(pid \d+\), and the kernel counted "
                        rf"no out-of-memory kill: something outside vramcal ended it \(a kill, a scheduler's "
                        rf"preemption\)\); the last good checkpoint is {run / checkpoint.LAST}; continue with "
                        rf"`vramcal train --resume --run-dir {run}`", line), line


def test_a_training_worker_killed_after_its_meter_read_usable_memory_ran_out_of_memory(setup):
    """The training worker sends its meter's readings as it goes (every few steps and at each epoch's end): killed
    after one at or above its plan's usable memory (1 byte here, below anything), the run ran out of memory."""
    import re

    line = killed_at_an_epochs_end(setup, setup / "epoch-end-usable", "profiles", usable_bytes=1)
    assert re.match(rf"the training process ran out of memory \(killed by SIGKILL \(pid \d+\) with {SIZE} held, at "
                    r"or above usable memory 1 B \(the meter's last reading\)\) and could not recover; the last good "
                    r"checkpoint is ", line), line


def test_a_worker_counts_a_dead_unreaped_caller_as_gone():
    """A caller killed under a parent that does not reap it (a container's first process may not) stays a zombie,
    which ``kill(pid, 0)`` still finds: the worker's watch reads its state and ends all the same."""
    from vramcal.environment import alive

    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        assert wait_for(lambda: not alive(pid), 5)  # dead, not yet reaped
        os.kill(pid, 0)  # ... which kill(pid, 0) alone took for alive
        assert alive(os.getpid())
    finally:
        os.waitpid(pid, 0)


# ------------------------------------------------------------------ a full disk during a probe (item 7a)

@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB file system of its own (tmpfs), so a test can fill it: what a full disk is, ENOSPC included."""
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small file system here (root is needed): {mounted.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> Path:
    """Fill ``disk`` to the last byte with one file; returns it (delete it to free the space)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for size in (1 << 20, 4096, 1):
            try:
                while os.write(fd, b"\0" * size):
                    pass
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def probe_args(setup: Path, disk: Path, *extra: str) -> list[str]:
    from test_train import SPEC_ARGS as TINY

    # the disk is under test, not the search: the shortest calibration that still verifies (no boundary trials, no
    # steady trial)
    return ["probe", "--gpu", "none", "--capacity", capacity(2**30), "--reserve", "0", *TINY, "--data",
            str(setup / "bars.parquet"), "--profiles-dir", str(disk / "profiles"), "--no-report", "--no-boundary",
            "--steady-steps", "0", *extra]


@pytest.mark.slow  # a real calibration of the tiny model in a process of its own, stopped, then finished: ~1 min
def test_a_probe_on_a_full_disk_stops_before_its_first_trial_and_during_one_keeps_its_trials(setup, small_disk):
    from vramcal.service.journal import SUFFIX

    previous = small_disk / "profiles" / "host" / "previous.json"
    previous.parent.mkdir(parents=True)
    previous.write_text('{"kept": true}\n')
    filler = fill(small_disk)
    # before: refused before any trial (a calibration can take an hour), naming the folder
    line = one_line_error(vramcal(setup, probe_args(setup, small_disk)))
    assert line.startswith(f"Error: cannot write profiles to {small_disk / 'profiles'}") and "No space left" in line
    assert "free space there, or choose another --out or --profiles-dir" in line
    filler.unlink()
    # during: the disk fills after the first trial; the probe stops, its trials kept in the journal
    log = setup / "probe.log"
    with open(log, "w") as output:
        probe = subprocess.Popen([sys.executable, "-m", "vramcal", *probe_args(setup, small_disk)], cwd=setup,
                                 stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    journals = lambda: list((small_disk / "profiles").rglob(f"*{SUFFIX}"))  # noqa: E731
    try:
        assert wait_for(journals, 180, probe), f"no journal in 180 s:\n{log.read_text()[-2000:]}"
        filler = fill(small_disk)
        probe.wait(timeout=300)
    finally:
        if probe.poll() is None:
            os.killpg(probe.pid, signal.SIGKILL)
    stopped = subprocess.CompletedProcess(probe.args, probe.returncode, "", log.read_text())
    line = one_line_error(stopped)
    (journal,) = journals()
    kept = json.loads(journal.read_text())["trials"]
    assert f"cannot write the trial journal {journal} (No space left on device)" in line
    assert "of them kept there; free space and run the same command again to continue from them" in line
    assert len(kept) >= 1 and previous.read_text() == '{"kept": true}\n'
    assert list((small_disk / "profiles").rglob("*.json")) == [previous]  # no profile, and no half of one
    filler.unlink()
    # the same command again: the kept trials are reused, the calibration finishes, the journal goes
    result = CliRunner().invoke(main, probe_args(setup, small_disk))
    assert result.exit_code in (0, 3), result.output
    assert f"{len(kept)} trial(s) of an earlier run of this calibration are in {journal}" in result.output
    from vramcal.profile import load_profile

    profile = load_profile(journal.with_name(journal.name.removesuffix(SUFFIX)))
    assert [t.to_dict() for t in profile.trials[:len(kept)]] == kept
    assert not journal.exists() and previous.read_text() == '{"kept": true}\n'


def test_a_folder_that_cannot_be_written_gets_the_advice_its_error_calls_for(tmp_path):
    """Issue 43 item 10: the advice follows the errno: a full disk asks for space (above), a file where the profiles
    folder must be says so, and neither asks the other's remedy."""
    from vramcal.files import os_advice

    (tmp_path / "afile").write_text("")
    result = CliRunner().invoke(main, ["probe", "--gpu", "none", *SPEC_ARGS, "--profiles-dir",
                                       str(tmp_path / "afile" / "sub"), "--no-report"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "(Not a directory): a file stands where a folder must be: choose another --out or --profiles-dir" in (
        result.output)
    assert "free space" not in result.output
    import errno

    assert os_advice(OSError(errno.EROFS, "Read-only file system"), "--out") == (
        "the file system is read-only: choose another --out")
    assert os_advice(OSError(errno.ENOENT, "No such file"), "--out") == ("no such file or folder: check the path, or "
                                                                         "choose another --out")


def test_a_data_limit_set_outside_vramcal_is_named_as_such(tmp_path):
    """Issue 43 item 11: under ``prlimit --data=600MiB`` a probe at 1.5 GiB said "not allowed to raise maximum
    limit" and blamed the step; the host's budget is now never more than that limit, and a --capacity above it,
    or a trainer's budget above it, is one line naming the limit."""
    limit = 600 * 2**20

    def limited():
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

    def run(*args):
        return subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True,
                              preexec_fn=limited, timeout=120)

    probe = run("-m", "vramcal", "probe", "--gpu", "none", "--capacity", capacity(3 * 2**29), *SPEC_ARGS,
                "--no-report")
    assert probe.returncode != 0 and "Traceback" not in probe.stderr, probe.stderr
    assert "its RLIMIT_DATA is 600.00 MiB, set outside vramcal" in probe.stderr
    shown = run("-c", "from vramcal.measure.device import host_device; d = host_device(); "
                      "print(d.total_bytes, d.total_source)")
    assert shown.stdout.split(maxsplit=1) == [str(limit), "RLIMIT_DATA set outside vramcal\n"], shown.stderr
    metered = run("-c", "from vramcal.measure.meters import HostMeter\n"
                        "try:\n    HostMeter(2**31)\nexcept Exception as e: print(type(e).__name__, e)")
    assert metered.stdout.startswith("MeterError this process's RLIMIT_DATA is 600.00 MiB"), metered.stdout


def test_an_address_space_limit_too_small_for_torch_is_one_line(tmp_path):
    """Issue 43 item 9: under ``prlimit --as=1GiB`` the worker's imports failed with a traceback and "Aborted!";
    the commands that run steps now say what the limit is and what to do, and the others still work."""
    def limited():
        resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30))

    def run(*args):
        return subprocess.run([sys.executable, "-m", "vramcal", *args], cwd=tmp_path, capture_output=True, text=True,
                              preexec_fn=limited, timeout=120)

    trained = run("train", "--gpu", "none", "--batch-size", "8")
    assert trained.returncode == 1 and "Traceback" not in trained.stderr, trained.stderr
    assert trained.stderr.strip().splitlines() == [
        "Error: this process may map at most 1.00 GiB of address space (RLIMIT_AS, set outside vramcal: ulimit -v, "
        "prlimit --as): torch and its libraries map more than that before a step; lift it to 2 GiB or more, and bound "
        "the run with --capacity instead"]
    assert run("show", "--config").returncode == 0
