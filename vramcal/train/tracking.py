"""Where a run's figures go beside ``metrics.jsonl`` (``report_to``, as the HF Trainer's): TensorBoard event files
(the default; ``<run_dir>/tensorboard``, every number of each epoch row under its metrics.jsonl key), and MLflow
through its own client when installed and asked for (one MLflow run per training run, its id kept in the run
folder so a resume logs into it; ``MLFLOW_TRACKING_URI`` and ``MLFLOW_EXPERIMENT_NAME`` as MLflow reads them).

Rank 0 alone writes. A resumed run's event file starts with TensorBoard's purge marker at the step after the last
epoch row, so TensorBoard shows what metrics.jsonl holds. A tracker that fails or hangs past
:data:`TRACKER_TIMEOUT_S` is one warning, never the run's end; metrics.jsonl keeps every figure (exact, where the
event format stores 32-bit floats)."""

from __future__ import annotations

import importlib.util
import json
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from vramcal.files import atomic_write_text
from vramcal.train import checkpoint
from vramcal.train.config import ConfigError
from vramcal.workload import first_line

Echo = Callable[[str], None]
TENSORBOARD = "tensorboard"  # the event files' folder inside a run folder
MLFLOW_RUN_ID = "mlflow_run_id"  # the run folder's file naming its MLflow run
MLFLOW_EXPERIMENT = "vramcal"  # the experiment when MLFLOW_EXPERIMENT_NAME is not set
OBJECTIVE = "tune/objective"  # a tune trial's value: its lowest validation loss
_NOT_FIGURES = ("kind", "step", "complete")  # what an epoch row holds that is no figure over the steps
TRACKER_TIMEOUT_S = 30.0  # a sound client answers in seconds; MLflow's retries an unreachable server for minutes


def epoch_scalars(row: dict[str, Any]) -> dict[str, float]:
    """TensorBoard's ``tag -> value`` of an epoch row: ``val_*`` under ``val/``, ``*_bytes`` under ``memory/``, the
    rest under ``train/``; a per-rank list as one tag per rank; flags and missing values left out."""
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
    """Where a run's event file begins purging: 0 for a new run; for a resumed one the step after the last epoch row
    in ``metrics.jsonl`` (0 when none can be read)."""
    if not resume:
        return 0
    try:
        rows = [json.loads(line) for line in (Path(run_dir) / checkpoint.METRICS).read_text().splitlines()
                if line.strip()]
    except (OSError, ValueError):
        return 0
    return max((int(r["step"]) for r in rows if r.get("kind") == "epoch"), default=-1) + 1


class _Tracker:
    """What every tracker shares: its first failure, or a call past ``timeout_s``, is one warning and ends its
    writing."""

    def __init__(self, what: str, echo: Echo, timeout_s: float = TRACKER_TIMEOUT_S) -> None:
        self._what, self.echo, self.timeout_s = what, echo, timeout_s
        self._failed = False

    def epoch(self, row: dict[str, Any]) -> None:
        """Write an epoch row's figures (:func:`epoch_scalars`) at its step."""
        self._guarded(lambda: self._write(row))

    def _guarded(self, action: Callable[[], Any]) -> None:
        """Run ``action`` on a thread of its own for at most ``timeout_s``, unless an earlier one failed; a failure
        or a call still running is the warning, once (the thread left to end with the process)."""
        if self._failed:
            return
        errors: list[BaseException] = []

        def call() -> None:
            try:
                action()
            except BaseException as error:  # noqa: BLE001 - whatever it is: a tracker must not end a training run
                errors.append(error)

        worker = threading.Thread(target=call, name="vramcal-tracker", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive() or errors:
            self._failed = True
            why = (f"{type(errors[0]).__name__}: {first_line(errors[0])}" if errors else
                   f"no answer within {self.timeout_s:g} s: not waited for any longer")
            self.echo(f"warning: {self._what} stopped ({why}); the run goes on and {checkpoint.METRICS} keeps every "
                      f"figure")


class RunTracker(_Tracker):
    """A run's TensorBoard writer, opened at the first epoch row.

    Args:
        log_dir: the event files' folder. purge_step: :func:`purge_step` of the run. echo: where the warning goes.
    """

    def __init__(self, log_dir: Path, purge_step: int, echo: Echo, timeout_s: float = TRACKER_TIMEOUT_S) -> None:
        super().__init__(f"TensorBoard logging to {log_dir}", echo, timeout_s)
        self.log_dir, self.purge_step = Path(log_dir), purge_step
        self._writer: Any = None

    def close(self, status: str = "FINISHED") -> None:
        """Flush and close the event file (``status`` is for trackers that record it)."""
        if self._writer is not None:
            self._guarded(self._writer.close)

    def _write(self, row: dict[str, Any]) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # loads torch

            self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=self.purge_step)
        for tag, value in epoch_scalars(row).items():
            self._writer.add_scalar(tag, value, int(row["step"]))
        self._writer.flush()  # a failed write surfaces here, at the epoch that made it


