"""The estimate of a card against published GPU measurements of fully specified training runs (issue 57, item 4).

``python -m bench.published`` traces each published run's step as its card runs it
(:func:`vramcal.estimate.estimate_step`, ``device_kind="cuda"``: the caching allocator's reserved peak, the card's
cuBLAS workspaces in it) and prints, per row, the estimate (the run's own published CUDA context + the traced
reserved peak) beside the published figure, the error and whether the GPU bound
(:data:`vramcal.estimate.learned.GPU_BOUND`, learned from these rows) covers it. ``--bound`` prints the bound the
rows give.

**The runs** (:data:`ROWS`): Hugging Face's "Efficient training on a single GPU" (transformers' documentation,
``docs/source/en/perf_train_gpu_one.md`` and ``model_memory_anatomy.md``, January 2022): ``bert-large-uncased``
for sequence classification (24 layers, hidden 1024, 16 heads, intermediate 4096, vocab 30522, 2 labels) trained by
the ``Trainer`` on 512 random sequences of seq_len 512 on a Tesla V100-SXM2 16 GB (driver 460.91.03, CUDA 11.2),
each figure ``nvmlDeviceGetMemoryInfo(...).used // 1024**2`` printed after training ("GPU memory occupied: N MB",
MiB: the whole card, so the CUDA context and the allocator's cached blocks: its reserved peak, never released
without ``empty_cache``). The page measured the context on its own, 1343 MiB after ``torch.ones((1, 1)).to("cuda")``:
that is each row's baseline (a measured context of the same card and software, as a GPU profile's would be). The
Trainer and torch of the time (torch 1.10, the last release before the page), reproduced by :func:`bert_step`:
transformers' own AdamW (``adamw_hf``: a loop over the parameters), weight decay 0, ``max_grad_norm`` 1.0,
``model.zero_grad()`` zeroing the gradients in place (torch 1.10's default, so they stay allocated), BERT's eager
attention (its softmax weights and their dropout mask kept for backward) with torch 1.10's softmax, which kept its
input for backward beside its output (``_softmax_backward_data(grad, output, dim, self)``; torch 1.11 stopped:
pytorch issue #49600, PR #65242; :class:`Softmax110`), dropout 0.1, ``fp16=True``: torch's CUDA autocast around
the forward pass and a GradScaler, gradient checkpointing: ``model.gradient_checkpointing_enable()``; with gradient
accumulation the peak is a step's at the per-device batch size (the gradients are kept anyway). No evaluation ran
(fewer steps than ``eval_steps``).

Not reproduced: the page's Adafactor and 8-bit Adam rows (another optimizer each; bitsandbytes is not installed);
the GradScaler's own tensors (a scale and a found-inf flag: bytes); the cuBLAS workspaces torch 1.10 did not yet
allocate through the caching allocator (the trace has them: 18 MiB on sm_70).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

import torch

from vramcal.records import TrialSettings
from vramcal.workload import ModelRef, TrainingStep

MIB = 2**20
SOURCE = ("transformers docs, perf_train_gpu_one.md / model_memory_anatomy.md (Jan 2022): bert-large-uncased, "
          "Trainer, seq_len 512, Tesla V100-SXM2 16 GB, nvidia-smi used after training")
CONTEXT_MIB = 1343  # the page's "GPU memory occupied" after torch.ones((1, 1)).to("cuda"): the CUDA context
SEQ_LEN = 512


@dataclass(frozen=True)
class Row:
    """One published run: its Trainer arguments and the figure it printed (MiB of the whole card)."""

    name: str
    batch_size: int
    measured_mib: int
    dtype: str = "fp32"
    checkpointing: bool = False


ROWS = (
    Row("vanilla, batch 4", 4, 14949),
    Row("batch 1, gradient accumulation 4", 1, 8681),
    Row("batch 1, accumulation 4, gradient checkpointing", 1, 6775, checkpointing=True),
    Row("batch 4, fp16", 4, 13939, dtype="fp16"),
    Row("batch 1, accumulation 4, checkpointing, fp16", 1, 7275, dtype="fp16", checkpointing=True),
)


class Softmax110(torch.autograd.Function):
    """``softmax(scores, -1)`` keeping for backward what torch 1.10's did: its input (fp32: under autocast,
    ``softmax.int``'s cast of it) and its output."""

    @staticmethod
    def forward(ctx: Any, scores: torch.Tensor) -> torch.Tensor:
        kept = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores
        out = torch._softmax(kept, -1, False)
        ctx.save_for_backward(kept, out)
        ctx.dtype = scores.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        kept, out = ctx.saved_tensors
        return torch._softmax_backward_data(grad, out, -1, kept.dtype).to(ctx.dtype)


