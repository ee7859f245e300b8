"""The integrations under FSDP (issue 40 item 3): the world each framework's run trains in, read from its own settings
(vramcal.integrations.worlds), the profile of that world found or carried by the sharding model, and a real 2-rank
Lightning FSDP fit (ModelParallelStrategy, fully_shard, gloo) sized by the callback.

Lightning's FSDP2 runs on the host (ModelParallelStrategy on 2 CPU ranks with gloo): tested for real. Accelerate keeps
its FSDP plugin for GPUs (on the CPU a world of several processes is MULTI_CPU and its model DistributedDataParallel,
whatever plugin it was given: measured, 2 processes of torchrun), so the Hugging Face Trainer's and Accelerate's FSDP
worlds are tested at the boundary: the plugin's settings as the frameworks make them, read as on a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from test_lightning import profile_here

from vramcal.integrations import hf, lightning
from vramcal.integrations.run import FrameworkRun
from vramcal.integrations.worlds import plugin_world, sharded_world
from vramcal.profile import load_profile, save_profile
from vramcal.records import World
from vramcal.sizing import SizingError
from vramcal.sizing.lookup import NoProfileError
from vramcal.sizing.sharding import carried

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
FSDP2 = World(2, strategy="fsdp")


def world_profile(world: World, whole_mib: float = 400):
    """:func:`test_lightning.profile_here` (600 MiB + 100 MiB per sample in 8 GiB) as a profile of ``world`` whose
    model states are ``whole_mib`` whole (a quarter of them gradients), each FSDP rank holding its share."""
    profile = profile_here()
    whole = int(whole_mib * MIB)
    share = world.nproc if world.strategy == "fsdp" else 1
    return dataclasses.replace(profile, world=world, model_info={
        "model_state_bytes": whole, "rank_model_state_bytes": whole // share, "gradient_bytes": whole // 4 // share})


def run(tmp_path, world: World, *profiles: World, **kwargs) -> tuple[FrameworkRun, list[str], list[str]]:
    """A FrameworkRun in ``world`` finding its profile among ``profiles`` (one file each) under tmp_path; what it
    said as information and as warnings."""
    for index, calibrated in enumerate(profiles):
        save_profile(world_profile(calibrated), tmp_path / f"p{index}.json")
    said, warned = [], []
    found = FrameworkRun(model=profile_here().model, profiles_dir=tmp_path, world=world, inform=said.append,
                         warn=warned.append, **kwargs)
    return found, said, warned


def test_an_fsdp_run_takes_its_worlds_profile_as_measured(tmp_path):
    found, said, _ = run(tmp_path, FSDP2, World(2), FSDP2, World(3, strategy="fsdp"))
    assert found.profile.world == FSDP2 and found.path is not None and not any("carried" in s for s in said)
    assert found.sizing.conservative_batch_size == found.profile.limits.conservative_batch_size


def test_a_profile_of_the_same_strategy_at_another_size_is_carried_and_said(tmp_path):
    found, said, _ = run(tmp_path, World(4, strategy="fsdp"), World(2), FSDP2)
    expected = carried(world_profile(FSDP2), World(4, strategy="fsdp"))
    assert found.profile.world.nproc == 4 and found.profile.limits == expected.limits
    # 300 MiB of parameters and optimizer state: a rank sheds 150 - 75 MiB at 4 ranks, room for more samples
    assert found.profile.limits.safe_batch_size > world_profile(FSDP2).limits.safe_batch_size
    (notice,) = [s for s in said if "carried" in s]
    assert "calibrated for FSDP 2 ranks" in notice and "carried to 4 ranks by the sharding model" in notice
    assert "150.00 MiB -> 75.00 MiB" in notice and "computed, not measured" in notice
    assert found.path is None and "carried to 4 ranks" in found.source  # the run is not recorded in it
    assert any("not verified" in n for n in found.sizing.notices)  # its limits are computed, not verified


def test_a_ddp_profile_carries_to_another_ddp_size_unmoved(tmp_path):
    found, said, _ = run(tmp_path, World(3), World(2))
    assert found.profile.limits.safe_batch_size == world_profile(World(2)).limits.safe_batch_size
    assert any("a DDP rank holds the whole model at any size" in s for s in said)


def test_a_profile_of_another_strategy_is_refused_in_one_line(tmp_path):
    with pytest.raises(NoProfileError) as error:
        run(tmp_path, FSDP2, World(2))
    assert "--nproc 2 --strategy fsdp" in str(error.value) and "\n" not in str(error.value)
    path = save_profile(world_profile(World(2)), tmp_path / "ddp.json")
    with pytest.raises(SizingError, match=r"calibrated for DDP 2 ranks.*this run is FSDP 2 ranks.*--strategy fsdp`"):
        FrameworkRun(path, world=FSDP2)
    other = World(2, strategy="fsdp", reshard_after_forward=False)
    with pytest.raises(SizingError, match="no reshard after forward"):
        FrameworkRun(save_profile(world_profile(other), tmp_path / "keep.json"), world=World(3, strategy="fsdp"))


def test_a_profile_without_its_model_states_is_not_carried(tmp_path):
    path = save_profile(dataclasses.replace(world_profile(FSDP2), model_info={}), tmp_path / "old.json")
    with pytest.raises(SizingError, match="does not record its model states"):
        FrameworkRun(path, world=World(3, strategy="fsdp"))


def test_lightnings_fsdp1_and_tensor_parallel_strategies_are_refused_in_one_line():
    """Lightning builds no Trainer with FSDPStrategy (FSDP1) on the CPU ('requires a GPU accelerator'): the
    strategy is read where the callback reads it, from a stand-in trainer of 2 ranks."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    with pytest.raises(SizingError, match=r"Lightning's FSDPStrategy is FSDP1 .*ModelParallelStrategy.*--nproc 2 "
                                          r"--strategy fsdp"):
        lightning._world(types.SimpleNamespace(strategy=FSDPStrategy(), world_size=2))
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
    with pytest.raises(SizingError, match="tensor_parallel_size 2"):
        lightning._sharded_later(Trainer(accelerator="cpu", devices=2, strategy=strategy))


