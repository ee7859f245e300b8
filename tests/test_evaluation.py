"""The evaluation limit (issue 41 item 4): the search over evaluation trials (faked at the hardware boundary), the
profile's record, and a real evaluation trial of the tiny model."""

from __future__ import annotations

import math

import pytest

from vramcal.calibration.evaluation import PREFIX, EvalLimits
from vramcal.records import Trial

from fakes import GIB, FakeTrialRunner

MIB = 2**20


class EvalRunner(FakeTrialRunner):
    """Training trials peak at ``memory``, evaluation trials (``train_batch_size`` set) at ``evaluate``; every
    request is kept."""

    def __init__(self, memory, evaluate, total_bytes):
        super().__init__(memory, total_bytes)
        self.evaluate, self.requests = evaluate, []

    def run(self, request, purpose: str = "") -> tuple[Trial, ...]:
        self.requests.append(request)
        if request.train_batch_size is None:
            return super().run(request, purpose)
        peak = int(self.evaluate(request.batch_size))
        status = "oom" if peak > self.total_bytes else "ok"
        return (Trial(request.batch_size, status, peak if status == "ok" else None, purpose=purpose, step_s=0.1),)


def calibrate(memory, evaluate, total_bytes, evaluation=True):
    from pathlib import Path

    from vramcal.calibration.limits import LimitSettings
    from vramcal.models.regressor.spec import RegressorSpec
    from vramcal.records import Device, TrialSettings
    from vramcal.service.calibrator import CalibrationPlan, run_trials

    device = Device("host", "Fake CPU (2 cores)", total_bytes, "--capacity")
    plan = CalibrationPlan(device, RegressorSpec(chunk_size=64, seq_len=128).ref("transformers"), LimitSettings(), {},
                           Path("profile.json"), trials=TrialSettings(max_trials=16), evaluation=evaluation)
    runner = EvalRunner(memory, evaluate, total_bytes)
    return run_trials(plan, runner), runner


def test_the_evaluation_limit_is_searched_verified_and_kept_apart_from_the_training_trials(tmp_path):
    from vramcal.profile import load_profile, save_profile

    total = 8 * GIB
    memory = lambda b: GIB + 12 * MIB * b  # noqa: E731 - training: activations kept for the backward pass
    evaluate = lambda b: GIB + 3 * MIB * b  # noqa: E731 - evaluation: a quarter of it per sample
    profile, runner = calibrate(lambda b, n: memory(b), evaluate, total)
    found, usable = profile.evaluation, profile.limits.usable_bytes
    assert profile.verified and found.verified
    # the warm-up steps train at the run's batch (the conservative size), the passes evaluate at theirs
    evaluations = [r for r in runner.requests if r.train_batch_size is not None]
    assert {r.train_batch_size for r in evaluations} == {profile.limits.conservative_batch_size}
    assert evaluations[0].batch_size == profile.limits.conservative_batch_size  # the search starts there
    truth = (usable - GIB) // (3 * MIB)
    assert evaluate(found.limits.safe_batch_size) <= usable and found.limits.safe_batch_size >= 0.95 * truth
    assert found.limits.safe_batch_size > 3.5 * profile.limits.safe_batch_size  # larger by the measured slopes
    assert math.isclose(found.fit.slope_bytes_per_sample, 3 * MIB, rel_tol=1e-6)
    # the training fit, limits and trials are the ones a calibration without --eval makes
    alone, _ = calibrate(lambda b, n: memory(b), evaluate, total, evaluation=False)
    assert (profile.fit, profile.limits, len(profile.trials)) == (alone.fit, alone.limits, len(alone.trials))
    assert not any(t.purpose.startswith(PREFIX) for t in profile.trials) and alone.evaluation is None
    assert load_profile(save_profile(profile, tmp_path / "p.json")) == profile
    assert EvalLimits.from_dict(found.to_dict()) == found


def eval_line(b: int, purpose: str) -> int:
    """Fake evaluation peaks: the training line's overhead, a quarter of its 0.4 MiB a sample."""
    from host_budget import extra_bytes

    return extra_bytes() + 550 * MIB + int(0.1 * MIB * b) + (b * 7919 % 7) * 50_000