def check_reporters(report_to: Iterable[str]) -> None:
    """Raises: ConfigError: a reporter (:data:`vramcal.train.config.REPORT_TO`) whose package is not installed (one
    line: what to install)."""
    for name in report_to:
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f"--report-to {name}: the {name} package is not installed: pip install {name}"
                              f"{' (or mlflow-skinny)' if name == 'mlflow' else ''}, or leave {name} out")


def run_trackers(plan: Any, echo: Echo) -> list[Any]:
    """The trackers of a run's ``config.report_to`` (none for a DDP rank but rank 0)."""
    if plan.rank != 0:
        return []
    found: list[Any] = []
    if "tensorboard" in plan.config.report_to:
        found.append(RunTracker(plan.run_dir / TENSORBOARD, purge_step(plan.run_dir, plan.resume), echo))
    if "mlflow" in plan.config.report_to:
        found.append(MlflowTracker(plan, echo))
    return found


class MlflowTracker(_Tracker):
    """A run's MLflow run through ``mlflow.tracking.MlflowClient``: created (or, resumed, found again by its id) at
    the first epoch row, with the config, batch size and LR as parameters.

    Args:
        plan: the run (:class:`vramcal.train.plan.Plan`). echo: where the warning goes.
    """

    def __init__(self, plan: Any, echo: Echo, timeout_s: float = TRACKER_TIMEOUT_S) -> None:
        super().__init__(f"MLflow logging of {plan.run_dir}", echo, timeout_s)
        self.plan = plan
        self.run_id: str | None = None
        self._client: Any = None

    def close(self, status: str = "FINISHED") -> None:
        """End the MLflow run with ``status`` (``FINISHED``, ``FAILED`` or ``KILLED``), if one was started."""
        if self.run_id is not None:
            self._guarded(lambda: self._client.set_terminated(self.run_id, status))

    def _open(self) -> None:
        import os

        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = client = MlflowClient()
        kept = self.plan.run_dir / MLFLOW_RUN_ID
        if self.plan.resume and kept.is_file():
            self.run_id = kept.read_text().strip()
            client.update_run(self.run_id, status="RUNNING")
            return
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", MLFLOW_EXPERIMENT)
        found = client.get_experiment_by_name(name)
        experiment = found.experiment_id if found is not None else client.create_experiment(name)
        run = client.create_run(experiment, run_name=self.plan.run_dir.name,
                                tags={"vramcal.run_dir": str(self.plan.run_dir)})
        self.run_id = run.info.run_id
        atomic_write_text(kept, self.run_id + "\n")
        params = {**_flat(self.plan.config.to_dict()), "batch_size_used": self.plan.batch_size,
                  "step_batch_size": self.plan.step_batch_size, "lr_used": self.plan.lr}
        client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in sorted(params.items())])

    def _write(self, row: dict[str, Any]) -> None:
        import time

        from mlflow.entities import Metric

        if self._client is None:
            self._open()
        now, step = int(time.time() * 1000), int(row["step"])
        metrics = [Metric(tag, value, now, step) for tag, value in epoch_scalars(row).items()]
        self._client.log_batch(self.run_id, metrics=metrics)


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config's settings as MLflow parameters: nested tables as ``spec.d_model``, unset ones left out."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        elif value is not None:
            flat[f"{prefix}{key}"] = ",".join(value) if isinstance(value, (list, tuple)) else value
    return flat


def log_trial(trial, echo: Echo) -> None:
    """Write a finished (complete or pruned) tune trial's hyperparameters and objective into its run folder's event
    files for TensorBoard's HParams dashboard (an optuna callback: :func:`vramcal.tune.study.run_study`); a
    failure is one warning."""
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
             f"({type(error).__name__}: {first_line(error)})")
