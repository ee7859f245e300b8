"""The batch sampler of lengths that vary (issue 41 item 2) in a real torch DataLoader, sized by a profile whose
calibration over three lengths ran against a known memory surface (faked at the hardware boundary): every batch it
forms fits that surface, every document comes once an epoch, and lengths it cannot batch are one-line refusals."""

from __future__ import annotations

import functools

import pytest
import torch

from vramcal.calibration.lengths import padded_length
from vramcal.sizing.sampler import LengthBatchSampler

from fakes import GIB, fake_calibration

MIB = 2**20
TOTAL = 12 * GIB


def memory(b, n):
    return GIB + 20_000 * b * n + 3 * MIB * b


@functools.cache
def profile():
    return fake_calibration(memory, TOTAL, max_trials=40, seq_lens=(128, 512, 2048), kind="cuda")


def documents(n=3000, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, 2049, (n,), generator=generator).tolist()


def collate(items):
    """(indices, the documents padded to the batch's longest: (B, L) int64)."""
    indices = [i for i, _ in items]
    longest = max(len(doc) for _, doc in items)
    batch = torch.zeros(len(items), longest, dtype=torch.long)
    for row, (_, doc) in enumerate(items):
        batch[row, :len(doc)] = doc
    return indices, batch


def loader(lengths, sampler):
    dataset = [(i, torch.ones(n, dtype=torch.long)) for i, n in enumerate(lengths)]
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)


def test_budget_batches_fit_the_memory_and_hold_every_document_once():
    lengths, found = documents(), profile()
    usable, budget = found.settings.usable_bytes(TOTAL), found.lengths.budget
    sampler = LengthBatchSampler.from_profile(found, lengths, "budget", seed=1)
    seen, shapes = [], []
    for indices, batch in loader(lengths, sampler):
        size, longest = batch.shape
        assert size <= budget.conservative_tokens // max(longest, 128) and size * longest <= budget.conservative_tokens
        assert memory(size, padded_length(longest, 64)) <= usable  # the true surface, at the scan's padding
        seen += indices
        shapes.append((size, longest))
    assert sorted(seen) == list(range(len(lengths))) and len(sampler) == len(shapes)
    # length-sorted batches are nearly all document: under 10 % padding (random batches of these lengths: about 50 %)
    assert sum(lengths) / sum(s * n for s, n in shapes) > 0.9
    sampler.set_epoch(1)
    assert [sorted(b) for b in sampler] != [sorted(b) for b in LengthBatchSampler.from_profile(found, lengths, seed=1)]


def test_bucket_batches_hold_one_bucket_each_within_its_batch_size():
    lengths, found = documents(), profile()
    usable = found.settings.usable_bytes(TOTAL)
    sampler = LengthBatchSampler.from_profile(found, lengths, "buckets", boundaries=(256, 1024, 2048), seed=2)
    table = {b.longest_seq_len: b for b in sampler.buckets}
    seen = []
    for indices, batch in loader(lengths, sampler):
        bucket = next(b for b in table.values() if b.shortest_seq_len <= batch.shape[1] <= b.longest_seq_len)
        assert all(bucket.shortest_seq_len <= lengths[i] <= bucket.longest_seq_len for i in indices)
        assert len(indices) <= bucket.conservative_batch_size
        assert memory(len(indices), bucket.padded_seq_len) <= usable
        seen += indices
    assert sorted(seen) == list(range(len(lengths))) and len(sampler) == len(list(sampler))


def test_lengths_it_cannot_batch_are_refused_in_one_line_before_any_batch():
    found = profile()
    with pytest.raises(ValueError, match=r"^document 2: a document of 3000 tokens is longer than the profile's "
                                         r"longest seq_len 2048: cut it"):
        LengthBatchSampler.from_profile(found, [10, 20, 3000], "budget")
    with pytest.raises(ValueError, match=r"^document 1: no bucket covers a document of 600 tokens: the buckets "
                                         r"hold 1-512"):
        LengthBatchSampler.from_profile(found, [10, 600], "buckets", boundaries=(128, 512))
    with pytest.raises(ValueError, match="the bucket 4096 is longer than the profile's longest seq_len 2048"):
        LengthBatchSampler.from_profile(found, [10], "buckets", boundaries=(4096,))
    with pytest.raises(ValueError, match="give a token budget or a bucket table"):
        LengthBatchSampler([10])
