"""A training step's memory estimated without a GPU and without real tensors.

:mod:`~vramcal.estimate.step` traces it, :mod:`~vramcal.estimate.trace` follows storages,
:mod:`~vramcal.estimate.allocator` models CUDA's caching allocator, :mod:`~vramcal.estimate.result` holds the
records. Importing this package loads no torch.
"""

from vramcal.estimate.allocator import AllocatorPeaks, Event, replay
from vramcal.estimate.result import EstimateError, PointEstimate, StepEstimate
from vramcal.estimate.step import estimate_step

__all__ = ["AllocatorPeaks", "EstimateError", "Event", "PointEstimate", "StepEstimate", "estimate_step", "replay"]
