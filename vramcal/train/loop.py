"""The training loop, run inside a worker process: epochs at the planned batch size, validation, metrics,
checkpoints and fallbacks.

The step is the regressor's :class:`~vramcal.workload.TrainingStep` built by the same factory a trial
builds (:func:`vramcal.models.regressor.training_step`), in the same kind of process, measured by the same
meter (:func:`vramcal.measure.meters.open_meter`): the profile's memory model describes this loop. AdamW,
linear warm-up then cosine decay to ``min_lr_fraction`` of the peak LR, gradient clipping; fp32 weights,
bf16 autocast on CUDA when the spec's dtype policy says so.

Peaks: the meter is reset after the run's first optimizer step (as a trial resets after its warm-up) and
at the start of each later epoch; each epoch's row carries the peak over its steps and its validation
pass, by the trials' definition.

Times, as a trial times its steps: ``train_s`` is the sum of the epoch's step times (each from gathering its
batch to the loss read back, which waits for the device), ``val_s`` the validation pass, and ``epoch_s`` their
sum: what the run forecast (:mod:`vramcal.forecast`) forecasts for an epoch.

Out of memory anyway (another process took memory, fragmentation): the step is retried with the
micro-batch halved and gradients accumulated over ``ceil(batch / micro)`` micro-batches, each loss
scaled by its share of the batch, so the effective batch and the gradient stay the same; validation
halves its chunk the same way. The event is printed and recorded in ``metrics.jsonl``. At a micro-batch
of one the run stops with one line naming the last good checkpoint.

A non-finite loss or gradient norm stops the run before the optimizer steps (the weights stay the last
good ones) with a :class:`NonFiniteError`, and that last finite state is saved as the last checkpoint (a
NaN at step 2 keeps step 1); a non-finite validation loss or weight after an epoch stops it too, keeping
the checkpoints there are. No checkpoint ever holds non-finite weights. A checkpoint that cannot be written
(a full disk) stops the run with one line naming the file and the last good checkpoint.

A run that diverges stops with a :class:`DivergedError` (the learning rate is too high), saving nothing
more: its loss is far above the zero-return baseline's (:data:`DIVERGED_RATIO` times the mean squared
target of the same batches over the last :data:`DIVERGENCE_STEPS` steps, or of the validation set after an
epoch), or it rose through a whole epoch (each quarter of the epoch's steps above the one before, the
last :data:`RISE_RATIO` times the first). The regressor's targets are standardised returns, so the baseline
is about 1 and a model that learns nothing scores it.

Resuming with another ``epochs`` or ``max_steps``: the warm-up stays as the run started, and the cosine
decay is stretched (or shortened) to the new total from the current step.

Under DDP (a :class:`Share` of a world) each step takes the next global batch of the epoch's order and
each rank its own slice of it, sized by its own profile; each rank's loss is scaled by
``n_ranks × own / global`` so that DDP's average of the gradients is the gradient of the global batch's
mean loss (one update equals one step of a single process at the summed batch), and an incomplete last
global batch is left out of the epoch. Validation is sharded over the ranks and summed. Every decision
(a non-finite loss, the end) is taken on figures summed over the ranks, so all ranks take it together;
rank 0 alone writes checkpoints and metrics. An out-of-memory error under DDP ends the run on every rank
(halving one rank's micro-batch would desynchronise the ranks' gradient reductions). Under FSDP (the model sharded
by ``fully_shard``, :func:`vramcal.measure.distributed.shard`) the same holds, its reduce-scatter averaging as DDP's
all-reduce does; a save gathers the whole state onto rank 0 with every rank (:mod:`vramcal.train.states`).
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from vramcal.measure.meters import synchronize, torch_cuda_empty_cache
from vramcal.models.regressor.step import RegressorStep, forward
from vramcal.oom import is_out_of_memory
from vramcal.progress import Heartbeat
from vramcal.train import checkpoint, states
from vramcal.train.errors import DivergedError, NonFiniteError, Stopped, TrainError
from vramcal.train.plan import Plan
from vramcal.units import format_bytes, format_duration, format_rate
from vramcal.workload import optimizer_step, step_loss

Echo = Callable[[str], None]
EpochHook = Callable[[dict[str, Any]], Any]

DIVERGED_RATIO = 10.0  # loss / zero-return loss: 10 times worse than predicting no move at all
DIVERGENCE_STEPS = 20  # steps the training loss is averaged over against the same batches' baseline
RISE_RATIO = 1.5  # last quarter of an epoch's step losses / its first, every quarter above the one before
WATCH_STEPS = 10  # steps between readings of the peak against the profile's prediction


@dataclass
class Progress:
    """Where a run is; saved in every checkpoint.

    Attributes:
        epoch: completed epochs. batch_in_epoch: batches done in the current (unfinished) epoch.
        step: optimizer steps done. micro_batch_size: samples per forward/backward (halved on OOM).
        best_val_loss: the lowest validation loss so far. rows: everything in ``metrics.jsonl``.
        epoch_loss_sum, epoch_samples, epoch_train_s, epoch_step_times: the unfinished epoch's figures, so
            a run resumed from a mid-epoch checkpoint reports the whole epoch.
        epoch_losses, epoch_baselines: each step's loss and its batch's zero-return loss (mean squared
            target) this epoch, for the divergence checks.
        epoch_tokens, epoch_padded_tokens: the unfinished epoch's tokens the loss counted and the tokens its
            batches held, padding included (the language model's trainer, :mod:`vramcal.train.lm_loop`; 0 here).
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
        """The loss scale under DDP (module docstring): ``n_ranks × own / global``; 1 for one process."""
        return len(self.batch_sizes) * self.own / self.global_batch

    def summed(self, values: list[float]) -> list[float]:
        """``values`` summed over the ranks (one process: as they are)."""
        if self.group is None:
            return values
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


class Trainer:
    """Runs a :class:`Plan` on a step built by the regressor's factory.

    Args:
        meter: the process's meter (:func:`vramcal.measure.meters.open_meter`), or None (no peaks).
        state: a checkpoint's payload to resume from.
        on_epoch: called with each epoch's metrics row after its checkpoint is saved; returning
            ``"stop"`` ends the run there (:class:`Stopped`).
        model: the module the forward pass goes through (under DDP, ``step.model`` wrapped); default
            ``step.model``.
        share: this rank's share of the global batch (default: one process, the whole batch).
    """

    def __init__(self, plan: Plan, step: RegressorStep, meter: Any = None, echo: Echo = print,
                 state: dict[str, Any] | None = None, on_epoch: EpochHook | None = None, model: Any = None,
                 share: Share | None = None) -> None:
        self.plan, self.step, self.meter, self.echo, self.on_epoch = plan, step, meter, echo, on_epoch
        self.config, self.pipeline = plan.config, getattr(step, "pipeline", None)  # None: the lm (lm_loop)
        self.model, self.share = model or step.model, share or Share((plan.step_batch_size,))
        self.sharded = plan.world is not None and plan.world.strategy == "fsdp"  # FSDP2: each rank holds a shard
        self.saves = self.share.rank == 0 or self.sharded  # takes part in a save (FSDP gathers on every rank)
        self.steps_per_epoch = self._steps_per_epoch()
        self.total_steps = min(self.config.max_steps or math.inf, self.config.epochs * self.steps_per_epoch)
        self.warmup_steps = (self.config.warmup_steps if self.config.warmup_steps is not None
                             else state["warmup_steps"] if state is not None and "warmup_steps" in state
                             else max(1, round(0.05 * self.total_steps)))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(step.optimizer, lambda s: lr_factor(
            s, self.warmup_steps, int(self.total_steps), self.config.min_lr_fraction))
        self.progress = Progress(micro_batch_size=plan.batch_size)  # an effective batch accumulates micro-batches
        if state is not None:
            states.load(step, state, self.sharded)
            self.scheduler.load_state_dict(state["scheduler"])
            self.progress = Progress(**state["progress"])
            self.scheduler.base_lrs = [plan.lr] * len(step.optimizer.param_groups)  # a new --lr applies from here
            for group in step.optimizer.param_groups:  # the new total's LR
                group["initial_lr"] = plan.lr
                group["lr"] = plan.lr * self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        self._measuring = state is not None  # a resumed run's first step is not its first ever
        self._had_oom = False  # an allocation failed in this process (see _out_of_memory)
        self._last_save = time.monotonic()
        self._saved_step = self.progress.step if state is not None else None  # the step the last save holds
        self._outgrown: set[str] = set()  # the bounds this run's peak has passed (said once each)
        validation = plan.validation
        self.val_batch_size = validation.batch_size if validation is not None else self.progress.micro_batch_size

    def _steps_per_epoch(self) -> int:
        """Optimizer steps per epoch: the windows over the global batch (under DDP the incomplete last batch is
        left out)."""
        assert self.pipeline is not None
        batch, n_train = self.share.global_batch, len(self.pipeline.train_starts)
        return n_train // batch if self.share.group is not None else math.ceil(n_train / batch)

    def _epoch_figures(self) -> dict[str, Any]:
        """What an epoch's row holds beyond the shared figures (the language model's tokens); none here."""
        return {}

    def _epoch_line(self, row: dict[str, Any]) -> str:
        """The line an epoch ends with, for people."""
        peak = f"  peak {format_bytes(row['peak_bytes'])}" if "peak_bytes" in row else ""
        return (f"epoch {row['epoch']}{'' if row['complete'] else ' (stopped at max_steps)'}: "
                f"train_loss {row['train_loss']:.4f}  val_loss {row['val_loss']:.4f} "
                f"(zero-return {row['val_zero_loss']:.4f})  dir_acc {row['val_dir_acc']:.3f} "
                f"(zero-return {row['val_zero_dir_acc']:.3f}, on moves {row['val_move_dir_acc']:.3f})  "
                f"{row['samples_per_s']:.1f} samples/s{peak}{validation_text(row)}")

    def _data_facts(self) -> dict[str, Any]:
        """The data's facts a checkpoint keeps (a resume checks the data against them)."""
        return self.pipeline.windows.stats()

    # ------------------------------------------------------------------------------------ a step

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
        """One optimizer step on the whole batch, with the OOM fallback (one process); returns (loss, grad
        norm, the batch's zero-return loss), the losses the global batch's means."""
        if self.share.group is not None:
            return self._ranked_step(x, y)
        batch, baseline = x.shape[0], float((y.float() ** 2).mean())
        loss, grad_norm = self._accumulated(batch, lambda i, j: (
            step_loss(self.step, (x[i:j], y[i:j]), self.model), (j - i) / batch))
        return loss, grad_norm, baseline

    def _accumulated(self, batch: int, part: Callable[[int, int], tuple[Any, float]]) -> tuple[float, float]:
        """One optimizer step over a batch of ``batch`` samples in micro-batches (module docstring: the OOM
        fallback halves them): ``part(i, j)`` is samples i to j's mean loss and its weight in the batch's (None: it
        counts nothing); returns (loss, grad norm)."""
        while True:
            micro = min(self.progress.micro_batch_size, batch)
            try:
                loss = 0.0
                for i in range(0, batch, micro):
                    lost, share = part(i, min(i + micro, batch))
                    if lost is not None:
                        (lost * share).backward()
                        loss += share * float(lost.detach())
                grad_norm = optimizer_step(self.step, skip_non_finite=True)
                return loss, float(grad_norm) if grad_norm is not None else 0.0
            except Exception as error:
                if not self._out_of_memory(error):
                    raise
                message = _first_line(error)
            self._fall_back(micro, batch, message, "step")

    def _ranked_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
        """One DDP step on this rank's slice (module docstring: the loss scaled, no fallback)."""
        share = self.share
        try:
            loss = step_loss(self.step, (x, y), self.model)
            (loss * share.weight).backward()
            grad_norm = optimizer_step(self.step, skip_non_finite=True)
        except Exception as error:
            if not self._out_of_memory(error):
                raise
            raise TrainError(f"rank {share.rank} ran out of memory at its batch of {share.own} at step "
                             f"{self.progress.step + 1} ({_first_line(error)}): under DDP every rank stops; "
                             f"{checkpoint.last_good(self.plan.run_dir)} with a smaller batch size") from None
        total, baseline = share.summed([float(loss.detach()) * share.own, float((y.float() ** 2).mean()) * share.own])
        return (total / share.global_batch, float(grad_norm) if grad_norm is not None else 0.0,
                baseline / share.global_batch)

    def _out_of_memory(self, error: BaseException) -> bool:
        """An allocation failure (:func:`vramcal.oom.is_out_of_memory`, oneDNN's bare message included once
        this run has had one)."""
        return is_out_of_memory(error, after_failure=self._had_oom)

    def _fall_back(self, micro: int, batch: int, message: str, where: str) -> None:
        """Free what the failed attempt held and halve the micro-batch, or stop at one sample."""
        import gc

        if self.sharded:  # a rank halving alone would leave the ranks' all-gathers unmatched
            raise TrainError(f"rank {self.share.rank} ran out of memory in the {where} at step "
                             f"{self.progress.step + 1} ({message}): under FSDP every rank stops; "
                             f"{checkpoint.last_good(self.plan.run_dir)} with a smaller --val-batch-size")
        self._had_oom = True
        self.step.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.plan.device.kind == "cuda":
            torch_cuda_empty_cache()
        if micro <= 1:
            raise TrainError(f"out of memory at a micro-batch of 1 sample in the {where} at step "
                             f"{self.progress.step + 1} ({message}): memory could not be recovered; "
                             f"{checkpoint.last_good(self.plan.run_dir)}")
        new = micro // 2
        if where == "validation":
            self.val_batch_size = new
        else:
            self.progress.micro_batch_size = new
        self.progress.rows.append({"kind": "oom", "where": where, "epoch": self.progress.epoch + 1,
                                   "step": self.progress.step + 1, "batch_size": batch,
                                   "micro_batch_size_from": micro, "micro_batch_size_to": new, "error": message})
        self.echo(f"out of memory in the {where} at step {self.progress.step + 1} with micro-batch {micro}: "
                  f"retrying with micro-batch {new}" + (f" x {math.ceil(batch / new)} accumulated (effective batch "
                                                         f"stays {batch})" if where == "step" else ""))

    # --------------------------------------------------------------------------------- evaluation

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Validation loss, the zero-return baseline's loss, and directional accuracy of both.

        Chunks of ``val_batch_size`` (the plan's :class:`~vramcal.train.plan.Validation`: the evaluation limit, or
        the training batch); a chunk that runs out of memory is retried at half the size, the training batch left
        as it is. Under DDP each rank takes every n-th window and the sums are added over the ranks; under FSDP a
        forward gathers each block from every rank, so a rank with fewer chunks runs idle forwards of one window
        until all have run as many, and an out-of-memory error stops the run.

        ``val_dir_acc`` = mean over positions of [sign(prediction) == sign(target)] (sign 0 for 0);
        ``val_zero_dir_acc`` is the same for the naive prediction 0 (= the share of unchanged bars);
        ``val_move_dir_acc`` counts only positions whose next bar moved (the baseline scores 0 there).
        """
        model, pipeline = self.step.model, self.pipeline
        model.eval()
        sums = torch.zeros(6, dtype=torch.float64)
        share = self.share
        position, starts = 0, pipeline.val_starts[share.rank::len(share.batch_sizes)]
        rounds = max(share.gathered(math.ceil(len(starts) / max(1, self.val_batch_size)))) if self.sharded else 0
        while position < len(starts):
            chunk = max(1, self.val_batch_size)
            try:
                x, y = pipeline.gather(starts[position:position + chunk])
                prediction = forward(model, x, self.config.spec.dtype).float()  # (B, L)
                rounds -= 1
                hit = torch.sign(prediction) == torch.sign(y)
                moved = y != 0
                sums += torch.stack([((prediction - y) ** 2).sum(), (y ** 2).sum(), hit.sum(), (~moved).sum(),
                                     (hit & moved).sum(), moved.sum()]).double().cpu()
                position += len(x)
            except Exception as error:
                if not self._out_of_memory(error):
                    raise
                self._fall_back(chunk, chunk, _first_line(error), "validation")
        for _ in range(rounds):  # FSDP: as many forwards (all-gathers) as the rank with the most chunks
            forward(model, pipeline.gather(pipeline.val_starts[:1])[0], self.config.spec.dtype)
        model.train()
        n = len(pipeline.val_starts) * pipeline.windows.seq_len
        se, zero_se, hits, unchanged, move_hits, moves = share.summed(sums.tolist())
        return {"val_loss": se / n, "val_zero_loss": zero_se / n, "val_dir_acc": hits / n,
                "val_zero_dir_acc": unchanged / n, "val_move_dir_acc": move_hits / max(moves, 1)}

    # ---------------------------------------------------------------------------------- the loop

    def run(self) -> dict[str, Any]:
        """Train until ``epochs`` or ``max_steps``; returns the last epoch's metrics row ({} if none).

        Raises:
            NonFiniteError: NaN or infinite loss or gradients (the last good checkpoint stays).
            TrainError: out of memory at a micro-batch of one, or a checkpoint that cannot be written.
            Stopped: ``on_epoch`` asked to stop.
        """
        if self.progress.epoch >= self.config.epochs or self.progress.step >= self.total_steps:
            self.echo(f"nothing to train: the run has done {self.progress.epoch} epochs and {self.progress.step} "
                      f"steps (pass a larger --epochs or --max-steps to go on)")
        while self.progress.epoch < self.config.epochs and self.progress.step < self.total_steps:
            self._epoch()
        return next((r for r in reversed(self.progress.rows) if r["kind"] == "epoch"), {})

    def _epoch_batches(self, epoch: int) -> list[Any]:
        """The epoch's global batches, in order: index arrays into the training windows."""
        return self.pipeline.epoch_order(epoch).split(self.share.global_batch)[:self.steps_per_epoch]

    def _train_batch(self, batch: Any) -> tuple[float, float, float, int]:
        """One optimizer step on a global batch of :meth:`_epoch_batches`: (loss, grad norm, zero-return loss,
        samples)."""
        share = self.share
        starts = self.pipeline.train_starts[batch]  # the global batch; this rank's slice of it:
        x, y = self.pipeline.gather(starts[share.offset:share.offset + share.own] if share.group else starts)
        loss, grad_norm, baseline = self._step(x, y)  # float(loss) waits for the device: the step's time
        return loss, grad_norm, baseline, share.global_batch if share.group else x.shape[0]

    def _rate(self) -> str:
        """The epoch's rate so far, for the progress bar and its lines: ``41.2 samples/s``."""
        return f"{format_rate(self.progress.epoch_samples / self.progress.epoch_train_s)} samples/s"

    def _progress_line(self, loss: float) -> str:
        """A log's line in place of the bar (:class:`vramcal.progress.Heartbeat`): ``step 120/300 (epoch 1/2),
        loss 0.9876, 41.2 samples/s, about 1.20 min of training steps left`` (at this epoch's mean step time)."""
        progress = self.progress
        left = (self.total_steps - progress.step) * progress.epoch_train_s / len(progress.epoch_step_times)
        return (f"step {progress.step}/{int(self.total_steps)} (epoch {progress.epoch + 1}/{self.config.epochs}), "
                f"loss {loss:.4f}, {self._rate()}, about {format_duration(left)} of training steps left")

    def _epoch(self) -> None:
        from tqdm import tqdm

        progress, share = self.progress, self.share
        batches = self._epoch_batches(progress.epoch)
        bar = tqdm(total=len(batches), initial=progress.batch_in_epoch, unit="batch", file=sys.stderr,
                   desc=f"epoch {progress.epoch + 1}/{self.config.epochs}", leave=False,
                   disable=None if share.rank == 0 else True)
        beat = Heartbeat() if bar.disable and share.rank == 0 else None  # no terminal: a line a minute instead
        if self._measuring and self.meter is not None:
            self.meter.reset()
        for index in range(progress.batch_in_epoch, len(batches)):
            if progress.step >= self.total_steps:
                break
            step_start = time.perf_counter()
            loss, grad_norm, baseline, samples = self._train_batch(batches[index])
            elapsed = time.perf_counter() - step_start
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                self._stop_non_finite(loss, grad_norm)
            progress.epoch_losses.append(loss)
            progress.epoch_baselines.append(baseline)
            self._check_divergence(diverged_loss(progress.epoch_losses, progress.epoch_baselines), progress.step + 1)
            self.scheduler.step()
            progress.step, progress.batch_in_epoch = progress.step + 1, index + 1
            progress.epoch_loss_sum += loss * samples
            progress.epoch_samples += samples
            progress.epoch_train_s += elapsed
            progress.epoch_step_times.append(elapsed)
            if not self._measuring:  # the run's first step allocated AdamW's state: measure from here on
                self._measuring = True
                if self.meter is not None:
                    self.meter.reset()
            if progress.step % WATCH_STEPS == 0:
                self._watch()
            bar.set_postfix_str(f"loss {loss:.4f}, {self._rate()}")
            bar.update(1)
            if beat is not None and beat.due():
                self.echo(self._progress_line(loss))
            if index + 1 < len(batches) and self.saves and self._save_due():
                self._save(None)
        synchronize(self.plan.device.kind)
        bar.close()
        self._end_epoch(len(batches))

    def _end_epoch(self, n_batches: int) -> None:
        progress = self.progress
        complete = progress.batch_in_epoch == n_batches
        train_s = progress.epoch_train_s
        peaks = self._peaks()  # the training steps' (the validation pass is measured on its own)
        if self.meter is not None and self._measuring:
            self.meter.reset()
        val_start = time.perf_counter()
        evaluation = self.evaluate()  # first: an out-of-memory fallback there changes the validation chunk
        val_s = time.perf_counter() - val_start
        validated = self._validation_peak()
        row = {"kind": "epoch", "epoch": progress.epoch + 1, "complete": complete, "step": progress.step,
               "train_loss": progress.epoch_loss_sum / max(progress.epoch_samples, 1),
               "samples": progress.epoch_samples, "train_s": train_s, "val_s": val_s, "epoch_s": train_s + val_s,
               "samples_per_s": progress.epoch_samples / train_s if train_s > 0 else 0.0,
               "step_s_median": statistics.median(progress.epoch_step_times) if progress.epoch_step_times else None,
               "lr": self.step.optimizer.param_groups[0]["lr"], "batch_size": self.share.global_batch,
               "micro_batch_size": progress.micro_batch_size, "val_batch_size": self.val_batch_size, **evaluation,
               **peaks, **validated, **self._epoch_figures()}
        bad = states.non_finite_weights(self.step, self.share, self.sharded)
        if not math.isfinite(row["val_loss"]) or bad:
            self._stop_non_finite(row["train_loss"], math.nan, val_loss=row["val_loss"], weights=bad)
        self._check_divergence(diverged_validation(row["val_loss"], row["val_zero_loss"])
                               or (rising(progress.epoch_losses) if complete else None), progress.step)
        progress.rows.append(row)
        if complete:
            progress.epoch, progress.batch_in_epoch = progress.epoch + 1, 0
            progress.epoch_loss_sum, progress.epoch_samples, progress.epoch_train_s = 0.0, 0, 0.0
            progress.epoch_step_times, progress.epoch_losses, progress.epoch_baselines = [], [], []
            progress.epoch_tokens, progress.epoch_padded_tokens = 0, 0
        if self.saves:
            self._save(row)
        self.echo(self._epoch_line(row))
        if self.on_epoch is not None and self.on_epoch(row) == "stop":
            raise Stopped(f"stopped after epoch {row['epoch']} by the caller")

    def _watch(self) -> None:
        """Say, while the run goes on, when this process's peak passes the warning line, then usable
        memory (once each; an ``outgrown`` event in the metrics): a run that outgrows its prediction (a creep
        the steady trial did not see) is told before it ends, or before an out-of-memory error."""
        if self.meter is None or not self._measuring or self.plan.sizing is None:  # unchecked: nothing predicted
            return
        peak, sizing = int(self.meter.read()["peak_bytes"]), self.plan.sizing
        for name, bound in (("the warning line", sizing.line_bytes), ("usable memory", sizing.usable_bytes)):
            if peak <= bound or name in self._outgrown:
                continue
            self._outgrown.add(name)
            self.progress.rows.append({"kind": "outgrown", "epoch": self.progress.epoch + 1,
                                       "step": self.progress.step, "peak_bytes": peak, "bound": name,
                                       "bound_bytes": bound, "rank": self.share.rank})
            self.echo(f"warning: step {self.progress.step}: this process's peak {format_bytes(peak)} is above {name} "
                      f"{format_bytes(bound)} at batch_size {sizing.batch_size} (predicted "
                      f"{format_bytes(sizing.predicted_peak_bytes)}): the run outgrows its prediction; a smaller "
                      f"--batch-size is safer, and a fresh `vramcal probe` measures this creep")

    def _validation_peak(self) -> dict[str, Any]:
        """The validation pass's peak (the meter was reset before it; under DDP the largest rank's) and the
        evaluation limit's prediction at its chunk size, when the plan has one."""
        if self.meter is None:
            return {}
        figures = self._peaks()
        validation = self.plan.validation
        predicted = validation.predicted_at(self.val_batch_size) if validation is not None else None
        usable = self.plan.sizing.usable_bytes if self.plan.sizing is not None else None
        return {"val_peak_bytes": figures["peak_bytes"], "val_predicted_peak_bytes": predicted,
                "val_usable_bytes": usable}

    def _peaks(self) -> dict[str, Any]:
        """The meter's figures of this epoch (under DDP: the largest rank's peak, and every rank's)."""
        if self.meter is None:
            return {}
        figures = self.meter.read()
        if self.share.group is None:
            return figures
        ranks = self.share.gathered(figures["peak_bytes"])
        return {**figures, "peak_bytes": max(ranks), "rank_peak_bytes": ranks,
                "batch_sizes": list(self.share.batch_sizes)}

    def gentler(self) -> str:
        """What to do after a divergence or a NaN: go on from the last checkpoint (or start again) with a tenth
        of the learning rate."""
        run_dir, lr = self.plan.run_dir, self.config.lr / 10
        saved = next((run_dir / name for name in checkpoint.CHECKPOINTS if (run_dir / name).is_file()), None)
        if saved is not None:
            return (f"the last good checkpoint is {saved}; go on from it with a lower learning "
                    f"rate: `vramcal train --resume --run-dir {run_dir} --lr {lr:.3g}` (or a lower --max-grad-norm)")
        return (f"no checkpoint was saved; start again with a lower learning rate (--lr {lr:.3g}) or "
                f"--max-grad-norm (the same --run-dir {run_dir} can be used)")

    def _check_divergence(self, why: str | None, step: int) -> None:
        """Record the divergence ``why`` describes (None: none) and stop (module docstring): nothing more is
        saved, so the last checkpoint is the one before it."""
        if why is None:
            return
        self._record_stop({"kind": "diverged", "epoch": self.progress.epoch + 1, "step": step, "reason": why})
        raise DivergedError(f"the run diverged at step {step}: {why}; stopped, nothing saved after it; "
                            f"{self.gentler()}")

    def _record_stop(self, event: dict[str, Any]) -> None:
        """Add the event that stops the run to the metrics (rank 0 writes them; a failed write is left: the
        stop is what matters, and its message says why)."""
        self.progress.rows.append(event)
        try:
            if self.share.rank == 0:
                checkpoint.write_metrics(self.plan.run_dir, self.progress.rows)
        except OSError:
            pass

    def _stop_non_finite(self, loss: float, grad_norm: float, val_loss: float | None = None,
                         weights: list[str] | None = None) -> None:
        """Record the event and raise. During a step: ``loss``, ``grad_norm``; after an epoch's evaluation:
        ``val_loss`` and the names of non-finite ``weights`` (the step count is then the last one done)."""
        after_epoch = val_loss is not None
        step = self.progress.step if after_epoch else self.progress.step + 1
        event = {"kind": "non-finite", "epoch": self.progress.epoch + 1, "step": step, "loss": str(loss),
                 "grad_norm": str(grad_norm)}
        if after_epoch:
            event.update(val_loss=str(val_loss), weights=list(weights or []))
            what = "weights" if weights else "validation loss"
            detail = f"validation loss {val_loss}" + (f", weights {', '.join(weights[:3])}" if weights else "")
        else:
            what = "loss" if not math.isfinite(loss) else "gradient norm"
            detail = f"loss {loss}, gradient norm {grad_norm}"
            self._save_finite()
        self._record_stop(event)
        raise NonFiniteError(f"non-finite {what} at step {step} ({detail}): stopped; {self.gentler()}")

    # ----------------------------------------------------------------------------- checkpoints

    def _save_finite(self) -> None:
        """After a non-finite step (skipped: the weights and the optimizer's state are the step before's),
        save that state as the last checkpoint, unless the last save holds it already; a full disk leaves the
        checkpoints there are."""
        if not self.saves or self.progress.step == self._saved_step:
            return
        if states.non_finite_weights(self.step, self.share, self.sharded):
            return
        try:
            self._save(None)
        except TrainError as error:
            self.echo(f"warning: the last finite state could not be saved ({error})")

    def _save_due(self) -> bool:
        """Whether a save is due after this step (under FSDP every rank joins it, so a clock's ``checkpoint_minutes``
        is rank 0's, told to all)."""
        c = self.config
        due = bool((c.checkpoint_steps and self.progress.step % c.checkpoint_steps == 0)
                   or (c.checkpoint_minutes and time.monotonic() - self._last_save >= 60 * c.checkpoint_minutes))
        return self.share.gathered(due)[0] if self.sharded and c.checkpoint_minutes else due

    def _save(self, row: dict[str, Any] | None) -> None:
        """The last checkpoint (the one it replaces kept as previous), the best one when validation loss
        improved, then the metrics: never ahead of a checkpoint. Rank 0 writes them (under FSDP every rank gathers
        the state first: :func:`vramcal.train.states.gather`)."""
        progress, plan = self.progress, self.plan
        improved = row is not None and row["val_loss"] < progress.best_val_loss
        if improved:
            progress.best_val_loss = row["val_loss"]
        payload = {**states.gather(self.step, self.sharded), "scheduler": self.scheduler.state_dict(),
                   "progress": asdict(progress), "data_stats": self._data_facts(), "warmup_steps": self.warmup_steps}
        try:
            if self.share.rank == 0:
                checkpoint.save_checkpoint(plan.run_dir, payload, best=improved)
                checkpoint.write_metrics(plan.run_dir, progress.rows)
        except OSError as error:
            raise TrainError(f"cannot write {error.filename or plan.run_dir} ({error.strerror or error}): stopped "
                             f"at step {progress.step}, unsaved; {checkpoint.last_good(plan.run_dir)} once there "
                             f"is space") from None
        self._last_save, self._saved_step = time.monotonic(), progress.step


def diverged_loss(losses: list[float], baselines: list[float]) -> str | None:
    """Why the last :data:`DIVERGENCE_STEPS` steps' training loss says the run diverged (None: it does not):
    its mean above :data:`DIVERGED_RATIO` times their batches' mean zero-return loss."""
    if len(losses) < DIVERGENCE_STEPS:
        return None
    loss, baseline = (statistics.fmean(v[-DIVERGENCE_STEPS:]) for v in (losses, baselines))
    if loss <= DIVERGED_RATIO * baseline:
        return None
    return (f"the training loss over the last {DIVERGENCE_STEPS} steps, {loss:.4g}, is {loss / baseline:.3g} times "
            f"the zero-return loss of the same batches ({baseline:.4g})")


def validation_text(row: dict[str, Any]) -> str:
    """``  validation peak 1.20 GiB at batch_size 512 (predicted 1.18 GiB, +1.7%)`` of an epoch's row (and a
    warning when it is above usable memory), or ""."""
    peak, predicted = row.get("val_peak_bytes"), row.get("val_predicted_peak_bytes")
    usable = row.get("val_usable_bytes")
    if peak is None:
        return ""
    against = f" (predicted {format_bytes(predicted)}, {(peak - predicted) / predicted:+.1%})" if predicted else ""
    above = (f"; warning: above usable memory {format_bytes(usable)}: a smaller --val-batch-size is safer"
             if usable is not None and peak > usable else "")
    return f"  validation peak {format_bytes(peak)} at batch_size {row['val_batch_size']}{against}{above}"


def diverged_validation(val_loss: float, zero_loss: float) -> str | None:
    """Why the validation loss says the run diverged: above :data:`DIVERGED_RATIO` times the zero-return
    baseline's (None: it does not)."""
    if val_loss <= DIVERGED_RATIO * zero_loss:
        return None
    return (f"the validation loss {val_loss:.4g} is {val_loss / zero_loss:.3g} times the zero-return baseline's "
            f"{zero_loss:.4g}")


def rising(losses: list[float]) -> str | None:
    """Why an epoch's step losses say the run diverged: each quarter's mean above the one before and the
    last :data:`RISE_RATIO` times the first (None: not so, or fewer than 8 steps)."""
    if len(losses) < 8:
        return None
    n = len(losses)
    quarters = [statistics.fmean(losses[i * n // 4:(i + 1) * n // 4]) for i in range(4)]
    if not all(b > a for a, b in zip(quarters, quarters[1:])) or quarters[3] < RISE_RATIO * quarters[0]:
        return None
    return (f"the training loss rose through the whole epoch, quarter by quarter from {quarters[0]:.4g} to "
            f"{quarters[3]:.4g}")


def _first_line(error: BaseException) -> str:
    """The error's first line (at most 200 characters), or its class name when it has no message
    (``MemoryError()`` has none)."""
    lines = str(error).strip().splitlines()
    return lines[0][:200] if lines else type(error).__name__
