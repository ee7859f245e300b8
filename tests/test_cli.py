"""The CLI through click's test runner: bad input gets one line, a non-zero exit, no traceback."""

import errno
import os
import re

import pytest
from click.testing import CliRunner
from host_budget import MIB, capacity, worker_data_bytes

from vramcal.cli import main
from vramcal.units import format_bytes, parse_bytes

from fakes import L4, fake_nvml


def invoke(*args):
    result = CliRunner().invoke(main, list(args))
    assert "Traceback" not in result.output
    return result


def one_line_error(result):
    lines = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(lines) == 1, result.output
    return lines[0]


def test_help_lists_the_commands():
    result = invoke("--help")
    assert result.exit_code == 0 and "probe" in result.output and "show" in result.output
    assert "-q, --quiet" in result.output and "-v, --verbose" in result.output
    both = invoke("--quiet", "--verbose", "show", "x.json")
    assert both.exit_code == 2 and "-q and -v contradict each other" in both.output


@pytest.mark.parametrize("args, message", [
    (["--headdim", "48"], "not divisible by headdim 48: use headdim in"),
    (["--seq-len", "100"], "seq_len 100 is not a multiple of chunk_size 64: use seq_len 64 or 128"),
    (["--chunk-size", "48", "--seq-len", "96"], "chunk_size 48 is not a power of two: use 32 or 64"),
    (["--capacity", "lots"], "cannot read 'lots' as a size"),
    (["--capacity", "1.5"], "1.5 is below the minimum of 1.00 MiB; a number without a unit is bytes: write a unit"),
    (["--margin", "1.5"], "--margin"),
    (["--dtype", "fp8"], "--dtype"),
    (["--d-model", "0"], "--d-model"),
])
def test_nonsense_options_exit_2_with_one_line(args, message):
    result = invoke("probe", "--gpu", "none", *args)
    assert result.exit_code == 2
    assert message in one_line_error(result)


def test_gpu_index_that_does_not_exist(monkeypatch):
    monkeypatch.setattr("vramcal.measure.device.load_nvml", lambda: fake_nvml([L4]))
    result = invoke("probe", "--gpu", "7")
    assert result.exit_code == 1
    assert "--gpu 7: this machine has 1 GPU(s) (indices: 0)" in one_line_error(result)
    result = invoke("probe", "--gpu", "GPU-00000000-unknown")
    assert result.exit_code == 1 and "no GPU with that index or UUID" in one_line_error(result)


def test_gpu_all_plans_every_card_before_any_trial(monkeypatch):
    """With two GPUs the data options were taken (popped) for the first card's plan and the second's raised
    KeyError (a traceback); an unwritable profiles folder stops both plans before any trial, in one line."""
    from fakes import H200

    monkeypatch.setattr("vramcal.measure.device.load_nvml", lambda: fake_nvml([L4, H200]))
    result = invoke("probe", "--gpu", "all", "--profiles-dir", "/proc/vramcal-profiles")
    assert result.exit_code == 1 and "cannot write profiles" in one_line_error(result), result.output


def test_bf16_on_the_host_and_a_capacity_too_small_for_the_reserve():
    result = invoke("probe", "--gpu", "none", "--dtype", "bf16-autocast")
    assert result.exit_code == 1 and "bf16-autocast is for CUDA GPUs" in one_line_error(result)
    result = invoke("probe", "--gpu", "none", "--capacity", "256MiB")
    assert result.exit_code == 1 and "leaves no usable memory" in one_line_error(result)


def test_a_capacity_smaller_than_one_sample(tmp_path):
    result = invoke("probe", "--gpu", "none", "--capacity", capacity(700 * MIB, margin=0.5), "--reserve", "0",
                    "--margin", "0.5", "--out", str(tmp_path / "p.json"))
    assert result.exit_code == 1
    line = one_line_error(result)
    assert "batch_size 1 does not fit in the usable" in line
    # how large a budget batch_size 1 alone needs: its peak over the usable half (--margin 0.5, no reserve)
    peak, need = re.search(r"its peak was ([\d.]+ [KMG]iB)\); give a larger --capacity \(batch_size 1 alone needs "
                           r"([\d.]+ [KMG]iB) with this reserve and margin", line).groups()
    peak, need = parse_bytes(peak.replace(" ", "")), parse_bytes(need.replace(" ", ""))
    assert abs(need - 2 * peak) <= 0.01 * need  # as printed: 3 significant figures
    assert not (tmp_path / "p.json").exists()


