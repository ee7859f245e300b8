"""A rank of a data-parallel world (DDP or FSDP2) in a worker process: joining the world, the model wrapped or
sharded, failures agreed.

A world's trial (:func:`vramcal.measure.trial.measure_rank`) and a training rank (:mod:`vramcal.train.worker`) run
the same sequence in a worker forked from vramcal's server, after the meter has pinned the rank's device::

    group = join(world, rank, init_method, timeout_s)   # torch.distributed.init_process_group
    step = build(...)
    group.agree(True)                                   # every rank built its step, or all stop
    model = wrap(step, world, device)                   # DistributedDataParallel, or FSDP2's fully_shard
    ... steps through ``model`` ...
    group.close()

Failures: a rank that fails outside a collective (building its step, drawing a batch) says so at the next
:meth:`Group.agree`, where every rank learns it and stops with one line; a failure inside a step, while the
others wait in DDP's gradient all-reduce, is seen by the caller, which stops the world
(:meth:`vramcal.measure.worker.Workers.run_all`); every collective is bounded by the process group's
timeout, the trial's time limit.
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
        """Whether every rank is ``ok`` (an all-reduce of a flag: the minimum over the ranks).

        Raises:
            PeerFailed: this rank is ok and another is not.
        """
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if ok else 0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if ok and not int(flag.item()):
            raise PeerFailed(f"rank {self.rank} stops: another rank of the world failed")
        return bool(flag.item())

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
    file for vramcal's own trials), with ``world.threads_per_rank`` intra-op threads.

    Args:
        timeout_s: the bound of every collective (a rank that waits longer raises).
        device: the rank's torch device; the agreement flags live there (NCCL needs CUDA tensors). A GPU rank's
            card is the only one its worker sees (the meter pinned it by UUID), so ``cuda`` is index 0: it is set
            as the current device (``torch.cuda.set_device`` takes no index-less device: torch's
            ``_get_device_index(..., optional=False)`` raises) and bound at init (``init_process_group``'s
            ``device_id``: NCCL forms its communicator there); without it FSDP2's default mesh
            (``init_device_mesh``) would set the device to ``LOCAL_RANK``, no card in a worker that sees one.
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(world.threads_per_rank)
    bound = torch.device(device.type, device.index or 0) if device.type == "cuda" else None
    if bound is not None:
        torch.cuda.set_device(bound)  # before FSDP2's default mesh, which would set the device to LOCAL_RANK
    dist.init_process_group(world.backend, init_method=init_method, rank=rank, world_size=world.nproc,
                            timeout=dt.timedelta(seconds=timeout_s), device_id=bound)
    return Group(rank, world.nproc, device)


def wrap(step: TrainingStep, world: World, device: torch.device) -> torch.nn.Module:
    """The module a rank's steps go through: ``step.model`` in ``torch.nn.parallel.DistributedDataParallel`` with
    the world's memory-relevant settings, or sharded in place by FSDP2 (:func:`shard`).

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
    """The submodules ``fully_shard`` wraps before the root: the factory's ``step.shard_units``, else every
    Mamba-2 block of ``step.model`` (:data:`BLOCK_CLASSES`, the first class that occurs), else none (the root
    alone is one unit)."""
    if step.shard_units is not None:
        return tuple(step.shard_units)
    for name in BLOCK_CLASSES:
        units = tuple(m for m in step.model.modules() if type(m).__name__ == name)
        if units:
            return units
    return ()


def shard(step: TrainingStep, world: World) -> torch.nn.Module:
    """Shard ``step.model`` across the world in place with FSDP2, as torchtitan does: ``fully_shard`` on each
    unit (:func:`shard_units`) and then on the root, with ``world.reshard_after_forward``; the optimizer's
    parameter groups are pointed at the sharded parameters (``fully_shard`` replaces each parameter by a
    DTensor of its shard, PyTorch's FSDP2 notes), so the factory builds its optimizer as it would for one
    process. Returns the model, now an ``FSDPModule``.

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
    """Bytes this rank holds of ``tensors`` (elements times element size): a DTensor's local shard, any other
    tensor whole."""
    return sum(local.numel() * local.element_size()
               for local in (t.to_local() if hasattr(t, "to_local") else t for t in tensors))


def build_agreed(group: Group, build: Any) -> Any:
    """``build()`` on every rank, agreed: a rank whose build raised tells the others (which stop with
    :class:`PeerFailed`), then raises its own error."""
    try:
        built = build()
    except BaseException:
        group.agree(False)
        raise
    group.agree(True)
    return built
