"""Every failure ends in one clear line, and nothing is lost (issue 10): out-of-memory kinds in the trainer,
a failing tune trial, credentials in storage URLs, calibrations that end unverified, unwritable folders
(as root too), and NaN or infinity in every float option.

Faults are injected at the hardware boundary only: a loss or forward pass that raises the error a device
or allocator raises; everything else is the real code on a real tiny Mamba-2.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import test_train
import test_tune
import torch
import torch.distributed
from click.testing import CliRunner
from host_budget import capacity
from test_train import in_process, one_line_failure, rows, sgd
from test_tune import tune

from vramcal.cli import main
from vramcal.train import loop

setup, paths = test_train.setup, test_tune.paths  # fixtures: a run's data and profile; a tune's
# The allocation failures the trainer must survive, as each library words them (vramcal.oom).
OOM_KINDS = {
    "torch": lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    "host-malloc": lambda: RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't "
                                        "allocate memory: you tried to allocate 1073741824 bytes. Error code 12"),
    "python": lambda: MemoryError(),
    "cublas": lambda: RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    "cuda-runtime": lambda: RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously "
                                         "reported at some other API call"),
    "cudnn": lambda: RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    "triton": lambda: RuntimeError("Triton Error [CUDA]: out of memory"),
    "nccl": lambda: torch.distributed.DistBackendError(
        "NCCL error in: ProcessGroupNCCL.cpp:3699, unhandled cuda error (run with NCCL_DEBUG=INFO for details), "
        "NCCL version 2.27.3\nncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\n"
        "Cuda failure 2 'out of memory'"),
}
ONEDNN = "could not create a primitive"


def failing_loss(step, fails) -> list[int]:
    """``step.loss`` raises ``fails(micro_batch_size, calls)`` (an exception, or None to run)."""
    real, calls = step.loss, []

    def loss(model, batch):
        calls.append(batch[0].shape[0])
        error = fails(batch[0].shape[0], calls)
        if error is not None:
            raise error
        return real(model, batch)

    step.loss = loss
    return calls


@pytest.mark.parametrize("kind", sorted(OOM_KINDS))
def test_every_out_of_memory_kind_halves_the_micro_batch(setup, kind):
    plan, step = in_process(setup, f"oom-{kind}", batch_size=8, max_steps=1)
    calls = failing_loss(step, lambda size, calls: OOM_KINDS[kind]() if size == 8 else None)
    row = loop.Trainer(plan, step, echo=lambda line: None).run()
    assert calls == [8, 4, 4] and row["micro_batch_size"] == 4 and math.isfinite(row["train_loss"])
    (event,) = rows(plan.run_dir, "oom")
    assert (event["micro_batch_size_from"], event["micro_batch_size_to"]) == (8, 4)
    assert event["error"] == ("MemoryError" if kind == "python" else str(OOM_KINDS[kind]()).splitlines()[0][:200])


def test_onednn_failing_after_an_allocation_failure_is_out_of_memory(setup):
    """Under ``prlimit --data`` a trainer that hit one out-of-memory error fails the next allocation inside
    oneDNN with only "could not create a primitive"; it is the same memory shortage, so the fallback goes on
    halving. The same error with no allocation failure before it is a real error and ends the run."""
    plan, step = in_process(setup, "onednn", batch_size=8, max_steps=1)
    errors = {8: MemoryError(), 4: RuntimeError(ONEDNN)}
    calls = failing_loss(step, lambda size, calls: errors.get(size))
    row = loop.Trainer(plan, step, echo=lambda line: None).run()
    assert calls == [8, 4, 2, 2, 2, 2] and row["micro_batch_size"] == 2
    assert [e["error"] for e in rows(plan.run_dir, "oom")] == ["MemoryError", ONEDNN]

    plan, step = in_process(setup, "onednn-alone", batch_size=8, max_steps=1)
    failing_loss(step, lambda size, calls: RuntimeError(ONEDNN))
    with pytest.raises(RuntimeError, match=ONEDNN):
        loop.Trainer(plan, step, echo=lambda line: None).run()


def test_a_failed_micro_batch_leaves_no_gradient_behind(setup):
    """Batch 8: micro-batch 4's first half runs backward (its gradient accumulates) and the second half
    fails; the retry at 2 must start from zero gradients and scale each loss by its share. With SGD and no
    clipping (either would normalise a doubled gradient away) the weights after the step are the plain
    step's exactly; so are the gradients the optimizer saw."""
    seen = []

    def run(run: str, fails):
        plan, step = in_process(setup, run, batch_size=8, max_steps=1)
        sgd(step)
        step.max_grad_norm = None
        step.optimizer.register_step_pre_hook(lambda *_: seen.append(
            {n: p.grad.clone() for n, p in step.model.named_parameters() if p.grad is not None}))
        failing_loss(step, fails)
        loop.Trainer(plan, step, echo=lambda line: None).run()
        return step.model.state_dict()

    plain = run("plain", lambda size, calls: None)
    fell_back = run("fell-back", lambda size, calls: MemoryError() if size == 8 or (size == 4 and
                                                                                    calls.count(4) == 2) else None)
    for name, grad in seen[0].items():
        torch.testing.assert_close(seen[1][name], grad, rtol=1e-4, atol=1e-7)
    for name, value in plain.items():
        torch.testing.assert_close(fell_back[name], value, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------------------------ tune

@pytest.fixture()
def optuna_records():
    """What optuna logs (its own handler prints failed trials with their traceback)."""
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.DEBUG)
    handler.emit = records.append
    logger = logging.getLogger("optuna")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_a_failing_trial_fails_alone_and_the_study_writes_its_results(paths, monkeypatch, optuna_records):
    """Trial 0 crashes (a RuntimeError escaping the run), trial 1's run fails as the trainer reports it (a
    TrainError), trial 2 cannot make its folder (a real RunDirError); each fails with its one-line reason,
    and trials 3-5 run; the table, the failures and the best configuration are written."""
    import optuna
    from optuna.trial import TrialState

    from vramcal.train import runner
    from vramcal.train.errors import TrainError
    from vramcal.tune.storage import STUDY_DB
    from vramcal.tune.study import BEST_CONFIG, DEFAULT_STUDY_NAME, TRIALS_TABLE

    real_train = runner.train

    def train(plan, **kwargs):
        if plan.run_dir.name == "0000":
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nCompile with TORCH_USE_CUDA_DSA")
        if plan.run_dir.name == "0001":
            raise TrainError("the training process failed (SIGSEGV); no checkpoint was saved")
        return real_train(plan, **kwargs)

    monkeypatch.setattr(runner, "train", train)
    run_dir = paths["tmp"] / "failing"
    (run_dir / "trials").mkdir(parents=True)
    (run_dir / "trials" / "0002").write_text("a file where trial 2's folder goes")
    result = tune(paths, "--trials", "3", "--n-initial", "3", run="failing")
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    study = optuna.load_study(study_name=DEFAULT_STUDY_NAME, storage=f"sqlite:///{run_dir / STUDY_DB}")
    assert [t.state for t in study.trials] == [TrialState.FAIL] * 3 + [TrialState.COMPLETE] * 3, result.output
    reasons = [t.user_attrs["error"] for t in study.trials[:3]]
    assert reasons[0] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert reasons[1] == "the training process failed (SIGSEGV); no checkpoint was saved"
    assert reasons[2].startswith(f"cannot write to the run folder {run_dir / 'trials' / '0002'}")
    assert f"trial 0: fail, no validation ({reasons[0]})" in result.output
    table = (run_dir / TRIALS_TABLE).read_text()
    for number, reason in enumerate(reasons):
        assert f"trial {number} failed: {reason}" in table and f"trial {number} failed: {reason}" in result.output
    best = json.loads((run_dir / BEST_CONFIG).read_text())
    assert best["lr"] == min(study.trials[3:], key=lambda t: t.value).params["lr"]
    assert not [r for r in optuna_records if r.exc_info], "optuna printed a failed trial's traceback"