def test_a_capacity_below_what_a_trial_process_holds_before_its_step(tmp_path):
    """A budget under the data segment a worker holds before it runs anything (the interpreter, torch and
    the rest of the preload) fits no batch size, and the line says so: it is neither the step's failure nor
    whichever allocation happened to fail first (with the CUDA build of torch: a parquet reader's thread,
    reported as 'failed ... before any memory limit: fix the step')."""
    below = worker_data_bytes() // 2
    result = invoke("probe", "--gpu", "none", "--capacity", str(below), "--reserve", "0", "--margin", "0",
                    "--out", str(tmp_path / "p.json"))
    assert result.exit_code == 1 and "  batch_size      1  oom" in result.output  # the trial's line
    quiet = invoke("-q", "probe", "--gpu", "none", "--capacity", str(below), "--reserve", "0", "--margin", "0",
                   "--out", str(tmp_path / "p.json"))
    assert quiet.exit_code == 1 and "batch_size      1" not in quiet.output  # -q: no line per trial, the error stays
    assert one_line_error(quiet) == one_line_error(result)
    line = one_line_error(result)
    assert "batch_size 1 does not fit in the usable" in line and "give a larger --capacity" in line
    assert f"the host budget {format_bytes(below)} is below the " in line
    assert "this process held before its step" in line
    assert not (tmp_path / "p.json").exists()


