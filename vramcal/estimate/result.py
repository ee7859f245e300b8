"""The records of an estimate, the line through its peaks, and its one error: plain values, no torch.

An estimate has no process baseline (DESIGN.md, "Estimates: a card you do not have").
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from vramcal.records import Kind
from vramcal.workload import ModelRef, WorkloadError, first_line


class EstimateError(RuntimeError):
    """The step could not be traced on fake tensors: one line naming the op where one is known."""


@dataclass(frozen=True)
class PointEstimate:
    """The traced step at one batch size, in bytes: ``peak_bytes`` is ``live_peak_bytes`` on the host and
    ``reserved_peak_bytes`` on a card (:func:`vramcal.estimate.allocator.replay`'s peaks); the parts of the live peak
    by :data:`vramcal.estimate.trace.CATEGORIES` sum to it; ``trace_s``: seconds the build and steps took."""

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
    """One training step's memory, traced at two or more batch sizes: the points, their least-squares line
    (:func:`line`; the step's own overhead, no process baseline), the factory's real dataset in host memory
    (``data_bytes``, 0 on a card), the kernel path, seconds taken, the card's choices (empty on the host) and the
    card's traits the trace asked (``traits``: :data:`vramcal.estimate.card.TRAITS` names; the trace holds for every
    card that answers them alike)."""

    model: ModelRef
    device_kind: Kind
    points: tuple[PointEstimate, ...]
    overhead_bytes: float
    slope_bytes_per_sample: float
    data_bytes: int
    kernel_path: str
    wall_s: float
    choices: tuple[str, ...] = ()
    traits: tuple[str, ...] = ()

    def predict(self, batch_size: float) -> float:
        """The line's peak at ``batch_size`` (bytes, without a process baseline)."""
        return self.overhead_bytes + self.slope_bytes_per_sample * batch_size

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (the model as :meth:`vramcal.workload.ModelRef.to_dict`)."""
        return {**dataclasses.asdict(self), "model": self.model.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepEstimate:
        """The estimate :meth:`to_dict` wrote. Raises: KeyError, TypeError, ValueError: not such a record."""
        return cls(**{**data, "model": ModelRef.from_dict(data["model"]), "device_kind": Kind(data["device_kind"]),
                      "choices": tuple(data["choices"]),
                      "traits": tuple(data["traits"]),
                      "points": tuple(PointEstimate(**point) for point in data["points"])})


def line(batch_sizes: Sequence[int], peak_bytes: Sequence[int]) -> tuple[float, float]:
    """Ordinary least squares of ``peak_bytes`` on ``batch_sizes``: ``(overhead_bytes, slope_bytes_per_sample)``,
    as :func:`vramcal.calibration.fit.fit_linear` fits trials.

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
    """The one line of :class:`EstimateError` for an error raised while tracing: the op and why where the error
    chain names it, else its first line; a factory that failed on its own says to fix the factory."""
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
    return f"cannot trace the step on fake tensors: {type(error).__name__}: {first_line(error)}; {_TRIALS}"


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, then its ``__cause__`` (else ``__context__``), once each."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__