# ----------------------------------------------------------------------------------------- secrets

def tune_args(paths, run: str, *extra: str) -> list[str]:
    from test_train import SPEC_ARGS

    return ["tune", "--data", str(paths["data"]), "--profiles-dir", str(paths["profiles"]), "--gpu", "none",
            "--run-dir", str(paths["tmp"] / run), *SPEC_ARGS, "--epochs", "1", "--max-steps", "2", *extra]


SECRET = "s3cretPW"
SECRET_URL = f"postgresql://alice:{SECRET}@127.0.0.1:1/optuna"


@pytest.mark.parametrize("how", ["option", "environment"])
def test_a_storage_password_is_never_printed(paths, how):
    """The server cannot be reached (or its driver is missing): one line, the password hidden."""
    args = ["--storage", SECRET_URL] if how == "option" else []
    result = CliRunner().invoke(main, tune_args(paths, "secret-fail", *args),
                                env={"VRAMCAL_TUNE_STORAGE": SECRET_URL} if how == "environment" else {})
    line = one_line_failure(result)
    assert line.startswith("Error: cannot open the study storage postgresql://alice:***@127.0.0.1:1/optuna: ")
    assert SECRET not in result.output


def test_a_storage_password_is_never_written(paths, monkeypatch, tmp_path):
    """A study that opens (a SQLite file stands in for the server behind the URL): the study line shows the URL
    with the password hidden, and nothing written under the tune folder holds it."""
    from vramcal.tune import storage as storages

    real_open, opened = storages.open_storage, []

    def open_storage(url, create=True):
        opened.append(url.text)
        return real_open(f"sqlite:///{tmp_path / 'server.db'}")

    monkeypatch.setattr(storages, "open_storage", open_storage)
    result = CliRunner().invoke(main, tune_args(paths, "secret", "--trials", "1", "--n-initial", "1"),
                                env={"VRAMCAL_TUNE_STORAGE": SECRET_URL})
    assert result.exit_code == 0, result.output
    assert opened == [SECRET_URL]  # the environment's URL was the one used
    assert "study 'vramcal-tune' in postgresql://alice:***@127.0.0.1:1/optuna: 1 trials" in result.output
    assert SECRET not in result.output
    written = [p for p in (paths["tmp"] / "secret").rglob("*") if p.is_file()]
    assert {p.name for p in written} >= {"best-config.json", "trials.md", "tune.png", "config.json", "run.json"}
    assert not [p for p in written if SECRET.encode() in p.read_bytes()]


