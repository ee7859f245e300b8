"""A batch sampler for documents of varying length, sized by a profile (issue 41 item 2): plain PyTorch.

``LengthBatchSampler`` yields lists of dataset indices, for ``torch.utils.data.DataLoader(dataset,
batch_sampler=sampler, collate_fn=...)``; the collate function pads each batch to its longest document (Mamba-2's
scan pads it further, to a multiple of chunk_size: :mod:`vramcal.calibration.lengths`). It forms batches

* by **bucket table** (``mode="buckets"``): each document goes to the bucket of its length; each batch holds
  documents of one bucket, at most the bucket's batch size;
* by **token budget** (``mode="budget"``): documents sorted by length, longest first (ties in a random order),
  then each batch takes the next documents up to ``floor(tokens / L)`` of them, L its first (longest) document's
  length, counted as at least the budget's shortest length: the batches the budget was verified for.

The batches' order is shuffled each epoch (:meth:`LengthBatchSampler.set_epoch`, as ``DistributedSampler``); the
documents within a bucket too. ``len(sampler)`` is the number of batches of an epoch. One process; under DDP
give each rank its own share of the dataset.

Every length is checked when the sampler is made: a document longer than the profile's longest seq_len, or of a
length no bucket covers, is a one-line ``ValueError`` naming it, before any batch is formed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import torch

from vramcal.calibration.lengths import Bucket, TokenBudget, bucket_of
from vramcal.profile import Profile, load_profile
from vramcal.sizing import SizingError, batching

Mode = Literal["budget", "buckets"]
Limit = Literal["conservative", "safe"]


class LengthBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Batches of indices of a dataset of documents of varying length (module docstring).

    Args:
        lengths: each document's length in tokens, by dataset index.
        budget: the token budget (``mode="budget"``), or ``buckets``: the bucket table (``mode="buckets"``); one of
            them. :meth:`from_profile` takes them from a profile.
        limit: ``conservative`` (the default, what a run trains at) or ``safe`` batch sizes and budget.
        shuffle: shuffle the batches' order (and the documents within a bucket) each epoch; False keeps the order
            formed (longest first; buckets in order).
        seed: the shuffles' seed, with the epoch (:meth:`set_epoch`).
        drop_last: leave out each bucket's last, incomplete batch (buckets only).

    Raises:
        ValueError: no budget or table, or both; a length below 1, above the budget's longest seq_len, or in no
            bucket (one line naming the document); a conservative size of 0 samples where a document needs one.
    """

    def __init__(self, lengths: Sequence[int], *, budget: TokenBudget | None = None,
                 buckets: Sequence[Bucket] | None = None, limit: Limit = "conservative", shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False) -> None:
        if (budget is None) == (buckets is None):
            raise ValueError("give a token budget or a bucket table (LengthBatchSampler.from_profile takes either "
                             "from a profile), not both or neither")
        if limit not in ("conservative", "safe"):
            raise ValueError(f"limit must be conservative or safe, got {limit!r}")
        self.lengths = [int(n) for n in lengths]
        self.budget, self.buckets, self.conservative = budget, tuple(buckets or ()), limit == "conservative"
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0
        self._sizes = [self._size(index, n) for index, n in enumerate(self.lengths)]

    @classmethod
    def from_profile(cls, profile: Profile | Path | str, lengths: Sequence[int], mode: Mode = "budget",
                     boundaries: Sequence[int] = (), **options) -> LengthBatchSampler:
        """The sampler of a profile calibrated over several lengths (``vramcal probe --seq-len A:B``): its token
        budget, or its bucket table at ``boundaries`` (each bucket's longest length; () the calibration's).

        Raises:
            ValueError (SizingError): a profile of one length, a boundary outside it, a bad mode; as the class.
            ProfileError: a path that holds no profile.
        """
        if isinstance(profile, str | Path):
            profile = load_profile(profile)
        if mode == "budget":
            return cls(lengths, budget=batching.budget(profile)[0], **options)
        if mode == "buckets":
            return cls(lengths, buckets=batching.buckets(profile, boundaries)[0], **options)
        raise SizingError(f"mode must be budget or buckets, got {mode!r}")

    def _size(self, index: int, length: int) -> int:
        """The batch size a document of ``length`` tokens allows (budget: when it is a batch's longest).

        Raises: ValueError: as the class."""
        try:
            if length < 1:
                raise ValueError(f"a document of {length} tokens: every length must be at least 1")
            if self.budget is not None:
                size = self.budget.batch_size(length, self.conservative)
            else:
                bucket = bucket_of(self.buckets, length)
                size = bucket.conservative_batch_size if self.conservative else bucket.safe_batch_size
        except ValueError as error:
            raise ValueError(f"document {index}: {error}") from None
        if size < 1:
            limit = "conservative" if self.conservative else "safe"
            raise ValueError(f"document {index}: not one document of {length} tokens fits the {limit} limit: use "
                             f"limit='safe', or cut it")
        return size

    def set_epoch(self, epoch: int) -> None:
        """Shuffle for this epoch (call before iterating each epoch, as ``DistributedSampler.set_epoch``)."""
        self.epoch = epoch

    def batches(self) -> list[list[int]]:
        """The epoch's batches, in order (module docstring)."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=generator).tolist() if self.shuffle \
            else list(range(len(self.lengths)))
        formed = self._by_budget(order) if self.budget is not None else self._by_bucket(order)
        if self.shuffle:
            formed = [formed[i] for i in torch.randperm(len(formed), generator=generator).tolist()]
        return formed

    def _by_budget(self, order: list[int]) -> list[list[int]]:
        ranked = sorted(order, key=lambda i: -self.lengths[i])  # stable: ties keep the shuffled order
        formed, start = [], 0
        while start < len(ranked):
            size = self._sizes[ranked[start]]  # the first is the batch's longest document
            formed.append(ranked[start:start + size])
            start += size
        return formed

    def _by_bucket(self, order: list[int]) -> list[list[int]]:
        formed = []
        for bucket in self.buckets:
            members = [i for i in order if bucket.shortest_seq_len <= self.lengths[i] <= bucket.longest_seq_len]
            if not members:
                continue
            size = self._sizes[members[0]]
            parts = [members[i:i + size] for i in range(0, len(members), size)]
            formed += parts[:-1] if self.drop_last and len(parts[-1]) < size else parts
        return formed

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches())

    def __len__(self) -> int:
        """Batches per epoch (the same every epoch: shuffling moves documents between equal lengths only)."""
        if self.budget is not None:
            return len(self._by_budget(list(range(len(self.lengths)))))
        counts = [sum(b.shortest_seq_len <= n <= b.longest_seq_len for n in self.lengths) for b in self.buckets]
        sizes = [b.conservative_batch_size if self.conservative else b.safe_batch_size for b in self.buckets]
        return sum((c // s if self.drop_last else math.ceil(c / s)) for c, s in zip(counts, sizes) if c)