def test_profiles_folder_that_is_a_file(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    result = invoke("probe", "--gpu", "none", "--profiles-dir", str(blocker / "sub"))
    assert result.exit_code == 1 and "cannot write profiles" in one_line_error(result)


@pytest.mark.parametrize("content, message", [
    ('{"schema_version": 2, "device": ', "not valid JSON"),
    ('{"schema_version": 99}', "schema_version 99 is not 2"),
    ('{"schema_version": 1}', "schema_version 1 is not 2"),
    ('{"schema_version": 2, "device": {}}', "model is missing"),
    ('{"hello": "world"}', "it is not a vramcal profile (it has no schema_version, device or trials)"),
    ('[1, 2]', "its top level is a list, not a JSON object: it is not a vramcal profile; re-run `vramcal probe`"),
    ("\x00\x01binary", "not valid JSON"),
])
def test_show_refuses_a_corrupt_profile(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    result = invoke("show", str(path))
    assert result.exit_code == 1 and message in one_line_error(result)


def test_show_missing_profile():
    result = invoke("show", "/nonexistent/profile.json")
    assert result.exit_code == 1 and "does not exist" in one_line_error(result)


def test_atomic_writes_leave_the_usual_file_mode_and_no_temporary_files(tmp_path):
    from vramcal.files import atomic_write_text

    mask = os.umask(0o022)
    try:
        target = tmp_path / "sub" / "file.json"
        atomic_write_text(target, "{}\n")
        atomic_write_text(target, '{"a": 1}\n')
    finally:
        os.umask(mask)
    assert target.read_text() == '{"a": 1}\n'
    assert target.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in target.parent.iterdir()] == ["file.json"]


@pytest.mark.parametrize("links", [True, False], ids=["hard-links", "no-hard-links"])
def test_a_save_stopped_between_any_two_of_its_renames_leaves_the_file_whole(tmp_path, monkeypatch, links):
    """A checkpoint's save keeps the previous version (``keep_previous``); a kill between its renames once left
    no ``checkpoint-last.pt`` at all (the old one renamed away, the new one not yet in place: seen in a test of a
    killed run under load). With hard links the file is whole at every step; without them (the fallback) the
    previous version is."""
    from vramcal import files

    target, previous = tmp_path / "checkpoint-last.pt", tmp_path / "checkpoint-prev.pt"
    if not links:
        monkeypatch.setattr(files.os, "link", lambda *a: (_ for _ in ()).throw(OSError(errno.EPERM, "no links")))
    real_replace = files.os.replace
    for stop_at in (0, 1):
        target.write_bytes(b"old")
        previous.unlink(missing_ok=True)
        calls = []

        def replace(source, destination, calls=calls, stop_at=stop_at):
            if len(calls) == stop_at:
                raise KeyboardInterrupt  # the process stops here
            calls.append(destination)
            real_replace(source, destination)

        monkeypatch.setattr(files.os, "replace", replace)
        with pytest.raises(KeyboardInterrupt):
            files.atomic_write(target, lambda handle: handle.write(b"new"), keep_previous=previous)
        monkeypatch.setattr(files.os, "replace", real_replace)
        if links or stop_at == 0:
            assert target.read_bytes() == b"old"
        else:
            assert not target.exists() and previous.read_bytes() == b"old"
        assert not [p.name for p in tmp_path.glob(".*.tmp")]  # nothing left for a resume to clean up
    files.atomic_write(target, lambda handle: handle.write(b"new"), keep_previous=previous)
    assert (target.read_bytes(), previous.read_bytes()) == (b"new", b"old")


@pytest.mark.parametrize("path, value, message", [
    (("limits", "conservative_batch_size"), "lots",
     "limits.conservative_batch_size = 'lots' is a string, not a whole number"),
    (("limits", "safe_batch_size"), True, "limits.safe_batch_size = true is true/false, not a whole number"),
    (("limits", "safe_batch_size"), -5, "limits.safe_batch_size = -5 is not >= 0"),
    (("trials", 0, "status"), "fine", "trials[0].status = 'fine' is not one of 'ok', 'oom', 'timeout', 'error'"),
    (("device", "total_bytes"), 1.5, "device.total_bytes = 1.5 is not a whole number"),
    (("fit", "slope_bytes_per_sample"), None, "fit.slope_bytes_per_sample is null, not a number"),
    (("fit", "slope_bytes_per_sample"), float("nan"), "fit.slope_bytes_per_sample = nan is not a finite number"),
    (("fit", "overhead_bytes"), float("inf"), "fit.overhead_bytes = inf is not a finite number"),
    (("fit", "batch_sizes", 1), "two", "fit.batch_sizes[1] = 'two' is a string, not a whole number"),
    (("limits", "usable_bytes"), 10**13, "limits.usable_bytes = 10000000000000 does not follow"),
    (("verification", "safe", "passed"), False, "verification.safe.passed = false contradicts its peak"),
    (("verification", "safe", "batch_size"), 3, "verification.safe.batch_size = 3 is not the safe batch size"),
])
def test_a_profile_with_a_bad_field_is_refused_in_one_line_naming_it(tmp_path, path, value, message):
    import json

    from vramcal.profile import save_profile

    from profiles_for_tests import gpu_profile

    good = save_profile(gpu_profile(), tmp_path / "good.json")
    data = json.loads(good.read_text())
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    for command in (["show", str(bad)], ["limits", str(bad)], ["report", str(bad), "--out", str(tmp_path)]):
        result = invoke(*command)
        assert result.exit_code == 1
        assert f"profile {bad}" in one_line_error(result) and message in one_line_error(result)


def test_hand_edited_limits_that_contradict_the_fit_are_refused(tmp_path):
    """safe = conservative = 10**9 in a file whose fit allows ~60: refused, naming the field and the ceiling (the
    larger of the fit's point estimate and the largest size that fitted, below the failure)."""
    import json

    from vramcal.profile import save_profile

    from profiles_for_tests import gpu_profile

    profile = gpu_profile()
    data = json.loads(save_profile(profile, tmp_path / "good.json").read_text())
    data["limits"]["safe_batch_size"] = data["limits"]["conservative_batch_size"] = 10**9
    for entry in data["verification"].values():
        entry["batch_size"] = 10**9
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    result = invoke("show", str(bad))
    assert result.exit_code == 1
    from vramcal.units import format_bytes

    point = profile.limits.point_safe_batch_size
    assert (f"limits.safe_batch_size = 1000000000 is not below the failed batch size "
            f"{profile.limits.failed_batch_size}") in one_line_error(result)
    data["limits"]["failed_batch_size"] = None  # and without the failure, the ceiling names the point estimate
    data["trials"] = [t for t in data["trials"] if t["status"] == "ok" and t["batch_size"] < 128]
    bad.write_text(json.dumps(data))
    largest = max(t["batch_size"] for t in data["trials"])
    assert (f"limits.safe_batch_size = 1000000000 is above what the file's own evidence allows ({point}: the fit's "
            f"point estimate in {format_bytes(profile.limits.usable_bytes)} is {point}, the largest batch size whose "
            f"trials fitted {largest})") in one_line_error(invoke("show", str(bad)))


def test_an_unwritable_reports_folder_fails_before_any_trial(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    result = invoke("probe", "--gpu", "none", "--out", str(tmp_path / "p.json"), "--reports-dir", str(blocker / "r"))
    assert result.exit_code == 1 and "cannot write reports" in one_line_error(result)
    assert "batch_size" not in result.output  # no trial ran


def processes_tagged(tag: str) -> set[int]:
    """The pids of processes alive now whose environment holds ``VRAMCAL_TEST_TAG=tag`` (what a command started
    with the tag left running: its children inherit the environment)."""
    found = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"VRAMCAL_TEST_TAG={tag}".encode() in f.read().split(b"\0"):
                    found.add(int(entry))
        except (OSError, ValueError):
            continue
    return found


def test_a_command_that_stops_early_leaves_no_worker_server_behind(tmp_path):
    """probe and train start their workers' fork server first (its imports overlap the command's own checks); a
    command that stops on a bad input ends it as it exits, rather than leave it importing torch for seconds."""
    import subprocess
    import sys
    import time
    import uuid

    for command in ("train", "probe"):
        tag, log = uuid.uuid4().hex, tmp_path / f"{command}.log"
        with open(log, "w") as output:  # a file, not a pipe: a pipe's reader would wait for the server too
            done = subprocess.run([sys.executable, "-m", "vramcal", command, "--gpu", "none", "--data",
                                   str(tmp_path / "missing.parquet")], stdout=output, stderr=subprocess.STDOUT,
                                  timeout=120, env={**os.environ, "VRAMCAL_TEST_TAG": tag})
        assert done.returncode != 0 and "Traceback" not in log.read_text(), log.read_text()
        deadline = time.monotonic() + 2  # the signal's delivery; left alone, its imports go on for seconds
        while processes_tagged(tag) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_tagged(tag) == set(), command


@pytest.mark.parametrize("command, flag, fix", [
    (("probe", "--gpu", "none", "--ddp-backend", "gloo"), "--ddp-backend", "--nproc"),
    (("train", "--gpu", "none", "--bucket-cap-mb", "50"), "--bucket-cap-mb", "--nproc-per-node"),
    (("train", "--gpu", "none", "--static-graph"), "--static-graph", "--nproc-per-node"),
    (("probe", "--gpu", "none", "--strategy", "fsdp"), "--strategy", "--nproc"),
    (("probe", "--gpu", "none", "--oversubscribe"), "--oversubscribe", "--nproc"),
    (("train", "--gpu", "none", "--oversubscribe"), "--oversubscribe", "--nproc-per-node"),
])
def test_ddp_options_for_one_process_are_refused_not_dropped(command, flag, fix):
    """They used to be dropped without a word: the user believed the run used them."""
    result = invoke(*command)
    assert result.exit_code == 2 and f"Invalid value for {flag}: is for a world of 2 or more ranks, and this is " \
        f"one process: add {fix} N, or leave it out" in result.output, result.output