@pytest.mark.parametrize(("text", "shown"), [
    (SECRET_URL, "postgresql://alice:***@127.0.0.1:1/optuna"),
    (f"mysql+pymysql://bob:{SECRET}/x@y@db.example:3306/optuna", "mysql+pymysql://bob:***@db.example:3306/optuna"),
    (f"(psycopg2.OperationalError) 'postgresql://alice:{SECRET}@h/db' refused",
     "(psycopg2.OperationalError) 'postgresql://alice:***@h/db' refused"),
    (f"postgresql://h/db?user=alice&password={SECRET}&sslmode=require",
     "postgresql://h/db?user=alice&password=***&sslmode=require"),
    (f"failed: host=h password={SECRET} dbname=optuna", "failed: host=h password=*** dbname=optuna"),
    ("sqlite:////tmp/run@1/study.db", "sqlite:////tmp/run@1/study.db"),
    ("postgresql://db.example:5432/optuna", "postgresql://db.example:5432/optuna"),
])
def test_redact_hides_passwords_in_urls_and_messages(text, shown):
    from vramcal.tune.storage import redact

    assert redact(text) == shown


def test_a_study_whose_every_trial_fails_stops_and_says_so(paths, monkeypatch):
    """A fault that fails every trial (here: the data file vanished mid-study) ends the study after one
    failure more than the trials asked, with its results written and one closing line (exit 1)."""
    from vramcal.models.regressor.bars import DataError
    from vramcal.train import runner
    from vramcal.tune.study import TRIALS_TABLE

    def train(plan, **kwargs):
        raise DataError(f"{plan.config.data}: no such file (build the E-mini sample with `vramcal data es-sample`)")

    monkeypatch.setattr(runner, "train", train)
    result = tune(paths, "--trials", "2", "--n-initial", "2", run="all-fail")
    line = one_line_failure(result)
    table = paths["tmp"] / "all-fail" / TRIALS_TABLE
    assert line == f"Error: no trial completed, no best configuration: 3 failed (the reasons are above and in {table})"
    assert "stopping: 3 trials failed (see the reasons above), 0 of 2 finished" in result.output
    assert table.read_text().count("failed: ") == 3 and "no such file" in table.read_text()


