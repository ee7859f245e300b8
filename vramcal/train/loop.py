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
good ones) with a :class:`NonFiniteError`; so does a non-finite validation loss or weight after an epoch.
No checkpoint is written after it, and none ever holds non-finite weights. A checkpoint that cannot be
written (a full disk) stops the run with one line naming the file and the last good checkpoint.

Resuming with another ``epochs`` or ``max_steps``: the warm-up stays as the run started, and the cosine
decay is stretched (or shortened) to the new total from the current step.
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
from vramcal.train import checkpoint
from vramcal.train.errors import NonFiniteError, Stopped, TrainError
from vramcal.train.plan import Plan
from vramcal.units import format_bytes
from vramcal.workload import optimizer_step

Echo = Callable[[str], None]
EpochHook = Callable[[dict[str, Any]], Any]


@dataclass
class Progress:
    """Where a run is; saved in every checkpoint.

    Attributes:
        epoch: completed epochs. batch_in_epoch: batches done in the current (unfinished) epoch.
        step: optimizer steps done. micro_batch_size: samples per forward/backward (halved on OOM).
        best_val_loss: the lowest validation loss so far. rows: everything in ``metrics.jsonl``.
        epoch_loss_sum, epoch_samples, epoch_train_s, epoch_step_times: the unfinished epoch's figures, so
            a run resumed from a mid-epoch checkpoint reports the whole epoch.
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
    """

    def __init__(self, plan: Plan, step: RegressorStep, meter: Any = None, echo: Echo = print,
                 state: dict[str, Any] | None = None, on_epoch: EpochHook | None = None) -> None:
        self.plan, self.step, self.meter, self.echo, self.on_epoch = plan, step, meter, echo, on_epoch
        self.config, self.pipeline = plan.config, step.pipeline
        assert self.pipeline is not None
        batch = plan.batch_size
        self.steps_per_epoch = math.ceil(len(self.pipeline.train_starts) / batch)
        self.total_steps = min(self.config.max_steps or math.inf, self.config.epochs * self.steps_per_epoch)
        self.warmup_steps = (self.config.warmup_steps if self.config.warmup_steps is not None
                             else state["warmup_steps"] if state is not None and "warmup_steps" in state
                             else max(1, round(0.05 * self.total_steps)))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(step.optimizer, lambda s: lr_factor(
            s, self.warmup_steps, int(self.total_steps), self.config.min_lr_fraction))
        self.progress = Progress(micro_batch_size=batch)
        if state is not None:
            step.model.load_state_dict(state["model"])
            step.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.progress = Progress(**state["progress"])
            for group, base_lr in zip(step.optimizer.param_groups, self.scheduler.base_lrs):  # the new total's LR
                group["lr"] = base_lr * self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        self._measuring = state is not None  # a resumed run's first step is not its first ever
        self._had_oom = False  # an allocation failed in this process (see _out_of_memory)
        self._last_save = time.monotonic()

    # ------------------------------------------------------------------------------------ a step

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        """One optimizer step on the whole batch, with the OOM fallback; returns (loss, grad norm)."""
        batch = x.shape[0]
        while True:
            micro = min(self.progress.micro_batch_size, batch)
            try:
                loss = torch.zeros((), device=x.device)
                for i in range(0, batch, micro):
                    share = min(micro, batch - i) / batch
                    part = self.step.loss((x[i:i + micro], y[i:i + micro]))
                    (part * share).backward()
                    loss += share * part.detach()
                grad_norm = optimizer_step(self.step, skip_non_finite=True)
                return float(loss), float(grad_norm) if grad_norm is not None else 0.0
            except Exception as error:
                if not self._out_of_memory(error):
                    raise
                message = _first_line(error)
            self._fall_back(micro, batch, message, "step")

    def _out_of_memory(self, error: BaseException) -> bool:
        """An allocation failure (:func:`vramcal.oom.is_out_of_memory`, oneDNN's bare message included once
        this run has had one)."""
        return is_out_of_memory(error, after_failure=self._had_oom)

    def _fall_back(self, micro: int, batch: int, message: str, where: str) -> None:
        """Free what the failed attempt held and halve the micro-batch, or stop at one sample."""
        import gc

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

        Chunks of the micro-batch size (the training batch size unless an out-of-memory error halved
        it); a chunk that runs out of memory is retried at half the size.

        ``val_dir_acc`` = mean over positions of [sign(prediction) == sign(target)] (sign 0 for 0);
        ``val_zero_dir_acc`` is the same for the naive prediction 0 (= the share of unchanged bars);
        ``val_move_dir_acc`` counts only positions whose next bar moved (the baseline scores 0 there).
        """
        model, pipeline = self.step.model, self.pipeline
        model.eval()
        sums = torch.zeros(6, dtype=torch.float64)
        position, starts = 0, pipeline.val_starts
        while position < len(starts):
            chunk = max(1, self.progress.micro_batch_size)
            try:
                x, y = pipeline.gather(starts[position:position + chunk])
                prediction = forward(model, x, self.config.spec.dtype).float()  # (B, L)
                hit = torch.sign(prediction) == torch.sign(y)
                moved = y != 0
                sums += torch.stack([((prediction - y) ** 2).sum(), (y ** 2).sum(), hit.sum(), (~moved).sum(),
                                     (hit & moved).sum(), moved.sum()]).double().cpu()
                position += len(x)
            except Exception as error:
                if not self._out_of_memory(error):
                    raise
                self._fall_back(chunk, chunk, _first_line(error), "validation")
        model.train()
        n = len(starts) * pipeline.windows.seq_len
        se, zero_se, hits, unchanged, move_hits, moves = sums.tolist()
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

    def _epoch(self) -> None:
        from tqdm import tqdm

        progress, batch = self.progress, self.plan.batch_size
        batches = self.pipeline.epoch_order(progress.epoch).split(batch)
        bar = tqdm(total=len(batches), initial=progress.batch_in_epoch, unit="batch", file=sys.stderr,
                   desc=f"epoch {progress.epoch + 1}/{self.config.epochs}", leave=False, disable=None)
        if self._measuring and self.meter is not None:
            self.meter.reset()
        for index in range(progress.batch_in_epoch, len(batches)):
            if progress.step >= self.total_steps:
                break
            step_start = time.perf_counter()
            x, y = self.pipeline.gather(self.pipeline.train_starts[batches[index]])
            loss, grad_norm = self._step(x, y)  # float(loss) waits for the device: the time is the step's
            elapsed = time.perf_counter() - step_start
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                self._stop_non_finite(loss, grad_norm)
            self.scheduler.step()
            progress.step, progress.batch_in_epoch = progress.step + 1, index + 1
            progress.epoch_loss_sum += loss * x.shape[0]
            progress.epoch_samples += x.shape[0]
            progress.epoch_train_s += elapsed
            progress.epoch_step_times.append(elapsed)
            if not self._measuring:  # the run's first step allocated AdamW's state: measure from here on
                self._measuring = True
                if self.meter is not None:
                    self.meter.reset()
            bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{progress.epoch_samples / progress.epoch_train_s:.1f}")
            bar.update(1)
            if index + 1 < len(batches) and self._save_due():
                self._save(None)
        synchronize(self.plan.device.kind)
        bar.close()
        self._end_epoch(len(batches))

    def _end_epoch(self, n_batches: int) -> None:
        progress = self.progress
        complete = progress.batch_in_epoch == n_batches
        train_s = progress.epoch_train_s
        val_start = time.perf_counter()
        evaluation = self.evaluate()  # first: an out-of-memory fallback there changes the micro-batch size
        val_s = time.perf_counter() - val_start
        row = {"kind": "epoch", "epoch": progress.epoch + 1, "complete": complete, "step": progress.step,
               "train_loss": progress.epoch_loss_sum / max(progress.epoch_samples, 1),
               "samples": progress.epoch_samples, "train_s": train_s, "val_s": val_s, "epoch_s": train_s + val_s,
               "samples_per_s": progress.epoch_samples / train_s if train_s > 0 else 0.0,
               "step_s_median": statistics.median(progress.epoch_step_times) if progress.epoch_step_times else None,
               "lr": self.step.optimizer.param_groups[0]["lr"], "batch_size": self.plan.batch_size,
               "micro_batch_size": progress.micro_batch_size, **evaluation,
               **(self.meter.read() if self.meter else {})}
        bad = checkpoint.non_finite_tensors(self.step.model.state_dict())
        if not math.isfinite(row["val_loss"]) or bad:
            self._stop_non_finite(row["train_loss"], math.nan, val_loss=row["val_loss"], weights=bad)
        progress.rows.append(row)
        if complete:
            progress.epoch, progress.batch_in_epoch = progress.epoch + 1, 0
            progress.epoch_loss_sum, progress.epoch_samples, progress.epoch_train_s = 0.0, 0, 0.0
            progress.epoch_step_times = []
        self._save(row)
        peak = f"  peak {format_bytes(row['peak_bytes'])}" if "peak_bytes" in row else ""
        self.echo(f"epoch {row['epoch']}{'' if complete else ' (stopped at max_steps)'}: "
                  f"train_loss {row['train_loss']:.4f}  val_loss {row['val_loss']:.4f} "
                  f"(zero-return {row['val_zero_loss']:.4f})  dir_acc {row['val_dir_acc']:.3f} "
                  f"(zero-return {row['val_zero_dir_acc']:.3f}, on moves {row['val_move_dir_acc']:.3f})  "
                  f"{row['samples_per_s']:.1f} samples/s{peak}")
        if self.on_epoch is not None and self.on_epoch(row) == "stop":
            raise Stopped(f"stopped after epoch {row['epoch']} by the caller")

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
        self.progress.rows.append(event)
        kept = checkpoint.last_good(self.plan.run_dir)
        try:
            checkpoint.write_metrics(self.plan.run_dir, self.progress.rows)
        except OSError:
            pass  # the stop is what matters; the event is in the message
        raise NonFiniteError(f"non-finite {what} at step {step} ({detail}): stopped; {kept}. "
                             f"Try a lower --lr or --max-grad-norm")

    # ----------------------------------------------------------------------------- checkpoints

    def _save_due(self) -> bool:
        c = self.config
        return bool((c.checkpoint_steps and self.progress.step % c.checkpoint_steps == 0)
                    or (c.checkpoint_minutes and time.monotonic() - self._last_save >= 60 * c.checkpoint_minutes))

    def _save(self, row: dict[str, Any] | None) -> None:
        """The last checkpoint (the one it replaces kept as previous), the best one when validation loss
        improved, then the metrics: never ahead of a checkpoint."""
        progress, plan = self.progress, self.plan
        improved = row is not None and row["val_loss"] < progress.best_val_loss
        if improved:
            progress.best_val_loss = row["val_loss"]
        payload = {"model": self.step.model.state_dict(), "optimizer": self.step.optimizer.state_dict(),
                   "scheduler": self.scheduler.state_dict(), "progress": asdict(progress),
                   "data_stats": self.pipeline.windows.stats(), "warmup_steps": self.warmup_steps}
        try:
            checkpoint.save_checkpoint(plan.run_dir, payload, best=improved)
            checkpoint.write_metrics(plan.run_dir, progress.rows)
        except OSError as error:
            raise TrainError(f"cannot write {error.filename or plan.run_dir} ({error.strerror or error}): stopped "
                             f"at step {progress.step}, unsaved; {checkpoint.last_good(plan.run_dir)} once there "
                             f"is space") from None
        self._last_save = time.monotonic()


def _first_line(error: BaseException) -> str:
    """The error's first line (at most 200 characters), or its class name when it has no message
    (``MemoryError()`` has none)."""
    lines = str(error).strip().splitlines()
    return lines[0][:200] if lines else type(error).__name__


# ------------------------------------------------------------------------------------ the worker

def train_in_worker(plan: Plan, channel: Any = None) -> dict[str, Any]:
    """The training process: meter, step, checkpoint, :class:`Trainer` (runs in a worker).

    Messages to the caller: ``("line", text)`` for people; asks ``("epoch", row)`` after each epoch, whose
    answer ``"stop"`` ends the run.

    Returns:
        ``{"last": the last epoch row, "step": optimizer steps done, "peak_bytes": the largest epoch peak}``.
    """
    from vramcal.measure.meters import open_meter
    from vramcal.measure.trial import torch_device
    from vramcal.workload import build

    def echo(line: str) -> None:
        if channel is None:
            print(line)
        else:
            channel.send("line", line)

    def on_epoch(row: dict[str, Any]) -> Any:
        return channel.ask("epoch", row) if channel is not None else None

    meter = open_meter(plan.device, plan.host_memory_limit_bytes)
    try:
        step = build(plan.model, torch_device(plan.device), plan.factory_options())
        meter.check_pinned()
        state = None
        if plan.resume:
            state, path, notice = checkpoint.load_resumable(plan.run_dir)
            if notice:
                echo(f"warning: {notice}")
                if path.name != checkpoint.LAST and (plan.run_dir / checkpoint.LAST).exists():
                    echo(f"the unreadable {checkpoint.LAST} is kept as "
                         f"{checkpoint.set_aside(plan.run_dir / checkpoint.LAST).name}")
            _check_same_data(state, step, plan)
            done = state["progress"]
            within = f", batch {done['batch_in_epoch']} of epoch {done['epoch'] + 1}" if done["batch_in_epoch"] else ""
            echo(f"continuing from {path}: {done['epoch']} epoch(s) and {done['step']} step(s) done{within}")
        trainer = Trainer(plan, step, meter, echo=echo, state=state, on_epoch=on_epoch)
        last = trainer.run()
    finally:
        meter.close()
    peaks = [r["peak_bytes"] for r in trainer.progress.rows if r["kind"] == "epoch" and "peak_bytes" in r]
    return {"last": last, "step": trainer.progress.step, "peak_bytes": max(peaks) if peaks else None,
            "epochs": len(peaks),
            "data_bytes": step.pool_data_bytes(plan.device.kind)}


def _check_same_data(state: dict[str, Any], step: RegressorStep, plan: Plan) -> None:
    from vramcal.models.regressor.bars import DataError

    saved, windows = state["data_stats"], step.pipeline.windows
    if (saved["rows"], saved["split_row"], saved["stride"]) != (len(windows.targets), windows.split_row,
                                                                windows.stride):
        raise DataError(f"{plan.config.data} is not the data this run started on ({saved['rows']} rows then, "
                        f"{len(windows.targets)} now): resume with the same file, or start a new run")
