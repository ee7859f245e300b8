"""One training step's memory without a GPU or real tensors: the step a trial runs, traced on fake tensors.

Per batch size, in a fresh ``FakeTensorMode(allow_non_fake_inputs=True)``: the factory's real build, faked (the meta
device would skip its own code; arrays it turns into tensors without an op stay real: ``data_bytes``), the warm-up,
a peak reset, the measured steps and validation as :mod:`vramcal.measure.trial` runs them, under
:class:`vramcal.estimate.trace.StorageTrace`. The estimate is the live peak on the host; on a card
(:func:`vramcal.estimate.card.as_card`, :func:`vramcal.estimate.fused.fused_twins`) the reserved peak of the events
replayed after the cuBLAS workspaces (:func:`vramcal.estimate.allocator.replay`).
Reasons and limits: DESIGN.md, "Estimates: a card you do not have".
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from vramcal.estimate.allocator import Event, replay
from vramcal.estimate.result import EstimateError, PointEstimate, StepEstimate, failure_message, line
from vramcal.records import Kind, TrialSettings
from vramcal.workload import ModelRef, build, detect_kernel_path, train_step, validation_step

if TYPE_CHECKING:  # pragma: no cover
    from vramcal.estimate.card import Card, Choices
    from vramcal.estimate.trace import StorageTrace
    from vramcal.workload import TrainingStep


def estimate_step(ref: ModelRef, batch_sizes: Sequence[int], *, options: dict[str, Any] | None = None,
                  device_kind: Kind = Kind.HOST, settings: TrialSettings | None = None,
                  card: Card | None = None) -> StepEstimate:
    """Trace the training step of ``ref`` at each of ``batch_sizes`` (two or more distinct, >= 1) and fit a line.

    ``options``: factory arguments that do not change the model; ``device_kind``: ``host`` (live bytes) or ``cuda``
    (as ``card`` runs it, default an H100; reserved bytes); ``settings``: the trial's steps. Returns the points and
    their line (bytes, no process baseline or CUDA context) and the card's choices.

    Raises:
        ValueError: fewer than two distinct batch sizes, or one below 1, or an unknown ``device_kind``.
        EstimateError: the step cannot be traced on fake tensors; the fused path asked where mamba_ssm is not
            installed, or of the host, or not entered (one line; measure with trials instead).
    """
    sizes = _checked_sizes(batch_sizes)
    if device_kind not in tuple(Kind):
        raise ValueError(f"device_kind must be host or cuda, got {device_kind!r}")
    device_kind = Kind(device_kind)
    start = time.perf_counter()
    _check_fused(ref, device_kind)
    with _as_card(device_kind, card) as choices:
        traced = [trace_point(ref, size, device_kind, options, settings or TrialSettings(), choices)
                  for size in sizes]
    _check_entered(ref, choices)
    points = tuple(point for point, _ in traced)
    overhead, slope = line([p.batch_size for p in points], [p.peak_bytes for p in points])
    data_bytes, kernel_path = traced[-1][1]
    return StepEstimate(model=ref, device_kind=device_kind, points=points, overhead_bytes=overhead,
                        slope_bytes_per_sample=slope, data_bytes=data_bytes, kernel_path=kernel_path,
                        wall_s=time.perf_counter() - start, choices=choices.lines() if choices else (),
                        traits=tuple(choices.consulted) if choices else ())


def trace_point(ref: ModelRef, batch_size: int, device_kind: Kind, options: dict[str, Any] | None,
                settings: TrialSettings, choices: Choices | None = None) -> tuple[PointEstimate, tuple[int, str]]:
    """One trial's steps at ``batch_size`` in a fresh fake mode, as the card of ``choices`` runs them (None: the
    host); returns the point and ``(data_bytes, kernel_path)``.

    Raises:
        EstimateError: anything raised while building or tracing (:func:`vramcal.estimate.result.failure_message`).
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramcal.estimate.trace import StorageTrace  # loads torch: only when called

    start = time.perf_counter()
    fake, trace = FakeTensorMode(allow_non_fake_inputs=True), StorageTrace()
    try:
        with torch.random.fork_rng(devices=[]), fake, _swappable_fakes(fake):
            with trace:
                step = build(ref, torch.device("cpu"), options)
                trace.label(step.model.parameters(), "parameters")
                trace.label_live("persistent")
                # Optimizer.step asks torch.accelerator for its current stream (a CUDA-graph capture check), which
                # starts CUDA on a GPU box: a context on the card beside every running trial. No graph is captured
                # in a trace. (torch 2.13 names the check _accelerator_graph_capture_health_check, 2.11 the other.)
                for check in ("_accelerator_graph_capture_health_check", "_cuda_graph_capture_health_check"):
                    setattr(step.optimizer, check, lambda: None)
                if choices is not None:
                    from vramcal.estimate.card import foreach  # loads torch: only when called

                    foreach(step.optimizer, choices)
                reset_at = _run_steps(step, batch_size, settings, trace)
    except Exception as error:  # noqa: BLE001 - every failure to trace is the one error a caller falls back on
        raise EstimateError(failure_message(error)) from error
    facts = (step.data_bytes if device_kind.holds_data else 0,
             step.kernel_path or detect_kernel_path(step.model))
    workspaces = choices.workspace_bytes() if choices is not None else ()
    return _point(trace, batch_size, device_kind, reset_at, time.perf_counter() - start, workspaces), facts