# ---------------------------------------------------------------------------------- NaN and infinity

def _float_options() -> list[tuple[tuple[str, ...], str, int, int]]:
    """(command path, option, its number of values, the position of a float among them) of every option of
    every command whose value is (or holds) a float, from click's command objects."""
    import click
    from test_documented import commands

    def is_float(kind) -> bool:
        return isinstance(kind, click.types.FloatParamType)

    found = []
    for path, command in commands():
        gpu = ["--gpu", "none"] if any("--gpu" in getattr(p, "opts", ()) for p in command.params) else []
        for param in command.params:
            if not isinstance(param, click.Option):
                continue
            kinds = param.type.types if isinstance(param.type, click.Tuple) else [param.type]
            found += [(path + tuple(gpu), param.opts[0], len(kinds), i) for i, kind in enumerate(kinds)
                      if is_float(kind)]
    return found


FLOAT_OPTIONS = _float_options()
NON_FINITE = ("nan", "NaN", "inf", "-inf", "1e999")


def test_the_float_options_were_found():
    names = {(" ".join(p for p in path if p not in ("--gpu", "none")), option) for path, option, _, _ in FLOAT_OPTIONS}
    assert {("probe", "--timeout"), ("probe", "--margin"), ("probe", "--conservative"), ("train", "--lr"),
            ("train", "--checkpoint-minutes"), ("tune", "--lr-range"), ("tune", "--val-fraction")} <= names


@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize(("path", "option", "arity", "position"), FLOAT_OPTIONS,
                         ids=[f"{' '.join(p[:-2] if '--gpu' in p else p)} {o}[{i}]" for p, o, _, i in FLOAT_OPTIONS])
def test_every_float_option_refuses_nan_and_infinity(path, option, arity, position, value, tmp_path, monkeypatch):
    """Exit 2 and one line naming the option, before anything starts (no trial, no folder, no file)."""
    monkeypatch.chdir(tmp_path)
    values = ["1"] * arity
    values[position] = value
    result = CliRunner().invoke(main, [*path, option, *values])  # path: the command (and --gpu none where it has it)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and option in errors[0] and "finite" in errors[0], result.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argument", ["x=NaN", "x=Infinity", "x=-Infinity"])
def test_model_arguments_refuse_nan_and_infinity(argument, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["probe", "--gpu", "none", "--model", "lm", "--model-arg", argument])
    assert result.exit_code == 2 and "--model-arg" in result.output and "is not a finite number" in result.output
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------ calibrations that end unverified

MIB = 2**20
TINY_PROBE = ["probe", "--gpu", "none", "--capacity", "2GiB", "--reserve", "0", "--no-report",
              *test_train.SPEC_ARGS]


def _line(b: int) -> int:
    return 400 * MIB + int(0.5 * MIB * b) + (b * 7919 % 13) * 100_000


UNVERIFIED = {  # how a calibration can end without verified limits: the trials' peaks, and the options
    "flat": (lambda b, purpose: 550 * MIB, []),  # the peak does not grow: no fit
    "few-trials": (lambda b, purpose: _line(b), ["--max-trials", "3"]),  # stopped before any verification
    "verification-over": (lambda b, purpose: 3 * 2**30 if purpose.startswith("verify") else _line(b), []),
    "oom-after-one": (lambda b, purpose: _line(b) if b == 1 else None, []),  # one sample fits, nothing more
}


def unverified_probe(monkeypatch, tmp_path, case: str):
    from test_documented import fake_measurement

    peak, options = UNVERIFIED[case]
    fake_measurement(monkeypatch, peak)
    return CliRunner().invoke(main, [*TINY_PROBE, "--out", str(tmp_path / "p.json"), *options])


