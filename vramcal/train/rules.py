"""The trainer's rules that need no model: where a run is, a rank's share of the batch, the LR schedule and the
divergence checks (:mod:`vramcal.train.loop` applies them)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from vramcal.units import format_bytes

DIVERGED_RATIO = 10.0  # loss / zero-return loss: 10 times worse than predicting no move at all
DIVERGENCE_STEPS = 20  # steps the training loss is averaged over against the same batches' baseline
RISE_RATIO = 1.5  # last quarter of an epoch's step losses / its first, every quarter above the one before


@dataclass
class Progress:
    """Where a run is; saved in every checkpoint.

    Attributes:
        epoch, batch_in_epoch, step: completed epochs, batches done in the unfinished epoch, optimizer steps done.
        micro_batch_size: samples per forward/backward (halved on OOM). best_val_loss: the lowest so far.
        rows: everything in ``metrics.jsonl``.
        epoch_*: the unfinished epoch's figures, so a run resumed mid-epoch reports the whole epoch (losses and
            baselines for the divergence checks; tokens for the language model, 0 here).
    """

    epoch: int = 0
    batch_in_epoch: int = 0
    step: int = 0
    micro_batch_size: int = 0
    best_val_loss: float = math.inf
    rows: list[dict[str, Any]] = field(default_factory=list)
    epoch_loss_sum: float = 0.0
    epoch_samples: int = 0
    epoch_train_s: float = 0.0
    epoch_step_times: list[float] = field(default_factory=list)
    epoch_losses: list[float] = field(default_factory=list)
    epoch_baselines: list[float] = field(default_factory=list)
    epoch_tokens: int = 0
    epoch_padded_tokens: int = 0


@dataclass(frozen=True)
class Share:
    """This process's share of the global batch: every rank's batch size and, under DDP, the process group
    (:class:`vramcal.measure.distributed.Group`); one process holds the whole batch and no group."""

    batch_sizes: tuple[int, ...]
    rank: int = 0
    group: Any = None

    @property
    def global_batch(self) -> int:
        return sum(self.batch_sizes)

    @property
    def own(self) -> int:
        return self.batch_sizes[self.rank]

    @property
    def offset(self) -> int:
        return sum(self.batch_sizes[:self.rank])

    @property
    def weight(self) -> float:
        """The loss scale ``n_ranks × own / global``: DDP's mean of the ranks' gradients is then the global batch's
        mean-loss gradient (one update equals one step of a single process at the summed batch); 1 for one
        process."""
        return len(self.batch_sizes) * self.own / self.global_batch

    def summed(self, values: list[float]) -> list[float]:
        """``values`` summed over the ranks (one process: as they are)."""
        if self.group is None:
            return values
        import torch
        import torch.distributed as dist

        total = torch.tensor(values, dtype=torch.float64, device=self.group.device)
        dist.all_reduce(total)
        return total.tolist()

    def gathered(self, value: Any) -> list[Any]:
        return [value] if self.group is None else self.group.gather(value)


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_fraction: float) -> float:
    """Multiplier of the peak LR at ``step``: linear warm-up to 1, then cosine decay to ``min_fraction``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_fraction + (1 - min_fraction) * 0.5 * (1 + math.cos(math.pi * progress))


def diverged_loss(losses: list[float], baselines: list[float]) -> str | None:
    """Why the last :data:`DIVERGENCE_STEPS` steps' mean loss says the run diverged: above :data:`DIVERGED_RATIO`
    times their batches' zero-return loss (about 1 on standardised returns); None: it does not."""
    if len(losses) < DIVERGENCE_STEPS:
        return None
    loss, baseline = (statistics.fmean(v[-DIVERGENCE_STEPS:]) for v in (losses, baselines))
    if loss <= DIVERGED_RATIO * baseline:
        return None
    return (f"the training loss over the last {DIVERGENCE_STEPS} steps, {loss:.4g}, is {loss / baseline:.3g} times "
            f"the zero-return loss of the same batches ({baseline:.4g})")


def validation_text(row: dict[str, Any]) -> str:
    """``  validation peak 1.20 GiB at batch_size 512 (predicted 1.18 GiB, +1.7%)`` of an epoch's row, with a warning
    above usable memory; "" without a peak."""
    peak, predicted = row.get("val_peak_bytes"), row.get("val_predicted_peak_bytes")
    usable = row.get("val_usable_bytes")
    if peak is None:
        return ""
    against = f" (predicted {format_bytes(predicted)}, {(peak - predicted) / predicted:+.1%})" if predicted else ""
    above = (f"; warning: above usable memory {format_bytes(usable)}: a smaller --val-batch-size is safer"
             if usable is not None and peak > usable else "")
    return f"  validation peak {format_bytes(peak)} at batch_size {row['val_batch_size']}{against}{above}"


def diverged_validation(val_loss: float, zero_loss: float) -> str | None:
    """Why the validation loss is above :data:`DIVERGED_RATIO` times the zero-return one (None: not)."""
    if val_loss <= DIVERGED_RATIO * zero_loss:
        return None
    return (f"the validation loss {val_loss:.4g} is {val_loss / zero_loss:.3g} times the zero-return baseline's "
            f"{zero_loss:.4g}")


def rising(losses: list[float]) -> str | None:
    """Why an epoch's step losses say the run diverged: each quarter's mean above the one before and the last
    :data:`RISE_RATIO` times the first (None: not so, or fewer than 8 steps)."""
    if len(losses) < 8:
        return None
    n = len(losses)
    quarters = [statistics.fmean(losses[i * n // 4:(i + 1) * n // 4]) for i in range(4)]
    if not all(b > a for a, b in zip(quarters, quarters[1:])) or quarters[3] < RISE_RATIO * quarters[0]:
        return None
    return (f"the training loss rose through the whole epoch, quarter by quarter from {quarters[0]:.4g} to "
            f"{quarters[3]:.4g}")
