"""A training step's memory estimated without a GPU and without real tensors (issue 38).

One file per part: :mod:`~vramcal.estimate.step` (:func:`estimate_step`: the step a trial runs, built and traced on
fake tensors at two or more batch sizes), :mod:`~vramcal.estimate.trace` (the dispatch mode that follows live
storage bytes), :mod:`~vramcal.estimate.allocator` (what CUDA's caching allocator reserves for those allocations)
and :mod:`~vramcal.estimate.result` (the records, the line through the peaks, :class:`EstimateError`).

Importing this package loads no torch: only :func:`estimate_step` does, when called.
"""

from vramcal.estimate.allocator import AllocatorPeaks, Event, replay
from vramcal.estimate.result import EstimateError, PointEstimate, StepEstimate
from vramcal.estimate.step import estimate_step

__all__ = ["AllocatorPeaks", "EstimateError", "Event", "PointEstimate", "StepEstimate", "estimate_step", "replay"]
