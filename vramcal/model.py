"""The Mamba-2 model that vramcal calibrates and trains: its spec and the one function that builds it.

Only this module imports Mamba-2 implementations. Two are supported, both from well-kept libraries:

* ``transformers``: ``transformers.Mamba2Model`` on its pure-PyTorch chunked-scan path (``torch_forward``),
  which runs on CPUs and GPUs. Where ``mamba_ssm`` is installed, transformers >= 5.2x binds the Triton
  kernels of ``mamba_ssm`` into the model at import time, even for CPU tensors, and crashes on them;
  vramcal imports the transformers module with ``mamba_ssm`` and ``causal_conv1d`` hidden, so this path
  is always the PyTorch one it claims to be.
* ``mamba_ssm``: ``mamba_ssm.modules.mamba2.Mamba2``, the authors' fused Triton/CUDA kernels
  (``mamba_split_conv1d_scan_combined``, ``use_mem_eff_path=True``). GPU only; it needs the compiled
  ``causal_conv1d`` package, because mamba_ssm 2.3.2's training path without it does not run.

The profile records which one ran (:func:`kernel_path`): their memory differs by several times.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import json
import math
import sys
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # pragma: no cover
    import torch

Implementation = Literal["auto", "transformers", "mamba_ssm"]
DtypePolicy = Literal["fp32", "bf16-autocast"]
IMPLEMENTATIONS: tuple[str, ...] = ("auto", "transformers", "mamba_ssm")
DTYPE_POLICIES: tuple[str, ...] = ("fp32", "bf16-autocast")

# The trainer's input features (vramcal.train.data computes them); the probe feeds the same width.
N_FEATURES = 5


@dataclass(frozen=True)
class ModelSpec:
    """A Mamba-2 regression model over windows of bars: the key of a profile.

    The model maps ``x: (batch_size, seq_len, n_features)`` float32 to ``(batch_size, seq_len)``
    float32 predictions (one next-bar return per position): a linear input projection to ``d_model``,
    ``n_layers`` pre-norm Mamba-2 blocks, a final RMSNorm and a linear head.

    Attributes:
        d_model: width of the residual stream.
        n_layers: number of Mamba-2 blocks.
        d_state: SSM state size N per head.
        headdim: channels per SSM head P; the number of heads is ``d_model * expand / headdim``.
        expand: inner width factor, ``d_inner = expand * d_model``.
        chunk_size: length of the chunks of the SSD chunked scan (Mamba-2 paper, Dao & Gu 2024, sec. 6).
        seq_len: bars per sample.
        n_features: input features per bar.
        d_conv: width of the causal depthwise convolution.
        n_groups: groups sharing B and C (1 = multi-value attention analogue).
        dtype: ``fp32``, or ``bf16-autocast`` (fp32 weights, bf16 autocast; CUDA only).
    """

    d_model: int = 128
    n_layers: int = 4
    d_state: int = 32
    headdim: int = 32
    expand: int = 2
    chunk_size: int = 64
    seq_len: int = 128
    n_features: int = N_FEATURES
    d_conv: int = 4
    n_groups: int = 1
    dtype: DtypePolicy = "fp32"

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def n_heads(self) -> int:
        return self.d_inner // self.headdim

    def validate(self) -> None:
        """Refuse a spec no Mamba-2 implementation can build or train.

        Raises:
            ValueError: one line naming the bad value and values that would work.
        """
        for name in ("d_model", "n_layers", "d_state", "headdim", "expand", "chunk_size", "seq_len",
                     "n_features", "d_conv", "n_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.d_inner % self.headdim:
            divisors = [h for h in (16, 32, 64, 128, 256) if self.d_inner % h == 0]
            raise ValueError(
                f"d_model x expand = {self.d_inner} is not divisible by headdim {self.headdim}: "
                f"use headdim in {divisors or 'a divisor of ' + str(self.d_inner)}, "
                f"or a d_model that is a multiple of {self.headdim // math.gcd(self.headdim, self.expand)}")
        if self.n_heads % self.n_groups:
            raise ValueError(f"n_heads = {self.n_heads} is not divisible by n_groups {self.n_groups}")
        if self.chunk_size & (self.chunk_size - 1):
            low = 1 << (self.chunk_size.bit_length() - 1)
            raise ValueError(f"chunk_size {self.chunk_size} is not a power of two: use {low} or {low * 2}")
        if self.seq_len % self.chunk_size:
            low = self.seq_len // self.chunk_size * self.chunk_size
            options = [v for v in (low, low + self.chunk_size) if v > 0]
            raise ValueError(
                f"seq_len {self.seq_len} is not a multiple of chunk_size {self.chunk_size}: "
                f"use seq_len {' or '.join(map(str, options))}, or a chunk_size that divides {self.seq_len}")
        if self.dtype not in DTYPE_POLICIES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_POLICIES)}, got {self.dtype!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelSpec:
        """Raises: ValueError if the dict has unknown or missing fields."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown model spec fields {sorted(unknown)}")
        return cls(**data)

    def key(self) -> str:
        """A short stable hash of the spec (8 hex digits of SHA-256 over its sorted JSON)."""
        text = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:8]

    def short(self) -> str:
        """One line for titles: ``d_model=256 n_layers=4 d_state=64 headdim=64 expand=2 ...``."""
        return (f"d_model={self.d_model} n_layers={self.n_layers} d_state={self.d_state} "
                f"headdim={self.headdim} expand={self.expand} chunk_size={self.chunk_size} "
                f"seq_len={self.seq_len} {self.dtype}")

    def n_params(self) -> int:
        """Trainable parameters, counted from the layer shapes (no torch needed).

        Per block (mamba_ssm / transformers Mamba2 layout): in_proj ``d_model x (2 d_inner + 2 G N + H)``,
        depthwise conv ``(d_inner + 2 G N) x (d_conv + 1)``, dt_bias, A_log, D (H each), gated norm
        ``d_inner``, out_proj ``d_inner x d_model``, pre-norm ``d_model``.
        """
        g_n = self.n_groups * self.d_state
        conv_dim = self.d_inner + 2 * g_n
        block = (self.d_model * (2 * self.d_inner + 2 * g_n + self.n_heads) + conv_dim * (self.d_conv + 1)
                 + 3 * self.n_heads + self.d_inner + self.d_inner * self.d_model + self.d_model)
        return ((self.n_features + 1) * self.d_model + self.n_layers * block + self.d_model
                + self.d_model + 1)