def attention_110(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None = None,
                  dropout: float = 0.0, **kwargs: Any) -> tuple[Any, Any]:
    """transformers' BERT eager attention (``modeling_bert.eager_attention_forward``) with :class:`Softmax110`."""
    scores = torch.matmul(query, key.transpose(2, 3)) * (scaling or query.size(-1) ** -0.5)
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.nn.functional.dropout(Softmax110.apply(scores), p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def bert_step(device: Any, dtype: str = "fp32", checkpointing: bool = False, seq_len: int = SEQ_LEN) -> TrainingStep:
    """The published runs' step (module docstring): BertForSequenceClassification as bert-large-uncased's config,
    eager attention with torch 1.10's softmax, AdamW looping over the parameters, gradients zeroed in place."""
    from transformers import AttentionInterface, BertConfig, BertForSequenceClassification

    AttentionInterface.register("eager_torch110", attention_110)
    config = BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                        vocab_size=30522, num_labels=2, attn_implementation="eager_torch110")
    model = BertForSequenceClassification(config).to(device)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()

    class TrainerAdamW(torch.optim.AdamW):
        def zero_grad(self, set_to_none: bool = True) -> None:  # torch 1.10's model.zero_grad(): in place
            super().zero_grad(set_to_none=False)

    optimizer = TrainerAdamW(model.parameters(), lr=5e-5, weight_decay=0.0, foreach=False)

    def batch(size: int) -> dict[str, Any]:
        return {"input_ids": torch.randint(100, 30000, (size, seq_len), device=device),
                "labels": torch.randint(0, 2, (size,), device=device)}

    def loss(module: Any, inputs: dict[str, Any]) -> Any:
        with torch.autocast("cuda", dtype=torch.float16, enabled=dtype == "fp16"):
            return module(**inputs).loss

    return TrainingStep(model=model, optimizer=optimizer, batch=batch, loss=loss, max_grad_norm=1.0)


def v100() -> Any:
    from vramcal.estimate.card import Card

    return Card("Tesla V100-SXM2 16 GB", (7, 0), 80)


def estimates() -> list[tuple[Row, int, tuple[str, ...]]]:
    """Each row with its estimated peak (bytes: the published context + the traced reserved peak at its batch
    size) and the card's choices the trace made. One trace per (dtype, checkpointing), at batch sizes 1 and 4."""
    from vramcal.estimate import estimate_step

    traces: dict[tuple[str, bool], Any] = {}
    found = []
    for row in ROWS:
        key = (row.dtype, row.checkpointing)
        if key not in traces:
            ref = ModelRef.make("bench.published:bert_step", {"dtype": row.dtype, "checkpointing": row.checkpointing})
            traces[key] = estimate_step(ref, (1, 4), device_kind="cuda", card=v100(),
                                        settings=TrialSettings(val_steps=0))
        trace = traces[key]
        point = next(p for p in trace.points if p.batch_size == row.batch_size)
        found.append((row, CONTEXT_MIB * MIB + point.reserved_peak_bytes, trace.choices))
    return found


def errors(found: list[tuple[Row, int, tuple[str, ...]]]) -> list[float]:
    return [estimated / (row.measured_mib * MIB) - 1 for row, estimated, _ in found]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bound", action="store_true", help="print the bound the rows give (low, high)")
    args = parser.parse_args(argv)
    from vramcal.estimate.learned import GPU_BOUND

    found = estimates()
    print(f"source: {SOURCE}; baseline: the page's CUDA context, {CONTEXT_MIB} MiB")
    print("| run | batch_size | dtype | checkpointing | published MiB | estimated MiB | error | inside the GPU bound |")
    print("|---|---:|---|---|---:|---:|---:|---|")
    for (row, estimated, _), error in zip(found, errors(found)):
        inside = GPU_BOUND.low <= error <= GPU_BOUND.high
        print(f"| {row.name} | {row.batch_size} | {row.dtype} | {'on' if row.checkpointing else 'off'} | "
              f"{row.measured_mib:,} | {estimated / MIB:,.0f} | {error:+.1%} | {'yes' if inside else 'NO'} |")
    for choice in sorted({c for _, _, choices in found for c in choices}):
        print(f"as the card runs it: {choice}")
    if args.bound:
        each = errors(found)
        print(f"bound: low {min(each):+.3f}, high {max(each):+.3f} over {len(each)} published rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
