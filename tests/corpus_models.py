"""Factories that misbehave as users' factories do, for the corpus (tests/test_corpus.py): one that hangs and
one whose ``batch()`` raises from some batch size on. Importable by name in trial processes (``tests`` is on
``sys.path`` under pytest, and the worker fork server starts with the caller's ``sys.path``)."""

from __future__ import annotations

import time

import torch
from user_models import mlp

import vramcal


def hangs(device: torch.device, **params) -> vramcal.TrainingStep:
    """Builds a model, then never returns (a dataset download that stalls, a lock never released)."""
    step = mlp(device, n_features=16, width=8)
    while True:
        time.sleep(0.05)
    return step  # pragma: no cover


def batch_raises(device: torch.device, *, from_batch_size: int = 8, **params) -> vramcal.TrainingStep:
    """:func:`user_models.mlp`, whose ``batch()`` raises from ``from_batch_size`` samples on (a sampler with too
    few items, a collate that breaks on a larger batch)."""
    step = mlp(device, n_features=256, width=8)
    real = step.batch

    def batch(batch_size: int):
        if batch_size >= from_batch_size:
            raise IndexError(f"sampler has {from_batch_size - 1} items, batch of {batch_size} requested")
        return real(batch_size)

    step.batch = batch
    return step
