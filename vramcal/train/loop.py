"""The training loop: epochs of the calibrated batch size, validation, metrics, checkpoints, fallbacks.

Each optimizer step uses :mod:`vramcal.train.step`, the functions a probe trial measures, so the
profile's memory model describes this loop's step. AdamW, linear warm-up then cosine decay to
``min_lr_fraction`` of the peak LR, gradient clipping; fp32 weights, bf16 autocast on CUDA when the
spec's dtype policy says so.

Out of memory anyway (another process took memory, fragmentation): the step is retried with the
micro-batch halved and gradients accumulated over ``ceil(batch / micro)`` micro-batches, each loss
scaled by its share of the batch, so the effective batch and the gradient stay the same; the event is
printed and recorded in ``metrics.jsonl``. Out-of-memory errors are recognised only by
:func:`vramcal.measure.meters.is_out_of_memory`.

A non-finite loss or gradient norm stops the run before the optimizer steps (the weights stay the last
good ones) with a :class:`NonFiniteError`; so does a non-finite validation loss or weight after an epoch
(an optimizer step can still overflow the weights). No checkpoint is written after it, and none ever holds
non-finite weights.

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

from vramcal.measure import meters
from vramcal.model import build_model
from vramcal.train import checkpoint
from vramcal.train.plan import Plan
from vramcal.train.step import forward, forward_backward, make_optimizer, optimizer_step
from vramcal.units import format_bytes

Echo = Callable[[str], None]
EpochHook = Callable[[dict[str, Any]], None]


class TrainError(RuntimeError):
    """A run that cannot go on; the one-line message says why and where the last good checkpoint is."""


class NonFiniteError(TrainError):
    """The loss or the gradient norm became NaN or infinite."""


@dataclass
class Progress:
    """Where a run is; saved in every checkpoint.

    Attributes:
        epoch: completed epochs. batch_in_epoch: batches done in the current (unfinished) epoch.
        step: optimizer steps done. micro_batch_size: samples per forward/backward (halved on OOM).
        best_val_loss: the lowest validation loss so far. rows: everything in ``metrics.jsonl``.
    """

    epoch: int = 0
    batch_in_epoch: int = 0
    step: int = 0
    micro_batch_size: int = 0
    best_val_loss: float = math.inf
    rows: list[dict[str, Any]] = field(default_factory=list)


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_fraction: float) -> float:
    """Multiplier of the peak LR at ``step``: linear warm-up to 1, then cosine decay to ``min_fraction``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_fraction + (1 - min_fraction) * 0.5 * (1 + math.cos(math.pi * progress))


class PeakMeter:
    """Peak memory of this process during an epoch. On CUDA, a probe trial's definition
    (:func:`vramcal.measure.meters.cuda_peaks`). On the host, the resident peak (VmHWM) only: a trial's
    ``peak_bytes`` also takes the data-segment peak because its budget is ``RLIMIT_DATA``, but the
    trainer runs under no such limit, and its parquet reader's allocator reserves address space it never
    touches (a data-segment peak ~1 GiB above the resident one on the E-mini bars)."""

    def __init__(self, plan: Plan) -> None:
        self.kind = plan.device.kind
        self._sampler = None
        if self.kind == "cuda":
            from vramcal.measure.device import load_nvml, nvml_handle

            nvml = load_nvml()
            self._sampler = meters.NvmlSampler(nvml, nvml_handle(nvml, plan.device), interval_s=0.05)
            self._sampler.__enter__()

    def reset(self) -> None:
        if self.kind == "host":
            meters.reset_peak_rss()
            return
        meters.torch_cuda_reset_peaks()
        self._sampler.reset_peaks()  # type: ignore[union-attr]

    def read(self) -> dict[str, Any]:
        if self.kind == "host":
            return {"peak_bytes": meters.read_status_bytes("VmHWM"), "peak_source": "VmHWM"}
        meters.synchronize("cuda")
        sampler = self._sampler
        overhead = sampler.current_bytes() - meters.torch_cuda_reserved_bytes()  # type: ignore[union-attr]
        return {**meters.cuda_peaks(sampler, overhead),  # type: ignore[arg-type]
                "peak_source": "max(NVML, overhead + torch max reserved)"}

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.__exit__(None, None, None)


