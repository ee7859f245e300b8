"""The records of an estimate (:func:`vramcal.estimate.step.estimate_step`), the line through its peaks, and its one
error: plain values, no torch.

An estimate is never a measurement (DESIGN.md, "estimate"): it has no process baseline (libraries, allocator
arenas, the CUDA context), which a batch-size-1 trial or a measured profile of the same kind of device supplies.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from vramcal.records import DeviceKind
from vramcal.workload import ModelRef, WorkloadError


class EstimateError(RuntimeError):
    """The step could not be traced on fake tensors (an op with no fake implementation, a shape or a branch that
    depends on the data, a factory that fails): one line naming the op where one is known. Measure the step with
    trials instead."""


@dataclass(frozen=True)
class PointEstimate:
    """The traced step at one batch size, in bytes.

    Attributes:
        batch_size: samples per step.
        peak_bytes: the estimate: ``live_peak_bytes`` on the host, ``reserved_peak_bytes`` on a CUDA device.
        live_peak_bytes: the most bytes of live tensor storage on the device during the measured steps and the
            validation passes (after the warm-up, as a trial resets its peaks).
        allocated_peak_bytes, reserved_peak_bytes: what CUDA's caching allocator would report for the same
            allocations and frees (``max_memory_allocated`` and ``max_memory_reserved``,
            :func:`vramcal.estimate.allocator.replay`); on the host trace, what a CUDA card would reserve for the
            same tensors.
        parameter_bytes, gradient_bytes, optimizer_state_bytes, persistent_bytes, activation_bytes: what was live
            at the live peak, by :data:`vramcal.estimate.trace.CATEGORIES` (persistent: buffers and the other
            tensors the factory holds; activation: activations and temporaries); they sum to ``live_peak_bytes``.
        trace_s: seconds the build and the traced steps took (the first point's include importing the model's
            libraries).
    """

    batch_size: int
    peak_bytes: int
    live_peak_bytes: int
    allocated_peak_bytes: int
    reserved_peak_bytes: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    persistent_bytes: int
    activation_bytes: int
    trace_s: float


@dataclass(frozen=True)
class StepEstimate:
    """One training step's memory, traced on fake tensors at two or more batch sizes.

    Attributes:
        model: what was traced (the profile key).
        device_kind: ``host`` (peaks are live bytes) or ``cuda`` (reserved bytes of the caching allocator, the cuBLAS
            workspaces included).
        points: one per batch size, in the order asked.
        overhead_bytes, slope_bytes_per_sample: the least-squares line ``peak_bytes = overhead_bytes +
            slope_bytes_per_sample * batch_size`` through the points' peaks (:func:`line`). The overhead is the
            step's own (model states, persistent tensors): no process baseline.
        data_bytes: the factory's dataset in host memory (:meth:`vramcal.workload.TrainingStep.pool_data_bytes`
            on the host; 0 for a CUDA device, where data the factory places on the device is traced): real arrays,
            so not in the trace, and in a host trial's measured pool.
        kernel_path: the Mamba-2 kernels the traced model runs (:func:`vramcal.workload.detect_kernel_path`).
        wall_s: seconds the whole estimate took (imports included).
        choices: the card's choices the trace made, one line each (:class:`vramcal.estimate.card.Choices`: dropout,
            attention, optimizer, autocast, fused kernels); empty for the host.
    """

    model: ModelRef
    device_kind: DeviceKind
    points: tuple[PointEstimate, ...]
    overhead_bytes: float
    slope_bytes_per_sample: float
    data_bytes: int
    kernel_path: str
    wall_s: float
    choices: tuple[str, ...] = ()

    def predict(self, batch_size: float) -> float:
        """The line's peak at ``batch_size`` (bytes, without a process baseline)."""
        return self.overhead_bytes + self.slope_bytes_per_sample * batch_size

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (the model as :meth:`vramcal.workload.ModelRef.to_dict`)."""
        return {**dataclasses.asdict(self), "model": self.model.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepEstimate:
        """The estimate :meth:`to_dict` wrote. Raises: KeyError, TypeError, ValueError: not such a record."""
        return cls(**{**data, "model": ModelRef.from_dict(data["model"]), "choices": tuple(data["choices"]),
                      "points": tuple(PointEstimate(**point) for point in data["points"])})


def line(batch_sizes: Sequence[int], peak_bytes: Sequence[int]) -> tuple[float, float]:
    """Ordinary least squares of ``peak_bytes`` on ``batch_sizes``: ``(overhead_bytes, slope_bytes_per_sample)``,
    slope = Σ(b - mean b)(y - mean y) / Σ(b - mean b)², overhead = mean y - slope · mean b (the same line
    :func:`vramcal.calibration.fit.fit_linear` fits to trials; exact through two points).

    Raises:
        ValueError: fewer than two distinct batch sizes.
    """
    n = len(batch_sizes)
    mean_b, mean_y = sum(batch_sizes) / n, sum(peak_bytes) / n
    sxx = sum((b - mean_b) ** 2 for b in batch_sizes)
    if sxx == 0:
        raise ValueError("a line needs at least two distinct batch sizes")
    slope = sum((b - mean_b) * (y - mean_y) for b, y in zip(batch_sizes, peak_bytes)) / sxx
    return mean_y - slope * mean_b, slope


# ----------------------------------------------------------------------------------------------- failures

_NO_FAKE_IMPL = re.compile(r"no fake impl registered for <CustomOpDef\(([^)]+)\)>")
_REASONS = {  # torch._subclasses.fake_tensor's exceptions, which carry the op as .func
    "UnsupportedOperatorException": "has no fake implementation",
    "DynamicOutputShapeException": "has an output shape that depends on the data",
    "DataDependentOutputException": "reads tensor values (.item(), bool(), .tolist()), which fake tensors do not "
                                    "have",
}
_REGISTER = "register one with torch.library.register_fake, or measure the step with trials"
_TRIALS = "measure the step with trials"


def failure_message(error: BaseException) -> str:
    """The one line of :class:`EstimateError` for an error raised while tracing: the op and why where the error (or
    one it was raised from or during) names it, else the error's own first line.

    ``cannot trace the step on fake tensors: aten.nonzero.default has an output shape that depends on the data;
    measure the step with trials``; a factory that failed on its own (:class:`vramcal.workload.WorkloadError` not
    ``in_torch``: not importable, an argument it does not take, its own ``raise``) is no tracing failure: its line
    says to fix the factory, which trials would call the same way.
    """
    if isinstance(error, WorkloadError) and not error.in_torch:
        return f"{error}; a trial calls the factory the same way: fix it first (call it by hand to see the traceback)"
    for cause in _chain(error):
        func = getattr(cause, "func", None)
        reason = _REASONS.get(type(cause).__name__)
        if func is not None and reason is not None:
            fix = _REGISTER if type(cause).__name__ == "UnsupportedOperatorException" else _TRIALS
            return f"cannot trace the step on fake tensors: {func} {reason}; {fix}"
        found = _NO_FAKE_IMPL.search(str(cause))
        if found:
            return f"cannot trace the step on fake tensors: {found.group(1)} has no fake implementation; {_REGISTER}"
    return f"cannot trace the step on fake tensors: {type(error).__name__}: {_first_line(error)}; {_TRIALS}"


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, then what it was raised from or during (``__cause__``, else ``__context__``), once each."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else "(no message)"
