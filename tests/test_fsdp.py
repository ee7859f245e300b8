"""FSDP2 on the host: 2-rank gloo worlds of the tiny model sharded with ``fully_shard``, for real, and the sharding
model that carries their profile to other world sizes and cards (vramcal.sizing.sharding), on synthetic profiles.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import host_budget
import pytest
import torch
from click.testing import CliRunner
from host_budget import SIZE
from test_ddp import (
    ddp_profile,
    free_port,
    kill_rank_1_after_a_checkpoint,
    run_as_the_search_does,
    train_args,
    vramcal,
)
from test_train import SPEC, SPEC_ARGS, make_profile
from test_train_data import synthetic_bars

from vramcal.api import worker_pool
from vramcal.cli import main
from vramcal.measure.device import host_device
from vramcal.measure.distributed import shard
from vramcal.measure.trial import TrialRequest, TrialRunner
from vramcal.models.registry import REGRESSOR
from vramcal.profile import load_profile, save_profile
from vramcal.records import TrialSettings, World
from vramcal.sizing import SizingError
from vramcal.sizing.sharding import at_world_size, fewest_ranks, state_shift
from vramcal.train import checkpoint
from vramcal.workload import TrainingStep

MIB = 2**20
TINY_LM = Path(__file__).resolve().parents[1] / "configs" / "mamba2-lm-tiny.json"


def fsdp_profile(whole_mib: float = 400, nproc: int = 2, gradient_mib: float = 0):
    """:func:`test_train.make_profile` (100 MiB + 24 MiB x batch in a 1 GiB budget) as a world of ``nproc`` FSDP
    ranks whose model states are ``whole_mib`` whole, ``gradient_mib`` of them gradients, each rank holding its
    share."""
    profile = make_profile(host_device())
    whole, grads = int(whole_mib * MIB), int(gradient_mib * MIB)
    return dataclasses.replace(profile, world=World(nproc, strategy="fsdp"), model_info={
        "model_state_bytes": whole, "rank_model_state_bytes": whole // nproc, "gradient_bytes": grads // nproc})


def test_a_rank_sheds_its_share_of_the_model_states_at_more_ranks_and_gains_it_at_fewer():
    profile = fsdp_profile(whole_mib=400)
    assert state_shift(profile, 2) == 0
    assert state_shift(profile, 4) == pytest.approx(-100 * MIB, abs=1)  # 400/4 - 400/2
    at_4, at_2 = at_world_size(profile, 4), at_world_size(profile, 2)
    assert at_2.measured and at_2.limits == profile.limits
    assert not at_4.measured and at_4.overhead_bytes == pytest.approx(profile.fit.overhead_bytes - 100 * MIB, abs=1)
    # 100 MiB more room at 24 MiB per sample: about 4 samples more per rank
    assert at_4.limits.safe_batch_size - profile.limits.safe_batch_size in (3, 4, 5)
    assert at_4.global_conservative == 4 * at_4.limits.conservative_batch_size


def test_the_gradients_do_not_move_with_the_world_size():
    """They are freed before the forward: the peak near the limits holds next to none (vramcal.sizing.sharding)."""
    assert state_shift(fsdp_profile(whole_mib=400, gradient_mib=100), 4) == pytest.approx(-75 * MIB, abs=1)


def test_a_ddp_rank_holds_the_whole_model_at_any_world_size():
    profile = dataclasses.replace(make_profile(host_device()), world=World(2))
    assert state_shift(profile, 8) == 0
    assert at_world_size(profile, 8).limits.safe_batch_size == profile.limits.safe_batch_size


def test_the_fewest_ranks_for_a_global_batch_counts_the_shards_a_rank_sheds():
    profile = fsdp_profile(whole_mib=400)
    per_rank = profile.limits.conservative_batch_size
    found = fewest_ranks(profile, 2 * per_rank)
    assert found.nproc == 2 and found.measured
    found = fewest_ranks(profile, 5 * per_rank)  # each rank of a bigger world fits more, so fewer than 5 are needed
    assert found.nproc < 5 and found.limits.conservative_batch_size * found.nproc >= 5 * per_rank
    assert fewest_ranks(profile, 10**6) is None  # the activations alone outgrow a rank
    ddp = dataclasses.replace(profile, world=World(2), model_info={})
    assert fewest_ranks(ddp, 5 * per_rank).nproc == 5


@pytest.mark.parametrize(("profile", "message"), [
    (make_profile(host_device()), "a single-process profile has no world to carry"),
    (dataclasses.replace(make_profile(host_device()), world=World(2, strategy="fsdp")),
     "does not record its model states"),
])
def test_a_profile_the_sharding_model_cannot_carry_says_how_to_make_one(profile, message):
    with pytest.raises(SizingError, match=message):
        at_world_size(profile, 4)


@pytest.mark.parametrize(("settings", "message"), [
    ({"strategy": "zero3"}, "strategy must be ddp or fsdp"),
    ({"reshard_after_forward": False}, "reshard_after_forward is a setting of FSDP, not of DDP"),
    ({"strategy": "fsdp", "static_graph": True}, "static_graph is a setting of DDP, not of FSDP"),
])
def test_a_world_with_the_other_strategys_settings_is_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        World(2, **settings)


def test_sharding_refuses_an_optimizer_that_already_stepped():
    """fully_shard replaces the parameters: state made for the old ones would be orphaned (or silently kept)."""
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    step = TrainingStep(model, optimizer, batch=lambda n: None, loss=lambda m, b: None)
    with pytest.raises(ValueError, match="already holds state"):
        shard(step, World(2, strategy="fsdp"))


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def test_limits_at_a_world_size_and_for_a_global_batch_on_the_hosts_budget(tmp_path):
    path = save_profile(fsdp_profile(), tmp_path / "fsdp.json")
    result = invoke("limits", str(path), "--world-size", "4")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "computed from that fit by the sharding model" in text and "optimizer state (400.00 MiB, counted" in text
    assert re.search(r"\|\s*4\s*\|", result.output)
    assert "computed (parameters and optimizer state -100.00 MiB per rank)" in result.output
    result = invoke("limits", str(path), "--global-batch", "40", "--json")
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output)["gpus"]
    assert row["fits"] and row["limits"]["conservative_batch_size"] * row["nproc"] >= 40
    result = invoke("limits", str(path), "--world-size", "4", "--seq-len", "32")
    assert result.exit_code == 2 and "--seq-len and --world-size ask different questions" in result.output


def test_limits_at_a_world_size_of_a_single_process_profile_is_one_line(tmp_path):
    path = save_profile(make_profile(host_device()), tmp_path / "one.json")
    result = invoke("limits", str(path), "--world-size", "4")
    assert result.exit_code == 1 and "a single-process profile has no world to carry" in result.output
    assert "Traceback" not in result.output


def test_probe_records_the_fsdp_world_and_its_settings(tmp_path, monkeypatch):
    """The measurement is faked (the real world is below): the world, the file's name and the settings' hash."""
    from test_documented import fake_measurement

    fake_measurement(monkeypatch)
    total = host_budget.budget(1536 * MIB)
    result = invoke("probe", "--gpu", "none", "--capacity", str(total), *SPEC_ARGS, "--nproc", "2", "--strategy",
                    "fsdp", "--no-reshard-after-forward", "--profiles-dir", str(tmp_path), "--no-report")
    assert result.exit_code == 0, result.output
    (path,) = tmp_path.rglob("*.json")
    assert load_profile(path).world == World(2, "gloo", strategy="fsdp", reshard_after_forward=False)
    assert re.search(r"-fsdp2-[0-9a-f]{6}-", path.name), path.name
    assert "FSDP 2 ranks (gloo, fully_shard per block, no reshard after forward)" in result.output
    result = invoke("probe", "--gpu", "none", *SPEC_ARGS, "--nproc", "2", "--bucket-cap-mb", "50", "--strategy", "fsdp")
    assert result.exit_code == 2 and "bucket_cap_mb is a setting of DDP, not of FSDP" in result.output


@pytest.mark.parametrize("world", [
    World(2, "gloo", strategy="fsdp", reshard_after_forward=False),
    World(2, "gloo", bucket_cap_mb=50, gradient_as_bucket_view=True, static_graph=True),
])
def test_the_probe_a_world_suggests_calibrates_that_world(world, tmp_path, monkeypatch):
    """The command a refusal names (the lookup's probe command, the world-difference hint) is read back by the
    probe itself: it must record the same world, strategy and settings included."""
    import shlex

    from test_documented import fake_measurement

    from vramcal.profile import world_difference
    from vramcal.sizing.lookup import probe_command

    fake_measurement(monkeypatch)
    total = host_budget.budget(1536 * MIB)
    device = host_device(total)
    command = probe_command(device, REGRESSOR.ref(SPEC, device, "auto"), world=world)
    assert " ".join(world.probe_args()) in command
    assert f"`vramcal probe {' '.join(world.probe_args())}`" in world_difference(None, world)
    result = invoke(*shlex.split(command)[1:], "--profiles-dir", str(tmp_path), "--no-report")
    assert result.exit_code == 0, result.output
    (path,) = tmp_path.rglob("*.json")
    assert load_profile(path).world == world


@pytest.mark.slow
def test_an_fsdp_world_trial_holds_half_the_model_states_on_each_rank():
    runner = TrialRunner(worker_pool())
    request = TrialRequest(SPEC.ref("transformers"), 16, host_device(host_budget.budget(1024 * MIB)),
                           settings=TrialSettings(timeout_s=60), world=World(2, strategy="fsdp"))
    (trial,) = run_as_the_search_does(runner, request)
    assert trial.ok and len(trial.rank_peak_bytes) == 2, trial.error
    whole, held = runner.context["model_state_bytes"], runner.context["rank_model_state_bytes"]
    assert whole / 2 <= held < 0.55 * whole  # dim-0 shards: rank 0 holds the larger half of an odd dimension
    ddp = TrialRunner(worker_pool())
    (replicated,) = run_as_the_search_does(ddp, dataclasses.replace(request, world=World(2)))
    assert replicated.ok and ddp.context["rank_model_state_bytes"] == ddp.context["model_state_bytes"] == whole



@pytest.mark.slow
def test_an_lm_world_trial_under_fsdp_shards_each_of_its_blocks():
    """What ``vramcal probe --nproc 2 --strategy fsdp --model lm --model-arg config=configs/mamba2-lm-tiny.json``
    runs at each batch size (the whole probe, 9 trials, took 2 min 46 s on the 2-core host and verified safe 87 and
    conservative 78 at 1.5 GiB): the lm family's step, each of its Mamba-2 blocks a unit by vramcal's default and the
    root (its tied embedding) another, each rank holding about half of its model states."""
    from vramcal.api import model_ref
    from vramcal.measure.distributed import shard_units
    from vramcal.workload import build

    device = host_device(host_budget.budget(1024 * MIB))
    ref = model_ref("lm", {"config": str(TINY_LM), "seq_len": 32}, device=device)
    assert len(shard_units(build(ref, torch.device("cpu")))) == json.loads(TINY_LM.read_text())["num_hidden_layers"]
    runner = TrialRunner(worker_pool())
    request = TrialRequest(ref, 8, device, settings=TrialSettings(timeout_s=60), world=World(2, strategy="fsdp"))
    (trial,) = run_as_the_search_does(runner, request)
    assert trial.ok and len(trial.rank_peak_bytes) == 2, trial.error
    whole, held = runner.context["model_state_bytes"], runner.context["rank_model_state_bytes"]
    assert whole / 2 <= held < 0.55 * whole

@pytest.mark.slow
def test_a_two_rank_fsdp_probe_is_verified_and_carried_to_three_ranks(tmp_path):
    total = host_budget.budget(1536 * MIB)
    result = invoke("probe", "--gpu", "none", "--capacity", str(total), *SPEC_ARGS, "--nproc", "2", "--strategy",
                    "fsdp", "--profiles-dir", str(tmp_path), "--no-report")
    assert result.exit_code == 0, result.output
    (path,) = tmp_path.rglob("*.json")
    profile = load_profile(path)
    assert profile.verified and profile.world.strategy == "fsdp", result.output
    info = profile.model_info
    assert info["model_state_bytes"] / 2 <= info["rank_model_state_bytes"] < 0.55 * info["model_state_bytes"]
    result = invoke("limits", str(path), "--world-size", "3", "--json")
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output)["gpus"]
    assert row["nproc"] == 3 and row["shift_bytes"] < 0 and not row["measured"]
    assert row["limits"]["safe_batch_size"] >= profile.limits.safe_batch_size


def test_cost_for_n_cards_of_a_worlds_profile(tmp_path):
    """``vramcal cost --world-size 4``: the per-rank batch carried by the sharding model, each rank a quarter of the
    samples at the rate its ranks measured, the world's samples/s and the price of 4 cards."""
    from vramcal.forecast import Dataset, forecast_profile
    from vramcal.sizing.sharding import carried

    from profiles_for_tests import timed_profile

    whole = 2 * 2**30  # of a 12 GiB card's trials, timed
    profile = dataclasses.replace(timed_profile(), world=World(2, "nccl", strategy="fsdp"), model_info={
        "model_state_bytes": whole, "rank_model_state_bytes": whole // 2, "gradient_bytes": 0})
    path = save_profile(profile, tmp_path / "fsdp.json")
    card = profile.device.name
    result = invoke("cost", str(path), "--world-size", "4", "--samples", "1000", "--val-samples", "0", "--price",
                    f"{card}=2", "--out", str(tmp_path), "--json")
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output)["forecasts"]
    at_4 = carried(profile, World(4, "nccl", strategy="fsdp"))
    rank = forecast_profile(at_4, Dataset(250, 0, "a quarter"), 10)  # one rank's share, alone
    assert row["ranks"] == 4 and row["batch_size"] == at_4.limits.conservative_batch_size
    assert row["batch_size"] > profile.limits.conservative_batch_size  # a rank of 4 holds less of the model
    assert row["price_per_hour"] == 8 and row["samples_per_s"] == pytest.approx(4 * rank.samples_per_s)
    assert row["run_s"] == pytest.approx(rank.run_s) and row["cost"] == pytest.approx(8 * rank.run_s / 3600)
    assert "4 cards under FSDP" in row["notes"][0] and "computed from its 2-rank fit" in row["notes"][0]
    one = save_profile(make_profile(host_device()), tmp_path / "one.json")
    result = invoke("cost", str(one), "--world-size", "4", "--samples", "1000", "--out", str(tmp_path))
    assert result.exit_code == 1 and "a single-process profile has no world to carry" in result.output


# --------------------------------------------------------------------------- training a sharded world

FSDP_WORLD = World(2, strategy="fsdp", reshard_after_forward=False)
FSDP_ARGS = ["--nproc-per-node", "2", "--strategy", "fsdp", "--no-reshard-after-forward"]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Bars, an FSDP world's profile (2 ranks, no reshard after forward, 1 GiB each) and a constant learning rate
    (so a run's LR does not depend on its total steps: a resumed run's schedule is an uninterrupted one's)."""
    tmp = tmp_path_factory.mktemp("fsdp-train")
    synthetic_bars(1200).to_parquet(tmp / "bars.parquet")
    path, _ = ddp_profile(tmp, 1024, slope_mib=24, world=FSDP_WORLD)
    (tmp / "constant-lr.json").write_text(json.dumps({"min_lr_fraction": 1.0}))
    return {"tmp": tmp, "profile": load_profile(path), "path": path}


@pytest.mark.slow
def test_an_fsdp_run_saved_and_resumed_trains_like_one_process_and_records_each_ranks_peak(sharded):
    """Its gathered checkpoint holds whole tensors; saved at step 3 and resumed to 5 by a plain ``--resume`` (the world,
    its ranks and settings, kept without naming them again), its weights are one process's after 5 steps at the
    summed batch; each rank's peak is recorded in the profile against the prediction for its batch."""
    tmp, profile = sharded["tmp"], sharded["profile"]
    b = profile.limits.conservative_batch_size
    lr = ["--config", str(tmp / "constant-lr.json")]
    first = vramcal(tmp, *train_args(tmp, "fsdp", *FSDP_ARGS, *lr, "--max-steps", "3", "--epochs", "3"))
    assert first.returncode == 0, first.stderr
    assert "training FSDP 2 ranks (gloo, fully_shard per block, no reshard after forward)" in first.stderr
    assert re.search(rf"ranks: 0: batch {b}, peak {SIZE}; 1: batch {b}, peak {SIZE} \(global batch {2 * b}\)",
                     first.stderr), first.stderr
    launched = json.loads((tmp / "fsdp" / "launch.json").read_text())
    assert launched["omp_num_threads"] == os.environ.get("OMP_NUM_THREADS")  # the caller's, not torchrun's 1
    saved = checkpoint.load_checkpoint(tmp / "fsdp" / checkpoint.LAST)
    assert saved["strategy"] == "fsdp" and all(type(t) is torch.Tensor for t in saved["model"].values())
    assert launched["nproc_per_node"] == 2 and launched["torchrun"] == {}
    resumed = vramcal(tmp, "train", "--resume", "--run-dir", str(tmp / "fsdp"), "--max-steps", "5")  # issue 59 item 13
    assert resumed.returncode == 0 and "continuing from" in resumed.stderr, resumed.stderr
    assert "training FSDP 2 ranks (gloo, fully_shard per block, no reshard after forward)" in resumed.stderr
    one = vramcal(tmp, *train_args(tmp, "one", *lr, "--batch-size", str(2 * b), "--max-steps", "5", "--epochs", "3",
                                   "--profiles-dir", str(tmp / "no-profiles")))
    assert one.returncode == 0, one.stderr
    a, c = (checkpoint.load_checkpoint(tmp / run / checkpoint.LAST) for run in ("fsdp", "one"))
    assert a["progress"]["step"] == c["progress"]["step"] == 5
    for name, tensor in c["model"].items():
        torch.testing.assert_close(a["model"][name], tensor, rtol=1e-4, atol=1e-6, msg=name)
    observed = load_profile(sharded["path"]).observations
    assert sorted((o.rank, o.world_size, o.batch_size) for o in observed) == [(0, 2, b), (0, 2, b), (1, 2, b),
                                                                             (1, 2, b)]
    sizing = json.loads((tmp / "fsdp" / checkpoint.RUN).read_text())["sizing"]  # the fit's, with the run's data
    assert sizing["batch_size"] == b and abs(sizing["predicted_peak_bytes"] - profile.fit.predict(b)) < MIB
    assert {o.predicted_peak_bytes for o in observed} == {sizing["predicted_peak_bytes"]}
    assert all(o.peak_bytes > 0 for o in observed)


@pytest.mark.slow
def test_a_killed_fsdp_run_resumes_from_its_gathered_checkpoint_and_only_as_fsdp(sharded):
    tmp = sharded["tmp"]
    args = train_args(tmp, "killed", *FSDP_ARGS, "--max-steps", "400", "--epochs", "50", "--checkpoint-steps", "2",
                      "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "killed")
    run_dir = tmp / "killed"
    run, _ = kill_rank_1_after_a_checkpoint(args, tmp, run_dir)
    out, err = run.communicate(timeout=120)
    errors = [line for line in err.splitlines() if line.startswith("Error")]
    assert run.returncode == 1 and "Traceback" not in err and len(errors) == 1 and "rank 1 failed" in errors[0], err
    kept = checkpoint.load_checkpoint(run_dir / checkpoint.LAST)  # whole: the kill left no half-written file
    assert kept["strategy"] == "fsdp"
    refused = vramcal(tmp, "train", "--resume", "--run-dir", str(run_dir), "--nproc-per-node", "2", "--strategy",
                      "ddp", "--max-steps", "1000")
    assert refused.returncode == 2 and "this run was started with --strategy fsdp and its checkpoints hold its state " \
        "that way: resume it without --strategy (or with --strategy fsdp)" in refused.stderr, refused.stderr
    step = kept["progress"]["step"]
    resumed = vramcal(tmp, "train", "--resume", "--run-dir", str(run_dir), "--nproc-per-node", "2", "--max-steps",
                      str(step + 2))
    assert resumed.returncode == 0 and f"{step} step(s) done" in resumed.stderr, resumed.stderr
    assert checkpoint.load_checkpoint(run_dir / checkpoint.LAST)["progress"]["step"] == step + 2


@pytest.mark.slow
def test_an_fsdp_run_against_a_ddp_profile_is_refused_naming_the_probe_that_makes_one(sharded, tmp_path):
    ddp_profile(tmp_path, 1024, slope_mib=24)  # the same model and budget, calibrated for DDP only
    tmp = sharded["tmp"]
    result = vramcal(tmp, *train_args(tmp, "refused", "--nproc-per-node", "2", "--strategy", "fsdp",
                                      "--reshard-after-forward", "--max-steps", "1", "--profiles-dir",
                                      str(tmp_path / "profiles")))
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error")]
    assert result.returncode == 1 and "Traceback" not in result.stderr and len(errors) == 1, result.stderr
    assert "for FSDP 2 ranks (gloo, fully_shard per block, reshard after forward)" in errors[0], errors[0]
    assert "--nproc 2 --strategy fsdp --d-model 32" in errors[0], errors[0]
    assert not checkpoint.has_checkpoint(tmp / "refused")


def test_a_plain_resume_takes_the_ranks_the_run_was_launched_with(tmp_path):
    """Issue 59 item 13: ``train --resume`` of a 2-rank FSDP run demanded ``--nproc-per-node 2`` and ``--strategy
    fsdp`` again. The run folder's launch.json says how it was launched (a record from before: its world's ranks); a
    run launched on several nodes is resumed on each as it was launched there."""
    from vramcal.train.distributed import LAUNCH, launched_ranks
    from vramcal.train.errors import TrainError

    assert launched_ranks(tmp_path) == (1, {})  # no launch.json: one process
    launch = {"world": FSDP_WORLD.to_dict(), "capacities": [], "nproc_per_node": 2,
              "torchrun": {"rdzv_backend": "c10d", "rdzv_endpoint": "127.0.0.1:29511"}}
    (tmp_path / LAUNCH).write_text(json.dumps(launch))
    assert launched_ranks(tmp_path) == (2, launch["torchrun"])
    (tmp_path / LAUNCH).write_text(json.dumps({"world": {**FSDP_WORLD.to_dict(), "nproc": 3}, "capacities": []}))
    assert launched_ranks(tmp_path) == (3, {})  # written before the launch was kept
    (tmp_path / LAUNCH).write_text(json.dumps({**launch, "torchrun": {"nnodes": "2"}}))
    with pytest.raises(TrainError, match="launched on several nodes .*--nproc-per-node 2 and the node's torchrun"):
        launched_ranks(tmp_path)


@pytest.mark.parametrize(("written", "sharded", "message"), [
    ({"strategy": "fsdp"}, False, "written by FSDP: resume it the same way (ranks under --strategy fsdp; a plain "
                                  "`vramcal train --resume --run-dir` resumes it as it was launched)"),
    ({}, True, "written by one process or DDP: resume it the same way (without --strategy fsdp; a plain"),
])
def test_a_checkpoint_loads_only_under_the_strategy_that_wrote_it(written, sharded, message):
    """The backstop behind the resume's own check (a run folder without launch.json: one process's run resumed as a
    world): the optimizer state of a gathered FSDP checkpoint is keyed by parameter name, a plain one by position."""
    from vramcal.train import states
    from vramcal.train.errors import TrainError

    model = torch.nn.Linear(4, 4)
    step = TrainingStep(model, torch.optim.AdamW(model.parameters()), batch=lambda n: None, loss=lambda m, b: None)
    with pytest.raises(TrainError, match=re.escape(message)):
        states.load(step, {"model": model.state_dict(), "optimizer": step.optimizer.state_dict(), **written}, sharded)


@pytest.mark.parametrize("caller", [None, "3"])
def test_a_rank_starts_its_worker_server_with_the_callers_omp_threads_not_torchruns(caller, monkeypatch):
    """torchrun sets OMP_NUM_THREADS=1 for its ranks where its caller had none; a worker server importing torch so
    holds ~80 MiB less data segment than the probe's did (OpenMP's and OpenBLAS's threads and buffers), which each
    worker inherits: the rank gives its server the caller's setting, recorded in launch.json by the launcher."""
    from vramcal.train import distributed

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as torchrun leaves it
    distributed.as_the_caller({distributed.OMP: caller})
    assert os.environ.get("OMP_NUM_THREADS") == caller
    distributed.as_the_caller({})  # a launch.json written before it was recorded: left as it is
    assert os.environ.get("OMP_NUM_THREADS") == caller
