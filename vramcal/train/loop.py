"""The training loop, run inside the training worker: epochs at the planned batch size, validation, metrics,
checkpoints, and the fallbacks and stops DESIGN.md "Training with a profile" and "Failure" describe.

The step is built by the factory the trials used and measured by the same meter, with peaks reset as a trial resets
them, so the profile's memory model describes this loop; ``epoch_s`` (step times plus the validation pass) is what
:mod:`vramcal.forecast` forecasts. DDP and FSDP: DESIGN.md "Several processes: DDP and FSDP"."""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from vramcal.measure.meters import empty_cache, synchronize
from vramcal.models.regressor.step import RegressorStep, forward
from vramcal.oom import is_out_of_memory
from vramcal.report.progress import Heartbeat
from vramcal.train import checkpoint, states
from vramcal.train.errors import DivergedError, NonFiniteError, Stopped, TrainError
from vramcal.train.plan import Plan
from vramcal.train.rules import (
    Progress,
    Share,
    diverged_loss,
    diverged_validation,
    lr_factor,
    rising,
    validation_text,
)
from vramcal.units import format_bytes, format_duration, format_rate
from vramcal.workload import first_line, optimizer_step, step_loss

Echo = Callable[[str], None]
EpochHook = Callable[[dict[str, Any]], Any]

WATCH_STEPS = 10  # steps between readings of the peak against the profile's prediction


