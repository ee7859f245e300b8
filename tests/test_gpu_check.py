"""The GPU check (scripts/gpu_check.py): its guards, time plan and rules without trials, and real runs on the host.

The rules (how much a calibration may run, the boundary bisection, the epoch cut) are pure functions tested on
recorded trials; the guards run plain Python steps. Two real runs on the host (marked slow) run the script as the
device does, with a step made to fail: one by ``--inject-error``, one by a budget in which one sample cannot fit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from host_budget import capacity

from vramcal.records import Trial

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))
import gpu_check  # noqa: E402
import gpu_check_policy as policy  # noqa: E402
import gpu_check_run as runs  # noqa: E402

MIB = 2**20


# ------------------------------------------------------------------------------------- the rules

def test_a_calibrations_trials_and_steady_steps_derive_from_the_time_given():
    # 35 s on the host: (35 - 10) / 3 = 8 trials' room, all of it trials (the least the search needs), no steady trial
    assert policy.trial_settings(policy.HOST, 35) == {"max_trials": 8, "steady_steps": 0, "timeout_s": 11.7}
    # 70 s: room for 20 trials: the cap of 16, and 4 trials' time for the steady trial = 16 steps
    assert policy.trial_settings(policy.HOST, 70) == {"max_trials": 16, "steady_steps": 16, "timeout_s": 23.3}
    # plenty: the caps (the product's 40 steady steps on the host, half on a GPU), and the per-trial cap
    assert policy.trial_settings(policy.HOST, 1000) == {"max_trials": 16, "steady_steps": 40, "timeout_s": 120}
    assert policy.trial_settings(policy.CUDA, 1000)["steady_steps"] == 20
    # too little: still the least the search needs, and trials of at least 10 s
    assert policy.trial_settings(policy.CUDA, 20) == {"max_trials": 8, "steady_steps": 0, "timeout_s": 10.0}
    assert policy.FUSED.max_trials == 8 and policy.FUSED.steady_steps == 10 and policy.FUSED.given_s == 150


def trial(batch_size, status="ok", peak_mib=None, wall_s=1.0, purpose="grow"):
    return Trial(batch_size, status, None if peak_mib is None else int(peak_mib * MIB), purpose=purpose, wall_s=wall_s,
                 startup_s=0.1, build_s=0.2, step_s=0.1,
                 error=None if status == "ok" else f"Traceback ...\nRuntimeError: {status} at {batch_size}")


class Device:
    """The bisection's trials at the hardware boundary: peak = 100 MiB + 1 MiB per sample on a 1000 MiB device,
    with scripted statuses for some sizes (each use pops one)."""

    def __init__(self, scripted=None):
        self.scripted, self.sizes = scripted or {}, []

    def run(self, size):
        self.sizes.append(size)
        if self.scripted.get(size):
            status, peak = self.scripted[size].pop(0)
            return trial(size, status, peak)
        peak = 100 + size
        return trial(size, "ok", peak) if peak <= 1000 else trial(size, "oom")


CALIBRATION = [trial(1, peak_mib=101), trial(8, peak_mib=108), trial(512, peak_mib=612, wall_s=2.0),
               trial(1100, "oom", purpose="boundary"), trial(860, "timeout", purpose="boundary")]


def test_the_bisection_finds_the_boundary_by_memory_alone():
    device = Device()
    found = policy.bisect_boundary(CALIBRATION, 1000 * MIB, 905.0, device.run, lambda: 100.0)
    # 512 fits and 1100 ran out of memory in the calibration; the true edge is 900; 1 % of the lower bound is the end
    assert device.sizes == [806, 953, 879, 916, 897, 906]
    assert (found["largest_fitting"], found["smallest_over"], found["complete"]) == (897, 906, True)
    assert found["ignored"] == [(860, "timeout")]  # the calibration's timeout is not an upper bound
    assert found["error_pct"] == pytest.approx(100 * (905 - found["largest_fitting"]) / found["largest_fitting"])


def test_an_error_near_the_limit_is_retried_once_and_a_peak_above_the_device_does_not_fit():
    device = Device({806: [("error", None)], 953: [("ok", 1001)]})  # 953 finishes but peaks past the device
    found = policy.bisect_boundary(CALIBRATION, 1000 * MIB, 905.0, device.run, lambda: 100.0)
    assert device.sizes == [806, 806, 953, 879, 916, 897, 906] and found["largest_fitting"] == 897 and found["complete"]
    assert [(t["batch_size"], t["status"], t["attempt"]) for t in found["trials"][:3]] == [
        (806, "error", 1), (806, "ok", 2), (953, "ok", 1)]


def test_an_error_or_timeout_twice_stops_the_bisection_and_never_becomes_the_boundary():
    device = Device({879: [("error", None), ("timeout", None)]})
    found = policy.bisect_boundary(CALIBRATION, 1000 * MIB, 905.0, device.run, lambda: 100.0)
    assert (found["largest_fitting"], found["smallest_over"], found["complete"]) == (806, 953, False)
    assert found["stopped_because"].startswith("batch 879 ended in timeout twice (RuntimeError: timeout at 879): "
                                               "not a memory outcome")


def test_the_bisection_starts_a_trial_only_when_the_time_left_covers_it():
    left = iter([100.0, 1.0])  # 806 runs and takes 1 s: 953, the next, needs ~1.2 s
    found = policy.bisect_boundary(CALIBRATION, 1000 * MIB, 905.0, Device().run, lambda: next(left))
    assert found["complete"] is False and found["stopped_because"] == "no time for batch 953 (~1 s, 1 s left)"
    assert len(found["trials"]) == 1


def test_an_epoch_is_cut_to_the_steps_the_trials_say_fit():
    trials = [trial(1, peak_mib=101), trial(100, peak_mib=200)]  # 0.1 s per step at 100, start + build 0.3 s
    assert policy.epoch_cut(trials, 100, 1000, given_s=10) is None  # 10 steps x 0.15 s + 0.3 s fit
    assert policy.epoch_cut(trials, 100, 100_000, given_s=10) == int((10 - 0.3) / 0.15) - 1
    assert policy.epoch_cut([], 100, 100_000, given_s=10) is None  # nothing to estimate from


def test_the_steady_trial_gets_the_steps_that_fit_a_third_of_the_time_left():
    trials = [trial(1, peak_mib=101), trial(100, peak_mib=200)]  # 0.1 s per step at 100; start + build 0.3 s
    # a third of 15 s, less 0.3 s and two steps of 1.2 x 0.1 s, in steps of 0.12 s
    assert policy.steady_steps_that_fit(trials, 100, 15.0, most=40) == (int((5 - 0.3 - 0.24) / 0.12), None)
    assert policy.steady_steps_that_fit(trials, 100, 1000.0, most=40) == (40, None)
    assert policy.steady_steps_that_fit(trials, 100, 1.2, most=40) == (0, "1 s left: not 2 steps of 0.1 s in a "
                                                                           "third of it")
    assert policy.steady_steps_that_fit(trials, 50, 1000.0, most=40) == (0, "no finished trial at batch 50 to time "
                                                                            "it by")
    assert policy.steady_steps_that_fit(trials, 100, 1000.0, most=0)[0] == 0


def test_first_and_later_trials():
    rows = [policy.trial_row(trial(1, peak_mib=101, wall_s=30.0), 2), policy.trial_row(trial(8, peak_mib=108), 2),
            policy.trial_row(trial(64, peak_mib=164, wall_s=3.0), 2)]
    assert rows[0]["rest_s"] == pytest.approx(30.0 - 0.1 - 0.2 - 2 * 0.1)
    times = policy.first_and_later(rows)
    assert (times["first_s"], times["later_median_s"], times["later"]) == (30.0, 2.0, 2)


# ------------------------------------------------------------------------------------- the guards

def step(name, body, estimate_s=1.0, weight=1.0, needs=()):
    return runs.Step(name, {"host": (estimate_s, weight)}, body, needs=needs)


def read(out: Path) -> dict:
    return json.loads((out / runs.RESULTS).read_text())


def test_each_step_is_written_when_it_ends_and_a_failure_does_not_stop_the_next(tmp_path):
    check = runs.Check(tmp_path / "out", tmp_path / "work", budget_s=60, command="test")
    seen = {}

    def second(given_s, partial):
        seen["on disk"] = read(tmp_path / "out")["steps"]  # the first step's record, written before this one ran
        partial["trials"] = [1, 2]
        raise ValueError("a failure\nits second line")

    def third(given_s, partial):
        return {"summary": "ran after the failure", "given_s": given_s}

    run_steps = [step("first", lambda g, p: {"summary": "fine"}), step("second", second),
                 step("third", third, needs=("first",)), step("fourth", third, needs=("second",)),
                 step("fifth", third, estimate_s=1000)]
    runs.run_steps(check, run_steps, lambda: "host")
    assert seen["on disk"]["first"]["status"] == "ok"
    results = read(tmp_path / "out")
    steps = results["steps"]
    assert results["order"] == ["first", "second", "third", "fourth", "fifth"]
    assert [steps[name]["status"] for name in results["order"]] == ["ok", "error", "ok", "skipped", "skipped"]
    assert steps["second"]["error"] == "ValueError: a failure" and steps["second"]["partial"] == {"trials": [1, 2]}
    assert steps["second"]["traceback"][-1] == "its second line"
    assert steps["fourth"]["reason"] == "needs the second step, which ended error"
    assert steps["fifth"]["reason"].startswith("needs ~1000 s, ")
    assert results["finished"] is True
    summary = (tmp_path / "out" / runs.SUMMARY).read_text()
    assert "- **third** (ok, " in summary and "ran after the failure" in summary
    assert "- **second** (error, " in summary and "ValueError: a failure" in summary
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["GPU_CHECK.md", "gpu_check.json"]


def test_the_time_left_is_shared_by_weight_and_a_step_is_stopped_when_its_time_is_spent(tmp_path):
    check = runs.Check(tmp_path / "out", tmp_path / "work", budget_s=runs.FINISH_S + 3.0, command="test")
    given = {}

    def slow(given_s, partial):
        given["slow"] = given_s
        partial["done"] = "half"
        time.sleep(10)
        return {}

    def after(given_s, partial):
        given["after"] = given_s
        return {}

    started = time.monotonic()
    runs.run_steps(check, [step("slow", slow, estimate_s=0.5, weight=1), step("after", after, estimate_s=0.1,
                                                                              weight=2)], lambda: "host")
    assert time.monotonic() - started < 4.0
    steps = read(tmp_path / "out")["steps"]
    assert given["slow"] == pytest.approx(1.0, abs=0.1)  # a third of the 3 s: its weight against the next one's
    assert steps["slow"]["status"] == "stopped" and steps["slow"]["partial"] == {"done": "half"}
    assert steps["slow"]["reason"] == "ran past the 1 s it was given"
    assert steps["after"]["status"] == "ok" and given["after"] == pytest.approx(2.0, abs=0.2)


def test_a_step_that_the_later_ones_need_may_use_their_share(tmp_path):
    check = runs.Check(tmp_path / "out", tmp_path / "work", budget_s=runs.FINISH_S + 10.0, command="test")
    given = {}

    def record(name):
        def body(given_s, partial):
            given[name] = given_s
            return {}
        return body

    runs.run_steps(check, [step("setup", record("setup"), estimate_s=0.5, weight=0),
                           step("first", record("first"), weight=1, needs=("setup",)),
                           step("needs-it", record("second"), weight=1, needs=("first",)),
                           step("other", record("third"), weight=2)], lambda: "host")
    assert given["setup"] == 0.5  # no weight: its estimate, however many steps need it
    assert given["first"] == pytest.approx(10 * 2 / 4, abs=0.2)  # its weight and its dependent's, of 4


def test_sigterm_stops_the_step_in_progress_and_skips_the_rest(tmp_path):
    check = runs.Check(tmp_path / "out", tmp_path / "work", budget_s=60, command="test")

    def terminated(given_s, partial):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        return {}

    runs.run_steps(check, [step("running", terminated), step("next", lambda g, p: {})], lambda: "host")
    steps = read(tmp_path / "out")["steps"]
    assert steps["running"]["status"] == "stopped" and "SIGTERM" in steps["running"]["reason"]
    assert steps["next"] == {"status": "skipped", "reason": "the check was stopped (SIGTERM: the check's outer time "
                                                            "limit)"}
    assert signal.getsignal(signal.SIGTERM) is not runs._terminate  # the previous handler is back


def test_bad_options_are_one_line_and_exit_2(capsys):
    for argv, text in [(["--out", "x", "--capacity", "lots"], "--capacity: cannot read 'lots' as a size"),
                       (["--out", "x", "--budget-s", "0"], "--budget-s must be positive"),
                       (["--out", "x", "--inject-error", "nothing"], "invalid choice: 'nothing'")]:
        with pytest.raises(SystemExit) as stopped:
            gpu_check.parse_args(argv)
        assert stopped.value.code == 2 and text in capsys.readouterr().err


# ------------------------------------------------------------------------------ real runs on the host

def check_run(*args: str, timeout_s: float = 240) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(SCRIPTS / "gpu_check.py"), "--gpu", "none", "--spec", "tiny", *args],
                          capture_output=True, text=True, timeout=timeout_s, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    return done, time.monotonic() - started


@pytest.mark.slow
def test_a_step_made_to_fail_leaves_every_other_steps_result(tmp_path):
    """--inject-error boundary: the calibration before it and the training run after it still run and are written,
    and with no bars file the check writes synthetic bars and says so."""
    out = tmp_path / "out"
    done, wall_s = check_run("--out", str(out), "--work", str(tmp_path / "work"), "--capacity", capacity(600 * MIB),
                             "--reserve", "0", "--budget-s", "180", "--inject-error", "boundary",
                             "--data", str(tmp_path / "no-bars.parquet"))
    assert done.returncode == 1, done.stdout + done.stderr  # a step ended in an error
    results = json.loads((out / "gpu_check.json").read_text())
    steps = results["steps"]
    assert results["order"] == list(gpu_check.STEPS) and results["finished"] is True
    status = {name: entry["status"] for name, entry in steps.items()}
    assert status == {"device": "ok", "data": "ok", "estimate": "ok", "default": "ok", "boundary": "error",
                      "train": "ok", "chunk_size": "ok", "large": "skipped", "fused": "skipped"}, \
        json.dumps(steps, indent=1)[:3000]
    assert steps["boundary"]["error"] == ("InjectedError: injected by --inject-error boundary (a rehearsal of a "
                                          "failing step)")
    assert steps["data"]["result"]["synthetic"] is True and Path(steps["data"]["result"]["path"]).is_file()
    calibration = steps["default"]["result"]
    assert calibration["verified"] is True and calibration["trials"] == len(calibration["sequence"]) >= 5
    steady = calibration["steady"]  # after the calibration, sized to the time left
    assert (steady["ran"] and steady["steps"] >= 2 and steady["trial"]["purpose"] == "steady") or steady["reason"]
    assert calibration["trial_wall_s"]["first_s"] > 0 and calibration["trial_wall_s"]["later"] >= 4
    estimate = calibration["estimate"]  # made before the trials, held against the verified safe size's peak
    if "default" in steps["estimate"]["result"]["estimates"]:  # else the estimate step's time ran out first
        (row,) = estimate["rows"]
        assert row["card"].startswith("host") and estimate["measured_safe"] == calibration["safe"]
        assert estimate["error"] == row["estimated_peak_at_safe"] / estimate["measured_peak"] - 1
        assert estimate["bytes_per_sample"] == {"host": row["slope_bytes_per_sample"]}
    assert steps["train"]["result"]["batch_size"] == calibration["conservative"]
    assert steps["train"]["result"]["measured_peak_bytes"] > 0
    chunks = steps["chunk_size"]["result"]  # the tiny spec's seq_len 32: chunk sizes 16 and 32, on the host's path
    assert chunks["implementation"] == "transformers" and [r["chunk_size"] for r in chunks["rows"]] == [16, 32]
    assert chunks["batch_sizes"][1] == max(2, calibration["conservative"] // 2)
    ran = [r for r in chunks["rows"] if r["samples_per_s"] is not None]  # the trials the step's time allowed
    assert ran and all(r["trials"][str(chunks["batch_sizes"][1])][0]["status"] == "ok" for r in ran), chunks
    summary = (out / "GPU_CHECK.md").read_text()
    for name in gpu_check.STEPS:
        assert f"- **{name}** ({status[name]}" in summary
    assert "synthetic 1-s bars" in summary and "InjectedError" in summary
    assert sorted(p.name for p in out.iterdir()) == ["GPU_CHECK.md", "gpu_check.json", "gpu_check_files.tar.gz"]
    with tarfile.open(out / "gpu_check_files.tar.gz") as bundle:
        names = bundle.getnames()
    assert any(n.startswith("profiles/") and n.endswith(".json") for n in names)
    assert any(n.startswith("reports/") and n.endswith(".md") for n in names)
    assert results["elapsed_s"] <= 180 and wall_s < 180 + 20
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_a_spec_that_cannot_fit_is_one_steps_error_and_the_rest_say_why_they_did_not_run(tmp_path):
    """A budget below one sample's need: the calibration fails for real (vramcal's CalibrationError), the steps
    that need it are skipped with the reason, and the default work folder is <out>.work."""
    out = tmp_path / "out"
    done, _ = check_run("--out", str(out), "--capacity", capacity(420 * MIB), "--reserve", "0", "--budget-s", "60",
                        "--data", str(ROOT / "tests" / "no-such-bars.parquet"), timeout_s=90)
    assert done.returncode == 1, done.stdout + done.stderr
    steps = json.loads((out / "gpu_check.json").read_text())["steps"]
    assert steps["default"]["status"] == "error" and steps["default"]["error"].startswith("CalibrationError: ")
    assert steps["default"]["partial"]["trials"][0]["batch_size"] == 1
    assert steps["boundary"] == {"status": "skipped", "reason": "needs the default step, which ended error"}
    assert steps["train"] == {"status": "skipped", "reason": "needs the default step, which ended error"}
    assert (tmp_path / "out.work" / "bars-synthetic.parquet").is_file()


def test_a_results_file_that_cannot_be_written_is_one_line_and_the_check_goes_on(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / runs.SUMMARY).mkdir()  # a folder where GPU_CHECK.md should go: that write fails, the JSON's does not
    check = runs.Check(out, tmp_path / "work", budget_s=60, command="test")
    runs.run_steps(check, [step("first", lambda g, p: {}), step("second", lambda g, p: {})], lambda: "host")
    assert read(out)["order"] == ["first", "second"] and read(out)["finished"] is True
    err = capsys.readouterr().err.splitlines()
    assert err and all(line.startswith(f"could not write {out / runs.SUMMARY} (") for line in err)
