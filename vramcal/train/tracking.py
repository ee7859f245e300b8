"""TensorBoard event files beside ``metrics.jsonl``: a run's epoch figures, a tune trial's hyperparameters.

::

    <run_dir>/tensorboard/     every number of each epoch row of metrics.jsonl, at the row's optimizer step, under
                               the key metrics.jsonl gives it: train/train_loss, train/lr, train/samples_per_s,
                               val/val_loss, memory/peak_bytes (per DDP rank: memory/rank_peak_bytes/rank1), ...
                               A tune trial's folder (trials/<nnnn>/) adds its hyperparameters and its objective
                               (``tune/objective``) for TensorBoard's HParams dashboard.

``tensorboard --logdir <run_dir>`` shows a run; ``--logdir`` a tune's folder shows every trial, one run each.
The files are written by TensorBoard's own writer (:class:`torch.utils.tensorboard.SummaryWriter`), flushed after
each epoch; rank 0 alone writes (the caller decides: :func:`vramcal.train.runner.train`).

A run that starts adds a new event file beside those there and never rewrites them. It begins with TensorBoard's
purge marker (``SummaryWriter(purge_step=...)``): a resumed run at the step after the last epoch row metrics.jsonl
held when it resumed, a new run (in a folder a failed run left) at 0, so TensorBoard hides events that
metrics.jsonl no longer holds and shows what it holds. A writer that fails (a full disk, a broken install) never
fails the run: one warning line, and nothing more goes to TensorBoard; metrics.jsonl keeps every figure.

The event format stores scalars as 32-bit floats: byte counts are exact there up to 16 MiB and within 1 in 10^7
above (metrics.jsonl keeps them exact).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vramcal.train import checkpoint

Echo = Callable[[str], None]
TENSORBOARD = "tensorboard"  # the event files' folder inside a run folder
OBJECTIVE = "tune/objective"  # a tune trial's value: its lowest validation loss
_NOT_FIGURES = ("kind", "step", "complete")  # what an epoch row holds that is no figure over the steps


def epoch_scalars(row: dict[str, Any]) -> dict[str, float]:
    """TensorBoard's ``tag -> value`` for an epoch row: each number under its metrics.jsonl key, in a section
    (``val_*`` under ``val/``, ``*_bytes`` under ``memory/``, the rest under ``train/``); a list (one value per
    DDP rank) as one tag per rank; the step (the event's own), ``kind``, flags and missing values left out."""
    scalars = {}
    for key, value in sorted(row.items()):
        section = "val" if key.startswith("val_") else "memory" if key.endswith("_bytes") else "train"
        values = enumerate(value) if isinstance(value, list) else [(None, value)]
        for rank, each in values:
            if key in _NOT_FIGURES or isinstance(each, bool) or not isinstance(each, int | float):
                continue
            scalars[f"{section}/{key}" + ("" if rank is None else f"/rank{rank}")] = float(each)
    return scalars


def purge_step(run_dir: Path, resume: bool) -> int:
    """Where a run's event file begins purging (module docstring): 0 for a new run; for a resumed one, the step
    after the last epoch row in ``metrics.jsonl`` (0 when it holds none, or cannot be read)."""
    if not resume:
        return 0
    try:
        rows = [json.loads(line) for line in (Path(run_dir) / checkpoint.METRICS).read_text().splitlines()
                if line.strip()]
    except (OSError, ValueError):
        return 0
    return max((int(r["step"]) for r in rows if r.get("kind") == "epoch"), default=-1) + 1


class RunTracker:
    """A run's TensorBoard writer (module docstring): opened at the first epoch row (nothing for a run that
    never ends one), stopped with one warning at its first failure.

    Args:
        log_dir: the event files' folder (``<run_dir>/tensorboard``).
        purge_step: :func:`purge_step` of the run.
        echo: where the warning goes.
    """

    def __init__(self, log_dir: Path, purge_step: int, echo: Echo) -> None:
        self.log_dir, self.purge_step, self.echo = Path(log_dir), purge_step, echo
        self._writer: Any = None
        self._failed = False

    def epoch(self, row: dict[str, Any]) -> None:
        """Write an epoch row's figures (:func:`epoch_scalars`) at its step and flush them to the file."""
        self._guarded(lambda: self._write(row))

    def close(self) -> None:
        if self._writer is not None:
            self._guarded(self._writer.close)

    def _write(self, row: dict[str, Any]) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # loads torch

            self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=self.purge_step)
        for tag, value in epoch_scalars(row).items():
            self._writer.add_scalar(tag, value, int(row["step"]))
        self._writer.flush()  # a failed write surfaces here, at the epoch that made it

    def _guarded(self, action: Callable[[], Any]) -> None:
        """Run ``action``; its first failure, whatever it is, is a warning and ends the writing, never the run."""
        if self._failed:
            return
        try:
            action()
        except Exception as error:  # whatever it is: a tracker must not end a training run (module docstring)
            self._failed = True
            self.echo(f"warning: TensorBoard logging to {self.log_dir} stopped ({_first_line(error)}); the run goes "
                      f"on and {checkpoint.METRICS} keeps every figure")


def log_trial(trial, echo: Echo) -> None:
    """Write a finished tune trial's hyperparameters and objective into its run folder's event files, for
    TensorBoard's HParams dashboard (an optuna callback's work: :func:`vramcal.tune.study.run_study`).

    Complete and pruned trials are written (a pruned one's objective is its lowest validation loss so far); a
    failed or surplus one is not. The hyperparameters are optuna's ``params``, the batch size the trainer used
    and the state; the session's metrics are ``tune/objective`` (at the trial's last step) and its run's own
    scalars. No experiment record is written: TensorBoard builds it from the trials' sessions. A failure is one
    warning line, never the tune's end.
    """
    objective = trial.value if trial.state.name == "COMPLETE" else trial.user_attrs.get("val_loss")
    run_dir = trial.user_attrs.get("run_dir")
    if trial.state.name not in ("COMPLETE", "PRUNED") or run_dir is None or objective is None:
        return
    log_dir = Path(run_dir) / TENSORBOARD
    values = {**trial.params, "batch_size_used": trial.user_attrs.get("batch_size_used"),
              "state": trial.state.name.lower()}
    try:
        from torch.utils.tensorboard import SummaryWriter  # loads torch
        from torch.utils.tensorboard.summary import hparams  # loads torch

        _, start, end = hparams({k: v for k, v in values.items() if v is not None}, {OBJECTIVE: objective})
        step = int(trial.user_attrs.get("steps", 0))
        with SummaryWriter(log_dir=str(log_dir)) as writer:
            writer.file_writer.add_summary(start, step)  # as SummaryWriter.add_hparams writes them, in this run
            writer.file_writer.add_summary(end, step)
            writer.add_scalar(OBJECTIVE, objective, step)
    except Exception as error:  # whatever it is: a tracker must not end a tune
        echo(f"warning: trial {trial.number}'s hyperparameters were not written to TensorBoard in {log_dir} "
             f"({_first_line(error)})")


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:200]}" if lines else type(error).__name__
