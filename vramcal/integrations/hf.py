"""Hugging Face ``transformers.Trainer``: a profile's batch size in the ``TrainingArguments``, held to the Trainer's
process, and its peak checked at the end of training.

    from transformers import Trainer, TrainingArguments
    from vramcal.integrations.hf import VramcalCallback

    vramcal_callback = VramcalCallback(model="lm", params={"config": "configs/mamba2-lm-small.json", "seq_len": 256})
    args = vramcal_callback.sized(TrainingArguments(output_dir="out", max_steps=1000), effective_batch_size=64)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[vramcal_callback])
    trainer.train()

:meth:`VramcalCallback.sized` fills ``per_device_train_batch_size`` (the largest micro-batch the profile allows,
or one that divides the requested effective batch) and ``gradient_accumulation_steps`` (what reaches it: the
effective batch is kept, as users of ``auto_find_batch_size`` ask). When training begins
(``on_train_begin``: the model is on the device and the optimizer created) the callback measures what this
process holds against what the trials' processes held — the process term
(:class:`vramcal.integrations.run.FrameworkRun`) — and stops with one line when the batch no longer fits with it
(the Trainer's dataloader is built by then, so the size cannot change: the line says which size fits). There
too the model's blocks are recomputed in the backward pass as the profile's trials did (its variant's activation
checkpointing, transformers' own with ``use_reentrant=False``:
:meth:`~vramcal.integrations.run.FrameworkRun.checkpoint`), whatever ``activation_checkpointing`` the arguments
give; a model with no blocks to checkpoint is refused in one line. At the end
(``on_train_end``) it prints this process's peak beside the prediction and appends the observation to the
profile. Under DDP (``torchrun``) each rank sizes itself from its own device's profile for the world; with the
``fsdp`` options on GPUs, from the FSDP2 world's (:mod:`vramcal.integrations.worlds`: FSDP1 refused in one line).

Needs ``transformers`` (a dependency) and ``accelerate`` (which ``Trainer`` needs); ``import vramcal`` imports
neither.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from vramcal.arguments import shown
from vramcal.integrations.run import FrameworkRun, asked_request, check_find, use_system_arrow_pool
from vramcal.integrations.worlds import backend_of, plugin_world
from vramcal.profile import DEFAULT_PROFILES_DIR, Profile
from vramcal.records import World
from vramcal.sizing import SizingError, check_counts


class VramcalCallback(TrainerCallback):
    """Size a ``transformers.Trainer`` run from a vramcal profile and check its peak (module docstring).

    Args:
        profile, model, params, profiles_dir, capacity_bytes: as :class:`vramcal.integrations.run.FrameworkRun`.
        asked: what the run asks of the profile, the fields of :class:`~vramcal.sizing.SizeRequest` (``limit``,
            ``batch_size_min``, ``request``: a per-device batch size to use instead, ...); the effective batch
            is :meth:`sized`'s.

    Attributes: ``run`` (the :class:`~vramcal.integrations.run.FrameworkRun`, after :meth:`sized`), ``report``
    (the line printed at the end).

    Raises:
        SizingError, TypeError, ValueError: an argument out of range or of the wrong type
            (:func:`~vramcal.integrations.run.check_find`), an asked value out of range, of the wrong type or
            unknown; neither ``profile`` nor ``model``. Each one line naming the argument.
    """

    def __init__(self, profile: Profile | str | Path | None = None, *, model: str | None = None,
                 params: dict[str, Any] | None = None, profiles_dir: str | Path = DEFAULT_PROFILES_DIR,
                 capacity_bytes: int | str | None = None, **asked: Any) -> None:
        self._find = check_find("VramcalCallback", profile, model, params, profiles_dir, capacity_bytes)
        self.ask = asked_request("VramcalCallback", asked)
        self.run: FrameworkRun | None = None
        self.report: str | None = None
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
        world = _world(args)
        ask = self.ask.replace(exact=True)
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

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is None:
            raise SizingError("VramcalCallback: pass the TrainingArguments through vramcal_callback.sized(args) "
                              "before building the Trainer")
        given = args.per_device_train_batch_size
        self.run.checkpoint(kwargs["model"])  # after the Trainer's own activation_checkpointing_enable: ours holds
        sizing = self.run.start()
        if given > sizing.safe_batch_size:
            raise SizingError(f"per_device_train_batch_size {given} no longer fits with what this process holds "
                              f"(the process term, {sizing.process_delta_bytes / 2**20:+.1f} MiB): build the Trainer "
                              f"with per_device_train_batch_size at most {sizing.safe_batch_size}")
        if given != sizing.batch_size:
            self.run.resize(given)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is None or self.run.peak_bytes is not None:
            return
        self.report = self.run.conclude(steps=state.global_step, run_dir=str(args.output_dir),
                                        main_process=state.is_world_process_zero)


def _world(args: Any) -> World | None:
    """The world of a Trainer run by several processes (its profile must be calibrated for it): FSDP2 when the
    arguments ask for FSDP (``fsdp``/``fsdp_config``, read as the Trainer hands them to Accelerate:
    ``fsdp_plugin_args``) on GPUs, else DDP (on the host Accelerate trains DDP whatever they ask: said in a warning).

    Raises:
        SizingError: FSDP1 (``fsdp_config`` version 1) or CPU offload, which no profile measures (one line).
    """
    if getattr(args, "world_size", 1) < 2:
        return None
    plugin, device_type = getattr(args, "fsdp_plugin_args", None), args.device.type
    if not plugin:
        return World(args.world_size, backend_of(device_type))
    if device_type != "cuda":
        warnings.warn("vramcal: TrainingArguments ask for FSDP, which Accelerate runs on GPUs only: this CPU run "
                      "trains DDP (MULTI_CPU) and is sized as DDP", stacklevel=3)
    return plugin_world(args.world_size, device_type, plugin.get("fsdp_version", 2),
                        plugin.get("reshard_after_forward", True), plugin.get("cpu_offload", False),
                        "TrainingArguments' fsdp_config")
