"""Lightning: :class:`VramcalBatchSize`, a callback that sets a LightningModule's (or DataModule's) batch size from a
vramcal profile, holds it to this process and checks its peak (DESIGN.md "Framework processes"; its worlds:
"Several processes: DDP and FSDP").

    trainer = lightning.Trainer(callbacks=[VramcalBatchSize()])
    trainer.fit(model, datamodule)   # model.batch_size (or datamodule.batch_size) = the conservative size

Needs ``lightning`` (``pip install "lightning>=2.6,<2.7"``); ``import vramcal`` never imports it.
"""

from __future__ import annotations

import gc
import inspect
import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.core.optimizer import _configure_optimizers
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from vramcal.arguments import name_text, of_type
from vramcal.integrations.run import FrameworkRun, asked_request, check_find, own_profile, use_system_arrow_pool
from vramcal.integrations.worlds import backend_of, ddp_world, fsdp1_refused, sharded_world, unmeasured
from vramcal.models.own import SAMPLE_ROWS, class_path, import_class, sample_batches
from vramcal.oom import is_out_of_memory
from vramcal.profile import DEFAULT_PROFILES_DIR, Profile
from vramcal.records import TrialSettings, World
from vramcal.sizing import GradientsHeld, Sizing, SizingError
from vramcal.units import format_bytes
from vramcal.workload import TrainingStep, WorkloadError

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

# Lightning's precisions a trial runs with Lightning's own plugin (the trainer's precision_plugin.precision)
PRECISIONS = ("32-true", "64-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed")