@pytest.fixture
def one_rank(tmp_path):
    """A world of one gloo rank in this process, for fully_shard to shard modules in (left at the end)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def sharded(reshard: tuple[bool, bool], **options) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    for unit, keep in zip(model, reshard):
        fully_shard(unit, reshard_after_forward=keep, **options)
    return fully_shard(model, **options)


def test_a_sharded_modules_world_is_read_from_its_units(one_rank):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    assert sharded_world(sharded((False, False)), 2, "gloo", "it") == World(2, strategy="fsdp",
                                                                             reshard_after_forward=False)
    assert sharded_world(sharded((True, True)), 2, "gloo", "it") == FSDP2
    for module, why in ((sharded((True, False)), "reshards some units after the forward and not others"),
                        (sharded((True, True), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
                         "mixed-precision policy"),
                        (sharded((True, True), offload_policy=CPUOffloadPolicy(pin_memory=False)),
                         "offloads the shards"),
                        (torch.nn.Linear(2, 2), "sharded no module with fully_shard")):
        with pytest.raises(SizingError, match=why):
            sharded_world(module, 2, "gloo", "it")


def test_the_trainers_and_accelerates_fsdp_plugins_are_read_as_on_a_gpu():
    """Accelerate trains FSDP on GPUs only: the plugins as the frameworks make them, read as on a GPU; on the host the
    same arguments train (and are sized as) DDP."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import TrainingArguments

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = TrainingArguments(output_dir="/tmp/unused", use_cpu=True, fsdp=True,
                                 fsdp_config={"version": 2, "reshard_after_forward": False})
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_offload=True)
    given = args.fsdp_plugin_args
    assert plugin_world(2, "cuda", given["fsdp_version"], given["reshard_after_forward"], False, "it") == World(
        2, "nccl", strategy="fsdp", reshard_after_forward=False)
    with pytest.raises(SizingError, match=r"it \(fsdp_version 1\) is FSDP1.*set the FSDP version to 2"):
        plugin_world(2, "cuda", 1, "full_shard", False, "it")
    with pytest.raises(SizingError, match="offloads the shards"):
        plugin_world(2, "cuda", 2, True, type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy", "it")
    on_host = types.SimpleNamespace(world_size=2, device=torch.device("cpu"), fsdp_plugin_args=given)
    with pytest.warns(UserWarning, match="this CPU run trains DDP"):
        assert hf._world(on_host) == World(2)


@pytest.mark.slow
def test_a_lightning_fsdp_fit_on_2_ranks_is_sized_by_the_callback(tmp_path):
    """Lightning's ModelParallelStrategy on 2 gloo ranks, each Mamba-2 block and the root sharded with fully_shard in
    configure_model (bench.lightning_fsdp's fit, the small spec, 2 steps): the callback reads the FSDP world from the
    sharded module, carries a 3-rank profile to it and measures both ranks' peaks."""
    profile = world_profile(World(3, strategy="fsdp"), whole_mib=2400)  # a rank of 2 holds 300 MiB more
    path, out = save_profile(profile, tmp_path / "fsdp3.json"), tmp_path / "fit.json"
    done = subprocess.run([sys.executable, "-m", "bench.lightning_fsdp", "--child", "--profile", str(path), "--spec",
                           "small", "--steps", "2", "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["world"] == "FSDP 2 ranks (gloo, fully_shard per block, reshard after forward)"
    assert result["source"] == f"{path}, carried to 2 ranks" and result["steps"] == 2
    at_2 = carried(load_profile(path), FSDP2).limits.conservative_batch_size  # Lightning's gradient term may lower it
    assert result["batch_size"] == result["conservative"] <= at_2 < profile.limits.conservative_batch_size
    assert len(result["ranks"]) == 2 and all(r["peak_bytes"] > 100 * MIB for r in result["ranks"])
    assert "carried to 2 ranks by the sharding model" in done.stderr + done.stdout
