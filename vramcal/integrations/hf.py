"""Hugging Face ``transformers.Trainer``: :class:`VramcalCallback` sets the ``TrainingArguments``' batch size from a
vramcal profile, holds it to the Trainer's process and checks its peak (DESIGN.md "Framework processes"; its
worlds: "Several processes: DDP and FSDP").

    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[VramcalCallback()])
    trainer.train()

Needs ``transformers`` and ``accelerate``; ``import vramcal`` imports neither.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from vramcal.arguments import of_type, shown
from vramcal.integrations.run import FrameworkRun, asked_request, check_find, own_profile, use_system_arrow_pool
from vramcal.integrations.worlds import backend_of, plugin_world
from vramcal.models.own import SAMPLE_ROWS, class_path, import_class, sample_batches
from vramcal.oom import is_out_of_memory
from vramcal.profile import DEFAULT_PROFILES_DIR, Profile
from vramcal.records import Kind, TrialSettings, World
from vramcal.sizing import Sizing, SizingError, check_counts
from vramcal.workload import TrainingStep


class _Resize(Exception):  # noqa: N818 - a signal to the guarded training loop, not an error
    """The batch no longer fits at ``on_train_begin``: the guarded loop starts again at the run's sizing."""


class VramcalCallback(TrainerCallback):
    """Size a ``transformers.Trainer`` run from a vramcal profile and check its peak.

    Given neither ``profile`` nor ``model``, the Trainer's own model is calibrated once when ``train()`` starts
    (:func:`trial_step`, the profile saved under ``profiles_dir``) and the Trainer's batch size and accumulation set
    from it. With a profile, :meth:`sized` gives the ``TrainingArguments``. When training begins the process term is
    measured and the model's blocks checkpointed as the profile's trials did; a batch that no longer fits, or an
    out-of-memory error, restarts the Trainer's inner loop smaller, as ``auto_find_batch_size`` does (:func:`_guard`),
    the effective batch kept. ``on_train_end`` says the peak against the prediction and records it.

    Args:
        profile, model, params, profiles_dir, capacity_bytes: as :class:`vramcal.integrations.run.FrameworkRun`.
        trials: how the model's own calibration runs its trials (:class:`~vramcal.records.TrialSettings`).
        asked: the fields of :class:`~vramcal.sizing.SizeRequest` (``limit``, ``batch_size_min``, ``request``,
            ``effective_batch_size`` for the model's own profile, ...); with a profile the effective batch is
            :meth:`sized`'s.

    Attributes: ``run`` (the :class:`~vramcal.integrations.run.FrameworkRun`, after :meth:`sized` or once training
    started), ``report`` (the line printed at the end).

    Raises (each one line):
        SizingError, TypeError, ValueError: arguments (:func:`~vramcal.integrations.run.check_find`). When
            ``train()`` starts, calibrating the model itself: SizingError (several processes, no config),
            WorkloadError (a class no trial can import), CalibrationError. In the loop: SizingError: out of memory
            with no smaller size a trial ran.
    """

    def __init__(self, profile: Profile | str | Path | None = None, *, model: str | None = None,
                 params: dict[str, Any] | None = None, profiles_dir: str | Path = DEFAULT_PROFILES_DIR,
                 capacity_bytes: int | str | None = None, trials: TrialSettings = TrialSettings(),
                 **asked: Any) -> None:
        self._find = check_find("VramcalCallback", profile, model, params, profiles_dir, capacity_bytes, own=True)
        self._own = profile is None and model is None
        self.trials = of_type("trials", trials, TrialSettings, "a vramcal.TrialSettings (TrialSettings(max_trials=8))")
        self.ask = asked_request("VramcalCallback", asked).replace(exact=True)
        self.run: FrameworkRun | None = None
        self.report: str | None = None
        self._guarded = False  # the Trainer's training loop starts again at a new size (on_init_end: _guard)
        use_system_arrow_pool()  # before the Trainer's dataloaders read data

    def sized(self, args: Any, effective_batch_size: int | None = None) -> Any:
        """``args`` (``TrainingArguments``) with ``per_device_train_batch_size`` and ``gradient_accumulation_steps``
        from the profile; ``effective_batch_size`` is the whole world's samples per optimizer step, kept exactly.

        Raises:
            TypeError: ``args`` no TrainingArguments, an ``effective_batch_size`` that is no whole number.
            SizingError: no profile, or no batch size within the bounds; an effective batch below 1, or one the
                ranks cannot share equally.
        """
        if not (dataclasses.is_dataclass(args) and hasattr(args, "per_device_train_batch_size")):
            raise TypeError(f"args= takes the Trainer's transformers.TrainingArguments, not {shown(args)}")
        check_counts(effective_batch_size=effective_batch_size)
        if self._own and self.run is None:
            raise SizingError("VramcalCallback() without a profile sizes the Trainer itself when train() starts: "
                              "pass it in Trainer(callbacks=[...]); sized(args) gives its sizes once it did")
        if not self._own:
            world, ask = _world(args), self.ask
            if effective_batch_size is not None:
                ranks = world.nproc if world else 1
                if effective_batch_size % ranks:
                    raise SizingError(f"effective_batch_size {effective_batch_size} is not a multiple of the "
                                      f"{ranks} ranks: give a multiple")
                ask = ask.replace(effective_batch_size=effective_batch_size // ranks)
            self.run = FrameworkRun(**self._find, device=args.device, ask=ask, world=world,
                                    framework="transformers.Trainer")
        s = self.run.sizing
        return dataclasses.replace(args, per_device_train_batch_size=s.batch_size,
                                   gradient_accumulation_steps=s.accumulation_steps)

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = _calling_trainer()
        if trainer is not None:
            _guard(trainer, self)
            self._guarded = True

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is None:
            raise SizingError("VramcalCallback: pass the TrainingArguments through vramcal_callback.sized(args) "
                              "before building the Trainer")
        given = args.per_device_train_batch_size
        if not self._own:  # the profile's variant, after the Trainer's own activation_checkpointing_enable
            self.run.checkpoint(kwargs["model"])
        sizing = self.run.start(say_resize=not self._guarded)
        if given > sizing.safe_batch_size:
            if self._guarded:
                self.run.inform(f"vramcal: per_device_train_batch_size {given} no longer fits with what this process "
                                f"holds (the process term, {sizing.process_delta_bytes / 2**20:+.1f} MiB): the "
                                f"training loop starts again at {sizing.batch_size} x {sizing.accumulation_steps} "
                                f"accumulated")
                raise _Resize()
            raise SizingError(f"per_device_train_batch_size {given} no longer fits with what this process holds "
                              f"(the process term, {sizing.process_delta_bytes / 2**20:+.1f} MiB): build the Trainer "
                              f"with per_device_train_batch_size at most {sizing.safe_batch_size}")
        if given != sizing.batch_size:
            self.run.resize(given)

    def _begin(self, trainer: Any) -> None:
        """``train()`` starts: the Trainer's own model's profile found or calibrated, then its batch size set.

        Raises:
            SizingError: several processes; see :func:`_own_model`.
        """
        if self.run is None and self._own:
            if getattr(trainer.args, "world_size", 1) > 1:
                raise SizingError(f"VramcalCallback() calibrates a model in one process, and this run has "
                                  f"{trainer.args.world_size}: calibrate the world with a factory (vramcal probe "
                                  f"--nproc) and give model=")
            params, batch = _own_model(trainer)
            path = own_profile(f"{__name__}:trial_step", params, batch, trainer.args.device, self._find, self.trials)
            self.run = FrameworkRun(**{**self._find, "profile": path}, device=trainer.args.device, ask=self.ask,
                                    framework="transformers.Trainer")
        if self.run is not None:
            _set_size(trainer, self.run.sizing)

    def _out_of_memory(self, trainer: Any) -> None:
        """An out-of-memory error in the loop: recorded, and the run's size moved below it, the effective batch kept.

        Raises:
            SizingError: no smaller size a trial ran; several processes (they cannot agree on a size mid-run).
        """
        before = self.run.sizing
        if getattr(trainer.args, "world_size", 1) > 1:
            raise SizingError(f"out of memory at per_device_train_batch_size {before.batch_size} with "
                              f"{trainer.args.world_size} processes: train again from your last checkpoint")
        effective = trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps
        _, line = self.run.out_of_memory(trainer.state.global_step, effective)
        if trainer.is_world_process_zero():
            print(f"{line}; the training loop starts again, as auto_find_batch_size restarts it", file=sys.stderr,
                  flush=True)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is None or self.run.peak_bytes is not None:
            return
        self.report = self.run.conclude(steps=state.global_step, run_dir=str(args.output_dir),
                                        main_process=state.is_world_process_zero)


def _calling_trainer() -> Any:
    """The Trainer whose method calls this hook (callbacks get no reference to it), None when none did."""
    frame = sys._getframe(1)
    while frame is not None:
        found = frame.f_locals.get("self")
        if isinstance(found, Trainer):
            return found
        frame = frame.f_back
    return None


def _guard(trainer: Any, callback: VramcalCallback) -> None:
    """Guard ``trainer._inner_training_loop`` (as ``auto_find_batch_size`` does): size the run when ``train()``
    starts, and start the loop again at the new size after :class:`_Resize` or an out-of-memory error."""
    inner = type(trainer)._inner_training_loop.__get__(trainer)

    def guarded(batch_size: int | None = None, args: Any = None, **kwargs: Any) -> Any:
        callback._begin(trainer)
        while True:
            try:
                return inner(batch_size=trainer._train_batch_size, args=args, **kwargs)
            except _Resize:
                pass
            except Exception as error:  # noqa: BLE001 - one kind is handled; the rest is raised again
                if not is_out_of_memory(error):
                    raise
                callback._out_of_memory(trainer)
            _set_size(trainer, callback.run.sizing)

    trainer._inner_training_loop = guarded


def _set_size(trainer: Any, sizing: Sizing) -> None:
    """The Trainer's batch size and accumulation, for the next start of its loop, from ``sizing``."""
    trainer._train_batch_size = sizing.batch_size
    trainer.args.per_device_train_batch_size = sizing.batch_size
    trainer.args.gradient_accumulation_steps = sizing.accumulation_steps


def _own_model(trainer: Any) -> tuple[dict[str, Any], Any]:
    """(the arguments of :func:`trial_step` that build the Trainer's model as it trains it, a batch of its data).

    Raises:
        SizingError: a model with no config, optimizer settings that are no plain values. WorkloadError: a class
            no trial can import.
    """
    model, args = trainer.model, trainer.args
    if getattr(model, "config", None) is None or not hasattr(type(model), "config_class"):
        raise SizingError(f"VramcalCallback() builds the Trainer's model from its config, and {type(model).__name__} "
                          f"has none: calibrate its step with a factory and give model=")
    optimizer, options = ((type(trainer.optimizer), dict(trainer.optimizer.defaults)) if trainer.optimizer else
                          Trainer.get_optimizer_cls_and_kwargs(args, model))
    try:
        options = json.loads(json.dumps(options, allow_nan=False))
    except (TypeError, ValueError) as error:
        raise SizingError(f"the optimizer's settings are not plain values ({error}): calibrate the step with a "
                          f"factory and give model=") from None
    checkpointing = dict(args.activation_checkpointing_kwargs or {}) if args.activation_checkpointing else None
    params = {"model": class_path(type(model)), "config": json.loads(model.config.to_json_string(use_diff=False)),
              "dtype": str(next(model.parameters()).dtype).removeprefix("torch."), "optimizer": class_path(optimizer),
              "optimizer_kwargs": options, "mixed": "bfloat16" if args.bf16 else "float16" if args.fp16 else None,
              "max_grad_norm": args.max_grad_norm or None, "activation_checkpointing": checkpointing}
    return params, _sample(trainer)


def _sample(trainer: Any) -> Any:
    """One batch of the Trainer's own train dataloader at :data:`~vramcal.models.own.SAMPLE_ROWS` rows."""
    before, trainer._train_batch_size = trainer._train_batch_size, SAMPLE_ROWS
    try:
        return next(iter(trainer.get_train_dataloader()))
    finally:
        trainer._train_batch_size = before


def trial_step(device: torch.device, model: str, config: dict[str, Any], dtype: str, optimizer: str,
               optimizer_kwargs: dict[str, Any], sample: str, mixed: str | None = None,
               max_grad_norm: float | None = None, activation_checkpointing: dict[str, Any] | None = None,
               **key: Any) -> TrainingStep:
    """The factory of a Trainer's own model's calibration (:mod:`vramcal.models.own`): ``import_class(model)`` built
    from ``config`` with random weights at ``dtype``, checkpointed as ``Trainer.train`` does with
    ``activation_checkpointing`` (None: off), ``optimizer(**optimizer_kwargs)``, the loss ``model(**batch).loss``
    under autocast to ``mixed`` on batches from ``sample``, clipped at ``max_grad_norm``. ``key``: unused.

    Raises:
        WorkloadError: the model's or the optimizer's class cannot be imported.
    """
    cls = import_class(model)
    decode = getattr(cls.config_class, "_decode_special_floats", lambda settings: settings)  # to_json_string's inf
    built = cls(cls.config_class.from_dict(decode(config))).to(device=device, dtype=getattr(torch, dtype))
    if activation_checkpointing is not None:
        options = dict(activation_checkpointing)
        every, offload = options.pop("every_n_layers", 1), options.pop("offload", False)
        built.activation_checkpointing_enable(activation_checkpointing_kwargs=options or None, every_n_layers=every,
                                              offload=offload)
    built.train()
    opt = import_class(optimizer)([p for p in built.parameters() if p.requires_grad], **optimizer_kwargs)

    def loss(batch: dict[str, Any]) -> torch.Tensor:
        with torch.autocast(device.type, dtype=getattr(torch, mixed)) if mixed else contextlib.nullcontext():
            return built(**batch).loss

    return TrainingStep(model=built, optimizer=opt, batch=sample_batches(sample, device), loss=loss,
                        max_grad_norm=max_grad_norm, info={"framework": "transformers.Trainer", "mixed": mixed})


def _world(args: Any) -> World | None:
    """The world of a Trainer of several processes: FSDP2 when ``fsdp_plugin_args`` ask for FSDP on GPUs, else DDP
    (on the host Accelerate trains DDP whatever they ask: said in a warning).

    Raises:
        SizingError: FSDP1 or CPU offload, which no profile measures.
    """
    if getattr(args, "world_size", 1) < 2:
        return None
    plugin, device_type = getattr(args, "fsdp_plugin_args", None), args.device.type
    if not plugin:
        return World(args.world_size, backend_of(device_type))
    if not Kind.of(device_type).cuda_kernels:
        warnings.warn("vramcal: TrainingArguments ask for FSDP, which Accelerate runs on GPUs only: this CPU run "
                      "trains DDP (MULTI_CPU) and is sized as DDP", stacklevel=3)
    return plugin_world(args.world_size, device_type, plugin.get("fsdp_version", 2),
                        plugin.get("reshard_after_forward", True), plugin.get("cpu_offload", False),
                        "TrainingArguments' fsdp_config")