class VramcalBatchSize(Callback):
    """Set the batch size from a vramcal profile; hold it to this process; report the measured peak at the end.

    At ``setup("fit")``, given neither ``profile`` nor ``model``, it calibrates the module itself once
    (:func:`trial_step`, the profile saved under ``profiles_dir``), then sets ``attr`` wherever
    ``lightning_setattr`` finds it (as ``BatchSizeFinder``). At ``on_fit_start`` it checkpoints the module's blocks
    as the profile's trials did, measures the process term (and the gradient term under automatic optimization)
    and sets the size again, with ``accumulate_grad_batches`` for an effective batch. An out-of-memory error in the
    fit is recorded and the fit loop runs again smaller (:func:`_go_on_after_out_of_memory`). ``on_fit_end`` says
    the peak against the prediction and records it. Under DDP the ranks take the smallest of their sizes.

    Args:
        profile, model, params, profiles_dir, capacity_bytes: as :class:`~vramcal.integrations.run.FrameworkRun`
            (``capacity_bytes`` is also the host budget the module's own calibration runs at).
        trials: how the module's own calibration runs its trials (:class:`~vramcal.records.TrialSettings`).
        attr: the attribute the dataloaders read (``batch_size``).
        asked: the fields of :class:`~vramcal.sizing.SizeRequest` (``limit``, ``batch_size_min``, ``request``,
            ``effective_batch_size`` per rank, ``size_for``, ``seq_len``).

    Attributes (after ``fit``): ``sizing``, ``profile_source``, ``peak_bytes``, ``rank_peak_bytes`` (every rank's,
    under DDP) and ``report`` (the line printed).

    Raises (each one line):
        At construction: TypeError, ValueError, SizingError: as :func:`~vramcal.integrations.run.check_find` and
            :class:`~vramcal.sizing.SizeRequest`; ``attr`` no attribute name. At ``setup``: SizingError: no
            matching profile or batch size; ValueError: no ``attr``, a device neither CUDA nor the CPU;
            WorkloadError, SizingError, CalibrationError: the module's own calibration (:func:`_own_model`).
            At ``on_fit_start``: SizingError: a checkpointing variant and no blocks. In the fit: SizingError: out
            of memory with no smaller size a trial ran, or under DDP.
    """

    def __init__(self, profile: Profile | str | Path | None = None, *, model: str | None = None,
                 params: dict[str, Any] | None = None, profiles_dir: str | Path = DEFAULT_PROFILES_DIR,
                 capacity_bytes: int | str | None = None, attr: str = "batch_size",
                 trials: TrialSettings = TrialSettings(), **asked: Any) -> None:
        self._find = check_find("VramcalBatchSize", profile, model, params, profiles_dir, capacity_bytes, own=True)
        self._own = profile is None and model is None
        self.trials = of_type("trials", trials, TrialSettings, "a vramcal.TrialSettings (TrialSettings(max_trials=8))")
        self.ask = asked_request("VramcalBatchSize", asked)
        self.attr = name_text("attr", attr, "the name of the attribute the dataloaders read, such as 'batch_size'")
        self.run: FrameworkRun | None = None
        self.sizing: Sizing | None = None
        self.profile_source: str | None = None
        self.report: str | None = None
        self.peak_bytes: int | None = None
        self.rank_peak_bytes: list[int] | None = None
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
        world, find = _world(trainer), self._find
        if self._own:
            if world is not None:
                raise SizingError(f"VramcalBatchSize() calibrates a module in one process, and this fit runs "
                                  f"{world.nproc} ranks: calibrate them with a factory (vramcal probe --nproc) and "
                                  f"give model=")
            params, batch = _own_model(trainer, pl_module, self.attr)
            find = {**find, "profile": own_profile(f"{__name__}:trial_step", params, batch,
                                                   trainer.strategy.root_device, find, self.trials, rank_zero_info)}
        self._size(trainer, pl_module, world, find)
        self._apply(trainer, pl_module, self.run.sizing, said=False)  # said at fit start, once it holds

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.run is None and _sharded_later(trainer):
            self._size(trainer, pl_module, sharded_world(pl_module, trainer.world_size,
                                                         backend_of(trainer.strategy.root_device.type),
                                                         "Lightning's ModelParallelStrategy"), self._find)
        if self.run is not None:
            if not self._own:  # a factory's profile ran its variant; the module's own ran it as it is
                self.run.checkpoint(pl_module)
            self._apply(trainer, pl_module, self.run.start(say_resize=False))
            _go_on_after_out_of_memory(trainer, self._out_of_memory)

    def _size(self, trainer: pl.Trainer, pl_module: pl.LightningModule, world: World | None,
              find: dict[str, Any]) -> None:
        """The run of this fit in ``world``, sized from the profile ``find`` locates (said on rank 0)."""
        ask = self.ask.replace(gradients=_gradients_held(pl_module)) if self.ask.gradients is None else self.ask
        self.run = FrameworkRun(**find, device=trainer.strategy.root_device, ask=ask, world=world,
                                framework="lightning", warn=lambda line: rank_zero_warn(line),
                                inform=lambda line: rank_zero_info(line))
        self.profile_source = self.run.source

    def _apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule, sizing: Sizing, said: bool = True) -> None:
        """Set the (agreed, under DDP) batch size and the accumulation; with ``said``, say so on rank 0, and why it
        moved since ``setup``."""
        own, batch = sizing.batch_size, _agreed(trainer, sizing.batch_size)
        if batch != own:
            sizing = self.run.resize(batch)
        lightning_setattr(pl_module, self.attr, batch)
        if sizing.accumulation_steps > 1:
            trainer.accumulate_grad_batches = sizing.accumulation_steps
        before, self.sizing = self.sizing, sizing
        if not said:
            return
        s, agreed = sizing, "" if batch == own else f", the smallest of the ranks' sizes; this rank's was {own}"
        why = "" if before is None or before.batch_size == batch else (
            f"; down from {before.batch_size}: this process holds {s.process_delta_bytes / 2**20:+.1f} MiB against "
            f"the trials' (the process term) and the gradients {s.gradient_delta_bytes / 2**20:+.1f} MiB")
        rank_zero_info(f"vramcal: {self.attr} = {batch} ({s.label}{agreed}; safe {s.safe_batch_size}, conservative "
                       f"{s.conservative_batch_size}{why}) from {self.profile_source}: predicted peak "
                       f"{format_bytes(s.predicted_peak_bytes)}, warned above {format_bytes(s.line_bytes)}, usable "
                       f"{format_bytes(s.usable_bytes)}")

    def _out_of_memory(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """An out-of-memory error in the fit: recorded, and the smaller size set, the samples per step kept.

        Raises:
            SizingError: under DDP (the ranks cannot agree mid-fit), or no smaller size a trial ran.
        """
        before = self.sizing
        if trainer.world_size > 1:
            raise SizingError(f"out of memory at {self.attr} {before.batch_size} in a fit of {trainer.world_size} "
                              f"ranks: fit again from your last checkpoint (the profile's limits are per rank)")
        sizing, line = self.run.out_of_memory(trainer.global_step, before.batch_size * trainer.accumulate_grad_batches)
        lightning_setattr(pl_module, self.attr, sizing.batch_size)
        trainer.accumulate_grad_batches = sizing.accumulation_steps
        self.sizing = sizing
        rank_zero_info(line)

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

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        trainer.fit_loop.__dict__.pop("run", None)  # this fit's guard (_go_on_after_out_of_memory) ends with it


def _go_on_after_out_of_memory(trainer: pl.Trainer, resized: Any) -> None:
    """Guard the trainer's fit loop: on an out-of-memory error (:func:`vramcal.oom.is_out_of_memory`) call
    ``resized(trainer, module)``, then run the loop again with its dataloader rebuilt, as ``BatchSizeFinder`` does."""
    loop = trainer.fit_loop
    run = type(loop).run.__get__(loop)

    def guarded() -> None:
        while True:
            try:
                return run()
            except Exception as error:  # noqa: BLE001 - one kind is handled; the rest is raised again
                if not is_out_of_memory(error):
                    raise
            resized(trainer, trainer.lightning_module)
            if loop._data_fetcher is not None:  # its batches, prefetched at the old size, go with it
                loop._data_fetcher.teardown()
                loop._data_fetcher = None
            loop._combined_loader = None  # rebuilt at the new size by the next run's setup_data
            trainer.lightning_module.zero_grad(set_to_none=True)
            gc.collect()

    loop.run = guarded


def _own_model(trainer: pl.Trainer, pl_module: pl.LightningModule, attr: str) -> tuple[dict[str, Any], Any]:
    """(the arguments of :func:`trial_step` that rebuild ``pl_module`` as this fit runs it, a batch of its data).

    Raises:
        SizingError: manual optimization, a precision no trial runs, a train dataloader that is no DataLoader.
            WorkloadError: a module its trials cannot rebuild.
    """
    name = type(pl_module).__name__
    if not pl_module.automatic_optimization:
        raise SizingError(f"VramcalBatchSize() calibrates a module under Lightning's automatic optimization, and "
                          f"{name} steps its own optimizers: calibrate its step with a factory and give model=")
    if trainer.precision not in PRECISIONS:
        raise SizingError(f"VramcalBatchSize() calibrates precision {', '.join(PRECISIONS)}, not "
                          f"{trainer.precision!r}: calibrate the step with a factory and give model=")
    clip = trainer.gradient_clip_val if trainer.gradient_clip_algorithm == "norm" else None
    params = {"model": class_path(type(pl_module)), "hparams": _hparams(pl_module, attr),
              "precision": trainer.precision, "max_grad_norm": clip}
    return params, _sample(trainer, pl_module, attr)


def _hparams(pl_module: pl.LightningModule, attr: str) -> dict[str, Any]:
    """What rebuilds ``pl_module`` in a trial, ``type(pl_module)(**hparams)`` (``attr`` at 1: trials set their own).

    Raises:
        WorkloadError: its constructor takes an argument ``hparams`` lack, or one that is no plain JSON value.
    """
    name, hparams = type(pl_module).__name__, dict(pl_module.hparams)
    if attr in hparams:
        hparams[attr] = 1
    needed = [p.name for p in list(inspect.signature(type(pl_module).__init__).parameters.values())[1:]
              if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in hparams]
    if needed:
        raise WorkloadError(f"VramcalBatchSize() rebuilds {name} in its trial processes as Lightning's "
                            f"load_from_checkpoint does, {name}(**hparams), and its hparams lack {', '.join(needed)}: "
                            f"call self.save_hyperparameters() in {name}.__init__")
    try:
        json.dumps(hparams, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise WorkloadError(f"{name}'s hparams are not plain JSON values ({error}), which its trials are rebuilt "
                            f"from: leave objects out with save_hyperparameters(ignore=[...]) and build them in "
                            f"__init__ from plain arguments") from None
    return hparams


def _sample(trainer: pl.Trainer, pl_module: pl.LightningModule, attr: str) -> Any:
    """One batch of the fit's own train dataloader at :data:`~vramcal.models.own.SAMPLE_ROWS` rows.

    Raises:
        SizingError: the train dataloader is not one ``DataLoader``.
    """
    before = lightning_getattr(pl_module, attr)
    lightning_setattr(pl_module, attr, SAMPLE_ROWS)
    try:
        loader = trainer.fit_loop._data_source.dataloader()
        if not isinstance(loader, torch.utils.data.DataLoader):
            raise SizingError(f"VramcalBatchSize() samples the fit's data from one DataLoader, and the train "
                              f"dataloader is {type(loader).__name__}: return one DataLoader from train_dataloader()")
        return next(iter(loader))
    finally:
        lightning_setattr(pl_module, attr, before)


def trial_step(device: torch.device, model: str, hparams: dict[str, Any], precision: str, sample: str,
               max_grad_norm: float | None = None, **key: Any) -> TrainingStep:
    """The factory of a LightningModule's own calibration (:mod:`vramcal.models.own`): the module rebuilt as
    ``import_class(model)(**hparams)`` under Lightning's plugin for ``precision``, its ``configure_optimizers``'
    optimizer, its ``training_step`` as the loss on batches from ``sample`` (through its batch-transfer hooks),
    gradients clipped by norm at ``max_grad_norm``. ``key``: the rest of the profile's key, unused.

    Raises:
        WorkloadError: the class cannot be imported; it configures no optimizer or several.
    """
    plugin = _precision_plugin(precision, device)
    with plugin.module_init_context():
        module = plugin.convert_module(import_class(model)(**hparams)).to(device)
    module.train()
    optimizers = _configure_optimizers(module.configure_optimizers())[0]
    if len(optimizers) != 1:
        raise WorkloadError(f"{type(module).__name__}.configure_optimizers gives {len(optimizers)} optimizers: "
                            f"automatic optimization steps one")
    rows = sample_batches(sample, device)

    def loss(batch: Any) -> torch.Tensor:
        with plugin.train_step_context(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*self.log.*")  # no trainer here to log to
            out = module.training_step(batch, 0)
        return out["loss"] if isinstance(out, Mapping) else out

    def batch(batch_size: int) -> Any:
        return module._apply_batch_transfer_handler(module._on_before_batch_transfer(rows(batch_size)), device)

    return TrainingStep(model=module, optimizer=optimizers[0], batch=batch, loss=loss, max_grad_norm=max_grad_norm,
                        info={"framework": "lightning", "precision": precision})


def _precision_plugin(precision: str, device: torch.device) -> Precision:
    """Lightning's plugin for ``precision``, as its accelerator connector picks one for one device."""
    if precision in ("16-mixed", "bf16-mixed"):
        return MixedPrecision(precision, device.type)
    if precision in ("16-true", "bf16-true"):
        return HalfPrecision(precision)
    return DoublePrecision() if precision == "64-true" else Precision()


def _gradients_held(pl_module: pl.LightningModule) -> GradientsHeld | None:
    """Automatic optimization zeroes the gradients after the forward pass (``Closure.closure``), so it runs beside
    them (DESIGN.md "Framework processes": the gradient term); None under manual optimization."""
    return GradientsHeld.AUTOMATIC_OPTIMIZATION if pl_module.automatic_optimization else None


def _world(trainer: pl.Trainer) -> World | None:
    """The DDP world of a trainer of several processes, with the ``DDPStrategy`` settings that move memory.

    Raises:
        SizingError: FSDPStrategy (FSDP1) or DeepSpeed, which no profile measures.
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
    """Whether ModelParallelStrategy shards the module in ``configure_model`` (FSDP2: the world read at fit start).

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
    return int(trainer.strategy.reduce(torch.tensor(batch_size, device=trainer.strategy.root_device),
                                       reduce_op="min"))


def _gathered(trainer: pl.Trainer, value: int) -> list[int]:
    """Every rank's ``value``, rank 0 first (one process: its own)."""
    if trainer.world_size < 2:
        return [value]
    gathered = trainer.strategy.all_gather(torch.tensor(value, device=trainer.strategy.root_device))
    return [int(v) for v in gathered.reshape(-1).tolist()]
