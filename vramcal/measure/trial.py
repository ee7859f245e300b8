"""One trial: real training steps of the real training step at one batch size, in a worker of its own.

The trial runs what training runs (:mod:`vramcal.workload`), in the kind of process training runs in
(:mod:`vramcal.measure.worker`), measured by the meter training uses (:func:`vramcal.measure.meters.open_meter`):

1. open the meter before anything is allocated (it pins the GPU by UUID, or sets the host budget's
   ``RLIMIT_DATA``), so the peak includes the CUDA context, the weights and the data;
2. build the step with its factory on the device: model, optimizer, data pipeline;
3. ``warmup_steps`` optimizer steps (AdamW allocates its state and Triton autotunes there), then reset
   the peaks;
4. ``measured_steps`` steps, each on a fresh batch from the pipeline and timed after a synchronize
   (torch.utils.benchmark's habit), then ``val_steps`` validation passes at the same batch size, as the
   trainer validates;
5. read the peaks: the trial's ``peak_bytes`` covers training steps and validation alike.

Every warm-up step, measured step and validation pass is timed on its own (``warmup_times_s``,
``step_times_s``, ``val_times_s``), from drawing its batch to a synchronize after it, the way the trainer
times its steps: the run forecast (:mod:`vramcal.forecast`) reads them.

Out-of-memory errors are recognised by :func:`vramcal.oom.is_out_of_memory` only.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

from vramcal.measure.worker import Outcome, Workers
from vramcal.records import Device, Trial, TrialSettings
from vramcal.workload import ModelRef


@dataclass(frozen=True)
class TrialRequest:
    """What a trial process needs (picklable).

    Attributes:
        model: the factory and its arguments (the profile's key).
        batch_size: samples per step.
        device: where to measure; on the host the trial runs under ``RLIMIT_DATA`` = its ``total_bytes``.
        options_json: more factory arguments as JSON that do not change the model (e.g. the dataset
            file of the regressor); recorded in the profile, not part of its key.
        settings: the steps of the trial (module docstring) and its time limit.
        steady: the steady trial: ``settings.steady_steps`` measured steps (:mod:`vramcal.calibration.creep`).
    """

    model: ModelRef
    batch_size: int
    device: Device
    options_json: str = "{}"
    settings: TrialSettings = TrialSettings()
    steady: bool = False

    def with_batch_size(self, batch_size: int) -> TrialRequest:
        return dataclasses.replace(self, batch_size=batch_size)

    @property
    def measured_steps(self) -> int:
        return self.settings.steady_steps if self.steady else self.settings.measured_steps

    @property
    def host_memory_limit_bytes(self) -> int | None:
        """``RLIMIT_DATA`` of a host trial (the budget); None on a GPU."""
        return self.device.total_bytes if self.device.kind == "host" else None


class TrialRunner:
    """Runs trials in workers (:class:`~vramcal.measure.worker.Workers`).

    Args:
        workers: the worker pool, whose fork server the caller preloaded (:func:`vramcal.api.worker_pool`).

    ``context`` holds what the last finished trial reported about the whole calibration: the kernel
    path that ran, the software environment seen inside the process, the model's facts and the data.
    """

    context: dict[str, Any]

    def __init__(self, workers: Workers) -> None:
        self.workers = workers
        self.context = {}

    def run(self, request: TrialRequest, purpose: str = "") -> Trial:
        """Run one trial (killed after ``request.settings.timeout_s``); never raises for what happens inside the
        trial process."""
        outcome = self.workers.run(measure, request, timeout_s=request.settings.timeout_s)
        return self.record(request, outcome, purpose)

    def record(self, request: TrialRequest, outcome: Outcome, purpose: str) -> Trial:
        if outcome.status != "ok":
            header = f"{outcome.error_type}: {outcome.message}" if outcome.error_type else outcome.message
            error = "\n".join(text for text in (header, outcome.error) if text)  # first line: what failed
            return Trial(batch_size=request.batch_size, status=outcome.status, purpose=purpose,
                         startup_s=outcome.startup_s, wall_s=outcome.wall_s, error=error)
        figures = dict(outcome.result)
        self.context = figures.pop("context")
        return Trial(batch_size=request.batch_size, status="ok", purpose=purpose, startup_s=outcome.startup_s,
                     wall_s=outcome.wall_s, **figures)


def torch_device(device: Device):
    """The torch device a worker trains on: ``cuda`` (the pinned GPU is the only visible one) or ``cpu``."""
    import torch

    return torch.device("cuda" if device.kind == "cuda" else "cpu")


def measure(request: TrialRequest, channel: Any = None) -> dict[str, Any]:
    """Build, warm up and measure (module docstring); runs in the trial process.

    Returns:
        The :class:`~vramcal.records.Trial` fields measured, and ``context`` (see :class:`TrialRunner`).

    Raises:
        Whatever the step raises (out-of-memory errors included); the worker records it.
    """
    from vramcal.measure.meters import open_meter
    from vramcal.workload import build, detect_kernel_path, train_step, validation_step

    device, batch_size = request.device, request.batch_size
    meter = open_meter(device, request.host_memory_limit_bytes)
    try:
        start = time.perf_counter()
        step = build(request.model, torch_device(device), json.loads(request.options_json))
        meter.check_pinned()
        build_s = time.perf_counter() - start
        warmup = [_timed(lambda: train_step(step, step.batch(batch_size)), device.kind)
                  for _ in range(request.settings.warmup_steps)]
        meter.reset()
        times = [_timed(lambda: train_step(step, step.batch(batch_size)), device.kind)
                 for _ in range(request.measured_steps)]
        val = [_timed(lambda: validation_step(step, batch_size), device.kind)
               for _ in range(request.settings.val_steps)]
        figures = meter.read()
        context = {"kernel_path": step.kernel_path or detect_kernel_path(step.model),
                   "environment": meter.environment(), "info": step.info,
                   "data": {"data_bytes": step.data_bytes, "on_device": step.data_on_device}}
    finally:
        meter.close()
    step_s = statistics.median(times)
    return {"step_s": step_s, "samples_per_s": batch_size / step_s, "build_s": build_s,
            "step_times_s": tuple(times), "warmup_times_s": tuple(warmup), "val_times_s": tuple(val),
            "data_bytes": step.pool_data_bytes(device.kind), "context": context, **figures}


def _timed(run: Any, device_kind: str) -> float:
    """Seconds ``run()`` took, read after a synchronize (the device's queue drained), as the trainer times a step."""
    from vramcal.measure.meters import synchronize

    start = time.perf_counter()
    run()
    synchronize(device_kind)
    return time.perf_counter() - start
