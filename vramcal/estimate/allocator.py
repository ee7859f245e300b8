"""What the CUDA caching allocator reserves for a sequence of tensor allocations and frees, without a GPU.

:func:`replay` runs the events through a model of ``c10/cuda/CUDACachingAllocator.cpp`` (pytorch 001074d2, defaults
of ``PYTORCH_CUDA_ALLOC_CONF``; each rule below names its function) and returns what ``max_memory_allocated()`` and
``max_memory_reserved()`` would read. Not modelled: the out-of-memory retry, several streams, ``max_split_size_mb``,
``roundup_power2_divisions``, ``expandable_segments``, the GC threshold, CUDA graphs' pools and allocations outside
the allocator (the CUDA context, NCCL). Segment addresses are the model's own.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

MIN_BLOCK_BYTES = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
SMALL_SIZE_BYTES = 1 << 20  # kSmallSize: the largest "small" allocation is 1 MiB
SMALL_BUFFER_BYTES = 2 << 20  # kSmallBuffer: "small" allocations are packed in 2 MiB segments
MIN_LARGE_ALLOC_BYTES = 10 << 20  # kMinLargeAlloc: allocations between 1 and 10 MiB may use kLargeBuffer
LARGE_BUFFER_BYTES = 20 << 20  # kLargeBuffer: "large" allocations may be packed in 20 MiB segments
ROUND_LARGE_BYTES = 2 << 20  # kRoundLarge: large segments are rounded up to 2 MiB


@dataclass(frozen=True, slots=True)
class Event:
    """One allocation or free (naming an earlier allocation's ``key`` and size) of a storage, in bytes."""

    kind: Literal["alloc", "free"]
    key: int
    size_bytes: int


def round_size(size_bytes: int) -> int:
    """Rule 1: ``size_bytes`` rounded up to a multiple of 512 bytes, at least 512 (``round_size``)."""
    return max(MIN_BLOCK_BYTES, -(-size_bytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)


def is_small(rounded_bytes: int) -> bool:
    """Rule 2: whether a rounded request comes from the small pool (<= 1 MiB, ``get_pool``)."""
    return rounded_bytes <= SMALL_SIZE_BYTES


def segment_size(rounded_bytes: int) -> int:
    """Rule 4: the bytes ``cudaMalloc`` is asked for when no cached block fits (``get_allocation_size``)."""
    if rounded_bytes <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if rounded_bytes < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return -(-rounded_bytes // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


def should_split(block_bytes: int, rounded_bytes: int) -> bool:
    """Rule 5: whether a block handed to a request is split (``should_split``)."""
    remaining = block_bytes - rounded_bytes
    return remaining >= MIN_BLOCK_BYTES if is_small(rounded_bytes) else remaining > SMALL_SIZE_BYTES


@dataclass(eq=False)
class _Block:
    """A piece of a segment: ``size_bytes`` at ``address``, its neighbours in the segment, allocated or cached."""

    address: int
    size_bytes: int
    small: bool
    prev: _Block | None = None
    next: _Block | None = None
    allocated: bool = False


@dataclass
class CachingAllocator:
    """The allocator's state: segments, cached free blocks per pool (best fit, ties by address:
    ``get_free_block``), and ``memory_allocated``/``memory_reserved`` with their peaks, in bytes."""

    allocated_bytes: int = 0
    reserved_bytes: int = 0
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    _free: dict[bool, list[tuple[int, int, int]]] = field(default_factory=lambda: {True: [], False: []})
    _blocks: dict[int, _Block] = field(default_factory=dict)  # a cached entry's id -> its free block
    _held: dict[int, _Block] = field(default_factory=dict)  # event key -> its allocated block
    _next_address: int = 0
    _ids: itertools.count = field(default_factory=itertools.count)

    def malloc(self, key: int, size_bytes: int) -> None:
        """Allocate ``size_bytes`` for ``key`` (rules 1-5; zero bytes take no block)."""
        if size_bytes <= 0:
            return
        rounded = round_size(size_bytes)
        block = self._take_free(rounded) or self._new_segment(rounded)
        if should_split(block.size_bytes, rounded):
            rest = _Block(block.address + rounded, block.size_bytes - rounded, block.small, block, block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size_bytes = rest, rounded
            self._cache(rest)
        block.allocated = True
        self._held[key] = block
        self.allocated_bytes += block.size_bytes
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)

    def free(self, key: int) -> None:
        """Rule 6: ``key``'s block merged with free neighbours and cached, never returned (``free_block``)."""
        block = self._held.pop(key, None)
        if block is None:
            return
        block.allocated = False
        self.allocated_bytes -= block.size_bytes
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._uncache(neighbour)
                block = self._merge(block, neighbour)
        self._cache(block)

    def reset_peaks(self) -> None:
        """Peaks from now on (``torch.cuda.reset_peak_memory_stats``)."""
        self.peak_allocated_bytes, self.peak_reserved_bytes = self.allocated_bytes, self.reserved_bytes

    def _take_free(self, rounded: int) -> _Block | None:
        entries = self._free[is_small(rounded)]
        at = bisect.bisect_left(entries, (rounded, -1, -1))
        if at == len(entries):
            return None
        return self._blocks.pop(entries.pop(at)[2])

    def _new_segment(self, rounded: int) -> _Block:
        size = segment_size(rounded)
        block = _Block(self._next_address, size, is_small(rounded))
        self._next_address += size
        self.reserved_bytes += size
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        return block

    def _cache(self, block: _Block) -> None:
        entry = (block.size_bytes, block.address, next(self._ids))
        bisect.insort(self._free[block.small], entry)
        self._blocks[entry[2]] = block

    def _uncache(self, block: _Block) -> None:
        entries = self._free[block.small]
        for index in range(bisect.bisect_left(entries, (block.size_bytes, block.address, -1)), len(entries)):
            if self._blocks[entries[index][2]] is block:
                del self._blocks[entries.pop(index)[2]]
                return
        raise AssertionError("a free block was not in its pool")

    @staticmethod
    def _merge(block: _Block, neighbour: _Block) -> _Block:
        """One block covering two adjacent blocks of a segment (``try_merge_blocks``)."""
        low, high = (neighbour, block) if neighbour is block.prev else (block, neighbour)
        low.size_bytes += high.size_bytes
        low.next = high.next
        if high.next is not None:
            high.next.prev = low
        return low


@dataclass(frozen=True)
class AllocatorPeaks:
    """What :func:`replay` read, in bytes: the peaks after ``reset_at`` and the segments held at the end."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    reserved_bytes: int


def replay(events: Iterable[Event], reset_at: int = 0) -> AllocatorPeaks:
    """Run ``events`` through a fresh :class:`CachingAllocator`, the peaks reset before event ``reset_at`` (as a trial
    after its warm-up; past the last: the state at the end)."""
    allocator, count = CachingAllocator(), 0
    for count, event in enumerate(events, start=1):
        if count - 1 == reset_at:
            allocator.reset_peaks()
        if event.kind == "alloc":
            allocator.malloc(event.key, event.size_bytes)
        else:
            allocator.free(event.key)
    if reset_at >= count:
        allocator.reset_peaks()
    return AllocatorPeaks(allocator.peak_allocated_bytes, allocator.peak_reserved_bytes, allocator.reserved_bytes)
