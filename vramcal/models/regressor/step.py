"""The regressor's training step (:func:`training_step`): the factory ``vramcal probe`` calibrates and ``vramcal
train`` trains, so a trial holds the trainer's model, optimizer and data pipeline. Where the data live: DESIGN.md
"Data"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vramcal.models.mamba2 import (
    DtypePolicy,
    autocast,
    import_mamba_ssm_mamba2,
    import_transformers_mamba2,
    kernel_path,
)
from vramcal.models.regressor.spec import RegressorSpec
from vramcal.workload import TrainingStep

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from vramcal.models.regressor.windows import Windows


def build_model(spec: RegressorSpec, implementation: str) -> torch.nn.Module:
    """The regressor (:class:`vramcal.models.regressor.net.Mamba2Regressor`) in fp32 on the CPU, built with a
    concrete ``implementation`` (``transformers`` or ``mamba_ssm``). Raises: ValueError: any other implementation."""
    from vramcal.models.regressor import net  # loads torch: only when called

    if implementation == "transformers":
        backbone = net.TransformersBackbone(import_transformers_mamba2(), spec)
    elif implementation == "mamba_ssm":
        backbone = net.MambaSsmBackbone(import_mamba_ssm_mamba2(), spec)
    else:
        raise ValueError(f"build_model needs a concrete implementation, got {implementation!r}")
    return net.Mamba2Regressor(spec.n_features, spec.d_model, backbone)


def forward(model: torch.nn.Module, x: torch.Tensor, dtype: DtypePolicy) -> torch.Tensor:
    """The model under the dtype policy (:func:`vramcal.models.mamba2.autocast`): (B, L, n_features) -> (B, L)."""
    with autocast(x.device.type, dtype):
        return model(x)


class WindowPipeline:
    """The trainer's data pipeline: windows gathered into batches ``x`` (B, L, n_features) and ``y`` (B, L) float32
    on ``device``; ``on_device`` keeps the rows there (else in host memory, copied per batch); ``seed`` orders epochs.
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
        """Bytes the pipeline holds (:attr:`vramcal.models.regressor.windows.Windows.pipeline_bytes`)."""
        return self.windows.pipeline_bytes

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
        """The next ``batch_size`` windows of an endless walk through ``split`` (``train``: the epochs' order;
        ``val``: in order)."""
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
    """The regressor's :class:`~vramcal.workload.TrainingStep`, with its spec and pipeline for the trainer."""

    spec: RegressorSpec | None = None
    pipeline: WindowPipeline | None = None


def load_windows(data: str | None, seq_len: int, stride: int | None = None, val_fraction: float = 0.2) -> Windows:
    """The windows (:func:`vramcal.models.regressor.windows.make_windows`) of an OHLCV parquet file, or of synthetic
    bars when ``data`` is None (:func:`vramcal.models.regressor.bars.synthetic_bars`).

    Raises:
        DataError: unusable bars, or too few for a window of each split.
    """
    from vramcal.models.regressor.bars import load_bars, synthetic_bars  # loads numpy: only when called
    from vramcal.models.regressor.windows import make_windows  # loads numpy: only when called

    bars = load_bars(data) if data is not None else synthetic_bars()
    return make_windows(bars, seq_len, stride, val_fraction, source=data or "synthetic bars")


def training_step(device: torch.device, *, implementation: str = "transformers", data: str | None = None,
                  stride: int | None = None, val_fraction: float = 0.2, data_on_device: bool = False,
                  lr: float = 1e-4, weight_decay: float = 0.01, max_grad_norm: float = 1.0, seed: int = 0,
                  **spec_fields: Any) -> RegressorStep:
    """The regressor's training step: MSE in fp32 of the model under the spec's dtype policy, AdamW.

    Args:
        implementation: ``transformers`` or ``mamba_ssm`` (concrete).
        data, stride, val_fraction: the windows (:func:`load_windows`); data_on_device: hold them on the device.
        spec_fields: the :class:`RegressorSpec` fields (``d_model``, ``seq_len``, ...).

    Raises:
        ValueError: an invalid spec; DataError: unusable data.
    """
    import torch

    spec = RegressorSpec.from_dict(spec_fields)
    windows = load_windows(data, spec.seq_len, stride, val_fraction)
    torch.manual_seed(seed)
    model = build_model(spec, implementation).to(device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                  weight_decay=weight_decay)
    pipeline = WindowPipeline(windows, device, on_device=data_on_device, seed=seed)

    def loss(module: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch  # (B, L, n_features), (B, L)
        return torch.nn.functional.mse_loss(forward(module, x, spec.dtype).float(), y)

    return RegressorStep(
        model=model, optimizer=optimizer, batch=lambda b: pipeline.next_batch("train", b), loss=loss,
        max_grad_norm=max_grad_norm, val_batch=lambda b: pipeline.next_batch("val", b),
        data_bytes=pipeline.data_bytes, data_on_device=data_on_device, kernel_path=kernel_path(implementation),
        info={"n_params": sum(p.numel() for p in model.parameters()), "data": data or "synthetic",
              "train_windows": len(windows.train_starts), "val_windows": len(windows.val_starts),
              "stride": windows.stride},
        spec=spec, pipeline=pipeline)