@pytest.mark.parametrize("case", sorted(UNVERIFIED))
def test_a_calibration_without_verified_limits_says_why_and_exits_3(monkeypatch, tmp_path, case):
    """Scripts tell a verified calibration from an unverified one by the exit status (README: 3)."""
    from vramcal.profile import load_profile

    result = unverified_probe(monkeypatch, tmp_path, case)
    assert result.exit_code == 3 and "Traceback" not in result.output, result.output
    last = result.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"not verified: \S.{15,} \(exit 3\)", last), result.stderr
    assert not load_profile(tmp_path / "p.json").verified


@pytest.mark.parametrize("case", ["flat", "verification-over"])
def test_the_reason_for_no_limits_is_neither_empty_nor_contradictory(monkeypatch, tmp_path, case):
    from vramcal.profile import load_profile

    output = unverified_probe(monkeypatch, tmp_path, case).output
    assert load_profile(tmp_path / "p.json").warnings, "the profile does not say why it has no limits"
    assert not re.search(r"no fit: *$", output, re.MULTILINE), output
    found = re.search(r"only (\d+) trial\(s\) finished over (\d+) batch size", output)
    assert not (found and int(found[1]) >= 3 and int(found[2]) >= 2), output


def test_the_issues_reproducer_exits_3_with_its_reason(tmp_path):
    """Issue 10: ``probe ... --chunk-size 1 --seq-len 1 --max-trials 3`` printed ``no fit:`` with nothing after
    it, exited 0 and wrote a profile with no limits. Real trials."""
    spec = ["--d-model", "32", "--n-layers", "1", "--d-state", "16", "--headdim", "16"]
    result = CliRunner().invoke(main, ["probe", "--gpu", "none", "--capacity", capacity(2**31), *spec,
                                       "--chunk-size", "1", "--seq-len", "1", "--max-trials", "3",
                                       "--out", str(tmp_path / "p.json"), "--no-report"])
    assert result.exit_code == 3, result.output
    assert re.fullmatch(r"not verified: \S.{15,} \(exit 3\)", result.stderr.strip().splitlines()[-1])


# ------------------------------------------------------------------------------- unwritable, as root too

@pytest.mark.parametrize("where", ["/proc/vramcal-profiles", "/proc/self/status/profiles"])
def test_an_unwritable_profiles_folder_fails_before_any_trial_even_as_root(where):
    """Root ignores permission bits, so the folder is one nobody can write: under /proc (a pseudo file
    system that takes no new files), or below a file there."""
    result = CliRunner().invoke(main, ["probe", "--gpu", "none", "--capacity", capacity(2**30), *test_train.SPEC_ARGS,
                                       "--max-trials", "3", "--no-report", "--profiles-dir", where])
    line = one_line_failure(result)
    assert f"cannot write profiles to {where}" in line and "choose another --out or --profiles-dir" in line
    assert "batch_size" not in result.output  # no trial ran


def test_an_unwritable_run_folder_is_one_line_even_as_root(setup):
    line = one_line_failure(test_train.train(setup, "/proc/vramcal-run"))
    assert "cannot write to the run folder" in line


# -------------------------------------------------------------------------- a failed verification shows

