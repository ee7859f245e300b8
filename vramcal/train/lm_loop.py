"""The language model's training loop (``vramcal train --model lm``): the regressor's
:class:`~vramcal.train.loop.Trainer` on batches of documents of every length (DESIGN.md "A language model on real
text").

A batch is its documents' bytes padded on the right; the loss is transformers' next-token cross-entropy over the
counted tokens, weighted by them when an out-of-memory step is split. ``val_zero_loss`` is a uniform guess over the
256 byte values (ln 256), the baseline the divergence checks hold the run to."""

from __future__ import annotations

import math
from typing import Any

import torch

from vramcal.calibration.lengths import padded_length
from vramcal.measure.trial import torch_device
from vramcal.models.corpus import BYTE_VOCAB, IGNORE_INDEX, Corpus, lengths
from vramcal.models.mamba2 import autocast
from vramcal.train import checkpoint
from vramcal.train.lm_plan import read_corpus, sampler, shapes
from vramcal.train.loop import Trainer
from vramcal.train.plan import Plan
from vramcal.units import format_rate
from vramcal.workload import build, first_line

UNIFORM_LOSS = math.log(BYTE_VOCAB)  # nats per byte of a uniform guess over the byte values


def tensors(docs: list[bytes], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``labels`` of documents padded on the right: (B, L) int64 each, labels padded with
    IGNORE_INDEX."""
    longest = max(map(len, docs))
    ids = torch.zeros(len(docs), longest, dtype=torch.int64)
    labels = torch.full((len(docs), longest), IGNORE_INDEX, dtype=torch.int64)
    for row, doc in enumerate(docs):
        values = torch.frombuffer(bytearray(doc), dtype=torch.uint8).to(torch.int64)
        ids[row, :len(doc)] = values
        labels[row, :len(doc)] = values
    return ids.to(device), labels.to(device)


def counted(labels: torch.Tensor) -> int:
    """Tokens the next-token loss counts: the labels after each row's first that are not padding."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


class TextTrainer(Trainer):
    """The :class:`~vramcal.train.loop.Trainer` on documents (module docstring).

    Args:
        corpus: the run's documents (:func:`vramcal.train.lm_plan.read_corpus`); the rest as the Trainer's.
    """

    def __init__(self, plan: Plan, step: Any, corpus: Corpus, **options: Any) -> None:
        stats = plan.data_stats
        self.corpus, self.dtype = corpus, str(plan.model.params.get("dtype", "fp32"))
        self.sampler = sampler(stats["batching"], lengths(corpus.train), seed=plan.config.seed)
        self.val_batches = sampler(stats["batching"], lengths(corpus.val), shuffle=False).batches()
        self.worst = (int(stats["worst"]["batch_size"]), int(stats["worst"]["seq_len"]))
        super().__init__(plan, step, **options)
        if options.get("state") is None:
            self.progress.micro_batch_size = int(stats["largest_batch"])  # no halving yet: whole batches
        self.val_batch_size = int(stats["largest_batch"])

    def _steps_per_epoch(self) -> int:
        return len(self.sampler)

    def _data_facts(self) -> dict[str, Any]:
        return {"identity": self.corpus.identity, "files": self.corpus.files}

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        """The epoch's batches (shuffled by epoch: a resume forms the same); in the first epoch the worst batch runs
        second, after the unmeasured step that allocates AdamW's state."""
        self.sampler.set_epoch(epoch)
        batches = self.sampler.batches()
        if epoch == 0 and len(batches) > 2:
            formed = shapes(batches, lengths(self.corpus.train), int(self.plan.data_stats["chunk_size"]))
            if self.worst in formed:
                batches.insert(1, batches.pop(formed.index(self.worst)))
        return batches

    def _loss(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean next-token loss of (B, L) ``ids`` against ``labels``: a scalar."""
        with autocast(ids.device.type, self.dtype):
            return self.model(input_ids=ids, labels=labels, use_cache=False).loss

    def _train_batch(self, batch: list[int]) -> tuple[float, float, float, int]:
        """One optimizer step on the batch's documents: (loss, grad norm, the uniform guess's loss, documents); the
        epoch's tokens counted."""
        docs = [self.corpus.train[i] for i in batch]
        ids, labels = tensors(docs, self.step_device)
        total = counted(labels)

        def part(i: int, j: int) -> tuple[torch.Tensor | None, float]:
            share = counted(labels[i:j]) / max(total, 1)
            return (self._loss(ids[i:j], labels[i:j]) if share else None), share  # one-token documents: nothing

        loss, grad_norm = self._accumulated(len(docs), part)
        self.progress.epoch_tokens += sum(map(len, docs))
        self.progress.epoch_padded_tokens += ids.numel()
        return loss, grad_norm, UNIFORM_LOSS, len(docs)

    def _rate(self) -> str:
        return f"{format_rate(self.progress.epoch_tokens / self.progress.epoch_train_s)} tokens/s"

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The validation documents' mean loss per counted token (nats), the uniform guess's, and bits per byte."""
        self.model.eval()
        loss_sum, tokens, docs = 0.0, 0, self.corpus.val
        for batch in self.val_batches:
            position = 0
            while position < len(batch):
                chunk = min(self.val_batch_size, len(batch) - position)
                try:
                    ids, labels = tensors([docs[i] for i in batch[position:position + chunk]], self.step_device)
                    n = counted(labels)
                    if n:
                        loss_sum += float(self._loss(ids, labels)) * n
                        tokens += n
                    position += chunk
                except Exception as error:
                    if not self._out_of_memory(error):
                        raise
                    self._fall_back(chunk, chunk, first_line(error), "validation")
        self.model.train()
        val_loss = loss_sum / max(tokens, 1)
        return {"val_loss": val_loss, "val_zero_loss": UNIFORM_LOSS, "val_bits_per_byte": val_loss / math.log(2)}

    @property
    def step_device(self) -> torch.device:
        return torch_device(self.plan.device)

    def _epoch_figures(self) -> dict[str, Any]:
        p = self.progress
        return {"tokens": p.epoch_tokens,
                "padded_tokens": p.epoch_padded_tokens, "epoch_steps": len(p.epoch_step_times),
                "tokens_per_s": p.epoch_tokens / p.epoch_train_s if p.epoch_train_s > 0 else 0.0,
                "steps_per_epoch": self.steps_per_epoch}

    def _epoch_line(self, row: dict[str, Any]) -> str:
        peak = f"  peak {row['peak_bytes'] / 2**20:.2f} MiB" if "peak_bytes" in row else ""
        return (f"epoch {row['epoch']}{'' if row['complete'] else ' (stopped at max_steps)'}: "
                f"train_loss {row['train_loss']:.4f}  val_loss {row['val_loss']:.4f} ({row['val_bits_per_byte']:.3f} "
                f"bits/byte; uniform {row['val_zero_loss']:.4f})  {row['tokens_per_s']:.0f} tokens/s "
                f"({row['tokens'] / max(row['padded_tokens'], 1):.1%} of the batches' tokens not padding){peak}")


def text_trainer(plan: Plan, meter: Any, echo: Any, on_epoch: Any) -> tuple[TextTrainer, int]:
    """The language model's trainer in the training worker, and the bytes of data it holds in the measured memory.

    Raises:
        CorpusError: the text is not the run's. WorkloadError: the factory failed.
    """
    corpus = read_corpus(plan)
    context = padded_length(int(plan.data_stats["context"]), int(plan.data_stats["chunk_size"]))
    options = {"lr": plan.lr, "weight_decay": plan.config.weight_decay, "max_grad_norm": plan.config.max_grad_norm,
               "seed": plan.config.seed}
    step = build(plan.model.replace(seq_len=context), torch_device(plan.device), options)
    meter.check_pinned()
    state = checkpoint.resume_from(plan.run_dir, plan.rank, echo) if plan.resume else None
    trainer = TextTrainer(plan, step, corpus, meter=meter, echo=echo, state=state, on_epoch=on_epoch)
    return trainer, corpus.held_bytes if plan.device.kind.holds_data else 0
