"""One trial: real training steps of the real training step at one batch size, in a worker of its own.

The trial runs what training runs (:mod:`vramcal.workload`), in the kind of process training runs in
(:mod:`vramcal.measure.worker`), measured by the meter training uses (:func:`vramcal.measure.meters.open_meter`):

1. open the meter before anything is allocated (it pins the GPU by UUID, or sets the host budget's
   ``RLIMIT_DATA``), so the peak includes the CUDA context, the weights and the data;
2. build the step with its factory on the device: model, optimizer, data pipeline;
3. ``warmup_steps`` optimizer steps (AdamW allocates its state and Triton autotunes there), then reset
   the peaks;
4. ``measured_steps`` steps, each on a fresh batch from the pipeline and timed after a synchronize
   (torch.utils.benchmark's habit), and, where their times are too few for a finite 95 % interval of the
   rate, up to four more, one at a time (:func:`vramcal.calibration.throughput.timing_done`: the throughput
   knee compares only finite intervals), then ``val_steps`` validation passes at the same batch size, as the
   trainer validates;
5. read the peaks: the trial's ``peak_bytes`` covers training steps and validation alike.

A trial that measures a peak only (``request.peak_only``: a boundary trial, search rule 3, which the search
reads for its peak alone) takes one measured step and no validation pass: past the largest size a run may take,
its steps are the calibration's most expensive, and a validation pass (forward only) peaks below a training step.
A second step adds little to a peak the warm-up has set up (the optimizer's state, the allocator's pools): on the
host at most 0.1 % at step 2 or 3 (``bench/results/creep-256k/STUDY.md``: 0.7 MiB of 823 MiB on the small spec),
against the 1 % the boundary is held to (the benchmark's boundary errors: +0.1 to +0.7 %).

A steady trial (``request.steady``) reads its peak after every measured step and runs an epoch's end after its
first ``measured_steps`` (:func:`steps`; :mod:`vramcal.calibration.creep`).

A steady trial that verifies its size (``request.verifies``: the conservative size's verification, search
rules 4 and 6) runs that sequence first: after ``measured_steps`` steps it runs the validation passes and reads the
meter (``short`` in its result: the figures a short trial at that size records), then goes on stepping as
a steady trial does, and validates again at its end. One process then gives both records
(:meth:`TrialRunner.run`), and the calibration spends no trial of its own on the verification.

In a DDP world (``request.world``) each rank is a worker of its own running the same sequence with the
model wrapped in DDP (:mod:`vramcal.measure.distributed`); the trial's peak is its largest rank's, with
every rank's kept, and a rank's failure fails the trial for all (the others are stopped, never left
waiting in a collective).

Every warm-up step, measured step and validation pass is timed on its own (``warmup_times_s``,
``step_times_s``, ``val_times_s``), from drawing its batch to a synchronize after it, the way the trainer
times its steps: the run forecast (:mod:`vramcal.forecast`) reads them.

Out-of-memory errors are recognised by :func:`vramcal.oom.is_out_of_memory` only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vramcal.calibration.creep import epoch_end_due, partial_batch_size, steady_done
from vramcal.calibration.throughput import timing_done
from vramcal.measure.distributed import build_agreed, join, local_bytes, wrap
from vramcal.measure.meters import open_meter, synchronize
from vramcal.measure.worker import Outcome, Workers
from vramcal.records import Device, Trial, TrialSettings, World
from vramcal.workload import (
    KernelWitness,
    ModelRef,
    build,
    detect_kernel_path,
    kernels_bound,
    train_step,
    validation_step,
)


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
        steady: the steady trial: at most ``settings.steady_steps`` measured steps, fewer once its peak has
            levelled off (:mod:`vramcal.calibration.creep`).
        verifies: a steady trial whose first ``settings.measured_steps`` steps and validation passes are a
            short trial at its size too (module docstring).
        world: a DDP world of ranks (``batch_size`` is then per rank), or None for one process.
        rank_devices: each rank's device (GPUs: one each); () = every rank on ``device`` (the host).
        peak_only: one measured step and no validation pass (module docstring): a boundary trial.
        usable_bytes: the calibration's usable memory (bytes): a host trial killed by a signal after its meter read
            at or above it is out-of-memory (:mod:`vramcal.measure.evidence`; a GPU trial never is); None: only the
            kernel's counter says so.
        train_batch_size: an evaluation trial (:mod:`vramcal.calibration.evaluation`): its warm-up steps train at
            this batch size, then its measured steps are evaluation passes alone at ``batch_size``. None: a
            training trial.
    """

    model: ModelRef
    batch_size: int
    device: Device
    options_json: str = "{}"
    settings: TrialSettings = TrialSettings()
    steady: bool = False
    verifies: bool = False
    world: World | None = None
    rank_devices: tuple[Device, ...] = ()
    peak_only: bool = False
    usable_bytes: int | None = None
    train_batch_size: int | None = None

    def rank_device(self, rank: int) -> Device:
        return self.rank_devices[rank] if self.rank_devices else self.device

    def with_batch_size(self, batch_size: int) -> TrialRequest:
        return dataclasses.replace(self, batch_size=batch_size)

    @property
    def measured_steps(self) -> int:
        return 1 if self.peak_only else self.settings.steady_steps if self.steady else self.settings.measured_steps

    @property
    def val_steps(self) -> int:
        return 0 if self.peak_only else self.settings.val_steps

    @property
    def host_memory_limit_bytes(self) -> int | None:
        """``RLIMIT_DATA`` of a host trial (the budget); None on a GPU."""
        return self.device.total_bytes if self.device.kind == "host" else None


