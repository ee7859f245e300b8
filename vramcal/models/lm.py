"""A second family: a Mamba-2 causal language model from a transformers ``Mamba2Config``.

For people training Mamba-2 language models, whose memory is not the regressor's: a vocabulary, an
embedding (tied to the head when the config says so) and logits of ``(batch_size, seq_len, vocab_size)``
in fp32 for the loss, which dominate the step at large vocabularies. Weights are random (memory does
not depend on their values); batches are random token ids of ``seq_len`` drawn on the device, and the
loss is transformers' own next-token cross-entropy (``labels=input_ids``).

Calibrate it with ``vramcal probe --model lm --model-arg config=path/to/config.json --seq-len 512``; the
profile keeps the config's settings themselves (not the path), so it identifies the model wherever the
file goes. ``configs/`` in the repository holds examples (the published mamba2-130m shape and a small
one for CPUs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vramcal.models.mamba2 import DTYPE_POLICIES
from vramcal.workload import TrainingStep

if TYPE_CHECKING:  # pragma: no cover
    import torch


def read_config(source: str | dict[str, Any]) -> dict[str, Any]:
    """A ``Mamba2Config``'s settings from a JSON file (or a dict), checked by building the config.

    A Hugging Face ``config.json`` works as it is (its bookkeeping keys such as ``architectures`` and
    ``transformers_version`` are dropped).

    Raises:
        ValueError: the file is missing or not JSON, or transformers refuses the settings (one line).
    """
    if isinstance(source, str):
        try:
            settings = json.loads(Path(source).read_text())
        except OSError as error:
            raise ValueError(f"--model lm: cannot read the config {source} ({error.strerror or error})") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"--model lm: {source} is not JSON (line {error.lineno})") from None
    else:
        settings = dict(source)
    if not isinstance(settings, dict):
        raise ValueError("--model lm: the config must be a JSON object of Mamba2Config settings")
    settings = {k: v for k, v in settings.items() if k not in ("architectures", "transformers_version", "model_type",
                                                              "torch_dtype", "dtype")}
    mamba2_config(settings)
    return settings


def mamba2_config(settings: dict[str, Any]):
    """``transformers.Mamba2Config(**settings)``.

    Raises:
        ValueError: unknown settings, or heads that do not tile the inner width.
    """
    from transformers import Mamba2Config

    try:
        config = Mamba2Config(**settings)
    except (TypeError, ValueError) as error:
        raise ValueError(f"--model lm: Mamba2Config refuses the config: {str(error).splitlines()[0]}") from None
    inner = config.expand * config.hidden_size
    if config.num_heads * config.head_dim != inner:
        raise ValueError(f"--model lm: num_heads x head_dim = {config.num_heads * config.head_dim} must equal "
                         f"expand x hidden_size = {inner}")
    return config


def training_step(device: torch.device, *, config: dict[str, Any], seq_len: int, dtype: str = "fp32",
                  implementation: str = "transformers", lr: float = 1e-4, weight_decay: float = 0.01,
                  max_grad_norm: float = 1.0, seed: int = 0) -> TrainingStep:
    """The language model's training step (module docstring).

    Args:
        device: where to train.
        config: ``Mamba2Config`` settings (:func:`read_config`).
        seq_len: tokens per sample; a multiple of the config's ``chunk_size``.
        dtype: ``fp32``, or ``bf16-autocast`` (fp32 weights, bf16 autocast on CUDA).
        implementation: ``transformers`` (its PyTorch chunked scan, mamba_ssm kernels hidden) or
            ``mamba_ssm`` (transformers' Mamba2 with mamba_ssm's fused kernels bound; CUDA only).

    Batches: ``input_ids`` (batch_size, seq_len) int64 on the device.

    Raises:
        ValueError: a bad config, seq_len or dtype.
    """
    import torch

    from vramcal.models.mamba2 import import_transformers_mamba2

    if dtype not in DTYPE_POLICIES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_POLICIES)}, got {dtype!r}")
    settings = mamba2_config(config)
    if seq_len < 1 or seq_len % settings.chunk_size:
        raise ValueError(f"seq_len {seq_len} is not a positive multiple of the config's chunk_size "
                         f"{settings.chunk_size}")
    if implementation == "transformers":
        modeling = import_transformers_mamba2()
    else:
        import transformers.models.mamba2.modeling_mamba2 as modeling
    torch.manual_seed(seed)
    model = modeling.Mamba2ForCausalLM(settings).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    generator = torch.Generator(device=device).manual_seed(seed)
    autocast = dtype == "bf16-autocast" and device.type == "cuda"

    def batch(batch_size: int) -> torch.Tensor:
        return torch.randint(0, settings.vocab_size, (batch_size, seq_len), device=device, generator=generator)

    def loss(input_ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            return model(input_ids=input_ids, labels=input_ids, use_cache=False).loss

    return TrainingStep(model=model, optimizer=optimizer, batch=batch, loss=loss, max_grad_norm=max_grad_norm,
                        info={"n_params": sum(p.numel() for p in model.parameters()),
                              "vocab_size": settings.vocab_size,
                              "tie_word_embeddings": bool(settings.tie_word_embeddings)})