def test_probe_eval_then_train_validates_at_the_evaluation_limit_and_warns_above_it(tmp_path, monkeypatch):
    """``probe --eval`` (trials measured by known lines: the search, the profile and the run are real), then real
    training runs of the tiny model: validation at the evaluation limit's conservative size, its peak measured
    against the evaluation fit, and a warning for a --val-batch-size above the evaluation limit."""
    import json

    from click.testing import CliRunner
    from host_budget import capacity
    from test_documented import fake_measurement, known_line
    from test_train import SPEC_ARGS
    from test_train_data import synthetic_bars

    from vramcal.cli import main
    from vramcal.profile import load_profile

    bars, out = tmp_path / "bars.parquet", tmp_path / "p.json"
    synthetic_bars(1500).to_parquet(bars)
    with monkeypatch.context() as patch:
        fake_measurement(patch, lambda b, each: (eval_line if each.startswith(PREFIX) else known_line)(b, each))
        probed = CliRunner().invoke(main, ["probe", "--gpu", "none", "--capacity", capacity(3 * GIB // 2), *SPEC_ARGS,
                                           "--data", str(bars), "--eval", "--out", str(out), "--no-report"])
    assert probed.exit_code == 0, probed.output
    profile = load_profile(out)
    found = profile.evaluation
    assert found.verified and found.limits.safe_batch_size > 3 * profile.limits.safe_batch_size
    assert "eval conservative batch_size" in probed.output and "the evaluation pass fits" in probed.output
    common = ["train", "--gpu", "none", *SPEC_ARGS, "--profile", str(out), "--data", str(bars), "--stride", "1",
              "--max-steps", "1"]
    run = CliRunner().invoke(main, [*common, "--run-dir", str(tmp_path / "run")])
    assert run.exit_code == 0, run.output
    conservative = found.limits.conservative_batch_size
    assert f"validation batch_size {conservative} (the evaluation limit (conservative" in run.output
    row = next(json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
               if json.loads(line)["kind"] == "epoch")
    assert row["val_batch_size"] == conservative and row["batch_size"] == profile.limits.conservative_batch_size
    assert row["val_peak_bytes"] > 0 and row["val_predicted_peak_bytes"] == int(found.fit.predict(conservative))
    assert "validation peak " in run.output and f"at batch_size {conservative} (predicted" in run.output
    above = found.limits.safe_batch_size + 1
    warned = CliRunner().invoke(main, [*common, "--run-dir", str(tmp_path / "above"), "--val-batch-size", str(above)])
    assert warned.exit_code == 0, warned.output
    assert f"warning: --val-batch-size {above} is above the evaluation limit (safe {found.limits.safe_batch_size}" \
        in warned.output


@pytest.mark.slow
def test_a_real_evaluation_trial_holds_less_than_a_training_trial_at_the_same_batch():
    """The tiny model on the host: an evaluation trial (one training step at batch 1, then evaluation passes
    alone at 256) peaks above the training step at 1 and below a training trial at 256."""
    from host_budget import budget

    from vramcal.api import worker_pool
    from vramcal.measure.trial import TrialRequest, TrialRunner
    from vramcal.models.regressor.spec import RegressorSpec
    from vramcal.records import Device, TrialSettings

    device = Device("host", "host", budget(1024 * MIB), "--capacity")
    ref = RegressorSpec(d_model=32, n_layers=1, d_state=16, headdim=16, seq_len=32, chunk_size=16).ref("transformers")
    settings = TrialSettings(warmup_steps=1, measured_steps=2, val_steps=0)
    runner = TrialRunner(worker_pool())
    (one,) = runner.run(TrialRequest(ref, 1, device, settings=settings), "grow")
    (train,) = runner.run(TrialRequest(ref, 256, device, settings=settings), "grow")
    (evaluated,) = runner.run(TrialRequest(ref, 256, device, settings=settings, train_batch_size=1), PREFIX + "grow")
    assert one.ok and train.ok and evaluated.ok, (one, train, evaluated)
    assert one.peak_bytes < evaluated.peak_bytes < train.peak_bytes
    assert len(evaluated.step_times_s) == 2 and len(evaluated.warmup_times_s) == 1  # two passes after one step
