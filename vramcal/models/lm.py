"""The ``lm`` family: a Mamba-2 causal language model from a transformers ``Mamba2Config`` (or a ``mamba_ssm``
``config.json``), whose vocabulary, embedding and fp32 logits (B, seq_len, vocab) the regressor lacks. The profile
keeps the config's settings, not its path; ``configs/`` holds examples (``mamba2-130m.json``,
``mamba2-lm-small.json``, ``mamba2-lm-tiny.json``)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vramcal.models.mamba2 import (
    CHECKPOINTING_OFF,
    DTYPE_POLICIES,
    autocast,
    checkpoint_blocks,
    checkpoint_every,
    import_transformers_kernels,
    import_transformers_mamba2,
)
from vramcal.schema import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, Range, SchemaError, read_value
from vramcal.words import given
from vramcal.workload import TrainingStep

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import Mamba2Config

FACTORY = "vramcal.models.lm:training_step"
# Keys of a Hugging Face config.json that describe the file, not the model.
BOOKKEEPING = ("architectures", "transformers_version", "model_type", "torch_dtype", "dtype", "_name_or_path")
# Keys of published Mamba-2 configs transformers' Mamba2 has no option for (it always gates before its RMSNorm)
NO_OPTION = ("rms_norm", "norm_before_gate")
# Without these a misspelt key would silently give Mamba2Config's default, a 64-layer 4096-wide model.
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size")
# The settings' types and ranges (transformers' own checks follow); a float may be written as a whole number
SETTINGS: dict[str, tuple[Any, Range | None]] = {
    **dict.fromkeys(("hidden_size", "num_hidden_layers", "vocab_size", "state_size", "expand", "head_dim",
                     "num_heads", "n_groups", "conv_kernel", "chunk_size"), (int, AT_LEAST_ONE)),
    "layer_norm_epsilon": (float, POSITIVE), "initializer_range": (float, NON_NEGATIVE),
    "time_step_min": (float, POSITIVE), "time_step_max": (float, POSITIVE), "time_step_floor": (float, NON_NEGATIVE),
    **dict.fromkeys(("use_bias", "use_conv_bias", "residual_in_fp32", "tie_word_embeddings", "rescale_prenorm_residual",
                     "use_cache"), (bool, None)),
    "hidden_act": (str, None), "time_step_rank": (int | str, AT_LEAST_ONE),
    "time_step_limit": (tuple[float, ...], NON_NEGATIVE),
    **dict.fromkeys(("pad_token_id", "bos_token_id"), (int | None, NON_NEGATIVE)),
}
# mamba_ssm's defaults (mamba_ssm/models/config_mamba.py MambaConfig, mamba_ssm/modules/mamba2.py Mamba2).
MAMBA_SSM_DEFAULTS = {"d_state": 128, "d_conv": 4, "expand": 2, "headdim": 64, "ngroups": 1, "chunk_size": 256,
                      "bias": False, "conv_bias": True}


def _lm() -> str:
    return given("model", "lm")


def read_config(source: str | Path | dict[str, Any]) -> dict[str, Any]:
    """A ``Mamba2Config``'s settings (keyword arguments, as the profile records them) from a Hugging Face or a
    ``mamba_ssm`` (:func:`from_mamba_ssm`) ``config.json``, or a dict; checked by building the config.

    Raises:
        ValueError: the file missing or not JSON; an unknown key; no ``hidden_size``, ``num_hidden_layers`` or
            ``vocab_size`` (:data:`SHAPE_KEYS`); or settings transformers refuses.
    """
    where = source if isinstance(source, (str, Path)) else "the config"
    if isinstance(source, (str, Path)):
        try:
            settings = json.loads(Path(source).read_text(encoding="utf-8-sig"))  # a byte-order mark left out
        except OSError as error:
            raise ValueError(f"{_lm()}: cannot read the config {source} ({error.strerror or error}): give "
                             f"{given('params', 'config=<a Mamba2Config JSON file>')}, e.g. "
                             f"configs/mamba2-lm-small.json") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"{_lm()}: {source} is not JSON (line {error.lineno}: {error.msg}): give a "
                             f"Mamba2Config JSON file") from None
        except (UnicodeDecodeError, RecursionError):
            raise ValueError(f"{_lm()}: {source} is not a JSON text file (not UTF-8, or nested too deeply): give "
                             f"a Mamba2Config JSON file") from None
    else:
        settings = source
    if not isinstance(settings, dict):
        raise ValueError(f"{_lm()}: {where} must be a JSON object of Mamba2Config settings")
    if any(key in settings for key in ("d_model", "n_layer", "ssm_cfg")):
        settings = from_mamba_ssm(settings)
    settings = {k: v for k, v in settings.items() if k not in BOOKKEEPING + NO_OPTION}
    if _is_default_time_step_limit(settings.get("time_step_limit")):
        del settings["time_step_limit"]  # (0, inf) is the default, and profiles hold finite JSON numbers only
    known = {field.name for field in dataclasses.fields(_config_class())}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"{_lm()}: {where}: {', '.join(unknown)} {'is not a' if len(unknown) == 1 else 'are not'} "
                         f"Mamba2Config setting{'s' * (len(unknown) > 1)}: fix or remove "
                         f"{'it' if len(unknown) == 1 else 'them'} (see configs/mamba2-130m.json)")
    missing = [key for key in SHAPE_KEYS if key not in settings]
    if missing:
        raise ValueError(f"{_lm()}: {where} does not set {', '.join(missing)}: give the model's shape "
                         f"(see configs/mamba2-130m.json)")
    settings = check_settings(settings, str(where))
    mamba2_config(settings, str(where))
    return settings


def from_mamba_ssm(settings: dict[str, Any]) -> dict[str, Any]:
    """``Mamba2Config`` settings for a ``mamba_ssm`` ``MambaConfig``: the vocabulary padded to
    ``pad_vocab_size_multiple`` and embeddings tied as its ``MambaLMHeadModel`` does, :data:`MAMBA_SSM_DEFAULTS`
    for what ``ssm_cfg`` leaves out, initialisation settings dropped.

    Raises:
        ValueError: a model transformers' Mamba2 cannot build: Mamba-1 layers, attention layers, MLP
            layers (``d_intermediate``) or a partial SSM (``d_ssm``).
    """
    ssm = {**MAMBA_SSM_DEFAULTS, **(settings.get("ssm_cfg") or {})}
    layer = ssm.get("layer", "Mamba1")
    if layer != "Mamba2":
        raise ValueError(f"{_lm()}: this mamba_ssm config has {layer} layers (ssm_cfg.layer); vramcal's lm "
                         f"is Mamba-2")
    for key, why in (("attn_layer_idx", "attention layers"), ("d_intermediate", "MLP layers")):
        if settings.get(key):
            raise ValueError(f"{_lm()}: this mamba_ssm config has {why} ({key}), which transformers' Mamba2 "
                             f"does not build: calibrate it with your own factory (--model module:function)")
    if ssm.get("d_ssm") is not None:
        raise ValueError(f"{_lm()}: ssm_cfg.d_ssm (an SSM on part of the width) is not in transformers' Mamba2")
    multiple = int(settings.get("pad_vocab_size_multiple", 8))
    vocab = math.ceil(int(settings["vocab_size"]) / multiple) * multiple
    inner = int(ssm["expand"]) * int(settings["d_model"])
    return {"hidden_size": settings["d_model"], "num_hidden_layers": settings["n_layer"], "vocab_size": vocab,
            "state_size": ssm["d_state"], "expand": ssm["expand"], "head_dim": ssm["headdim"],
            "num_heads": inner // int(ssm["headdim"]), "n_groups": ssm["ngroups"], "conv_kernel": ssm["d_conv"],
            "chunk_size": ssm["chunk_size"], "use_bias": ssm["bias"], "use_conv_bias": ssm["conv_bias"],
            "residual_in_fp32": settings.get("residual_in_fp32", True),
            "tie_word_embeddings": settings.get("tie_embeddings", True)}


def _is_default_time_step_limit(value: Any) -> bool:
    try:
        return value is not None and [float(v) for v in value] == [0.0, math.inf]
    except (TypeError, ValueError):
        return False


def _config_class() -> type[Mamba2Config]:
    from transformers import Mamba2Config

    return Mamba2Config


def check_settings(settings: dict[str, Any], where: str = "the config") -> dict[str, Any]:
    """The settings checked against :data:`SETTINGS` and the relations transformers' Mamba2 needs (heads tiling the
    inner width, groups dividing the heads, time steps in order); returned with floats made floats.

    Raises:
        ValueError: the first bad setting, named with ``where`` (the config file), with what it must be.
    """
    checked = dict(settings)
    for name, (hint, limits) in SETTINGS.items():
        if name in settings:
            try:
                checked[name] = read_value(settings[name], hint, name, limits)
            except SchemaError as error:
                raise ValueError(f"{_lm()}: {where}: {error}: fix it in the config") from None
    if isinstance(checked.get("time_step_rank"), str) and checked["time_step_rank"] != "auto":
        raise ValueError(f"{_lm()}: {where}: time_step_rank = {checked['time_step_rank']!r} is neither \"auto\" "
                         f"nor a whole number: fix it in the config")
    limit = checked.get("time_step_limit")
    if limit is not None and (len(limit) != 2 or limit[0] > limit[1]):
        raise ValueError(f"{_lm()}: {where}: time_step_limit = {list(limit)} is not two numbers, the lower first: "
                         f"fix it in the config")
    full = {**_defaults(), **checked}
    inner = full["expand"] * full["hidden_size"]
    if full["num_heads"] * full["head_dim"] != inner:
        raise ValueError(f"{_lm()}: {where}: num_heads x head_dim = {full['num_heads']} x {full['head_dim']} = "
                         f"{full['num_heads'] * full['head_dim']} must equal expand x hidden_size = {full['expand']} x "
                         f"{full['hidden_size']} = {inner}: fix num_heads or head_dim in the config")
    if full["num_heads"] % full["n_groups"]:
        raise ValueError(f"{_lm()}: {where}: num_heads {full['num_heads']} is not divisible by n_groups "
                         f"{full['n_groups']}: fix n_groups in the config")
    if full["time_step_min"] > full["time_step_max"]:
        raise ValueError(f"{_lm()}: {where}: time_step_min {full['time_step_min']} is above time_step_max "
                         f"{full['time_step_max']}: fix it in the config")
    return checked


def _defaults() -> dict[str, Any]:
    fields = {f.name: f.default for f in dataclasses.fields(_config_class())}
    return {name: fields[name] for name in ("expand", "hidden_size", "num_heads", "head_dim", "n_groups",
                                            "time_step_min", "time_step_max")}


def mamba2_config(settings: dict[str, Any], where: str = "the config") -> Mamba2Config:
    """``transformers.Mamba2Config(**settings)``, the settings checked first (:func:`check_settings`).
    Raises: ValueError: a bad setting, or one transformers refuses (the line of its error that names it)."""
    settings = check_settings(settings, where)
    try:
        return _config_class()(**settings)
    except Exception as error:  # noqa: BLE001 - huggingface_hub's strict-dataclass errors are neither TypeError nor ValueError
        raise ValueError(f"{_lm()}: {where}: Mamba2Config refuses it: {_refusal(error)}: fix it in the config") \
            from None


def _refusal(error: Exception) -> str:
    """The line of a huggingface_hub strict-dataclass error that names the field (not its headers or type prefix)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    telling = [line for line in lines if not line.endswith(":")] or lines or [type(error).__name__]
    kind, sep, rest = telling[0].partition(": ")
    return (rest if sep and kind.isidentifier() and kind.endswith(("Error", "Exception")) else telling[0])[:300]