@contextlib.contextmanager
def _as_card(device_kind: Kind, card: Card | None) -> Iterator[Choices | None]:
    """A card's choices and, where mamba_ssm is installed, its fused kernels' twins; None for the host."""
    if not device_kind.cuda_kernels:
        yield None
        return
    from vramcal.estimate.card import Card, as_card  # loads torch: only when called
    from vramcal.estimate.fused import fused_twins, fused_unavailable  # loads torch: only when called

    with as_card(card or Card()) as choices:
        with fused_twins(choices) if fused_unavailable() is None else contextlib.nullcontext():
            yield choices


def _check_fused(ref: ModelRef, device_kind: Kind) -> None:
    """Raises: EstimateError: the fused path asked of the host, or where it is not installed."""
    if ref.params.get("implementation") != "mamba_ssm":
        return
    if not device_kind.cuda_kernels:
        raise EstimateError("the mamba_ssm implementation runs on CUDA cards only: estimate a card, or the host with "
                            "the transformers implementation")
    from vramcal.estimate.fused import fused_unavailable  # loads torch: only when called

    why = fused_unavailable()
    if why:
        raise EstimateError(why)


def _check_entered(ref: ModelRef, choices: Choices | None) -> None:
    """Raises: EstimateError: the fused path asked of a step that launched none of its kernels on CPU tensors."""
    if ref.params.get("implementation") == "mamba_ssm" and (choices is None or not choices.launched):
        raise EstimateError("the step launched no mamba_ssm kernel on CPU tensors (its library sends them to its "
                            "PyTorch path): the fused path cannot be traced for this model; measure it with trials")


def _run_steps(step: TrainingStep, batch_size: int, settings: TrialSettings, trace: StorageTrace) -> int:
    """The trial's steps under ``trace``; returns the index of the first event after the peaks' reset."""
    for _ in range(settings.warmup_steps):
        train_step(step, step.batch(batch_size))
    reset_at = len(trace.events)
    for _ in range(settings.measured_steps):
        train_step(step, step.batch(batch_size))
    for _ in range(settings.val_steps):
        validation_step(step, batch_size)
    return reset_at


def _point(trace: StorageTrace, batch_size: int, device_kind: Kind, reset_at: int, trace_s: float,
           workspaces: Sequence[int] = ()) -> PointEstimate:
    """A finished trace's point: live peak and breakdown, and the allocator's peaks after ``workspaces``."""
    from vramcal.estimate.trace import live_peak  # loads torch: only when called

    live, held = live_peak(trace, "cpu", reset_at)
    on_device = [(index, e) for index, e in enumerate(trace.events) if trace.devices[e.key] == "cpu"]
    held_for_good = [Event("alloc", -1 - n, size) for n, size in enumerate(workspaces)]
    cuda = replay(held_for_good + [e for _, e in on_device],
                  reset_at=len(held_for_good) + sum(1 for index, _ in on_device if index < reset_at))
    return PointEstimate(
        batch_size=batch_size, peak_bytes=cuda.peak_reserved_bytes if device_kind.cuda_kernels else live,
        live_peak_bytes=live, allocated_peak_bytes=cuda.peak_allocated_bytes,
        reserved_peak_bytes=cuda.peak_reserved_bytes, parameter_bytes=held["parameters"],
        gradient_bytes=held["gradients"], optimizer_state_bytes=held["optimizer_states"],
        persistent_bytes=held["persistent"], activation_bytes=held["activations"], trace_s=trace_s)


def _checked_sizes(batch_sizes: Sequence[int]) -> list[int]:
    sizes = list(batch_sizes)
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes) or len(set(sizes)) < 2:
        raise ValueError(f"batch_sizes must be two or more distinct whole numbers >= 1, got {sizes!r}")
    return sizes


@contextlib.contextmanager
def _swappable_fakes(fake: Any) -> Iterator[None]:
    """``torch.utils.swap_tensors`` that first drops the two tensors from ``fake``'s memo, so ``Module.to()`` works on
    fake parameters (torch 2.13 refuses them otherwise; pytorch PR #178584 does the same)."""
    import torch

    original, memo = torch.utils.swap_tensors, fake.fake_tensor_converter.tensor_memo

    def swap(first: torch.Tensor, second: torch.Tensor) -> None:
        for key, value in list(memo.items()):
            if value is first or value is second:
                del memo[key]
        original(first, second)

    torch.utils.swap_tensors = swap
    try:
        yield
    finally:
        torch.utils.swap_tensors = original