class Trainer:
    """Runs a :class:`Plan` on a step built by the regressor's factory.

    Args:
        meter: the process's meter (:func:`vramcal.measure.meters.open_meter`), or None (no peaks).
        state: a checkpoint's payload to resume from (a new ``epochs``/``max_steps`` stretches the cosine decay).
        on_epoch: called with each epoch's row after its checkpoint; ``"stop"`` ends the run (:class:`Stopped`).
        model: the module the forward goes through (DDP's wrapper); default ``step.model``.
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
        """Optimizer steps per epoch (under DDP the incomplete last global batch is left out)."""
        assert self.pipeline is not None
        batch, n_train = self.share.global_batch, len(self.pipeline.train_starts)
        return n_train // batch if self.share.group is not None else math.ceil(n_train / batch)

    def _epoch_figures(self) -> dict[str, Any]:
        """An epoch row's figures beyond the shared ones (the language model's tokens); none here."""
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

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
        """One optimizer step on the whole batch: (loss, grad norm, the batch's zero-return loss)."""
        if self.share.group is not None:
            return self._ranked_step(x, y)
        batch, baseline = x.shape[0], float((y.float() ** 2).mean())
        loss, grad_norm = self._accumulated(batch, lambda i, j: (
            step_loss(self.step, (x[i:j], y[i:j]), self.model), (j - i) / batch))
        return loss, grad_norm, baseline

    def _accumulated(self, batch: int, part: Callable[[int, int], tuple[Any, float]]) -> tuple[float, float]:
        """One optimizer step over ``batch`` samples in micro-batches (``part(i, j)``: their mean loss, weight)."""
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
                message = first_line(error)
            self._fall_back(micro, batch, message, "step")

    def _ranked_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
        """One DDP step on this rank's slice, its loss scaled by :attr:`Share.weight` (no fallback)."""
        share = self.share
        try:
            loss = step_loss(self.step, (x, y), self.model)
            (loss * share.weight).backward()
            grad_norm = optimizer_step(self.step, skip_non_finite=True)
        except Exception as error:
            if not self._out_of_memory(error):
                raise
            raise TrainError(f"rank {share.rank} ran out of memory at its batch of {share.own} at step "
                             f"{self.progress.step + 1} ({first_line(error)}): under DDP every rank stops; "
                             f"{checkpoint.last_good(self.plan.run_dir)} with a smaller batch size") from None
        total, baseline = share.summed([float(loss.detach()) * share.own, float((y.float() ** 2).mean()) * share.own])
        return (total / share.global_batch, float(grad_norm) if grad_norm is not None else 0.0,
                baseline / share.global_batch)

    def _out_of_memory(self, error: BaseException) -> bool:
        """An allocation failure (:func:`vramcal.oom.is_out_of_memory`)."""
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
        empty_cache(self.plan.device.kind)
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

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Validation loss, the zero-return baseline's loss, and directional accuracy of both.

        Chunks of ``val_batch_size``, halved on out-of-memory. Under DDP each rank takes every n-th window and sums
        are added over the ranks; under FSDP a rank with fewer chunks runs idle forwards until all ran as many.
        ``val_dir_acc`` = mean of [sign(prediction) == sign(target)]; ``val_zero_dir_acc`` the same for the
        prediction 0; ``val_move_dir_acc`` over positions whose next bar moved."""
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
                self._fall_back(chunk, chunk, first_line(error), "validation")
        for _ in range(rounds):  # FSDP: as many forwards (all-gathers) as the rank with the most chunks
            forward(model, pipeline.gather(pipeline.val_starts[:1])[0], self.config.spec.dtype)
        model.train()
        n = len(pipeline.val_starts) * pipeline.windows.seq_len
        se, zero_se, hits, unchanged, move_hits, moves = share.summed(sums.tolist())
        return {"val_loss": se / n, "val_zero_loss": zero_se / n, "val_dir_acc": hits / n,
                "val_zero_dir_acc": unchanged / n, "val_move_dir_acc": move_hits / max(moves, 1)}

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
        """One optimizer step on a global batch: (loss, grad norm, zero-return loss, samples)."""
        share = self.share
        starts = self.pipeline.train_starts[batch]  # the global batch; this rank's slice of it:
        x, y = self.pipeline.gather(starts[share.offset:share.offset + share.own] if share.group else starts)
        loss, grad_norm, baseline = self._step(x, y)  # float(loss) waits for the device: the step's time
        return loss, grad_norm, baseline, share.global_batch if share.group else x.shape[0]

    def _rate(self) -> str:
        """The epoch's rate so far: ``41.2 samples/s``."""
        return f"{format_rate(self.progress.epoch_samples / self.progress.epoch_train_s)} samples/s"

    def _progress_line(self, loss: float) -> str:
        """``step 120/300 (epoch 1/2), loss 0.9876, 41.2 samples/s, about 1.20 min of training steps left``."""
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
        """Say once each when this process's peak passes the warning line, then usable memory."""
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
        """The validation pass's peak and the evaluation limit's prediction at its chunk size."""
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
        """What to do after a divergence or a NaN: resume (or start again) with a tenth of the LR."""
        run_dir, lr = self.plan.run_dir, self.config.lr / 10
        saved = next((run_dir / name for name in checkpoint.CHECKPOINTS if (run_dir / name).is_file()), None)
        if saved is not None:
            return (f"the last good checkpoint is {saved}; go on from it with a lower learning "
                    f"rate: `vramcal train --resume --run-dir {run_dir} --lr {lr:.3g}` (or a lower --max-grad-norm)")
        return (f"no checkpoint was saved; start again with a lower learning rate (--lr {lr:.3g}) or "
                f"--max-grad-norm (the same --run-dir {run_dir} can be used)")

    def _check_divergence(self, why: str | None, step: int) -> None:
        """Record the divergence ``why`` names (None: none) and stop, saving nothing more."""
        if why is None:
            return
        self._record_stop({"kind": "diverged", "epoch": self.progress.epoch + 1, "step": step, "reason": why})
        raise DivergedError(f"the run diverged at step {step}: {why}; stopped, nothing saved after it; "
                            f"{self.gentler()}")

    def _record_stop(self, event: dict[str, Any]) -> None:
        """Add the event that stops the run to the metrics (a failed write is left: the stop matters)."""
        self.progress.rows.append(event)
        try:
            if self.share.rank == 0:
                checkpoint.write_metrics(self.plan.run_dir, self.progress.rows)
        except OSError:
            pass

    def _stop_non_finite(self, loss: float, grad_norm: float, val_loss: float | None = None,
                         weights: list[str] | None = None) -> None:
        """Record a non-finite loss, gradient norm (the last finite state saved) or weight, and raise."""
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

    def _save_finite(self) -> None:
        """After a skipped non-finite step, save the finite state before it unless saved already."""
        if not self.saves or self.progress.step == self._saved_step:
            return
        if states.non_finite_weights(self.step, self.share, self.sharded):
            return
        try:
            self._save(None)
        except TrainError as error:
            self.echo(f"warning: the last finite state could not be saved ({error})")

    def _save_due(self) -> bool:
        """Whether a save is due after this step (under FSDP rank 0's clock, told to all)."""
        c = self.config
        due = bool((c.checkpoint_steps and self.progress.step % c.checkpoint_steps == 0)
                   or (c.checkpoint_minutes and time.monotonic() - self._last_save >= 60 * c.checkpoint_minutes))
        return self.share.gathered(due)[0] if self.sharded and c.checkpoint_minutes else due

    def _save(self, row: dict[str, Any] | None) -> None:
        """The last (and best) checkpoint, then the metrics, never ahead of a checkpoint; rank 0 writes."""
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