def check_params(config: dict[str, Any], seq_len: Any, dtype: str = "fp32",
                 checkpointing: str = CHECKPOINTING_OFF) -> Mamba2Config:
    """The built ``Mamba2Config`` once the family's arguments are checked (before any trial, and in the trial).

    Raises:
        ValueError: a bad config, a ``seq_len`` that is no positive multiple of its ``chunk_size``, an unknown
            ``dtype``, or a bad ``checkpointing`` (:func:`vramcal.models.mamba2.checkpoint_every`).
    """
    if dtype not in DTYPE_POLICIES:
        raise ValueError(f"{_lm()}: dtype must be one of {', '.join(DTYPE_POLICIES)}, got {dtype!r}")
    settings = mamba2_config(config)
    try:
        checkpoint_every(checkpointing, settings.num_hidden_layers, "num_hidden_layers")
    except ValueError as error:
        raise ValueError(f"{_lm()}: {error}") from None
    chunk = settings.chunk_size
    whole = isinstance(seq_len, int) and not isinstance(seq_len, bool)
    if not whole or seq_len < 1 or seq_len % chunk:
        low = seq_len // chunk * chunk if whole else 0
        options = [v for v in (low, low + chunk) if v > 0]
        raise ValueError(f"{_lm()}: seq_len {seq_len!r} is not a positive multiple of the config's chunk_size "
                         f"{chunk}: use --seq-len {' or '.join(map(str, options))}")
    return settings