def test_a_failed_verification_is_reported_as_failed_wherever_it_is_shown(tmp_path):
    """The safe batch size's verification trial peaked above usable memory: the report (its verification line
    and its note), ``show`` and ``report --json`` say so. (The test profiles' other verification peaks sit
    just below the prediction, so a report that always printed "passed" passed every other test.)"""
    from vramcal.profile import save_profile
    from vramcal.report import write_report

    from profiles_for_tests import build_profile, gpu_device, gpu_trial, seed_peak

    trials = [gpu_trial(b, seed_peak(b, i)) for i, b in enumerate((1, 2, 4, 8, 16, 32, 64))]
    passing = build_profile(gpu_device(), trials)
    usable, safe = passing.limits.usable_bytes, passing.limits.safe_batch_size
    over = usable - int(passing.fit.predict(safe)) + 2**20  # the safe trial's peak: 1 MiB above usable
    profile = build_profile(gpu_device(), trials, verify_offset_bytes=over)
    assert not profile.verification["safe"].passed and profile.verification["conservative"].passed
    conservative = profile.limits.conservative_batch_size
    text = write_report([profile], tmp_path / "reports")[1].read_text()
    assert f"safe batch {safe}: **FAILED**, peak " in text and f"conservative batch {conservative}: passed" in text
    assert f"Not verified (conservative batch {conservative} passed; safe batch {safe} FAILED)" in text
    path = save_profile(profile, tmp_path / "failed.json")
    shown = CliRunner().invoke(main, ["show", str(path)]).output
    assert f"safe          batch_size {safe:<6} (NOT verified)" in shown
    assert f"conservative  batch_size {conservative:<6} (verified: peak" in shown
    facts = json.loads(CliRunner().invoke(main, ["report", str(path), "--out", str(tmp_path / "r"), "--json"]).output)
    assert facts["profiles"][0]["verified"] is False


# ------------------------------------------------------------------------- a worker killed from outside

def test_a_worker_killed_from_outside_is_not_an_out_of_memory(monkeypatch):
    """A real worker killed by SIGKILL while the kernel counts no out-of-memory kill: an ``error`` of type Killed
    naming the signal and the pid (it measured nothing), not ``oom``; the same kill while the counter rises (the
    kernel's own counter, faked: the hardware boundary) is ``oom``."""
    from vramcal.measure import evidence, worker

    killed = worker.Workers(("user_models",)).run("user_models:kill_myself", timeout_s=60)
    assert killed.status == "error" and killed.error_type == evidence.KILLED, killed
    assert re.match(r"killed by SIGKILL \(pid \d+\), and the kernel counted no out-of-memory kill", killed.message)
    assert killed.error is None  # no traceback: the record says the kill once ("Killed: killed by ...")
    counter = "/sys/fs/cgroup/memory/job/memory.oom_control"
    monkeypatch.setattr(evidence, "oom_kill_counter", lambda: (counter, 5))  # the kernel's counter, now at 5
    rose = evidence.exit_status(-9, 123, (counter, 4))
    assert rose == {"status": "oom", "message": f"killed by SIGKILL (pid 123) by the kernel's out-of-memory killer "
                                                f"({counter}'s oom_kill counted it)"}
    assert evidence.exit_status(-9, 123, (counter, 5))["status"] == "error"  # it did not rise
    assert evidence.exit_status(-9, 123, None)["status"] == "error"  # no counter: no evidence


def test_a_worker_killed_after_its_meter_read_usable_memory_is_out_of_memory():
    """DESIGN's third kind of evidence: a real worker sends its meter's reading, then is killed by SIGKILL with no
    out-of-memory kill counted. At or above the usable memory its caller named, that is out-of-memory; below it
    (or with no usable memory named) it is a kill from outside."""
    from vramcal.measure import evidence, worker

    workers, gib = worker.Workers(("user_models",)), 2**30
    near = workers.run("user_models:kill_myself", gib, timeout_s=60, usable_bytes=gib - 2**20)
    assert near.status == "oom", near
    assert re.fullmatch(r"killed by SIGKILL \(pid \d+\) with 1(\.00)? GiB held, at or above usable memory 1023(\.00)? "
                        r"MiB \(the meter's last reading\)", near.message), near
    for usable in (gib + 1, None):
        far = workers.run("user_models:kill_myself", gib, timeout_s=60, usable_bytes=usable)
        assert far.status == "error" and far.error_type == evidence.KILLED, far


