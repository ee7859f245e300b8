"""The regressor's spec (:class:`RegressorSpec`): the Mamba-2 regressor's shape, the key of its profiles."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from vramcal.models.mamba2 import CHECKPOINTING_OFF, DTYPE_POLICIES, DtypePolicy, checkpoint_every, keyed_params
from vramcal.workload import ModelRef

# The factory a profile of this family names (kept in every profile: it must not move).
FACTORY = "vramcal.models.regressor:training_step"
# The trainer's input features (vramcal.models.regressor.windows computes them); a trial feeds the same width.
N_FEATURES = 5


@dataclass(frozen=True)
class RegressorSpec:
    """A Mamba-2 regressor over windows of bars, (B, L, n_features) -> (B, L) float32: the key of a profile,
    checked when made (:meth:`validate`).

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
        checkpointing: ``off``, ``block`` or ``every:K`` (:func:`vramcal.models.mamba2.checkpoint_every`): a
            variant with a profile of its own.
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
    checkpointing: str = CHECKPOINTING_OFF

    def __post_init__(self) -> None:
        self.validate()

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def n_heads(self) -> int:
        return self.d_inner // self.headdim

    def validate(self) -> None:
        """Refuse a spec no Mamba-2 implementation can build or train (run when the spec is made).

        Raises:
            ValueError: one line naming the bad value and values that would work. TypeError: a size that is no
                whole number, or a ``dtype``/``checkpointing`` that is no str.
        """
        for name in ("d_model", "n_layers", "d_state", "headdim", "expand", "chunk_size", "seq_len",
                     "n_features", "d_conv", "n_groups", "dtype", "checkpointing"):
            value, kind = getattr(self, name), str if name in ("dtype", "checkpointing") else int
            if isinstance(value, bool) or not isinstance(value, kind):
                raise TypeError(f"{name} must be {'a str' if kind is str else 'a whole number'}, not "
                                f"{type(value).__name__} {value!r:.40}")
            if kind is int and value < 1:
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
        checkpoint_every(self.checkpointing, self.n_layers)

    @property
    def checkpoint_stride(self) -> int:
        """How many blocks apart the checkpointed blocks are; 0: none."""
        return checkpoint_every(self.checkpointing, self.n_layers)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RegressorSpec:
        """Raises: ValueError if the dict has unknown or missing fields."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown model spec fields {sorted(unknown)}")
        return cls(**data)

    def ref(self, implementation: str) -> ModelRef:
        """The profile key with a concrete ``implementation`` (:func:`~vramcal.models.mamba2.keyed_params`)."""
        return ModelRef.make(FACTORY, {**keyed_params(self.to_dict()), "implementation": implementation})

    @classmethod
    def from_ref(cls, ref: ModelRef) -> tuple[RegressorSpec, str]:
        """The spec and implementation of a ``regressor`` reference.
        Raises: ValueError: ``ref`` is not the regressor family, or its arguments are not a spec."""
        if ref.factory != FACTORY:
            raise ValueError(f"{ref.factory} is not vramcal's regressor")
        params = ref.params
        implementation = params.pop("implementation", "transformers")
        return cls.from_dict(params), implementation

    def short(self) -> str:
        """One line for titles: ``d_model=256 n_layers=4 ... fp32`` (and ``checkpointing=block`` where it is on)."""
        checkpointing = f" checkpointing={self.checkpointing}" if self.checkpoint_stride else ""
        return (f"d_model={self.d_model} n_layers={self.n_layers} d_state={self.d_state} "
                f"headdim={self.headdim} expand={self.expand} chunk_size={self.chunk_size} "
                f"seq_len={self.seq_len} {self.dtype}{checkpointing}")

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