def training_step(device: torch.device, *, config: dict[str, Any], seq_len: int, dtype: str = "fp32",
                  checkpointing: str = CHECKPOINTING_OFF, implementation: str = "transformers", lr: float = 1e-4,
                  weight_decay: float = 0.01, max_grad_norm: float = 1.0, seed: int = 0) -> TrainingStep:
    """The language model's training step: random weights, batches of random ``input_ids`` (B, seq_len) int64 on
    the device, transformers' next-token loss (``labels=input_ids``), AdamW.

    Args:
        config: ``Mamba2Config`` settings (:func:`read_config`).
        seq_len: tokens per sample; a multiple of the config's ``chunk_size``.
        dtype, checkpointing: as :func:`check_params` takes them.
        implementation: ``transformers`` or ``mamba_ssm`` (transformers' Mamba2 with the fused kernels; CUDA only).

    Raises:
        ValueError: a bad config, seq_len, dtype or checkpointing (:func:`check_params`).
    """
    import torch

    settings = check_params(config, seq_len, dtype, checkpointing)
    modeling = import_transformers_mamba2() if implementation == "transformers" else import_transformers_kernels()
    torch.manual_seed(seed)
    model = modeling.Mamba2ForCausalLM(settings).to(device)
    checkpoint_blocks(model, checkpoint_every(checkpointing, settings.num_hidden_layers))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    generator = torch.Generator(device=device).manual_seed(seed)

    def batch(batch_size: int) -> torch.Tensor:
        return torch.randint(0, settings.vocab_size, (batch_size, seq_len), device=device, generator=generator)

    def loss(module: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        # (B, seq_len) int64 -> scalar; logits (B, seq_len, vocab)
        with autocast(device.type, dtype):
            return module(input_ids=input_ids, labels=input_ids, use_cache=False).loss

    return TrainingStep(model=model, optimizer=optimizer, batch=batch, loss=loss, max_grad_norm=max_grad_norm,
                        info={"n_params": sum(p.numel() for p in model.parameters()),
                              "vocab_size": settings.vocab_size,
                              "tie_word_embeddings": bool(settings.tie_word_embeddings)})
