"""The bundled trainer end to end on CPU: a real tiny Mamba-2 model, synthetic bars, an in-memory profile.

Fakes only at the hardware boundary: a model whose forward raises ``torch.OutOfMemoryError`` for large
micro-batches, as a GPU would.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_train_data import synthetic_bars

from vramcal.calibrate.fit import fit_linear
from vramcal.calibrate.limits import LimitSettings, compute_limits
from vramcal.cli import main  # first: it registers the train and data commands
from vramcal.measure.device import host_device
from vramcal.model import ModelSpec, build_model
from vramcal.profile import Profile, profile_path, save_profile
from vramcal.records import Device
from vramcal.train import checkpoint, loop, sizing
from vramcal.train.config import TrainConfig, load_config
from vramcal.train.plan import plan_run

MIB = 2**20
SPEC = ModelSpec(d_model=32, n_layers=1, d_state=16, headdim=16, seq_len=32, chunk_size=16)
SPEC_ARGS = ["--d-model", "32", "--n-layers", "1", "--d-state", "16", "--headdim", "16", "--seq-len", "32",
             "--chunk-size", "16"]


def make_profile(device: Device, spec: ModelSpec = SPEC, slope_mib: int = 24) -> Profile:
    """A profile over synthetic trials: 100 MiB + slope x batch in a 1 GiB budget (safe batch ~12)."""
    from vramcal.records import Trial

    device = Device(**{**device.to_dict(), "total_bytes": 1024 * MIB})
    sizes = (1, 2, 4, 8, 16)
    peaks = [100 * MIB + slope_mib * MIB * b + (i % 2) * MIB for i, b in enumerate(sizes)]
    fit = fit_linear(sizes, peaks)
    settings = LimitSettings()
    return Profile(device=device, spec=spec, implementation="transformers", kernel_path="test", settings=settings,
                   trials=tuple(Trial(b, "ok", p) for b, p in zip(sizes, peaks)), fit=fit,
                   limits=compute_limits(fit, device.total_bytes, settings), created_utc="2025-01-01T00:00:00Z")


@pytest.fixture()
def setup(tmp_path):
    data = tmp_path / "bars.parquet"
    synthetic_bars(400).to_parquet(data)
    profiles = tmp_path / "profiles"
    profile = make_profile(host_device())
    save_profile(profile, profile_path(profiles, profile.device, SPEC, "transformers"))
    return {"data": data, "profiles": profiles, "profile": profile, "tmp": tmp_path}


def train(setup, run: str, *extra: str):
    args = ["train", "--data", str(setup["data"]), "--profiles-dir", str(setup["profiles"]), "--gpu", "none",
            "--run-dir", str(setup["tmp"] / run), *SPEC_ARGS, *extra]
    return CliRunner().invoke(main, args)


def rows(run_dir: Path, kind: str = "epoch") -> list[dict]:
    lines = (run_dir / checkpoint.METRICS).read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def weights(run_dir: Path, name: str = checkpoint.LAST) -> dict[str, torch.Tensor]:
    return checkpoint.load_checkpoint(run_dir / name)["model"]


def one_line_failure(result) -> str:
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output and result.exc_info[0] is SystemExit
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    return lines[0]


# --------------------------------------------------------------------------------------------- runs

def test_a_run_writes_metrics_checkpoints_and_its_record(setup):
    result = train(setup, "run", "--epochs", "2", "--batch-size", "8")
    assert result.exit_code == 0, result.output
    run_dir = setup["tmp"] / "run"
    epochs = rows(run_dir)
    assert [r["epoch"] for r in epochs] == [1, 2] and all(r["complete"] for r in epochs)
    assert epochs[-1]["step"] == 2 * math.ceil(18 / 8)  # 18 training windows of 32 bars, stride 16
    for row in epochs:
        assert math.isfinite(row["train_loss"]) and math.isfinite(row["val_loss"])
        assert 0 <= row["val_dir_acc"] <= 1 and 0 <= row["val_zero_dir_acc"] <= 1
        assert row["samples_per_s"] > 0 and row["peak_bytes"] > 50 * MIB and row["peak_source"] == "VmHWM"
    record = json.loads((run_dir / checkpoint.RUN).read_text())
    assert record["implementation"] == "transformers" and "torch_forward" in record["kernel_path"]
    assert record["batch"]["batch_size"] == 8 and record["data"]["train_windows"] == 18
    assert (run_dir / checkpoint.BEST).is_file()
    assert load_config(run_dir / checkpoint.CONFIG).spec == SPEC
    assert "done: 6 steps" in result.output


def test_runs_are_reproducible_for_a_seed(setup):
    for run in ("a", "b"):
        assert train(setup, run, "--max-steps", "3", "--seed", "7").exit_code == 0
    a, b = weights(setup["tmp"] / "a"), weights(setup["tmp"] / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert rows(setup["tmp"] / "a")[0]["val_loss"] == rows(setup["tmp"] / "b")[0]["val_loss"]
    assert train(setup, "c", "--max-steps", "3", "--seed", "8").exit_code == 0
    assert not all(torch.equal(a[k], v) for k, v in weights(setup["tmp"] / "c").items())


def test_resume_continues_a_killed_run_to_the_same_weights(setup, monkeypatch):
    assert train(setup, "straight", "--epochs", "3", "--batch-size", "8").exit_code == 0
    real_save = loop.Trainer._save

    def save_then_die(self, row):  # the process is killed right after epoch 2's checkpoint
        real_save(self, row)
        if self.progress.epoch == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(loop.Trainer, "_save", save_then_die)
    train(setup, "killed", "--epochs", "3", "--batch-size", "8")
    monkeypatch.setattr(loop.Trainer, "_save", real_save)
    killed = setup["tmp"] / "killed"
    assert [r["epoch"] for r in rows(killed)] == [1, 2]
    result = CliRunner().invoke(main, ["train", "--resume", "--run-dir", str(killed)])
    assert result.exit_code == 0, result.output
    assert "resuming at step 6" in result.output
    assert [r["epoch"] for r in rows(killed)] == [1, 2, 3]
    straight = weights(setup["tmp"] / "straight")
    assert all(torch.equal(straight[k], v) for k, v in weights(killed).items())


def test_out_of_memory_halves_the_micro_batch_and_keeps_the_gradient(setup):
    """A forward that fails above 5 samples, as a GPU would: the step is retried as 2 x 4 accumulated."""

    class OomAbove(torch.nn.Module):
        def __init__(self, spec, implementation):
            super().__init__()
            self.inner = build_model(spec, implementation)

        def forward(self, x):
            if x.shape[0] > 5:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return self.inner(x)

    def plan(run):
        config = TrainConfig(data=str(setup["data"]), spec=SPEC, gpu="none", profiles_dir=str(setup["profiles"]),
                             batch_size=8, epochs=1, max_steps=2)
        return plan_run(config, setup["tmp"] / run)

    messages = []
    loop.start(plan("oom"), echo=messages.append, model_factory=OomAbove)
    loop.start(plan("plain"), echo=lambda line: None)
    events = rows(setup["tmp"] / "oom", "oom")
    assert [(e["micro_batch_size_from"], e["micro_batch_size_to"], e["batch_size"]) for e in events] == [(8, 4, 8)]
    assert "retrying with micro-batch 4 x 2 accumulated (effective batch stays 8)" in messages[0]
    assert rows(setup["tmp"] / "oom")[0]["micro_batch_size"] == 4
    with_fallback = {k.removeprefix("inner."): v for k, v in weights(setup["tmp"] / "oom").items()}
    for name, value in weights(setup["tmp"] / "plain").items():
        torch.testing.assert_close(with_fallback[name], value, rtol=1e-4, atol=1e-6)


def test_a_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(setup, monkeypatch):
    good = {}
    real_save = loop.Trainer._save

    def save(self, row):
        real_save(self, row)
        good.update({k: v.clone() for k, v in self.model.state_dict().items()})
        self.model.head.bias.data.fill_(float("nan"))  # the next forward is NaN

    monkeypatch.setattr(loop.Trainer, "_save", save)
    result = train(setup, "nan", "--epochs", "3", "--batch-size", "8")
    assert result.exit_code == 1 and "Traceback" not in result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("Error: non-finite loss at step 4") and "checkpoint-last.pt" in line
    kept = weights(setup["tmp"] / "nan")
    assert all(torch.equal(kept[k], good[k]) for k in good)
    assert rows(setup["tmp"] / "nan", "non-finite")[0]["step"] == 4


# ----------------------------------------------------------------------------------- batch sizing

def test_explicit_batch_size_is_clamped_with_a_warning(setup):
    safe = setup["profile"].limits.safe_batch_size
    result = train(setup, "clamp", "--batch-size", "1000", "--max-steps", "1")
    assert result.exit_code == 0, result.output
    assert f"warning: --batch-size 1000 is outside [1, {safe}] (--batch-size-min, the profile's safe batch size): " \
           f"using {safe}" in result.output
    assert rows(setup["tmp"] / "clamp")[0]["batch_size"] == safe


def test_auto_uses_the_conservative_batch_size_and_scales_the_lr(setup):
    limits = setup["profile"].limits
    result = train(setup, "auto", "--max-steps", "1", "--lr-scaling", "linear", "--reference-batch-size", "4")
    assert result.exit_code == 0, result.output
    record = json.loads((setup["tmp"] / "auto" / checkpoint.RUN).read_text())
    assert record["batch"]["batch_size"] == limits.conservative_batch_size
    assert record["batch"]["source"] == "conservative"
    assert record["lr"] == pytest.approx(5e-5 * limits.conservative_batch_size / 4)


def test_choose_batch_size_bounds():
    profile = make_profile(host_device())
    safe = profile.limits.safe_batch_size
    assert sizing.choose_batch_size(profile, None, 1).batch_size == profile.limits.conservative_batch_size
    assert sizing.choose_batch_size(profile, 3, 5).batch_size == 5
    assert sizing.choose_batch_size(profile, 3, 5).source == "clamped"
    assert sizing.choose_batch_size(profile, safe, 1).warning is None
    with pytest.raises(sizing.SizingError, match="above the profile's safe batch size"):
        sizing.choose_batch_size(profile, None, safe + 1)
    assert sizing.scaled_lr(1e-4, 384, 96, "sqrt") == pytest.approx(2e-4)
    assert sizing.scaled_lr(1e-4, 384, 96, "none") == 1e-4


def test_lr_schedule_warms_up_then_decays():
    factors = [loop.lr_factor(s, 4, 20, 0.1) for s in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in itertools.pairwise(factors[3:]))
    assert loop.lr_factor(20, 4, 20, 0.1) == pytest.approx(0.1)


def test_config_file_with_command_line_overrides(setup):
    config = setup["tmp"] / "best.json"
    config.write_text(json.dumps({"lr": 1e-3, "seed": 3, "spec": SPEC.to_dict(), "max_steps": 1,
                                  "batch_size": "auto"}))
    result = CliRunner().invoke(main, ["train", "--config", str(config), "--data", str(setup["data"]), "--gpu", "none",
                                       "--profiles-dir", str(setup["profiles"]), "--run-dir",
                                       str(setup["tmp"] / "cfg"), "--seed", "5"])
    assert result.exit_code == 0, result.output
    saved = load_config(setup["tmp"] / "cfg" / checkpoint.CONFIG)
    assert (saved.lr, saved.seed, saved.spec, saved.max_steps, saved.batch_size) == (1e-3, 5, SPEC, 1, None)
    toml = setup["tmp"] / "best.toml"
    toml.write_text('[train]\nlr = 2e-4\nd_model = 64\nbatch_size = 8\n')
    assert load_config(toml).replace(seed=1) == TrainConfig(lr=2e-4, spec=ModelSpec(d_model=64), batch_size=8, seed=1)
    toml.write_text('lr = 2e-4\nlearning_rate = 1\n')
    line = one_line_failure(CliRunner().invoke(main, ["train", "--config", str(toml)]))
    assert "unknown setting(s) learning_rate" in line


# -------------------------------------------------------------------------------------- bad input

def test_no_profile_says_which_probe_to_run(setup):
    line = one_line_failure(train(setup, "x", "--profiles-dir", str(setup["tmp"] / "empty")))
    assert "no profile for" in line and "--probe" in line
    assert "vramcal probe --gpu none --impl transformers --d-model 32 --n-layers 1" in line


def test_profiles_of_another_spec_or_device_are_refused(setup):
    other_spec = make_profile(host_device(), spec=ModelSpec(d_model=64, n_layers=1, d_state=16, headdim=16,
                                                            seq_len=32, chunk_size=16))
    save_profile(other_spec, setup["tmp"] / "spec.json")
    line = one_line_failure(train(setup, "x", "--profile", str(setup["tmp"] / "spec.json")))
    assert "another model spec: d_model=32 (profile 64)" in line
    other_device = make_profile(Device(kind="host", name="Some Other CPU (64 cores)", total_bytes=1,
                                       total_source="test"))
    save_profile(other_device, setup["tmp"] / "device.json")
    line = one_line_failure(train(setup, "y", "--profile", str(setup["tmp"] / "device.json")))
    assert "another device" in line and "Some Other CPU" in line


@pytest.mark.parametrize(("make", "phrase"), [
    (lambda p: None, "no such file"),
    (lambda p: p.write_bytes(b""), "the file is empty"),
    (lambda p: p.write_bytes(b"garbage, not parquet"), "not a readable parquet file"),
    (lambda p: synthetic_bars(400).drop(columns="high").to_parquet(p), "missing column(s) high"),
    (lambda p: synthetic_bars(400).assign(volume=float("nan")).to_parquet(p), "NaN or infinite"),
    (lambda p: synthetic_bars(400).iloc[::-1].to_parquet(p), "not sorted"),
    (lambda p: synthetic_bars(20).to_parquet(p), "fewer than one window"),
])
def test_bad_data_fails_in_one_line(setup, make, phrase):
    path = setup["tmp"] / "bad.parquet"
    make(path)
    line = one_line_failure(train(setup, "bad-run", "--data", str(path)))
    assert phrase in line
    assert not (setup["tmp"] / "bad-run").exists()


def test_seq_len_that_breaks_the_chunking_rules(setup):
    result = train(setup, "x", "--seq-len", "40")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "seq_len 40 is not a multiple of chunk_size 16: use seq_len 32 or 48" in result.output


def test_run_folder_problems_lose_nothing(setup):
    assert train(setup, "kept", "--max-steps", "1").exit_code == 0
    before = {p.name: p.read_bytes() for p in (setup["tmp"] / "kept").iterdir()}
    line = one_line_failure(train(setup, "kept", "--max-steps", "1"))
    assert "already holds a run: pass --resume" in line
    assert {p.name: p.read_bytes() for p in (setup["tmp"] / "kept").iterdir()} == before
    (setup["tmp"] / "a-file").write_text("")
    line = one_line_failure(train(setup, "a-file/run"))
    assert "cannot write to the run folder" in line
    line = one_line_failure(CliRunner().invoke(main, ["train", "--resume", "--run-dir", str(setup["tmp"] / "none")]))
    assert "nothing to resume" in line


# ------------------------------------------------------------------------------- tester's findings

@pytest.mark.parametrize("option", [("--lr", "inf"), ("--max-grad-norm", "inf"), ("--weight-decay", "nan")])
def test_non_finite_settings_are_refused_with_exit_2_and_no_folder(setup, option):
    result = train(setup, "inf", "--max-steps", "1", *option)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "must be a finite number" in result.output
    assert not (setup["tmp"] / "inf").exists()
    with pytest.raises(ValueError, match="lr must be a finite number > 0, got inf"):
        TrainConfig(lr=math.inf)


def test_weights_that_overflow_in_a_step_stop_the_run_and_are_never_saved(setup, monkeypatch):
    """A finite loss and gradient, then a step that overflows the weights (as --lr 1e30 would): the run
    fails like a non-finite training loss, and no checkpoint (good or bad) is written."""
    real_step = loop.optimizer_step

    def overflowing_step(model, *args, **kwargs):
        grad_norm = real_step(model, *args, **kwargs)
        model.head.bias.data.fill_(math.inf)
        return grad_norm

    monkeypatch.setattr(loop, "optimizer_step", overflowing_step)
    result = train(setup, "overflow", "--max-steps", "1")
    assert result.exit_code == 1 and "Traceback" not in result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("Error: non-finite weights at step 1") and "no checkpoint was written yet" in line
    run_dir = setup["tmp"] / "overflow"
    assert not (run_dir / checkpoint.LAST).exists() and not (run_dir / checkpoint.BEST).exists()
    event = rows(run_dir, "non-finite")[0]  # strict JSON (json.loads of the file succeeded)
    assert event["step"] == 1 and event["weights"] == ["head.bias"]


def test_checkpoints_never_hold_non_finite_weights(tmp_path):
    with pytest.raises(ValueError, match="non-finite weights in w"):
        checkpoint.save_checkpoint(tmp_path / "c.pt", {"model": {"w": torch.tensor([1.0, math.nan])}})
    assert not (tmp_path / "c.pt").exists()
    torch.save({"format": checkpoint.CHECKPOINT_FORMAT, "model": {"w": torch.tensor([math.inf])}}, tmp_path / "old.pt")
    with pytest.raises(checkpoint.RunDirError, match="holds non-finite weights"):
        checkpoint.load_checkpoint(tmp_path / "old.pt")


def test_metrics_are_strict_json_with_null_for_non_finite_numbers(tmp_path):
    checkpoint.write_metrics(tmp_path, [{"kind": "epoch", "val_loss": math.nan, "lr": [math.inf, 1.5]}])
    text = (tmp_path / checkpoint.METRICS).read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"kind": "epoch", "val_loss": None, "lr": [None, 1.5]}


@pytest.mark.parametrize("extra", [("--gpu", "7"), ("--profile", "bad.json"), ("--batch-size-min", "5000")])
def test_a_run_that_cannot_start_leaves_no_folder(setup, extra):
    if extra[0] == "--profile":
        (setup["tmp"] / "bad.json").write_text("{not json")
        extra = ("--profile", str(setup["tmp"] / "bad.json"))
    one_line_failure(train(setup, "nothing", *extra))
    assert not (setup["tmp"] / "nothing").exists()


def test_resume_with_fewer_or_more_steps(setup):
    """Fewer steps than done: said in one line. More: the cosine decay is stretched to the new total, so
    2 steps resumed to 4 end with the weights of a straight 4-step run (warm-up and data order kept)."""
    result = train(setup, "short", "--max-steps", "2", "--batch-size", "8")
    assert result.exit_code == 0 and "done: 2 steps," in result.output, result.output
    assert "done: 1 step," in train(setup, "one", "--max-steps", "1").output
    short = setup["tmp"] / "short"
    result = CliRunner().invoke(main, ["train", "--resume", "--run-dir", str(short), "--max-steps", "1"])
    assert result.exit_code == 0 and "--max-steps 1: the run has already done 2 steps, nothing to train" \
        in result.output
    result = CliRunner().invoke(main, ["train", "--resume", "--run-dir", str(short), "--max-steps", "4"])
    assert result.exit_code == 0, result.output
    assert train(setup, "straight", "--max-steps", "4", "--batch-size", "8").exit_code == 0
    straight = weights(setup["tmp"] / "straight")
    assert all(torch.equal(straight[k], v) for k, v in weights(short).items())


def test_a_run_resumes_from_another_directory(setup, monkeypatch):
    monkeypatch.chdir(setup["tmp"])
    result = CliRunner().invoke(main, ["train", "--data", "bars.parquet", "--profiles-dir", "profiles", "--gpu",
                                       "none", "--run-dir", "rel", "--max-steps", "1", *SPEC_ARGS])
    assert result.exit_code == 0, result.output
    saved = load_config(setup["tmp"] / "rel" / checkpoint.CONFIG)
    assert saved.data == str(setup["data"].resolve()) and Path(saved.profiles_dir).is_absolute()
    (setup["tmp"] / "elsewhere").mkdir()
    monkeypatch.chdir(setup["tmp"] / "elsewhere")
    result = CliRunner().invoke(main, ["train", "--resume", "--run-dir", "../rel", "--max-steps", "2"])
    assert result.exit_code == 0 and "done: 2 steps" in result.output, result.output


def test_es_sample_failures_are_one_line(setup):
    ticks = setup["tmp"] / "ticks.csv"
    ticks.write_text("DateTime,Price,Volume\n2013-09-01 17:00:00.1,10,1\n2013-09-01 17:00:01.5,11,2\n")
    (setup["tmp"] / "afile").write_text("")
    base = ["data", "es-sample", "--ticks", str(ticks)]
    line = one_line_failure(CliRunner().invoke(main, [*base, "--out", str(setup["tmp"] / "afile" / "x.parquet")]))
    assert "cannot write" in line and "choose another --out" in line
    line = one_line_failure(CliRunner().invoke(main, [*base, "--bar", "0s", "--out", str(setup["tmp"] / "y.parquet")]))
    assert "--bar '0s' is not a positive length of time" in line
    result = CliRunner().invoke(main, [*base, "--bar", "1D", "--out", str(setup["tmp"] / "z.parquet")])
    assert result.exit_code == 0 and "warning: only 1 1D bar, fewer than one window" in result.output