class Trainer:
    """Runs a :class:`Plan`. ``model_factory`` is :func:`vramcal.model.build_model` (tests may wrap it).

    ``on_epoch``, when given, is called with each epoch's metrics row after its checkpoint is saved;
    an exception it raises (e.g. ``optuna.TrialPruned`` from ``vramcal tune``) ends the run there.
    """

    def __init__(self, plan: Plan, echo: Echo = print, model_factory: Callable = build_model,
                 state: dict[str, Any] | None = None, on_epoch: EpochHook | None = None) -> None:
        self.plan, self.echo, self.config, self.on_epoch = plan, echo, plan.config, on_epoch
        dev = plan.torch_device
        torch.manual_seed(self.config.seed)
        self.model = model_factory(self.config.spec, plan.implementation).to(dev)
        self.optimizer = make_optimizer(self.model, lr=plan.lr, weight_decay=self.config.weight_decay)
        windows = plan.windows
        self.features = torch.from_numpy(windows.features).to(dev)  # (M, n_features)
        self.targets = torch.from_numpy(windows.targets).to(dev)  # (M,)
        self.offsets = torch.arange(windows.seq_len, device=dev)  # (L,)
        self.train_starts = torch.from_numpy(windows.train_starts)
        self.val_starts = torch.from_numpy(windows.val_starts)
        batch = plan.batch.batch_size
        self.steps_per_epoch = math.ceil(len(self.train_starts) / batch)
        self.total_steps = min(self.config.max_steps or math.inf, self.config.epochs * self.steps_per_epoch)
        self.warmup_steps = (self.config.warmup_steps if self.config.warmup_steps is not None
                             else state["warmup_steps"] if state is not None and "warmup_steps" in state
                             else max(1, round(0.05 * self.total_steps)))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(
            s, self.warmup_steps, int(self.total_steps), self.config.min_lr_fraction))
        self.progress = Progress(micro_batch_size=batch)
        if state is not None:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.progress = Progress(**state["progress"])
            for group, base_lr in zip(self.optimizer.param_groups, self.scheduler.base_lrs):  # the new total's LR
                group["lr"] = base_lr * self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)

    # ------------------------------------------------------------------------------------ batches

    def _gather(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows starting at ``starts`` (B,): x (B, L, n_features), y (B, L)."""
        rows = starts.to(self.offsets.device)[:, None] + self.offsets  # (B, L)
        return self.features[rows], self.targets[rows]

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        """One optimizer step on the whole batch, with the OOM fallback; returns (loss, grad norm)."""
        batch = x.shape[0]
        while True:
            micro = min(self.progress.micro_batch_size, batch)
            try:
                loss = torch.zeros((), device=x.device)
                for i in range(0, batch, micro):
                    share = min(micro, batch - i) / batch
                    loss += share * forward_backward(self.model, x[i:i + micro], y[i:i + micro],
                                                     self.config.spec.dtype, x.device.type, loss_scale=share)
                grad_norm = optimizer_step(self.model, self.optimizer, self.config.max_grad_norm,
                                           skip_non_finite=True)
                return float(loss), float(grad_norm)
            except Exception as error:
                if not meters.is_out_of_memory(error):
                    raise
                message = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
            self._fall_back(micro, batch, message)

    def _fall_back(self, micro: int, batch: int, message: str) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.plan.torch_device == "cuda":
            meters.torch_cuda_empty_cache()
        if micro <= 1:
            raise TrainError(f"out of memory at a micro-batch of 1 sample at step {self.progress.step + 1} "
                             f"({message}): free the device or use a smaller model; last checkpoint in "
                             f"{self.plan.run_dir}")
        new = micro // 2
        self.progress.micro_batch_size = new
        self.progress.rows.append({"kind": "oom", "epoch": self.progress.epoch + 1, "step": self.progress.step + 1,
                                   "batch_size": batch, "micro_batch_size_from": micro,
                                   "micro_batch_size_to": new, "error": message})
        self.echo(f"out of memory at step {self.progress.step + 1} with micro-batch {micro}: retrying with "
                  f"micro-batch {new} x {math.ceil(batch / new)} accumulated (effective batch stays {batch})")

    # --------------------------------------------------------------------------------- evaluation

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Validation loss, the zero-return baseline's loss, and directional accuracy of both.

        ``val_dir_acc`` = mean over positions of [sign(prediction) == sign(target)] (sign 0 for 0);
        ``val_zero_dir_acc`` is the same for the naive prediction 0 (= the share of unchanged bars);
        ``val_move_dir_acc`` counts only positions whose next bar moved (the baseline scores 0 there).
        """
        self.model.eval()
        sums = torch.zeros(6, dtype=torch.float64)
        chunk = max(1, self.progress.micro_batch_size)
        for starts in self.val_starts.split(chunk):
            x, y = self._gather(starts)
            prediction = forward(self.model, x, self.config.spec.dtype, x.device.type).float()  # (B, L)
            hit = torch.sign(prediction) == torch.sign(y)
            moved = y != 0
            sums += torch.stack([((prediction - y) ** 2).sum(), (y ** 2).sum(), hit.sum(), (~moved).sum(),
                                 (hit & moved).sum(), moved.sum()]).double().cpu()
        self.model.train()
        n = len(self.val_starts) * self.plan.windows.seq_len
        se, zero_se, hits, unchanged, move_hits, moves = sums.tolist()
        return {"val_loss": se / n, "val_zero_loss": zero_se / n, "val_dir_acc": hits / n,
                "val_zero_dir_acc": unchanged / n, "val_move_dir_acc": move_hits / max(moves, 1)}

    # ---------------------------------------------------------------------------------- the loop

    def run(self) -> dict[str, Any]:
        """Train until ``epochs`` or ``max_steps``; returns the last metrics row.

        Raises:
            NonFiniteError: NaN or infinite loss or gradients (the last good checkpoint stays).
            TrainError: out of memory even at a micro-batch of one.
        """
        meter = PeakMeter(self.plan)
        try:
            while self.progress.epoch < self.config.epochs and self.progress.step < self.total_steps:
                self._epoch(meter)
        finally:
            meter.close()
        return next((r for r in reversed(self.progress.rows) if r["kind"] == "epoch"), {})

    def _epoch(self, meter: PeakMeter) -> None:
        from tqdm import tqdm

        progress, batch = self.progress, self.plan.batch.batch_size
        generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + progress.epoch)
        batches = torch.randperm(len(self.train_starts), generator=generator).split(batch)
        bar = tqdm(total=len(batches), initial=progress.batch_in_epoch, unit="batch", file=sys.stderr,
                   desc=f"epoch {progress.epoch + 1}/{self.config.epochs}", leave=False, disable=None)
        meter.reset()
        loss_sum, samples, started, step_times = 0.0, 0, time.perf_counter(), []
        for index in range(progress.batch_in_epoch, len(batches)):
            if progress.step >= self.total_steps:
                break
            step_start = time.perf_counter()
            x, y = self._gather(self.train_starts[batches[index]])
            loss, grad_norm = self._step(x, y)  # float(loss) waits for the device: the time is the step's
            step_times.append(time.perf_counter() - step_start)
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                self._stop_non_finite(loss, grad_norm)
            self.scheduler.step()
            progress.step, progress.batch_in_epoch = progress.step + 1, index + 1
            loss_sum, samples = loss_sum + loss * x.shape[0], samples + x.shape[0]
            rate = samples / (time.perf_counter() - started)
            bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{rate:.1f}")
            bar.update(1)
        meters.synchronize(self.plan.device.kind)
        train_s = time.perf_counter() - started
        bar.close()
        complete = progress.batch_in_epoch == len(batches)
        row = {"kind": "epoch", "epoch": progress.epoch + 1, "complete": complete, "step": progress.step,
               "train_loss": loss_sum / max(samples, 1), "samples": samples, "train_s": train_s,
               "samples_per_s": samples / train_s if train_s > 0 else 0.0,
               "step_s_median": statistics.median(step_times) if step_times else None,
               "lr": self.optimizer.param_groups[0]["lr"], "batch_size": batch,
               "micro_batch_size": progress.micro_batch_size, **meter.read(), **self.evaluate()}
        bad = checkpoint.non_finite_tensors(self.model.state_dict())
        if not math.isfinite(row["val_loss"]) or bad:
            bar.close()
            self._stop_non_finite(row["train_loss"], math.nan, val_loss=row["val_loss"], weights=bad)
        progress.rows.append(row)
        if complete:
            progress.epoch, progress.batch_in_epoch = progress.epoch + 1, 0
        self._save(row)
        self.echo(f"epoch {row['epoch']}{'' if complete else ' (stopped at max_steps)'}: "
                  f"train_loss {row['train_loss']:.4f}  val_loss {row['val_loss']:.4f} "
                  f"(zero-return {row['val_zero_loss']:.4f})  dir_acc {row['val_dir_acc']:.3f} "
                  f"(zero-return {row['val_zero_dir_acc']:.3f}, on moves {row['val_move_dir_acc']:.3f})  "
                  f"{row['samples_per_s']:.1f} samples/s  peak {format_bytes(row['peak_bytes'])}")
        if self.on_epoch is not None:
            self.on_epoch(row)

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
        checkpoint.write_metrics(self.plan.run_dir, self.progress.rows)
        last = self.plan.run_dir / checkpoint.LAST
        kept = f"the last good checkpoint is {last}" if last.exists() else "no checkpoint was written yet"
        raise NonFiniteError(f"non-finite {what} at step {step} ({detail}): stopped; {kept}. "
                             f"Try a lower --lr or --max-grad-norm")

    def _save(self, row: dict[str, Any]) -> None:
        """Metrics, then the last checkpoint, then the best one when validation loss improved."""
        progress, plan = self.progress, self.plan
        improved = row["val_loss"] < progress.best_val_loss
        if improved:
            progress.best_val_loss = row["val_loss"]
        checkpoint.write_metrics(plan.run_dir, progress.rows)
        payload = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                   "scheduler": self.scheduler.state_dict(), "progress": asdict(progress),
                   "config": self.config.to_dict(), "batch": asdict(plan.batch), "lr": plan.lr,
                   "implementation": plan.implementation, "device": plan.device.to_dict(),
                   "profile_path": plan.profile_path, "profile_limits": plan.profile_limits,
                   "data_stats": plan.windows.stats(), "warmup_steps": self.warmup_steps}
        checkpoint.save_checkpoint(plan.run_dir / checkpoint.LAST, payload)
        if improved:
            checkpoint.save_checkpoint(plan.run_dir / checkpoint.BEST, payload)


def start(plan: Plan, echo: Echo = print, model_factory: Callable = build_model,
          state: dict[str, Any] | None = None, on_epoch: EpochHook | None = None) -> dict[str, Any]:
    """Write the run's config and record (new runs), train, and return the last epoch's metrics.

    ``on_epoch``: see :class:`Trainer`.
    """
    if state is None:  # absolute paths: --resume works from any directory
        checkpoint.write_json(plan.run_dir / checkpoint.CONFIG, plan.config.with_absolute_paths().to_dict())
    checkpoint.write_json(plan.run_dir / checkpoint.RUN, plan.record())
    return Trainer(plan, echo=echo, model_factory=model_factory, state=state, on_epoch=on_epoch).run()