@pytest.mark.parametrize(("before", "after", "reading", "usable", "oom"), [
    (("cg", 3), ("cg", 4), None, None, True),  # the cgroup's counter rose during the worker's life
    (("cg", 4), ("cg", 4), None, None, False),
    (("/proc/vmstat", 4), ("cg", 9), None, None, False),  # two counters: no comparison
    (None, ("cg", 4), None, None, False),
    (None, None, 1000, 1000, True),  # the last reading at usable memory
    (None, None, 999, 1000, False),
    (None, None, 1000, None, False),  # no usable memory named
    (None, None, None, 1000, False),  # no reading sent (killed before its step was built)
])
def test_out_of_memory_evidence_is_the_counter_rising_or_a_reading_at_usable_memory(before, after, reading, usable,
                                                                                   oom):
    from vramcal.measure.evidence import oom_evidence

    assert (oom_evidence(before, after, reading, usable) is not None) == oom


def cgroup_tree(tmp_path, cgroups: str, files: dict[str, str]):
    """A /proc/self/cgroup of ``cgroups`` and cgroup files under ``tmp_path/cgroup``; returns both paths."""
    (tmp_path / "self-cgroup").write_text(cgroups)
    for name, text in files.items():
        (tmp_path / "cgroup" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "cgroup" / name).write_text(text)
    (tmp_path / "vmstat").write_text("pgfault 100\noom_kill 7\n")
    return {"cgroups": tmp_path / "self-cgroup", "root": tmp_path / "cgroup", "vmstat": tmp_path / "vmstat"}


@pytest.mark.parametrize(("cgroups", "files", "counter"), [
    ("4:memory:/job/a\n0::/\n", {"memory/job/a/memory.oom_control": "oom_kill_disable 0\noom_kill 2\n"},
     "memory/job/a/memory.oom_control"),  # cgroup v1: the process's own memory cgroup
    ("0::/job/b\n", {"job/b/memory.events": "low 0\noom 1\noom_kill 1\n"}, "job/b/memory.events"),  # v2
    ("0::/job/c\n", {"memory.events": "oom_kill 3\n"}, "memory.events"),  # a container's own cgroup as the root
    ("0::/\n", {}, None),  # no cgroup counter readable: the machine's, /proc/vmstat
])
def test_the_processs_own_cgroup_counter_speaks_before_the_machines(tmp_path, cgroups, files, counter):
    """The machine-wide counter also counts a neighbour's out-of-memory kill, which would have made a kill from
    outside an out-of-memory one: it counts only where the process's cgroup has no counter."""
    from vramcal.measure.evidence import oom_kill_counter

    paths = cgroup_tree(tmp_path, cgroups, files)
    found = oom_kill_counter(**paths)
    assert found == ((str(paths["root"] / counter), int(files[counter].split("oom_kill ")[1].split()[0]))
                     if counter else (str(paths["vmstat"]), 7))


def test_a_probe_whose_trial_is_killed_twice_stops_without_a_profile(tmp_path):
    """A real probe whose worker is SIGKILLed at batch sizes of 200 and more (a kill -9, a preemption): the size
    is run again once, killed again, and the probe stops with one line naming the signal, instead of bisecting
    below it and verifying a size far too small. The measured trials stay in the journal."""
    out = tmp_path / "p.json"
    result = CliRunner().invoke(main, ["probe", "--gpu", "none", "--capacity", capacity(3 * 2**29), "--model",
                                       "user_models:killed_from_outside", "--model-arg", "kill_at=200",
                                       "--out", str(out), "--no-report", "--no-boundary"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert re.search(r"at batch_size \d+ was killed from outside twice \(killed by SIGKILL \(pid \d+\); killed by "
                     r"SIGKILL \(pid \d+\)\)", line), line
    assert "safe" not in result.output and not out.exists()
    assert (tmp_path / "p.json.journal").is_file()  # the measured trials, for the same command to continue from


def test_an_effective_batch_below_the_minimum_is_refused_before_training(tmp_path):
    """``train --effective-batch-size 16 --batch-size-min 32`` trained at 16, ignoring the minimum."""
    setup = {"data": tmp_path / "none.parquet", "profiles": tmp_path / "profiles", "tmp": tmp_path}
    line = one_line_failure(test_train.train(setup, "run", "--effective-batch-size", "16", "--batch-size-min", "32"))
    assert "--effective-batch-size 16 is below --batch-size-min 32" in line, line
    assert not (tmp_path / "run").exists()

