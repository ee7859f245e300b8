"""One training step's memory without a GPU and without real tensors: the step a trial runs, traced on fake tensors.

For each batch size, as a trial does (:mod:`vramcal.measure.trial`) and in one fresh ``FakeTensorMode`` each:

1. the factory builds the step (:func:`vramcal.workload.build`: model, optimizer, data pipeline) inside
   ``FakeTensorMode(allow_non_fake_inputs=True)``: every tensor made by a torch op is fake (shapes, dtypes and
   devices, no memory), including the model's parameters and their initialisation; arrays the factory turns into
   tensors without an op (the regressor's windows: ``torch.from_numpy``) stay real host tensors, which the fake
   mode converts when an op reads them (a batch gathered from them is fake). They are the factory's dataset,
   reported as ``data_bytes``, not traced;
2. ``warmup_steps`` steps (:func:`vramcal.workload.train_step`: the factory's loss under its own dtype and autocast,
   backward, clipping when set, the optimizer step, ``zero_grad``); AdamW allocates its state here;
3. the peaks reset; ``measured_steps`` steps and ``val_steps`` validation passes
   (:func:`vramcal.workload.validation_step`) at the same batch size;

all under a :class:`vramcal.estimate.trace.StorageTrace`, vramcal's own dispatch mode that follows live storage bytes
op by op (its module says why not torch's ``MemTracker``: the allocator's model needs the ordered allocations and
frees, and a trial runs several iterations). The peak of
the measured part is the estimate on the host; on a CUDA device the same allocations and frees run through the
caching allocator's model (:func:`vramcal.estimate.allocator.replay`) and the reserved peak is the estimate.

The factory is a real build, only faked: a model built on the meta device instead would skip the factory's own
code (its data pipeline, its dtype policy, the optimizer it picks), and converting a real build to fake tensors
would need the real memory first. ``Module.to()`` of fake parameters fails in torch 2.13 (``swap_tensors`` refuses
tensors the fake mode's memo holds weak references to; pytorch PRs #178584 and #184976); while the factory runs,
:func:`_swappable_fakes` drops those memo entries before a swap, as the first of those PRs does.

For a CUDA card (``device_kind="cuda"``) the step is traced on fake CPU tensors as the card runs it
(:func:`vramcal.estimate.card.as_card`: dropout's mask, the attention backend, AdamW's foreach, CUDA's autocast
lists), with mamba_ssm's fused kernels as twins where they are installed
(:func:`vramcal.estimate.fused.fused_twins`); the choices made are in ``StepEstimate.choices``. Its allocations and
frees, after the cuBLAS workspaces (:func:`vramcal.estimate.constants.card_constants`), run through the caching
allocator's model (:func:`vramcal.estimate.allocator.replay`) and the reserved peak is the estimate. The CUDA context
is not traced (:mod:`vramcal.estimate.constants`).

Limits: a step that reads tensor values (``.item()``, a branch on a tensor), an op with a data-dependent output
shape, or a custom kernel with no fake implementation cannot be traced (:class:`EstimateError`); the host's process
baseline, its allocator's arenas and fragmentation are not in the trace.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from vramcal.estimate.allocator import Event, replay
from vramcal.estimate.result import EstimateError, PointEstimate, StepEstimate, failure_message, line
from vramcal.records import DeviceKind, TrialSettings
from vramcal.workload import ModelRef, build, detect_kernel_path, train_step, validation_step

if TYPE_CHECKING:  # pragma: no cover
    from vramcal.estimate.card import Card, Choices
    from vramcal.estimate.trace import StorageTrace
    from vramcal.workload import TrainingStep


def estimate_step(ref: ModelRef, batch_sizes: Sequence[int], *, options: dict[str, Any] | None = None,
                  device_kind: DeviceKind = "host", settings: TrialSettings | None = None,
                  card: Card | None = None) -> StepEstimate:
    """Trace the training step of ``ref`` at each of ``batch_sizes`` (module docstring) and fit a line to the peaks.

    Args:
        ref: the factory and its arguments, as a trial builds them; ``implementation=mamba_ssm`` traces the fused
            kernels (a CUDA card only).
        batch_sizes: two or more distinct batch sizes (>= 1); the fake step costs the same at any size.
        options: more factory arguments that do not change the model (the regressor's data file, ...).
        device_kind: ``host`` (peaks in live bytes) or ``cuda`` (the step as ``card`` runs it; peaks in the caching
            allocator's reserved bytes, its cuBLAS workspaces included).
        settings: the trial's steps (``warmup_steps``, ``measured_steps``, ``val_steps``); default
            :class:`vramcal.records.TrialSettings`.
        card: the card a ``cuda`` trace is made for (:class:`vramcal.estimate.card.Card`; default an H100).

    Returns:
        The points and their line (bytes, no CUDA context or process baseline), and the card's choices made.

    Raises:
        ValueError: fewer than two distinct batch sizes, or one below 1, or an unknown ``device_kind``.
        EstimateError: the step cannot be traced on fake tensors; the fused path asked where mamba_ssm is not
            installed, or of the host, or not entered (one line; measure with trials instead).
    """
    sizes = _checked_sizes(batch_sizes)
    if device_kind not in ("host", "cuda"):
        raise ValueError(f"device_kind must be host or cuda, got {device_kind!r}")
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
                        wall_s=time.perf_counter() - start, choices=choices.lines() if choices else ())


def trace_point(ref: ModelRef, batch_size: int, device_kind: DeviceKind, options: dict[str, Any] | None,
                settings: TrialSettings, choices: Choices | None = None) -> tuple[PointEstimate, tuple[int, str]]:
    """Build and trace one trial's steps at ``batch_size`` in a fresh fake mode (module docstring), as the card of
    ``choices`` runs them (within :func:`_as_card`; None: the host).

    Returns:
        The point, and ``(data_bytes, kernel_path)`` of the built step.

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
                if choices is not None:
                    from vramcal.estimate.card import foreach  # loads torch: only when called

                    foreach(step.optimizer, choices)
                reset_at = _run_steps(step, batch_size, settings, trace)
    except Exception as error:  # noqa: BLE001 - every failure to trace is the one error a caller falls back on
        raise EstimateError(failure_message(error)) from error
    facts = (step.pool_data_bytes("host") if device_kind == "host" else 0,
             step.kernel_path or detect_kernel_path(step.model))
    workspaces = choices.workspace_bytes() if choices is not None else ()
    return _point(trace, batch_size, device_kind, reset_at, time.perf_counter() - start, workspaces), facts


@contextlib.contextmanager
def _as_card(device_kind: DeviceKind, card: Card | None) -> Iterator[Choices | None]:
    """For a CUDA card: its choices (:func:`vramcal.estimate.card.as_card`) and, where mamba_ssm is installed, its
    fused kernels' twins; for the host: nothing."""
    if device_kind != "cuda":
        yield None
        return
    from vramcal.estimate.card import Card, as_card  # loads torch: only when called
    from vramcal.estimate.fused import fused_twins, fused_unavailable  # loads torch: only when called

    with as_card(card or Card()) as choices:
        with fused_twins(choices) if fused_unavailable() is None else contextlib.nullcontext():
            yield choices


def _check_fused(ref: ModelRef, device_kind: DeviceKind) -> None:
    """Raises: EstimateError: the fused path asked of the host, or where it is not installed."""
    if ref.params.get("implementation") != "mamba_ssm":
        return
    if device_kind != "cuda":
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
    """The trial's steps (module docstring, 2 and 3) under ``trace``; returns the index of the first event after
    the peaks' reset."""

    for _ in range(settings.warmup_steps):
        train_step(step, step.batch(batch_size))
    reset_at = len(trace.events)
    for _ in range(settings.measured_steps):
        train_step(step, step.batch(batch_size))
    for _ in range(settings.val_steps):
        validation_step(step, batch_size)
    return reset_at


def _point(trace: StorageTrace, batch_size: int, device_kind: DeviceKind, reset_at: int, trace_s: float,
           workspaces: Sequence[int] = ()) -> PointEstimate:
    """The point of a finished trace: live peak and breakdown, and the caching allocator's peaks of its events after
    ``workspaces`` (allocations held for good; the reset mapped onto the events)."""
    from vramcal.estimate.trace import live_peak  # loads torch: only when called

    live, held = live_peak(trace, "cpu", reset_at)
    on_device = [(index, e) for index, e in enumerate(trace.events) if trace.devices[e.key] == "cpu"]
    held_for_good = [Event("alloc", -1 - n, size) for n, size in enumerate(workspaces)]
    cuda = replay(held_for_good + [e for _, e in on_device],
                  reset_at=len(held_for_good) + sum(1 for index, _ in on_device if index < reset_at))
    return PointEstimate(
        batch_size=batch_size, peak_bytes=cuda.peak_reserved_bytes if device_kind == "cuda" else live,
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
    """``torch.utils.swap_tensors`` that first drops the two tensors from ``fake``'s memo (module docstring), so
    ``Module.to()`` works on fake parameters; restored on exit."""
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
