"""Lightning: a profile's batch size for a LightningModule (or its DataModule), and its peak checked at the end.

    from vramcal.integrations.lightning import VramcalBatchSize

    trainer = lightning.Trainer(callbacks=[VramcalBatchSize("profiles/<device>/<model>.json")])
    trainer.fit(model, datamodule)   # model.batch_size (or datamodule.batch_size) = the conservative size

Lightning's ``BatchSizeFinder`` runs steps at growing sizes in the training process until one runs out
of memory; this callback applies a size that vramcal measured in isolated trials and verified, with its
margin, and at the end of ``fit`` prints the run's own peak beside the profile's prediction and upper
95 % bound (:func:`vramcal.train.runner.compare`), warning when the peak is above either.

It sets the attribute as ``BatchSizeFinder`` does, with Lightning's ``lightning_setattr``: on the
LightningModule, its ``hparams``, the DataModule and its ``hparams``, wherever the name is found. Do it
in ``setup("fit")``, before Lightning asks for the dataloaders, so they are built at that size.

The peak, of this (the training) process from ``on_fit_start`` to ``on_fit_end``, by the trials'
definitions (DESIGN.md, :mod:`vramcal.measure.meters`):

- CUDA: ``max(NVML per-process peak, NVML overhead at fit start + torch.cuda.max_memory_reserved())``,
  NVML sampled every 10 ms by a background thread. Where NVML is unusable,
  ``torch.cuda.max_memory_reserved()`` alone, which leaves out the CUDA context (a warning says so).
- CPU: ``max(VmHWM since fit start, peak of the data segment over the process's life)``.

Both cover the whole process, as the trials' figures do. A Lightning process that holds more than the
trial processes did (its dataset, Lightning's own imports and loggers, a second model) shows a larger
peak than the profile predicts, and the line says by how much; tell :func:`vramcal.sizing.size` about
data held in the measured memory with ``pool_data_bytes``. Under DDP each rank measures its own process
and rank 0 reports.

Needs ``lightning`` (``pip install "lightning>=2.6,<2.7"``); ``import vramcal`` never imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from vramcal.measure.meters import AttachedMeter, attach_meter
from vramcal.profile import DEFAULT_PROFILES_DIR, Profile, ProfileError, load_profile
from vramcal.sizing import Limit, Sizing, SizingError, size
from vramcal.units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

    from vramcal.records import Device


class VramcalBatchSize(Callback):
    """Set the batch size from a vramcal profile at ``setup("fit")``; report the measured peak at ``on_fit_end``.

    Args:
        profile: a :class:`~vramcal.profile.Profile`, a profile file, or None to find the newest matching
            one for ``model`` on this run's device under ``profiles_dir`` (:func:`vramcal.api.locate_profile`).
        model, params: what was calibrated (``regressor``, ``lm`` or ``module:function`` and its
            arguments), to find the profile or check the given file against; ``params["seq_len"]`` is the
            run's length, which a profile calibrated over several lengths needs.
        profiles_dir: where to look when ``profile`` is None.
        limit: ``conservative`` (default) or ``safe``: which limit to use when nothing is requested.
        batch_size_min: the smallest batch size acceptable (samples).
        request: a batch size to use instead, clamped to ``[batch_size_min, safe]`` (with a warning).
        attr: the attribute the dataloaders read (``batch_size``).
        pool_data_bytes: bytes of data this run holds in the measured memory (None: as in the calibration).

    Attributes (after ``fit``): ``sizing`` (:class:`~vramcal.sizing.Sizing`), ``profile_source`` (where the
    profile came from), ``peak_bytes`` (the measured peak) and ``report`` (the line printed).

    Raises:
        ValueError: neither ``profile`` nor ``model`` given (at construction); the module has no ``attr``;
            the run's device is neither a CUDA GPU nor the CPU. SizingError: no matching profile, a profile
            from another device or model, or no batch size within the bounds (each one line).
    """

    def __init__(self, profile: Profile | str | Path | None = None, *, model: str | None = None,
                 params: dict[str, Any] | None = None, profiles_dir: str | Path = DEFAULT_PROFILES_DIR,
                 limit: Limit = "conservative", batch_size_min: int = 1, request: int | None = None,
                 attr: str = "batch_size", pool_data_bytes: int | None = None) -> None:
        if profile is None and model is None:
            raise ValueError("VramcalBatchSize needs profile=<a profile file or Profile>, or model=<what was "
                             "calibrated> to find one under profiles_dir")
        if limit not in ("conservative", "safe"):
            raise ValueError(f"limit must be conservative or safe, got {limit!r}")
        self.profile, self.model, self.params = profile, model, params
        self.profiles_dir, self.limit, self.batch_size_min = profiles_dir, limit, batch_size_min
        self.request, self.attr, self.pool_data_bytes = request, attr, pool_data_bytes
        self.sizing: Sizing | None = None
        self.profile_source: str | None = None
        self.peak_bytes: int | None = None
        self.report: str | None = None
        self._meter: AttachedMeter | None = None
        self._definition = ""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not lightning_hasattr(pl_module, self.attr):
            raise ValueError(f"neither the LightningModule nor its DataModule has {self.attr!r} (an attribute or "
                             f"in hparams): add it, or pass attr=<the name your dataloaders read>")
        device = _device(trainer)
        profile, self.profile_source = self._find(device)
        self.sizing = size(profile, self.request, limit=self.limit, batch_size_min=self.batch_size_min,
                           pool_data_bytes=self.pool_data_bytes, seq_len=(self.params or {}).get("seq_len"))
        for notice in self.sizing.notices:
            rank_zero_warn(f"vramcal: {notice}")
        lightning_setattr(pl_module, self.attr, self.sizing.batch_size)
        s = self.sizing
        rank_zero_info(f"vramcal: {self.attr} = {s.batch_size} ({s.source}; safe {s.safe_batch_size}, conservative "
                       f"{s.conservative_batch_size}) from {self.profile_source}: predicted peak "
                       f"{format_bytes(s.predicted_peak_bytes)}, upper bound {format_bytes(s.upper_bytes)}, usable "
                       f"{format_bytes(s.usable_bytes)}")
        self._meter = attach_meter(device, warn=lambda line: rank_zero_warn(f"vramcal: {line}"))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._meter is not None:
            self._meter.reset()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from vramcal.train.runner import compare

        if self._meter is None or self.sizing is None:
            return
        self.peak_bytes = self._meter.read()
        self._close()
        line, warnings = compare(self.sizing, self.peak_bytes)
        self.report = f"vramcal: {line} (this process's {self._definition})"
        rank_zero_info(self.report)
        for warning in warnings:
            rank_zero_warn(f"vramcal: {warning}")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self._meter is not None:
            self._definition = self._meter.definition
            self._meter.close()
            self._meter = None

    def _find(self, device: Device) -> tuple[Profile, str]:
        """The profile and where it came from, checked against this run's device (and ``model`` when given)."""
        from vramcal.api import locate_profile

        if self.model is not None and not isinstance(self.profile, Profile):
            located = locate_profile(self.model, self.params, device=device, profiles_dir=self.profiles_dir,
                                     path=self.profile)
            for notice in located.notices:
                rank_zero_warn(f"vramcal: skipped {notice}")
            return located.profile, str(located.path)
        if isinstance(self.profile, Profile):
            profile, source = self.profile, "the given profile"
        else:
            try:
                profile, source = load_profile(self.profile), str(self.profile)
            except ProfileError as error:
                raise SizingError(str(error)) from None
        difference = device.hardware_difference(profile.device)
        if difference:
            raise SizingError(f"{source} was made on another device ({difference}): its batch sizes do not hold "
                              f"on this run's {device.name}; run `vramcal probe` on it")
        if self.model is not None:  # a Profile given with the model it should be for
            from vramcal.api import model_ref
            from vramcal.profile import check_profile_matches

            try:
                check_profile_matches(profile, device, model_ref(self.model, self.params, device=device))
            except ProfileError as error:
                raise SizingError(f"{source}: {error}") from None
        return profile, source


def _device(trainer: pl.Trainer) -> Device:
    """The vramcal device of the trainer's root device: a CUDA GPU by its index among the visible ones, or the host.

    Raises:
        ValueError: another kind of device (MPS, TPU, ...).
    """
    from vramcal.api import select_devices

    root = trainer.strategy.root_device
    if root.type == "cuda":
        return select_devices(str(root.index or 0))[0][0]
    if root.type == "cpu":
        return select_devices("none")[0][0]
    raise ValueError(f"vramcal's profiles are for NVIDIA GPUs and the host CPU; this run trains on {root.type}")
