"""Lightning: a profile's batch size for a LightningModule (or its DataModule), and its peak checked at the end.

    from vramcal.integrations.lightning import VramcalBatchSize

    trainer = lightning.Trainer(callbacks=[VramcalBatchSize("profiles/<device>/<model>.json")])
    trainer.fit(model, datamodule)   # model.batch_size (or datamodule.batch_size) = the conservative size

Lightning's ``BatchSizeFinder`` runs steps at growing sizes in the training process until one runs out
of memory; this callback applies a size that vramcal measured in isolated trials and verified, with its
margin, and holds it to this process (:class:`vramcal.integrations.run.FrameworkRun`):

- at ``setup("fit")`` it sets the size from the profile, as ``BatchSizeFinder`` does, with Lightning's
  ``lightning_setattr`` (on the LightningModule, its ``hparams``, the DataModule and its ``hparams``,
  wherever the name is found);
- at ``on_fit_start`` — the model and the optimizers are on the device, the dataloaders not yet built — it
  measures what this process holds against what the trials' processes held (the process term), carries it
  into the prediction and the limits, and sets the size again when it no longer fits; with an effective
  batch it sets ``trainer.accumulate_grad_batches`` to reach it;
- at ``on_fit_start`` too, the module's Mamba-2 blocks are recomputed in the backward pass as the profile's
  trials did (its variant's activation checkpointing, :meth:`~vramcal.integrations.run.FrameworkRun.checkpoint`),
  or the fit is refused with one line when the module has none vramcal can checkpoint;
- under automatic optimization Lightning zeroes the gradients between the forward and the backward pass,
  so each forward pass runs beside the previous step's gradients: their bytes (the profile's
  ``gradient_bytes``) join the prediction and the limits too (:mod:`vramcal.sizing`, the gradient term);
- at ``on_fit_end`` it prints this process's peak since fit start beside the prediction and its upper 95 %
  bound, warns when the peak is above either, and appends the observation to the profile.

The peak is this process's, by the trials' definitions (DESIGN.md, :func:`vramcal.measure.meters.attach_meter`).

Under DDP each rank sizes itself from its own device's profile for the world (``trainer.world_size``
ranks), and the ranks agree on the smallest of their sizes (Lightning's samplers give every rank the same
number of batches, so the sizes must be equal); at the end every rank's peak is gathered and rank 0
prints them; each rank records its own observation.

Needs ``lightning`` (``pip install "lightning>=2.6,<2.7"``); ``import vramcal`` never imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from vramcal.arguments import name_text
from vramcal.integrations.run import FrameworkRun, asked_request, check_find, use_system_arrow_pool
from vramcal.integrations.worlds import backend_of, ddp_world, fsdp1_refused, sharded_world, unmeasured
from vramcal.profile import DEFAULT_PROFILES_DIR, Profile
from vramcal.records import World
from vramcal.sizing import GradientsHeld, Sizing
from vramcal.units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl


class VramcalBatchSize(Callback):
    """Set the batch size from a vramcal profile; hold it to this process; report the measured peak at the end.

    Args:
        profile: a :class:`~vramcal.profile.Profile`, a profile file, or None to find the newest matching
            one for ``model`` on this run's device under ``profiles_dir`` (:func:`vramcal.lookup.locate_profile`).
        model, params: what was calibrated (``regressor``, ``lm`` or ``module:function`` and its
            arguments), to find the profile or check the given file against; ``params["seq_len"]`` is the
            run's length, which a profile calibrated over several lengths needs.
        profiles_dir: where to look when ``profile`` is None.
        capacity_bytes: the budget the profile to find was calibrated at (as
            :class:`~vramcal.integrations.run.FrameworkRun`).
        attr: the attribute the dataloaders read (``batch_size``).
        asked: what the run asks of the profile, the fields of :class:`~vramcal.sizing.SizeRequest`:
            ``limit`` (``conservative``, the default, or ``safe``), ``batch_size_min``, ``request`` (a batch
            size to use instead, clamped to ``[batch_size_min, safe]`` with a warning), ``effective_batch_size``
            (samples per optimizer step per rank to keep: ``trainer.accumulate_grad_batches`` micro-batches reach
            it), ``size_for``, ``seq_len``. Under automatic optimization the callback adds the gradient term.

    Attributes (after ``fit``): ``sizing`` (:class:`~vramcal.sizing.Sizing`), ``profile_source`` (where the
    profile came from), ``peak_bytes`` (the measured peak), ``rank_peak_bytes`` (every rank's, under DDP)
    and ``report`` (the line printed).

    Raises:
        At construction: TypeError, ValueError, SizingError: an argument of the wrong type or value
            (:func:`~vramcal.integrations.run.check_find`, :class:`~vramcal.sizing.SizeRequest`, ``attr`` no
            attribute name), an unknown asked value, neither ``profile`` nor ``model``. At ``setup``: SizingError:
            no matching profile, a profile from another device, model or world, or no batch size within the
            bounds; ValueError: the module has no ``attr``; the run's device is neither a CUDA GPU nor the CPU.
            At ``on_fit_start``: SizingError: the profile's variant checkpoints and the module has no blocks
            vramcal can checkpoint. Each one line.
    """

    def __init__(self, profile: Profile | str | Path | None = None, *, model: str | None = None,
                 params: dict[str, Any] | None = None, profiles_dir: str | Path = DEFAULT_PROFILES_DIR,
                 capacity_bytes: int | str | None = None, attr: str = "batch_size", **asked: Any) -> None:
        self._find = check_find("VramcalBatchSize", profile, model, params, profiles_dir, capacity_bytes)
        self.ask = asked_request("VramcalBatchSize", asked)
        self.attr = name_text("attr", attr, "the name of the attribute the dataloaders read, such as 'batch_size'")
        self.run: FrameworkRun | None = None
        self.sizing: Sizing | None = None
        self.profile_source: str | None = None
        self.peak_bytes: int | None = None
        self.rank_peak_bytes: list[int] | None = None
        self.report: str | None = None
        use_system_arrow_pool(rank_zero_info)  # before configure_model builds the model and reads its data

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not lightning_hasattr(pl_module, self.attr):
            raise ValueError(f"neither the LightningModule nor its DataModule has {self.attr!r} (an attribute or "
                             f"in hparams): add it, or pass attr=<the name your dataloaders read>")
        self.run, self.sizing = None, None  # a new fit says its size again
        if _sharded_later(trainer):
            return  # configure_model shards the module after setup: its world is read at fit start
        self._size(trainer, pl_module, _world(trainer))
        self._apply(trainer, pl_module, self.run.sizing)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.run is None and _sharded_later(trainer):
            self._size(trainer, pl_module, sharded_world(pl_module, trainer.world_size,
                                                         backend_of(trainer.strategy.root_device.type),
                                                         "Lightning's ModelParallelStrategy"))
        if self.run is not None:
            self.run.checkpoint(pl_module)  # the profile's variant: its blocks recomputed as the trials' were
            self._apply(trainer, pl_module, self.run.start())

    def _size(self, trainer: pl.Trainer, pl_module: pl.LightningModule, world: World | None) -> None:
        """The run of this fit in ``world``, sized from the profile (its information and warnings on rank 0)."""
        ask = self.ask.replace(gradients=_gradients_held(pl_module)) if self.ask.gradients is None else self.ask
        self.run = FrameworkRun(**self._find, device=trainer.strategy.root_device, ask=ask, world=world,
                                framework="lightning", warn=lambda line: rank_zero_warn(line),
                                inform=lambda line: rank_zero_info(line))
        self.profile_source = self.run.source

    def _apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule, sizing: Sizing) -> None:
        """Set the (agreed, under DDP) batch size and the accumulation, and say so on rank 0: once when it is first
        decided (``setup``) and again only when fit start changed it."""
        own, batch = sizing.batch_size, _agreed(trainer, sizing.batch_size)
        if batch != own:
            sizing = self.run.resize(batch)
        lightning_setattr(pl_module, self.attr, batch)
        if sizing.accumulation_steps > 1:
            trainer.accumulate_grad_batches = sizing.accumulation_steps
        said, self.sizing = self.sizing, sizing
        if said is not None and (said.batch_size, said.accumulation_steps) == (batch, sizing.accumulation_steps):
            return  # said at setup: fit start kept the size (the prediction's process term is in the report)
        s, agreed = sizing, "" if batch == own else f", the smallest of the ranks' sizes; this rank's was {own}"
        rank_zero_info(f"vramcal: {self.attr} = {batch} ({s.label}{agreed}; safe {s.safe_batch_size}, conservative "
                       f"{s.conservative_batch_size}) from {self.profile_source}: predicted peak "
                       f"{format_bytes(s.predicted_peak_bytes)}, warned above {format_bytes(s.line_bytes)}, usable "
                       f"{format_bytes(s.usable_bytes)}")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.run is None or self.run.peak_bytes is not None:
            return
        self.report, warnings = self.run.finish(steps=trainer.global_step, run_dir=str(trainer.default_root_dir))
        self.peak_bytes = self.run.peak_bytes
        self.rank_peak_bytes = _gathered(trainer, self.peak_bytes)
        rank_zero_info(self.report)
        if len(self.rank_peak_bytes) > 1:
            rank_zero_info("vramcal: every rank's peak: " + ", ".join(
                f"{rank}: {format_bytes(peak)}" for rank, peak in enumerate(self.rank_peak_bytes)))
        for warning in warnings:
            rank_zero_warn(f"vramcal: {warning}")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.run is not None:
            self.run.close()


def _gradients_held(pl_module: pl.LightningModule) -> GradientsHeld | None:
    """Why the module's forward passes run beside the previous step's gradients: Lightning's automatic
    optimization zeroes them inside its closure, after the forward pass (``Closure.closure``: step, zero_grad,
    backward), where a trial frees them after the optimizer step. None under manual optimization (the
    module's own order)."""
    return GradientsHeld.AUTOMATIC_OPTIMIZATION if pl_module.automatic_optimization else None


def _world(trainer: pl.Trainer) -> World | None:
    """The DDP world of a trainer with more than one process (its profile must be calibrated for it): the settings
    of DistributedDataParallel it was given (``DDPStrategy(**kwargs)``) that move a rank's memory.

    Raises:
        SizingError: FSDPStrategy (FSDP1) or DeepSpeed, whose memory no profile measures (one line each).
    """
    from lightning.pytorch.strategies import FSDPStrategy  # loads lightning's strategies: only when called

    strategy, nproc = trainer.strategy, trainer.world_size
    if nproc < 2:
        return None
    if isinstance(strategy, FSDPStrategy):
        raise fsdp1_refused("Lightning's FSDPStrategy", nproc, "train with ModelParallelStrategy and fully_shard "
                            "on each block and the root in configure_model (FSDP2)")
    if "DeepSpeed" in type(strategy).__name__:
        raise unmeasured(f"Lightning's {type(strategy).__name__} (ZeRO)")
    import torch.distributed as dist

    backend = backend_of(strategy.root_device.type)
    return ddp_world(nproc, backend, getattr(strategy, "_ddp_kwargs", None)) if dist.is_initialized() else None


def _sharded_later(trainer: pl.Trainer) -> bool:
    """Whether the trainer's ranks shard the module themselves in ``configure_model`` (Lightning's
    ModelParallelStrategy: FSDP2's ``fully_shard``, read at fit start by :func:`~vramcal.integrations.worlds.
    sharded_world`).

    Raises:
        SizingError: a tensor-parallel mesh (``tensor_parallel_size`` above 1), which no profile measures.
    """
    from lightning.pytorch.strategies import ModelParallelStrategy  # loads lightning's strategies: only when called

    strategy = trainer.strategy
    if trainer.world_size < 2 or not isinstance(strategy, ModelParallelStrategy):
        return False
    tensor_parallel = strategy._tensor_parallel_size
    if tensor_parallel not in ("auto", 1):
        raise unmeasured(f"ModelParallelStrategy with tensor_parallel_size {tensor_parallel} (tensor parallelism)",
                         "shard with data_parallel_size equal to the world size and tensor_parallel_size 1")
    return True


def _agreed(trainer: pl.Trainer, batch_size: int) -> int:
    """The smallest of the ranks' batch sizes (one process: its own)."""
    if trainer.world_size < 2:
        return batch_size
    import torch

    return int(trainer.strategy.reduce(torch.tensor(batch_size, device=trainer.strategy.root_device),
                                       reduce_op="min"))


def _gathered(trainer: pl.Trainer, value: int) -> list[int]:
    """Every rank's ``value``, rank 0 first (one process: its own)."""
    if trainer.world_size < 2:
        return [value]
    import torch

    gathered = trainer.strategy.all_gather(torch.tensor(value, device=trainer.strategy.root_device))
    return [int(v) for v in gathered.reshape(-1).tolist()]