class TrialRunner:
    """Runs trials in workers (:class:`~vramcal.measure.worker.Workers`).

    Args:
        workers: the worker pool, whose fork server the caller preloaded (:func:`vramcal.api.worker_pool`).
        on_step: called in this process with each step of a steady trial as it ends (its ``step`` message,
            :func:`steps`): progress through the longest trial.

    ``context`` holds what the last finished trial reported about the whole calibration: the kernel
    path that ran, the software environment seen inside the process, the model's facts and the data.
    """

    context: dict[str, Any]

    def __init__(self, workers: Workers, on_step: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.workers, self.on_step = workers, on_step
        self.context = {}

    def _handle(self, kind: str, payload: Any) -> None:
        """A worker's message: a steady trial's ``step`` goes to ``on_step`` (progress)."""
        if kind == "step" and self.on_step is not None:
            self.on_step(payload)

    def run(self, request: TrialRequest, purpose: str = "") -> tuple[Trial, ...]:
        """Run one trial (killed after ``request.settings.timeout_s``); never raises for what happens inside the
        trial processes.

        Returns:
            Its record; a steady trial that verifies its size (``request.verifies``) and finished gives two:
            its first steps as the short trial ``verify-conservative`` (``wall_s`` those steps' share), then
            the steady trial under ``purpose``.
        """
        if request.world is not None:
            return self.run_world(request, purpose)
        outcome = self.workers.run(measure, request, timeout_s=request.settings.timeout_s, handler=self._handle,
                                   usable_bytes=request.usable_bytes, device_kind=request.device.kind)
        if outcome.status != "ok":
            return (self.failed(request, outcome, purpose),)
        return self.records([outcome.result], [outcome], request, purpose)

    def run_world(self, request: TrialRequest, purpose: str) -> tuple[Trial, ...]:
        """The ranks of a DDP trial, each in a worker, meeting through a file in a fresh folder."""
        import shutil
        import tempfile

        folder = tempfile.mkdtemp(prefix="vramcal-world-")
        try:
            init = f"file://{folder}/rendezvous"
            calls = [(measure_rank, (request, rank, init)) for rank in range(request.world.nproc)]
            outcomes = self.workers.run_all(calls, timeout_s=request.settings.timeout_s, handler=self._handle,
                                            usable_bytes=request.usable_bytes, device_kind=request.device.kind)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if all(o.status == "ok" for o in outcomes):
            return self.records([o.result for o in outcomes], outcomes, request, purpose)
        rank, root = first_failure(outcomes)
        status = "oom" if any(o.status == "oom" for o in outcomes) else root.status
        message = f"rank {rank}: {root.message}"
        if status == "timeout":  # every rank was stopped at once: where each one was says which hung
            message = "; ".join(f"rank {r}: {o.message or 'finished'}" for r, o in enumerate(outcomes))
        return (self.failed(request, dataclasses.replace(root, status=status, message=message), purpose),)

    def records(self, figures: list[dict[str, Any]], outcomes: list[Outcome], request: TrialRequest,
                purpose: str) -> tuple[Trial, ...]:
        """The records of a trial whose processes (one, or a world's ranks) all finished: the steady trial's
        first steps first when it verified its size, each from :meth:`record`."""
        steady = self.record(figures, outcomes, request, purpose)
        if any("short" not in each for each in figures):
            return (steady,)
        short = self.record([each["short"] for each in figures], outcomes, request, "verify-conservative")
        wall_s = (short.startup_s or 0.0) + short.build_s + sum(  # type: ignore[operator]
            (*short.warmup_times_s, *short.step_times_s, *short.val_times_s))  # type: ignore[misc]
        return dataclasses.replace(short, wall_s=wall_s), steady

    def record(self, figures: list[dict[str, Any]], outcomes: list[Outcome], request: TrialRequest,
               purpose: str) -> Trial:
        """The trial of one finished process, or of a world whose ranks all finished: the largest rank's
        figures, every rank's peak, and the world's step times (its slowest rank's, step by step: DDP's
        collectives make every rank wait for it). ``figures`` are each process's result, as it sent them."""
        self.context = figures[0]["context"]
        figures = [{k: v for k, v in each.items() if k not in ("context", "rank", "short")} for each in figures]
        if len(figures) == 1:
            return Trial(batch_size=request.batch_size, status="ok", purpose=purpose, startup_s=outcomes[0].startup_s,
                         wall_s=outcomes[0].wall_s, **figures[0])
        startup_s, wall_s = max(o.startup_s or 0 for o in outcomes), max(o.wall_s or 0 for o in outcomes)
        top = max(range(len(figures)), key=lambda rank: figures[rank]["peak_bytes"])
        step_s = max(f["step_s"] for f in figures)
        slowest = {key: tuple(map(max, zip(*(f[key] for f in figures))))
                   for key in ("step_times_s", "warmup_times_s", "val_times_s")}
        trial = {**figures[top], **slowest, "step_s": step_s, "samples_per_s": request.batch_size / step_s}
        return Trial(batch_size=request.batch_size, status="ok", purpose=purpose, startup_s=startup_s, wall_s=wall_s,
                     rank_peak_bytes=tuple(f["peak_bytes"] for f in figures), **trial)

    def failed(self, request: TrialRequest, outcome: Outcome, purpose: str) -> Trial:
        """The record of a trial that did not finish: its status and the error's first line, then the traceback."""
        header = f"{outcome.error_type}: {outcome.message}" if outcome.error_type else outcome.message
        error = "\n".join(text for text in (header, outcome.error) if text)  # first line: what failed
        return Trial(batch_size=request.batch_size, status=outcome.status, purpose=purpose,
                     startup_s=outcome.startup_s, wall_s=outcome.wall_s, error=error)


def first_failure(outcomes: list[Outcome]) -> tuple[int, Outcome]:
    """The rank whose failure ended the world: an out-of-memory rank before others, then the earliest to end
    (the others were stopped after it, or saw it die)."""
    failed = [(rank, o) for rank, o in enumerate(outcomes) if o.status != "ok"]
    return min(failed, key=lambda item: (item[1].status != "oom", item[1].wall_s or 0.0))


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

    device, phase = request.device, phase_of(channel)
    meter = open_meter(device, request.host_memory_limit_bytes)
    try:
        start = time.perf_counter()
        phase("building the step")
        step = build(request.model, torch_device(device), json.loads(request.options_json))
        meter.check_pinned()
        held = meter.held_bytes()  # what the process holds as training starts: the process term's baseline
        return {**steps(request, step, step.model, meter, time.perf_counter() - start, channel=channel,
                        phase=phase_of(channel, meter)), "held_bytes": held}
    finally:
        meter.close()


def measure_rank(request: TrialRequest, rank: int, init_method: str, channel: Any = None) -> dict[str, Any]:
    """Rank ``rank`` of a DDP trial (module docstring): the meter on the rank's device, the world joined, the
    step built (agreed), wrapped in DDP, then measured as :func:`measure` measures one process.

    Raises:
        Whatever the step raises; :class:`vramcal.measure.distributed.PeerFailed` when another rank failed.
    """

    device, phase = request.rank_device(rank), phase_of(channel)
    meter = open_meter(device, request.host_memory_limit_bytes)
    group = None
    try:
        phase("joining the world (torch.distributed.init_process_group)")
        group = join(request.world, rank, init_method, request.settings.timeout_s, torch_device(device))
        start = time.perf_counter()
        phase("building the step")
        step = build_agreed(group, lambda: build(request.model, torch_device(device),
                                                 json.loads(request.options_json)))
        meter.check_pinned()
        model = wrap(step, request.world, torch_device(device))
        held = meter.held_bytes()
        return {**steps(request, step, model, meter, time.perf_counter() - start, group.all_of,
                        channel if rank == 0 else None, phase_of(channel, meter)), "rank": rank, "held_bytes": held}
    finally:
        if group is not None:
            group.close()
        meter.close()


def phase_of(channel: Any, meter: Any = None) -> Callable[[str], None]:
    """``channel.phase`` (:meth:`vramcal.measure.worker.Channel.phase`), then with a ``meter`` its peak so far
    (:meth:`~vramcal.measure.worker.Channel.reading`: the last one is the evidence a kill may need); a no-op
    without a channel. A meter is given once the step is built (on a GPU its reading synchronizes: CUDA has
    started by then)."""
    if channel is None:
        return lambda text: None
    if meter is None:
        return channel.phase

    def phase(text: str) -> None:
        channel.phase(text)
        channel.reading(meter.read()["peak_bytes"])

    return phase


def steps(request: TrialRequest, step: Any, model: Any, meter: Any, build_s: float,
          all_ranks: Callable[[bool], bool] = bool, channel: Any = None,
          phase: Callable[[str], None] = phase_of(None)) -> dict[str, Any]:
    """Warm-up, the measured steps and the validation passes through ``model``, and the meter's figures.

    A steady trial reads its peak after every measured step (``step_peaks``), runs :func:`end_epoch` after its
    first ``settings.measured_steps`` (``epoch_end_step``) and ends once its peak has not risen for
    ``settings.plateau_steps`` steps after that (:mod:`vramcal.calibration.creep`); under DDP each decision is every
    rank's (``all_ranks``: the ranks' agreement, so they act at the same step). It sends each step through
    ``channel`` as it ends (a ``step`` message: ``step``, ``of`` (the most), ``peak_bytes``, ``step_s``), so the
    caller's progress moves through its minutes. One that verifies its size (``request.verifies``) also returns
    ``short``: its figures after its first ``settings.measured_steps`` steps and the validation passes, as a short
    trial's (module docstring). A short trial times more steps while its rate's interval is open (:func:`timing_done`).
    ``phase`` is told each part as it starts (a trial killed at its time limit names where it was).
    """
    device, batch_size, settings = request.device, request.batch_size, request.settings
    if request.train_batch_size is not None:
        return evaluation_steps(request, step, model, meter, build_s, phase)

    def validate() -> list[float]:
        if request.val_steps:
            phase("the validation pass")
        return [_timed(lambda: validation_step(step, batch_size, model), device.kind)
                for _ in range(request.val_steps)]

    phase(f"the warm-up step{'s' * (settings.warmup_steps != 1)}")
    train, witness = _trainer(step, model, batch_size)
    warmup = [_timed(train, device.kind) for _ in range(settings.warmup_steps)]
    meter.reset()
    times, curve, short, epoch_end = [], [], None, None
    for number in range(1, request.measured_steps + 1):
        phase(f"measured step {number} of {'at most ' * request.steady}{request.measured_steps}")
        times.append(_timed(train, device.kind))
        if request.steady:
            curve.append(int(meter.read()["peak_bytes"]))
            if request.verifies and len(curve) == settings.measured_steps:
                short = _figures(step, meter, device.kind, batch_size, build_s, warmup, times, validate(), witness)
            if channel is not None:
                channel.send("step", {"step": len(curve), "of": request.measured_steps, "peak_bytes": curve[-1],
                                      "step_s": times[-1]})
            if epoch_end is None:
                if all_ranks(epoch_end_due(curve, settings)):
                    end_epoch(step, model, batch_size, device.kind, phase)
                    epoch_end = len(curve)
            elif all_ranks(steady_done(curve, settings, epoch_end)):
                break
    _time_more(request, train, times, all_ranks, phase)
    figures = _figures(step, meter, device.kind, batch_size, build_s, warmup, times, validate(), witness)
    return {**figures, **({"step_peaks": tuple(curve), "epoch_end_step": epoch_end} if request.steady else {}),
            **({"short": short} if short is not None else {})}


def _time_more(request: TrialRequest, train: Callable[[], Any], times: list[float],
               all_ranks: Callable[[bool], bool], phase: Callable[[str], None]) -> None:
    """A short trial's extra timed steps, appended to ``times``, while its rate's interval is open
    (:func:`timing_done`; every rank's decision under DDP)."""
    while not (request.steady or request.peak_only or all_ranks(timing_done(times, request.measured_steps))):
        phase(f"timed step {len(times) + 1} (for the rate's interval)")
        times.append(_timed(train, request.device.kind))


def evaluation_steps(request: TrialRequest, step: Any, model: Any, meter: Any, build_s: float,
                     phase: Callable[[str], None] = phase_of(None)) -> dict[str, Any]:
    """An evaluation trial (:mod:`vramcal.calibration.evaluation`): ``warmup_steps`` training steps at
    ``request.train_batch_size`` (the optimizer's state allocated, the gradients freed by its step, as the trainer
    leaves them before it validates), the meter reset, then ``measured_steps`` evaluation passes alone at
    ``request.batch_size`` (:func:`vramcal.workload.validation_step`), each timed; their figures are the trial's."""

    kind, settings = request.device.kind, request.settings
    phase(f"the warm-up training step{'s' * (settings.warmup_steps != 1)} at batch_size {request.train_batch_size}")
    train, witness = _trainer(step, model, request.train_batch_size)  # type: ignore[arg-type]
    warmup = [_timed(train, kind) for _ in range(settings.warmup_steps)]
    meter.reset()
    passes = []
    for number in range(1, request.measured_steps + 1):
        phase(f"evaluation pass {number} of {request.measured_steps}")
        passes.append(_timed(lambda: validation_step(step, request.batch_size, model), kind))
    return _figures(step, meter, kind, request.batch_size, build_s, warmup, passes, [], witness)


def _trainer(step: Any, model: Any, batch_size: int) -> tuple[Callable[[], None], Any]:
    """One training step at ``batch_size`` as a call, and the :class:`vramcal.workload.KernelWitness` its first call
    runs under where the model's kernels are bound (:func:`vramcal.workload.kernels_bound`; else None)."""

    witness = KernelWitness() if step.kernel_path is None and kernels_bound(step.model) else None
    unwitnessed = [witness] if witness else []

    def train() -> None:
        with unwitnessed.pop() if unwitnessed else contextlib.nullcontext():
            train_step(step, step.batch(batch_size), model)

    return train, witness


def end_epoch(step: Any, model: Any, batch_size: int, device_kind: str, phase: Callable[[str], None]) -> None:
    """A steady trial's epoch's end, as a training run's epoch ends: one training step at a partial batch
    (:func:`vramcal.calibration.creep.partial_batch_size` of ``batch_size``), then validation passes at the batch
    size and at the partial one."""

    partial = partial_batch_size(batch_size)
    phase(f"the epoch's end (a step at batch_size {partial} and validation passes)")
    train_step(step, step.batch(partial), model)
    validation_step(step, batch_size, model)
    validation_step(step, partial, model)
    synchronize(device_kind)


def _figures(step: Any, meter: Any, device_kind: str, batch_size: int, build_s: float, warmup: list[float],
             times: list[float], val: list[float], witness: Any = None) -> dict[str, Any]:
    """A trial's record from its step times and the meter's reading now (its peaks so far); ``witness``: the
    :class:`vramcal.workload.KernelWitness` of its first step, where the model's kernels are bound."""

    figures = meter.read()
    context = {"kernel_path": step.kernel_path or detect_kernel_path(step.model, witness and witness.called),
               "environment": meter.environment(), "info": step.info, "gradient_bytes": gradient_bytes(step.model),
               **model_state(step),
               "data": {"data_bytes": step.data_bytes, "on_device": step.data_on_device}}
    step_s = statistics.median(times)
    return {"step_s": step_s, "samples_per_s": batch_size / step_s, "build_s": build_s,
            "step_times_s": tuple(times), "warmup_times_s": tuple(warmup), "val_times_s": tuple(val),
            "data_bytes": step.pool_data_bytes(device_kind),
            "context": context, **figures}


def gradient_bytes(model: Any) -> int:
    """Bytes of the gradients a step of ``model`` holds on this rank: every parameter that requires one, at its
    own element size (what ``loss.backward()`` allocates into ``param.grad``; under FSDP the rank's shard)."""
    return local_bytes(p for p in model.parameters() if p.requires_grad)


def model_state(step: Any) -> dict[str, int]:
    """The model states of ``step`` after its steps, in bytes: the parameters, their gradients (as
    :func:`gradient_bytes`) and the optimizer's state tensors (AdamW: two per parameter), held whole by one process
    or a DDP rank, and by an FSDP rank only in its shard.

    Returns:
        ``model_state_bytes``: one whole copy (a DTensor counted at its global size); ``rank_model_state_bytes``:
        what this process holds of it.
    """
    params = [p for p in step.model.parameters()]
    states = [v for state in step.optimizer.state.values() for v in state.values() if hasattr(v, "numel")]
    whole = sum(t.numel() * t.element_size() for t in [*params, *states])
    grads = [p for p in params if p.requires_grad]
    return {"model_state_bytes": whole + sum(p.numel() * p.element_size() for p in grads),
            "rank_model_state_bytes": local_bytes([*params, *states]) + local_bytes(grads)}


def _timed(run: Callable[[], Any], device_kind: str) -> float:
    """Seconds ``run()`` took, read after a synchronize (the device's queue drained), as the trainer times a step."""

    start = time.perf_counter()
    run()
    synchronize(device_kind)
    return time.perf_counter() - start