def mamba_ssm_available() -> bool:
    """True when mamba_ssm's Mamba2 module and the compiled causal_conv1d can both be imported."""
    try:
        _import_mamba_ssm_mamba2()
        importlib.import_module("causal_conv1d")
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False
    return True


def resolve_implementation(implementation: Implementation, device_kind: str) -> str:
    """Pick the concrete implementation for a device (``cuda`` or ``host``).

    ``auto`` picks ``mamba_ssm`` on CUDA when :func:`mamba_ssm_available`, else ``transformers``.

    Raises:
        ValueError: ``mamba_ssm`` asked for on the host, or asked for where it cannot be imported.
    """
    if implementation == "auto":
        return "mamba_ssm" if device_kind == "cuda" and mamba_ssm_available() else "transformers"
    if implementation == "mamba_ssm":
        if device_kind != "cuda":
            raise ValueError("the mamba_ssm implementation runs on NVIDIA GPUs only: use --impl transformers")
        if not mamba_ssm_available():
            raise ValueError("mamba_ssm is not usable here (it needs mamba-ssm and the compiled causal-conv1d): "
                             "pip install 'vramcal[cuda]' on a GPU box, or use --impl transformers")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {', '.join(IMPLEMENTATIONS)}, got {implementation!r}")
    return implementation


def kernel_path(implementation: str) -> str:
    """The kernel path a concrete implementation runs in training, as recorded in profiles."""
    if implementation == "mamba_ssm":
        return "mamba_ssm.Mamba2 fused mamba_split_conv1d_scan_combined (Triton + causal_conv1d CUDA)"
    return "transformers Mamba2 torch_forward (pure PyTorch chunked scan; mamba_ssm kernels not bound)"


def import_transformers_mamba2() -> types.ModuleType:
    """Import ``transformers.models.mamba2.modeling_mamba2`` bound to its pure-PyTorch functions.

    transformers binds ``mamba_ssm``/``causal_conv1d`` functions at import when they are importable;
    hiding them from ``sys.modules`` during the import keeps the PyTorch reference path. If the module
    was imported earlier with kernels bound, it is reloaded under the same guard.
    """
    name = "transformers.models.mamba2.modeling_mamba2"
    hidden = ("mamba_ssm", "causal_conv1d")
    saved = {key: sys.modules[key] for key in list(sys.modules)
             if key.split(".")[0] in hidden}
    for key in saved:
        del sys.modules[key]
    for key in hidden:
        sys.modules[key] = None  # type: ignore[assignment]  # makes `import key` raise ImportError
    try:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "_vramcal_torch_only", False):
            return module
        module = importlib.reload(module) if module is not None else importlib.import_module(name)
        module._vramcal_torch_only = True
        # transformers warns at every first call that it falls back to PyTorch: here that is the intent.
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
        return module
    finally:
        for key in hidden:
            sys.modules.pop(key, None)
        sys.modules.update(saved)


def _import_mamba_ssm_mamba2() -> types.ModuleType:
    """Import ``mamba_ssm.modules.mamba2``.

    mamba-ssm 2.3.2's package ``__init__`` imports the compiled ``selective_scan_cuda`` (Mamba-1 only);
    when that extension is missing, the package is entered as a bare namespace so Mamba-2's Triton
    modules still import.
    """
    try:
        return importlib.import_module("mamba_ssm.modules.mamba2")
    except ImportError as error:
        if "selective_scan_cuda" not in str(error):
            raise
    spec = importlib.util.find_spec("mamba_ssm")
    package = types.ModuleType("mamba_ssm")
    package.__path__ = list(spec.submodule_search_locations)  # type: ignore[union-attr]
    sys.modules["mamba_ssm"] = package
    return importlib.import_module("mamba_ssm.modules.mamba2")


def build_model(spec: ModelSpec, implementation: str) -> torch.nn.Module:
    """Build the model that ``vramcal probe`` measures and ``vramcal train`` trains, in fp32 on the CPU.

    Args:
        spec: the model spec (validated here).
        implementation: a concrete implementation, ``transformers`` or ``mamba_ssm`` (see
            :func:`resolve_implementation`).

    Returns:
        A :class:`vramcal.regressor.Mamba2Regressor` mapping ``(batch_size, seq_len, n_features)``
        float32 to ``(batch_size, seq_len)``. Move it to the device yourself.

    Raises:
        ValueError: an invalid spec or implementation.
    """
    from vramcal import regressor

    spec.validate()
    if implementation == "transformers":
        backbone = regressor.TransformersBackbone(import_transformers_mamba2(), spec)
    elif implementation == "mamba_ssm":
        backbone = regressor.MambaSsmBackbone(_import_mamba_ssm_mamba2(), spec)
    else:
        raise ValueError(f"build_model needs a concrete implementation, got {implementation!r}")
    return regressor.Mamba2Regressor(spec.n_features, spec.d_model, backbone)
