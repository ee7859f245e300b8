"""A rank of a DDP world in a worker process: joining the world, the model wrapped, failures agreed.

A DDP trial (:func:`vramcal.measure.trial.measure_rank`) and a training rank (:mod:`vramcal.train.worker`) run
the same sequence in a worker forked from vramcal's server, after the meter has pinned the rank's device::

    group = join(world, rank, init_method, timeout_s)   # torch.distributed.init_process_group
    step = build(...)
    group.agree(True)                                   # every rank built its step, or all stop
    model = wrap(step.model, world, device)             # torch.nn.parallel.DistributedDataParallel
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
        device: the rank's torch device; the agreement flags live there (NCCL needs CUDA tensors).
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(world.threads_per_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(world.backend, init_method=init_method, rank=rank, world_size=world.nproc,
                            timeout=dt.timedelta(seconds=timeout_s))
    return Group(rank, world.nproc, device)


def wrap(model: torch.nn.Module, world: World, device: torch.device) -> torch.nn.Module:
    """``model`` in ``torch.nn.parallel.DistributedDataParallel`` with the world's memory-relevant settings."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                   bucket_cap_mb=world.bucket_cap_mb,
                                   gradient_as_bucket_view=world.gradient_as_bucket_view,
                                   find_unused_parameters=world.find_unused_parameters,
                                   static_graph=world.static_graph)


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
