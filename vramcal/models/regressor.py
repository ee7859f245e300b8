"""The bundled model family: a Mamba-2 regressor over windows of OHLCV bars, and its training step.

``vramcal train`` trains this model and ``vramcal probe`` calibrates it by default, both through
:func:`training_step`, the same factory: a trial holds the trainer's model, optimizer and data
pipeline (the same windows, drawn and copied to the device the same way), so what a trial measures is
what training holds.

Data residency: on the host the windows are host memory, the measured pool. On a GPU they stay in
host memory and each batch is gathered there, pinned and copied to the device (non-blocking); with
``data_on_device`` the windows are moved to the GPU once and gathered there, and their bytes count in
the GPU's memory.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vramcal.models.mamba2 import DTYPE_POLICIES, DtypePolicy, import_mamba_ssm_mamba2, import_transformers_mamba2
from vramcal.workload import ModelRef, TrainingStep

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from vramcal.train.data import Windows

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

    def ref(self, implementation: str) -> ModelRef:
        """The profile key of this spec trained with a concrete ``implementation``."""
        return ModelRef.make("regressor", {**self.to_dict(), "implementation": implementation})

    @classmethod
    def from_ref(cls, ref: ModelRef) -> tuple[ModelSpec, str]:
        """The spec and implementation of a ``regressor`` reference.

        Raises:
            ValueError: ``ref`` is not the regressor family, or its arguments are not a spec.
        """
        if ref.family != "regressor":
            raise ValueError(f"{ref.factory} is not vramcal's regressor")
        params = ref.params
        implementation = params.pop("implementation", "transformers")
        return cls.from_dict(params), implementation

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


# ------------------------------------------------------------------------------------------- model

def build_model(spec: ModelSpec, implementation: str) -> torch.nn.Module:
    """Build the regressor in fp32 on the CPU (move it to the device yourself).

    Args:
        spec: the model spec (validated here).
        implementation: a concrete implementation, ``transformers`` or ``mamba_ssm``
            (:func:`vramcal.models.mamba2.resolve_implementation`).

    Returns:
        A :class:`vramcal.models.regressor_net.Mamba2Regressor`: ``(batch_size, seq_len, n_features)``
        float32 -> ``(batch_size, seq_len)``.

    Raises:
        ValueError: an invalid spec or implementation.
    """
    from vramcal.models import regressor_net

    spec.validate()
    if implementation == "transformers":
        backbone = regressor_net.TransformersBackbone(import_transformers_mamba2(), spec)
    elif implementation == "mamba_ssm":
        backbone = regressor_net.MambaSsmBackbone(import_mamba_ssm_mamba2(), spec)
    else:
        raise ValueError(f"build_model needs a concrete implementation, got {implementation!r}")
    return regressor_net.Mamba2Regressor(spec.n_features, spec.d_model, backbone)


def forward(model: torch.nn.Module, x: torch.Tensor, dtype: DtypePolicy) -> torch.Tensor:
    """The model under the dtype policy: (batch_size, seq_len, n_features) -> (batch_size, seq_len).

    ``bf16-autocast`` runs under bf16 autocast on CUDA (fp32 weights); elsewhere everything is fp32.
    """
    import torch

    device_type = x.device.type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=dtype == "bf16-autocast" and device_type == "cuda"):
        return model(x)


# ------------------------------------------------------------------------------------------- data

class WindowPipeline:
    """The trainer's data pipeline: windows of standardised bars, gathered into batches on the device.

    Args:
        windows: from :func:`vramcal.train.data.make_windows`.
        device: the training device.
        on_device: keep the rows in the device's memory (else host memory, batches copied per step).
        seed: the seed of the epoch permutations.

    Batches: ``x`` (batch_size, seq_len, n_features) float32 and ``y`` (batch_size, seq_len) float32, the
    windows starting at the given rows.
    """

    def __init__(self, windows: Windows, device: torch.device, on_device: bool = False, seed: int = 0) -> None:
        import torch

        self.windows, self.device, self.on_device, self.seed = windows, device, on_device, seed
        home = device if on_device else torch.device("cpu")
        self.features = torch.from_numpy(windows.features).to(home)  # (M, n_features)
        self.targets = torch.from_numpy(windows.targets).to(home)  # (M,)
        self.offsets = torch.arange(windows.seq_len, device=home)  # (L,)
        self.train_starts = torch.from_numpy(windows.train_starts)  # (n_train,) int64, host
        self.val_starts = torch.from_numpy(windows.val_starts)  # (n_val,) int64, host
        self._streams: dict[str, tuple[int, int, torch.Tensor]] = {}

    @property
    def data_bytes(self) -> int:
        """Bytes the pipeline holds: rows, targets, window starts and one epoch's permutation."""
        return int(self.features.nbytes + self.targets.nbytes + self.train_starts.nbytes * 2
                   + self.val_starts.nbytes)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """Indices into ``train_starts`` in the order of ``epoch`` (a seeded permutation, int64)."""
        import torch

        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.train_starts), generator=generator)

    def gather(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The windows starting at rows ``starts`` (batch_size,) int64, on the training device."""
        rows = starts.to(self.offsets.device)[:, None] + self.offsets  # (B, L)
        x, y = self.features[rows], self.targets[rows]  # (B, L, n_features), (B, L)
        if self.on_device or self.device.type == "cpu":
            return x, y
        return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)

    def next_batch(self, split: str, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``batch_size`` windows of an endless walk through ``split`` (``train``: epoch after
        epoch in the trainer's order; ``val``: in order), repeating windows when ``batch_size`` exceeds
        the split. This is what a trial draws."""
        import torch

        starts_of = self.train_starts if split == "train" else self.val_starts
        epoch, position, order = self._streams.get(split, (0, 0, self._order(split, 0)))
        taken = []
        while batch_size > 0:
            if position == len(order):
                epoch, position = epoch + 1, 0
                order = self._order(split, epoch)
            chunk = order[position:position + batch_size]
            taken.append(chunk)
            position, batch_size = position + len(chunk), batch_size - len(chunk)
        self._streams[split] = (epoch, position, order)
        return self.gather(starts_of[torch.cat(taken)])

    def _order(self, split: str, epoch: int) -> torch.Tensor:
        import torch

        return self.epoch_order(epoch) if split == "train" else torch.arange(len(self.val_starts))


@dataclass
class RegressorStep(TrainingStep):
    """The regressor's :class:`~vramcal.workload.TrainingStep` with what the trainer needs besides:
    its spec and data pipeline."""

    spec: ModelSpec | None = None
    pipeline: WindowPipeline | None = None


def training_step(device: torch.device, *, implementation: str = "transformers", data: str | None = None,
                  stride: int | None = None, val_fraction: float = 0.2, data_on_device: bool = False,
                  lr: float = 1e-4, weight_decay: float = 0.01, max_grad_norm: float = 1.0, seed: int = 0,
                  **spec_fields: Any) -> RegressorStep:
    """The bundled regressor's training step: the factory of ``vramcal probe`` (default ``--model``) and
    of ``vramcal train``.

    Args:
        device: where to train.
        implementation: ``transformers`` or ``mamba_ssm`` (concrete).
        data: an OHLCV parquet file (:func:`vramcal.train.data.load_bars`), or None for synthetic bars of
            the size of the E-mini sample (:func:`vramcal.train.data.synthetic_bars`).
        stride, val_fraction: how the bars are cut into windows (:func:`vramcal.train.data.make_windows`).
        data_on_device: hold the windows in the device's memory (see the module docstring).
        lr, weight_decay: AdamW's (the memory does not depend on them).
        max_grad_norm: gradient clipping norm.
        seed: seeds the weights and the epoch order.
        spec_fields: the :class:`ModelSpec` fields (``d_model``, ``seq_len``, ...).

    Returns:
        A :class:`RegressorStep`: MSE loss in fp32 of the model under the spec's dtype policy.

    Raises:
        ValueError: an invalid spec; DataError: unusable data.
    """
    import torch

    from vramcal.models.mamba2 import kernel_path
    from vramcal.train.data import load_bars, make_windows, synthetic_bars

    spec = ModelSpec.from_dict(spec_fields)
    spec.validate()
    bars = load_bars(data) if data is not None else synthetic_bars()
    windows = make_windows(bars, spec.seq_len, stride, val_fraction, source=data or "synthetic bars")
    del bars
    torch.manual_seed(seed)
    model = build_model(spec, implementation).to(device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                  weight_decay=weight_decay)
    pipeline = WindowPipeline(windows, device, on_device=data_on_device, seed=seed)

    def loss(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(forward(model, x, spec.dtype).float(), y)

    return RegressorStep(
        model=model, optimizer=optimizer, batch=lambda b: pipeline.next_batch("train", b), loss=loss,
        max_grad_norm=max_grad_norm, val_batch=lambda b: pipeline.next_batch("val", b),
        data_bytes=pipeline.data_bytes, data_on_device=data_on_device, kernel_path=kernel_path(implementation),
        info={"n_params": sum(p.numel() for p in model.parameters()), "data": data or "synthetic",
              "train_windows": len(windows.train_starts), "stride": windows.stride},
        spec=spec, pipeline=pipeline)
