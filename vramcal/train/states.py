"""A checkpoint's model and optimizer state: as they are for one process and DDP, gathered whole onto rank 0's CPU
under FSDP (PyTorch's ``torch.distributed.checkpoint.state_dict`` API, ``full_state_dict=True``), so the run
folder keeps one file per checkpoint whatever the world size. Why, and the cost: DESIGN.md "Several processes: DDP
and FSDP"."""

from __future__ import annotations

from typing import Any

from vramcal.train.checkpoint import non_finite_tensors
from vramcal.train.errors import TrainError
from vramcal.workload import TrainingStep

STRATEGY = "strategy"  # the checkpoint key: "fsdp" for gathered FSDP state dicts; absent for one process and DDP


def gather(step: TrainingStep, sharded: bool) -> dict[str, Any]:
    """The checkpoint's ``model`` and ``optimizer`` entries (plus ``{STRATEGY: "fsdp"}`` under FSDP, a collective
    every rank calls: rank 0 receives the full state dicts, the others empty ones)."""
    if not sharded:
        return {"model": step.model.state_dict(), "optimizer": step.optimizer.state_dict()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict  # loads torch: only here

    model, optimizer = get_state_dict(step.model, step.optimizer,
                                      options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": model, "optimizer": optimizer, STRATEGY: "fsdp"}


def load(step: TrainingStep, state: dict[str, Any], sharded: bool) -> None:
    """Load a checkpoint's model and optimizer state into ``step`` (under FSDP a collective: every rank keeps its own
    shard).

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
    """Names of the model's weights holding a NaN or an infinity; under FSDP each rank checks its shards and the
    names are joined (a collective), so all take the same decision."""
    if not sharded:
        return non_finite_tensors(step.model.state_dict())
    local = {name: t.to_local() if hasattr(t, "to_local") else t for name, t in step.model.state_dict().items()}
    return sorted({name for names in share.gathered(non_finite_tensors(local)) for name in names})
