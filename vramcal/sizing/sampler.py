"""A batch sampler for documents of varying length, sized by a profile: plain PyTorch (DESIGN.md, "Lengths that
vary"). ``LengthBatchSampler`` yields lists of dataset indices for ``DataLoader(dataset, batch_sampler=...)``:
by **bucket table** (``mode="buckets"``: each batch from one bucket, at most its batch size) or by **token budget**
(``mode="budget"``: documents longest first, ties in a random order, each batch ``floor(tokens / L)`` of them, L its
first document's length, at least the budget's shortest: the batches the budget was verified for). The batches'
order is shuffled each epoch (:meth:`LengthBatchSampler.set_epoch`). Every length is checked when it is made.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import torch

from vramcal.calibration.lengths import Bucket, TokenBudget, bucket_of
from vramcal.profile import Profile, load_profile
from vramcal.sizing import Limit, SizingError, batching

Mode = Literal["budget", "buckets"]


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
        """The batch size a document of ``length`` tokens allows (budget: as a batch's longest). Raises: ValueError."""
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
        order = list(range(len(self.lengths)))
        return len(self._by_budget(order) if self.budget is not None else self._by_bucket(order))
