"""What a checkpoint holds of the model and its optimizer, and loading it back: as they are for one process and DDP,
gathered whole onto rank 0 under FSDP.

One process and a DDP world hold the whole model on every rank: rank 0 saves ``model.state_dict()`` and
``optimizer.state_dict()`` as they are. An FSDP world (``fully_shard``: each rank holds a DTensor shard of every
parameter and of its AdamW state) saves the *full* state dicts, gathered onto rank 0's CPU by PyTorch's distributed
state-dict API (``torch.distributed.checkpoint.state_dict.get_state_dict`` with ``full_state_dict=True,
cpu_offload=True``: a collective every rank joins; each parameter is all-gathered in turn and copied to the CPU, the
other ranks get empty dicts); rank 0 then writes them into the run's usual checkpoint file
(:mod:`vramcal.train.checkpoint`: one file, written atomically, the previous one kept). Loading is the inverse: every
rank reads the file and ``set_state_dict(..., full_state_dict=True)`` keeps its own shard of each tensor. The
optimizer's state is keyed by parameter name (the API's layout), so a checkpoint records the strategy it was written
under (:data:`STRATEGY`) and a resume under another one is refused.

Why gathered and not a distributed checkpoint (``torch.distributed.checkpoint.save``, one file per rank): the run
folder keeps one file per checkpoint, so its promises (atomic, previous kept, best kept, a truncated one passed over)
hold as they are, and the file does not depend on the world size (a run resumes at another ``--nproc-per-node``).
The cost: during a save rank 0's host memory holds one whole copy of the parameters and the optimizer state (the
card only one parameter at a time, with ``cpu_offload``); a model whose state does not fit one host's memory needs
the distributed checkpoint instead. Sources: PyTorch's ``torch.distributed.checkpoint.state_dict`` documentation
and its FSDP2 notes.
"""

from __future__ import annotations

from typing import Any

from vramcal.train.checkpoint import non_finite_tensors
from vramcal.train.errors import TrainError
from vramcal.workload import TrainingStep

STRATEGY = "strategy"  # the checkpoint key: "fsdp" for gathered FSDP state dicts; absent for one process and DDP


def gather(step: TrainingStep, sharded: bool) -> dict[str, Any]:
    """The checkpoint's ``model`` and ``optimizer`` entries (module docstring); under FSDP a collective every rank
    must call, rank 0 receiving the full state dicts on its CPU and the others empty ones.

    Returns:
        ``{"model": ..., "optimizer": ...}``, plus ``{STRATEGY: "fsdp"}`` under FSDP.
    """
    if not sharded:
        return {"model": step.model.state_dict(), "optimizer": step.optimizer.state_dict()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict  # loads torch: only here

    model, optimizer = get_state_dict(step.model, step.optimizer,
                                      options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": model, "optimizer": optimizer, STRATEGY: "fsdp"}


def load(step: TrainingStep, state: dict[str, Any], sharded: bool) -> None:
    """Load a checkpoint's model and optimizer state into ``step`` (under FSDP a collective: every rank passes the
    whole state it read and keeps its own shard).

    Raises:
        TrainError: the checkpoint was written under another strategy (one line: how to resume it).
    """
    written = state.get(STRATEGY, "ddp")
    if (written == "fsdp") != sharded:
        wanted, flag = (("FSDP", "ranks under --strategy fsdp") if written == "fsdp" else
                        ("one process or DDP", "without --strategy fsdp"))
        raise TrainError(f"this run's checkpoints were written by {wanted}: resume it the same way ({flag}; a plain "
                         f"`vramcal train --resume --run-dir` resumes it as it was launched)")
    if not sharded:
        step.model.load_state_dict(state["model"])
        step.optimizer.load_state_dict(state["optimizer"])
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict  # loads torch: only here

    set_state_dict(step.model, step.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(full_state_dict=True))


def non_finite_weights(step: TrainingStep, share: Any, sharded: bool) -> list[str]:
    """Names of the model's weights holding a NaN or an infinity; under FSDP each rank checks its own shards and the
    ranks' names are joined (a collective every rank must call), so all take the same decision."""
    if not sharded:
        return non_finite_tensors(step.model.state_dict())
    local = {name: t.to_local() if hasattr(t, "to_local") else t for name, t in step.model.state_dict().items()}
    return sorted({name for names in share.gathered(non_finite_tensors(local)) for name in names})
