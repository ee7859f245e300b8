"""A rank of a data-parallel world (DDP or FSDP2) in a worker process: joining the world, the model wrapped or
sharded, failures agreed.

A world's trial (:func:`vramcal.measure.trial.measure`) and a training rank (:mod:`vramcal.train.worker`) run
:func:`join`, the step built on every rank (:func:`build_agreed`), :func:`wrap`, the steps, ``group.close()``. A rank
failing outside a collective says so at the next :meth:`Group.agree`, and every rank stops; one failing inside a
step is seen by the caller, which stops the world (:meth:`vramcal.measure.worker.Workers.run_all`). Every
collective is bounded by the process group's timeout, the trial's time limit.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from vramcal.records import World
    from vramcal.workload import TrainingStep


class PeerFailed(RuntimeError):
    """Another rank of the world failed; this one stops with it (the other rank's error is the cause)."""


@dataclass
class Group:
    """This process's place in the world: its rank, the world's size, the device of its collectives."""

    rank: int
    size: int
    device: Any

    def agree(self, ok: bool) -> bool:
        """Whether every rank is ``ok`` (:meth:`all_of`).

        Raises:
            PeerFailed: this rank is ok and another is not.
        """
        everyone = self.all_of(ok)
        if ok and not everyone:
            raise PeerFailed(f"rank {self.rank} stops: another rank of the world failed")
        return everyone

    def all_of(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (an all-reduce of the minimum; no rank fails by it)."""
        import torch
        import torch.distributed as dist

        value = torch.tensor([1 if flag else 0], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return bool(value.item())

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (plain Python data), rank 0 first."""
        import torch.distributed as dist

        values: list[Any] = [None] * self.size
        dist.all_gather_object(values, value)
        return values

    def close(self) -> None:
        """Leave the world (``torch.distributed.destroy_process_group``)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def join(world: World, rank: int, init_method: str, timeout_s: float, device: torch.device) -> Group:
    """Join ``world`` as ``rank`` (``torch.distributed.init_process_group``; ``env://`` under torchrun, a shared
    file for vramcal's trials), with ``world.threads_per_rank`` intra-op threads.

    Args:
        timeout_s: the bound of every collective.
        device: the rank's torch device (the agreement flags live there). A GPU rank's one visible card is set as
            current device with an index (``torch.cuda.set_device`` refuses none) and bound at init (``device_id``),
            before FSDP2's default mesh would set it to ``LOCAL_RANK``.
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(world.threads_per_rank)
    bound = torch.device(device.type, device.index or 0) if device.type == "cuda" else None
    if bound is not None:
        torch.cuda.set_device(bound)
    dist.init_process_group(world.backend, init_method=init_method, rank=rank, world_size=world.nproc,
                            timeout=dt.timedelta(seconds=timeout_s), device_id=bound)
    return Group(rank, world.nproc, device)


def wrap(step: TrainingStep, world: World, device: torch.device) -> torch.nn.Module:
    """The module a rank's steps go through: ``step.model`` in ``DistributedDataParallel`` with the world's settings,
    or sharded in place by FSDP2 (:func:`shard`).

    Raises:
        ValueError: FSDP over a model with no parameter to shard.
    """
    if world.strategy == "fsdp":
        return shard(step, world)
    from torch.nn.parallel import DistributedDataParallel  # loads torch: only when called

    return DistributedDataParallel(step.model, device_ids=[device] if device.type == "cuda" else None,
                                   bucket_cap_mb=world.bucket_cap_mb,
                                   gradient_as_bucket_view=world.gradient_as_bucket_view,
                                   find_unused_parameters=world.find_unused_parameters,
                                   static_graph=world.static_graph)


# the units fully_shard wraps by default: transformers' Mamba-2 block (mixer and norm), else mamba_ssm's mixer
BLOCK_CLASSES = ("Mamba2Block", "Mamba2")


def shard_units(step: TrainingStep) -> tuple[torch.nn.Module, ...]:
    """The submodules ``fully_shard`` wraps before the root: ``step.shard_units``, else every block of the first of
    :data:`BLOCK_CLASSES` in ``step.model``, else none."""
    if step.shard_units is not None:
        return tuple(step.shard_units)
    for name in BLOCK_CLASSES:
        units = tuple(m for m in step.model.modules() if type(m).__name__ == name)
        if units:
            return units
    return ()


def shard(step: TrainingStep, world: World) -> torch.nn.Module:
    """Shard ``step.model`` in place with FSDP2, as torchtitan does (``fully_shard`` on each of :func:`shard_units`,
    then the root), and point the optimizer's groups at the sharded DTensor parameters (PyTorch's FSDP2 notes).
    Returns the model, now an ``FSDPModule``.

    Raises:
        ValueError: the optimizer already holds state (a step ran before sharding), or a parameter it holds is
            not the model's.
    """
    from torch.distributed.fsdp import fully_shard  # loads torch: only when called

    model, optimizer = step.model, step.optimizer
    if optimizer.state:
        raise ValueError("the factory's optimizer already holds state: under FSDP the model is sharded before the "
                         "first step, so return the optimizer before any step")
    names = {id(p): name for name, p in model.named_parameters()}
    for unit in shard_units(step):
        fully_shard(unit, reshard_after_forward=world.reshard_after_forward)
    fully_shard(model, reshard_after_forward=world.reshard_after_forward)
    sharded = dict(model.named_parameters())
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise ValueError(f"the optimizer holds a parameter of shape {tuple(missing[0].shape)} that is not the "
                             f"model's: under FSDP it must optimize the model's own parameters")
        group["params"] = [sharded[names[id(p)]] for p in group["params"]]
    return model


def local_bytes(tensors: Any) -> int:
    """Bytes this rank holds of ``tensors``: a DTensor's local shard, any other tensor whole."""
    return sum(local.numel() * local.element_size()
               for local in (t.to_local() if hasattr(t, "to_local") else t for t in tensors))


def build_agreed(group: Group, build: Any) -> Any:
    """``build()`` on every rank, agreed: a rank whose build raised tells the others (:class:`PeerFailed`), then
    raises."""
    try:
        built = build()
    except BaseException:
        group.agree(False)
        raise
    group.agree(True)
    return built
