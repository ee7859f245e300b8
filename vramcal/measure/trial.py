"""One trial: real training steps at one batch size, in a worker of its own, measured by the trainer's meter.

1. open the meter (:func:`vramcal.measure.meters.open_meter`) before anything is allocated;
2. build the step with its factory (:mod:`vramcal.workload`) on the device;
3. ``warmup_steps`` steps (AdamW's state, Triton's autotuning), then reset the peaks;
4. ``measured_steps`` steps, each timed after a synchronize (torch.utils.benchmark's habit), more while the
   rate's 95 % interval is open (:func:`vramcal.calibration.throughput.timing_done`), then ``val_steps``
   validation passes; 5. read the peaks (training and validation alike).

A boundary trial (``peak_only``) takes one measured step and no validation: a second adds at most 0.1 % to the
peak (``bench/results/creep-256k/STUDY.md``). A steady trial reads its peak every step and runs an epoch's end
(:mod:`vramcal.calibration.creep`); one that ``verifies`` records its first steps as a short trial too. A world's
trial runs a worker per rank (:mod:`vramcal.measure.distributed`); its peak is its largest rank's.
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
from vramcal.records import Device, Kind, Trial, TrialSettings, World
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
    """What a trial process needs (picklable; module docstring for the kinds of trial).

    Attributes:
        model: the factory and its arguments (the profile's key). batch_size: samples per step (per rank).
        device: where to measure; a host trial runs under ``RLIMIT_DATA`` = its ``total_bytes``.
        options_json: factory arguments as JSON that do not change the model (recorded, not in the key).
        settings: the trial's steps and time limit. steady, verifies, peak_only: the kinds (module docstring).
        world: a DDP/FSDP world of ranks, or None. rank_devices: each rank's device; (): all on ``device``.
        usable_bytes: a host trial killed after its meter read at or above it is out-of-memory
            (:mod:`vramcal.measure.evidence`); None: only the kernel's counter says so.
        train_batch_size: an evaluation trial (:mod:`vramcal.calibration.evaluation`) warms up training at this
            size, then measures evaluation passes at ``batch_size``; None: a training trial.
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
        return self.device.total_bytes if self.device.kind.budgeted else None


class TrialRunner:
    """Runs trials in workers (:class:`~vramcal.measure.worker.Workers`, preloaded by :func:`vramcal.api.worker_pool`).

    ``on_step`` gets each steady trial's step as it ends (:func:`steps`); ``context`` holds what the last finished
    trial reported for the whole calibration (kernel path, environment, the model's facts, the data).
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
        """Run one trial (killed after ``request.settings.timeout_s``); never raises for what happens in its workers.

        Returns:
            Its record; a finished trial that ``verifies`` gives two: the short ``verify-conservative`` first.
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
            calls = [(measure, (request, rank, init)) for rank in range(request.world.nproc)]
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
        """The records of a trial whose processes all finished (:meth:`record`), the verifying short one first."""
        steady = self.record(figures, outcomes, request, purpose)
        if any("short" not in each for each in figures):
            return (steady,)
        short = self.record([each["short"] for each in figures], outcomes, request, "verify-conservative")
        wall_s = (short.startup_s or 0.0) + short.build_s + sum(  # type: ignore[operator]
            (*short.warmup_times_s, *short.step_times_s, *short.val_times_s))  # type: ignore[misc]
        return dataclasses.replace(short, wall_s=wall_s), steady

    def record(self, figures: list[dict[str, Any]], outcomes: list[Outcome], request: TrialRequest,
               purpose: str) -> Trial:
        """The trial of finished processes' ``figures``: the largest rank's, every rank's peak, and the slowest rank's
        step times, step by step (the collectives make every rank wait for it)."""
        self.context = figures[0]["context"]
        figures = [{k: v for k, v in each.items() if k not in ("context", "rank", "short")} for each in figures]
        startup_s, wall_s = max(o.startup_s or 0 for o in outcomes), max(o.wall_s or 0 for o in outcomes)
        top = max(range(len(figures)), key=lambda rank: figures[rank]["peak_bytes"])
        step_s = max(f["step_s"] for f in figures)
        slowest = {key: tuple(map(max, zip(*(f[key] for f in figures))))
                   for key in ("step_times_s", "warmup_times_s", "val_times_s")}
        trial = {**figures[top], **slowest, "step_s": step_s, "samples_per_s": request.batch_size / step_s}
        ranks = tuple(f["peak_bytes"] for f in figures) if len(figures) > 1 else None
        return Trial(batch_size=request.batch_size, status="ok", purpose=purpose, startup_s=startup_s, wall_s=wall_s,
                     rank_peak_bytes=ranks, **trial)

    def failed(self, request: TrialRequest, outcome: Outcome, purpose: str) -> Trial:
        """The record of a trial that did not finish: its status and the error's first line, then the traceback."""
        header = f"{outcome.error_type}: {outcome.message}" if outcome.error_type else outcome.message
        error = "\n".join(text for text in (header, outcome.error) if text)
        return Trial(batch_size=request.batch_size, status=outcome.status, purpose=purpose,
                     startup_s=outcome.startup_s, wall_s=outcome.wall_s, error=error)


def first_failure(outcomes: list[Outcome]) -> tuple[int, Outcome]:
    """The rank whose failure ended the world: an out-of-memory rank first, then the earliest to end."""
    failed = [(rank, o) for rank, o in enumerate(outcomes) if o.status != "ok"]
    return min(failed, key=lambda item: (item[1].status != "oom", item[1].wall_s or 0.0))


def torch_device(device: Device):
    """The torch device a worker trains on: ``cuda`` (the pinned GPU, the only one visible) or ``cpu``."""
    import torch

    return torch.device(device.kind.torch_type)


def measure(request: TrialRequest, rank: int | None = None, init_method: str = "", channel: Any = None
            ) -> dict[str, Any]:
    """Build, warm up and measure (module docstring), in the trial's process: one process, or rank ``rank`` of a
    world, joined through ``init_method``, its step built on every rank (agreed) and wrapped.

    Returns:
        The :class:`~vramcal.records.Trial` fields measured, ``held_bytes`` (held as training starts: the process
        term's baseline), ``context`` (:class:`TrialRunner`), and a world's ``rank``.

    Raises:
        Whatever the step raises (out-of-memory errors included); :class:`vramcal.measure.distributed.PeerFailed`
        when another rank failed.
    """
    device, phase = request.device if rank is None else request.rank_device(rank), phase_of(channel)
    meter = open_meter(device, request.host_memory_limit_bytes)
    group = None
    try:
        if rank is not None:
            phase("joining the world (torch.distributed.init_process_group)")
            group = join(request.world, rank, init_method, request.settings.timeout_s, torch_device(device))
        start = time.perf_counter()
        phase("building the step")

        def make() -> Any:
            return build(request.model, torch_device(device), json.loads(request.options_json))

        step = make() if group is None else build_agreed(group, make)
        meter.check_pinned()
        model = step.model if group is None else wrap(step, request.world, torch_device(device))
        held = meter.held_bytes()
        figures = steps(request, step, model, meter, time.perf_counter() - start, bool if group is None else
                        group.all_of, None if rank else channel, phase_of(channel, meter))
        return {**figures, "held_bytes": held, **({} if rank is None else {"rank": rank})}
    finally:
        if group is not None:
            group.close()
        meter.close()


def phase_of(channel: Any, meter: Any = None) -> Callable[[str], None]:
    """``channel.phase`` (:meth:`vramcal.measure.worker.Channel.phase`), then with a ``meter`` (once CUDA started)
    its peak so far (:meth:`~vramcal.measure.worker.Channel.reading`: a kill's evidence); no channel: a no-op."""
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

    A steady trial records its peak each step (``step_peaks``), runs :func:`end_epoch` when
    :func:`~vramcal.calibration.creep.epoch_end_due` (``epoch_end_step``), stops at
    :func:`~vramcal.calibration.creep.steady_done`, and sends each step through ``channel`` (``step``, ``of``,
    ``peak_bytes``, ``step_s``); one that ``verifies`` also returns ``short``. ``all_ranks``: a world's agreement,
    so every rank acts at the same step. ``phase`` is told each part as it starts (a timeout names it).
    """
    device, batch_size, settings = request.device, request.batch_size, request.settings
    if request.train_batch_size is not None:
        return evaluation_steps(request, step, model, meter, build_s, phase)

    def validate() -> list[float]:
        if request.val_steps:
            phase("the validation pass")
        return [_timed(lambda: validation_step(step, batch_size, model), device.kind)
                for _ in range(request.val_steps)]

    train, witness, warmup = _warm_up(request, step, model, meter, batch_size, phase)
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
    """A short trial's extra timed steps, appended to ``times``, while its rate's interval is open."""
    while not (request.steady or request.peak_only or all_ranks(timing_done(times, request.measured_steps))):
        phase(f"timed step {len(times) + 1} (for the rate's interval)")
        times.append(_timed(train, request.device.kind))


def evaluation_steps(request: TrialRequest, step: Any, model: Any, meter: Any, build_s: float,
                     phase: Callable[[str], None] = phase_of(None)) -> dict[str, Any]:
    """An evaluation trial (:mod:`vramcal.calibration.evaluation`): the warm-up trains at
    ``request.train_batch_size`` (the state the trainer validates in), then ``measured_steps`` timed evaluation
    passes alone at ``request.batch_size`` are measured."""
    kind, size = request.device.kind, request.train_batch_size
    _, witness, warmup = _warm_up(request, step, model, meter, size, phase, f" at batch_size {size}")  # type: ignore
    passes = []
    for number in range(1, request.measured_steps + 1):
        phase(f"evaluation pass {number} of {request.measured_steps}")
        passes.append(_timed(lambda: validation_step(step, request.batch_size, model), kind))
    return _figures(step, meter, kind, request.batch_size, build_s, warmup, passes, [], witness)


def _warm_up(request: TrialRequest, step: Any, model: Any, meter: Any, batch_size: int,
             phase: Callable[[str], None], at: str = "") -> tuple[Callable[[], None], Any, list[float]]:
    """``warmup_steps`` timed training steps at ``batch_size``, then the meter reset. Returns the training step as a
    call, the :class:`vramcal.workload.KernelWitness` its first call runs under where the model's kernels are bound
    (:func:`vramcal.workload.kernels_bound`; else None), and the warm-up's times (s)."""
    count = request.settings.warmup_steps
    phase(f"the warm-up {'training ' * bool(at)}step{'s' * (count != 1)}{at}")
    witness = KernelWitness() if step.kernel_path is None and kernels_bound(step.model) else None
    unwitnessed = [witness] if witness else []

    def train() -> None:
        with unwitnessed.pop() if unwitnessed else contextlib.nullcontext():
            train_step(step, step.batch(batch_size), model)

    warmup = [_timed(train, request.device.kind) for _ in range(count)]
    meter.reset()
    return train, witness, warmup


def end_epoch(step: Any, model: Any, batch_size: int, device_kind: Kind, phase: Callable[[str], None]) -> None:
    """A steady trial's epoch's end, as a run's: a training step at the partial batch
    (:func:`vramcal.calibration.creep.partial_batch_size`), validation passes at both sizes."""
    partial = partial_batch_size(batch_size)
    phase(f"the epoch's end (a step at batch_size {partial} and validation passes)")
    train_step(step, step.batch(partial), model)
    validation_step(step, batch_size, model)
    validation_step(step, partial, model)
    synchronize(device_kind)


def _figures(step: Any, meter: Any, device_kind: Kind, batch_size: int, build_s: float, warmup: list[float],
             times: list[float], val: list[float], witness: Any = None) -> dict[str, Any]:
    """A trial's record from its step times (s) and the meter's reading now; ``witness``: :func:`_warm_up`'s."""
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
    """Bytes of the gradients ``loss.backward()`` allocates on this rank (every parameter that requires one, at its
    element size; under FSDP the rank's shard)."""
    return local_bytes(p for p in model.parameters() if p.requires_grad)


def model_state(step: Any) -> dict[str, int]:
    """The model states of ``step`` after its steps (parameters, gradients, the optimizer's state tensors), bytes:
    ``model_state_bytes`` one whole copy (a DTensor at its global size), ``rank_model_state_bytes`` this rank's."""
    params = [p for p in step.model.parameters()]
    states = [v for state in step.optimizer.state.values() for v in state.values() if hasattr(v, "numel")]
    whole = sum(t.numel() * t.element_size() for t in [*params, *states])
    grads = [p for p in params if p.requires_grad]
    return {"model_state_bytes": whole + sum(p.numel() * p.element_size() for p in grads),
            "rank_model_state_bytes": local_bytes([*params, *states]) + local_bytes(grads)}


def _timed(run: Callable[[], Any], device_kind: Kind) -> float:
    """Seconds ``run()`` took, read after a synchronize, as the trainer times a step."""
    start = time.perf_counter()
    run()
    synchronize(device_kind)
    return time.perf_counter() - start
