"""A framework's training run sized by a vramcal profile and checked against it: what the Lightning, Hugging Face
and Accelerate integrations share, and what a plain PyTorch loop uses (the process term and the gradient term:
DESIGN.md "Framework processes")::

    run = FrameworkRun(model="mytrain:make_step", device=torch.device("cuda"))   # finds the profile
    ... build the model and the optimizer, move them to the device ...
    batch_size = run.start().batch_size   # what this process holds now: the process term, in the sizing
    ... build the DataLoader at batch_size, train ...
    print(run.finish(steps))              # the measured peak against the prediction; recorded in the profile
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vramcal import __version__
from vramcal.arguments import callback, flag, mapping, of_type, path_like
from vramcal.environment import HOST_MALLOC, cache_thread_stacks, set_arrow_pool, set_host_malloc
from vramcal.integrations.worlds import locate_world
from vramcal.measure.device import DeviceError, free_bytes
from vramcal.measure.meters import attach_meter
from vramcal.measure.nvml import NvmlError
from vramcal.models.mamba2 import CHECKPOINTING_OFF, checkpoint_every, checkpoint_model
from vramcal.models.own import data_shapes, refuse_training_at_import, save_sample
from vramcal.profile import (
    DEFAULT_PROFILES_DIR,
    Observation,
    Profile,
    ProfileError,
    append_observation,
    utc_now,
)
from vramcal.records import TrialSettings, World
from vramcal.service.pool import capacity_argument, select_devices
from vramcal.service.size import size_for
from vramcal.sizing import SizeRequest, Sizing, SizingError, check_counts, compare, size
from vramcal.units import format_bytes
from vramcal.words import is_info
from vramcal.workload import ModelRef

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from vramcal.records import Device

Warn = Callable[[str], None]


def _warn(line: str) -> None:
    warnings.warn(line, stacklevel=3)


def _inform(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class FrameworkRun:
    """A training run of a framework's process, sized by a profile (module docstring). Messages name the caller's
    arguments.

    Args:
        profile: a :class:`~vramcal.profile.Profile`, a profile file, or None to find the newest matching one
            for ``model`` on this run's device under ``profiles_dir`` (:func:`vramcal.sizing.lookup.locate_profile`).
        capacity_bytes: the budget the profile to find was calibrated at (bytes or ``"1.5GiB"``); None: the
            matching files must share one budget.
        model, params: what was calibrated (``regressor``, ``lm`` or ``module:function`` and its arguments);
            ``params["seq_len"]`` is the run's length unless ``ask`` gives one.
        device: the torch device this process trains on (``cuda:N`` or ``cpu``).
        ask: what the run asks of the profile (:class:`~vramcal.sizing.SizeRequest`).
        world: the DDP or FSDP world this process is a rank of (a profile of another size is carried:
            :func:`vramcal.integrations.worlds.locate_world`).
        framework: who trains (``lightning``, ``transformers.Trainer``, ``accelerate``, ``plain``), recorded.
        host_malloc: on the host, :meth:`start` gives this process the trials' glibc malloc settings and cached
            thread stacks (:func:`vramcal.environment.set_host_malloc`, :func:`~vramcal.environment.
            cache_thread_stacks`); False keeps glibc's defaults.
        warn, inform: how warnings (default :func:`warnings.warn`) and information (default: stderr) are said.

    Attributes:
        sizing: the batch size and its prediction (after :meth:`start`, with the process term).
        profile, source: the profile and where it came from. held_bytes: what the process held at start.

    Raises (each one line naming the argument):
        TypeError: an argument of the wrong type. ValueError: a device neither a CUDA GPU nor the CPU, a
            ``capacity_bytes`` that is no size (DeviceError: a GPU this machine cannot use).
        SizingError: neither ``profile`` nor ``model``, no matching profile (or several budgets), a profile from
            another device, model or world, or no batch size within the bounds.
    """

    def __init__(self, profile: Profile | str | Path | None = None, *, model: str | None = None,
                 params: dict[str, Any] | None = None, device: torch.device | str = "cpu",
                 profiles_dir: str | Path = DEFAULT_PROFILES_DIR, capacity_bytes: int | str | None = None,
                 ask: SizeRequest = SizeRequest(),
                 world: World | None = None, framework: str = "plain", host_malloc: bool = True,
                 warn: Warn = _warn, inform: Warn = _inform) -> None:
        find = check_find("FrameworkRun", profile, model, params, profiles_dir, capacity_bytes)
        of_type("ask", ask, SizeRequest, "what the run asks as a vramcal.SizeRequest (SizeRequest(request=64))")
        of_type("world", world, World, "the DDP or FSDP world as a vramcal.records.World, or None", none=True)
        self.framework, self.host_malloc = of_type("framework", framework, str, "a name"), flag("host_malloc",
                                                                                                host_malloc)
        self.warn, self.inform = callback("warn", warn, none=False), callback("inform", inform, none=False)
        use_system_arrow_pool(self.inform)
        self.device, self.world = vramcal_device(device), world
        located = locate_world(find["model"], params, device=self.device, profile=profile,
                               profiles_dir=profiles_dir, world=world, total_bytes=find["capacity_bytes"])
        for notice in located.notices:
            (inform if is_info(notice) else warn)(f"vramcal: {notice}")
        self.profile, self.source, self.path = located.profile, located.source, located.path
        seq_len = (params or {}).get("seq_len")
        self.ask = ask if ask.seq_len is not None or seq_len is None else ask.replace(seq_len=seq_len)
        self.sizing: Sizing = size(self.profile, self.ask)
        self.held_bytes: int | None = None
        self.peak_bytes: int | None = None
        self._meter: Any = None
        # attached as early as possible, before the model reaches the card (AttachedCudaMeter's baseline)
        self._attached: Any = attach_meter(self.device, warn=self.warn)
        self._unseen: str | None = None  # what the meter could not see (finish): the observation says so
        self._free: dict[str, Any] = {}  # the gate's reading at start()
        self.checkpointed: tuple[int, int] | None = None  # checkpoint(): (blocks recomputed, blocks found)
        self.failed = False  # the run ran out of memory (out_of_memory)

    def start(self, say_resize: bool = True) -> Sizing:
        """Training starts (model, optimizer and data in place): on the host the trials' malloc settings, then what
        this process holds measured and the run sized again with the process term and the gate
        (:func:`vramcal.measure.device.free_bytes` plus what this process holds), and the peak measured from here.
        Returns the sizing; a batch size it lowered is said through ``inform`` with ``say_resize``."""

        if self.checkpointed is None and checkpoint_every(self.variant):
            self.warn(f"vramcal: {self.source} was calibrated with checkpointing {self.variant}: call "
                      f"checkpoint(model) before start(), or the run holds more than its prediction")
        held_to_trials = self.device.kind.budgeted and self.host_malloc  # the host trials' allocator settings
        done = set_host_malloc() if held_to_trials else None
        if held_to_trials:
            cache_thread_stacks()  # later threads reuse them, as the trials' did: no growth after the term's measure
        if done:
            self.inform(f"vramcal: this process's glibc malloc now runs as the trials' did ({done}: mallopt), for "
                      f"their host figures to hold here; export GLIBC_TUNABLES={HOST_MALLOC} before Python starts to "
                      f"have it from the first allocation")
        if self._meter is not None:  # a second start (a restarted training loop) measures anew
            self._meter.close()
        self._meter, self._attached = self._attached or attach_meter(self.device, warn=self.warn), None
        self.held_bytes = None if self._meter.unseen else self._meter.held_bytes()
        if self._meter.unseen:
            self.warn(f"vramcal: {self._meter.unseen}: no process term is measured, and the peak will be a lower "
                      f"bound; make the run (the callback) before the model reaches the card")
        free, source = free_bytes(self.device)
        if free is not None and self.held_bytes is not None:  # this process's own memory is not the others'
            free, source = free + self.held_bytes, f"{source} plus what this process holds"
        self._free = {"free_bytes": free, "free_source": source}
        before = self.sizing.batch_size
        self.sizing = size(self.profile, self.ask, process_bytes=self.held_bytes, **self._free)
        for notice in self.sizing.notices:
            (self.inform if is_info(notice) else self.warn)(f"vramcal: {notice}")
        if self.sizing.batch_size < before and say_resize:
            self.inform(f"vramcal: batch_size {before} -> {self.sizing.batch_size}: with what this process holds and "
                        f"what the device has free now it no longer fits the profile's limits")
        self._meter.reset()
        return self.sizing

    @property
    def variant(self) -> str:
        """The profile's activation checkpointing (``off``, ``block``, ``every:K``: :mod:`vramcal.sizing.variants`)."""
        return str(self.profile.model.params.get("checkpointing", CHECKPOINTING_OFF))

    def checkpoint(self, module: torch.nn.Module) -> str | None:
        """Checkpoint ``module``'s blocks as the profile's trials did (:func:`vramcal.models.mamba2.checkpoint_model`);
        call it before :meth:`start`. Returns the line said (a warning for a model that recomputes blocks the trials
        did not), None where neither checkpoints.

        Raises:
            TypeError: ``module`` no ``torch.nn.Module``. SizingError: the profile's variant checkpoints and the
                model has no blocks vramcal can checkpoint.
        """
        import torch  # deferred: the integrations' module loads without torch

        of_type("module", module, torch.nn.Module, "the torch.nn.Module this process trains")
        recomputed, blocks = self.checkpointed = checkpoint_model(module, checkpoint_every(self.variant))
        if self.variant != CHECKPOINTING_OFF and not blocks:
            raise SizingError(f"{self.source} was calibrated with checkpointing {self.variant}, and the model "
                              f"({type(module).__name__}) has no Mamba-2 blocks vramcal can checkpoint (transformers' "
                              f"or vramcal's): use a profile calibrated with checkpointing off")
        if self.variant != CHECKPOINTING_OFF:
            line = (f"vramcal: checkpointing {self.variant}: {recomputed} of {blocks} blocks recomputed in the "
                    f"backward pass, as the trials of {self.source}")
            self.inform(line)
            return line
        if recomputed:
            line = (f"vramcal: the model recomputes {recomputed} of {blocks} blocks in the backward pass and "
                    f"{self.source} was calibrated without checkpointing: the run holds less and runs slower than "
                    f"its figures; use a profile calibrated with --checkpointing, or turn the model's off")
            self.warn(line)
            return line
        return None

    def resize(self, batch_size: int) -> Sizing:
        """The sizing at ``batch_size`` (clamped), the process term and the gate kept: the batch a framework settles
        on (the smallest over DDP ranks).

        Raises:
            TypeError: no whole number. SizingError: below 1.
        """
        check_counts(answer_batch_size=batch_size)
        self.sizing = size(self.profile, self.ask.replace(request=batch_size), process_bytes=self.held_bytes,
                           **self._free)
        return self.sizing

    def finish(self, steps: int = 0, run_dir: str = "") -> tuple[str, list[str]]:
        """The process's peak since :meth:`start` against the prediction (one line, and warnings), the observation
        appended to the profile (a failed write is a warning). After :meth:`out_of_memory` it is said only.

        Raises:
            RuntimeError: :meth:`start` was not called. TypeError: ``steps`` no whole number, ``run_dir`` no str.
                ValueError: ``steps`` below 0.
        """
        of_type("steps", steps, int, "the optimizer steps done, a whole number >= 0")
        if steps < 0:
            raise ValueError(f"steps={steps} is below 0: give the optimizer steps done")
        of_type("run_dir", run_dir, str, "the run's folder as a str")
        if self._meter is None:
            raise RuntimeError("FrameworkRun.finish() before start(): call start() when training starts")
        self.peak_bytes = self._meter.read()
        definition, self._unseen = self._meter.definition, self._meter.unseen
        self._meter.close()
        self._meter = None
        line, warned = compare(self.sizing, self.peak_bytes, process=self.held_bytes is not None)
        if self.failed:
            return f"vramcal: {line} (this process's {definition}; after an out-of-memory error: not recorded)", []
        self._observe(self._observation(steps, run_dir))
        return f"vramcal: {line} (this process's {definition})", warned

    def conclude(self, steps: int = 0, run_dir: str = "", main_process: bool = True) -> str:
        """:meth:`finish`, said: its line on stderr by the main process, its warnings through ``warn``.

        Raises:
            as :meth:`finish`; TypeError: ``main_process`` not True or False.
        """
        flag("main_process", main_process)
        report, warned = self.finish(steps=steps, run_dir=run_dir)
        if main_process:
            print(report, file=sys.stderr, flush=True)
        for line in warned:
            self.warn(f"vramcal: {line}")
        return report

    def out_of_memory(self, steps: int, effective_batch_size: int) -> tuple[Sizing, str]:
        """This run ran out of memory after ``steps`` optimizer steps: recorded in the profile (an observation marked
        ``out_of_memory``), and the sizing it goes on with, capped below the failed size
        (:func:`vramcal.sizing.run_failure_cap`) and ``effective_batch_size`` kept by accumulation. Returns the
        sizing and the line that says so.

        Raises:
            SizingError: no trial ran below the failed size.
        """
        broke = self.sizing
        self.peak_bytes = self._meter.read() if self._meter is not None else broke.predicted_peak_bytes
        self._unseen = self._meter.unseen if self._meter is not None else None
        observation = self._observation(steps, "", out_of_memory=True)
        self._observe(observation)
        self.failed = True
        self.profile = dataclasses.replace(self.profile, observations=(*self.profile.observations, observation))
        self.ask = self.ask.replace(request=None, effective_batch_size=effective_batch_size, exact=False)
        self.sizing = s = size(self.profile, self.ask, process_bytes=self.held_bytes, **self._free)
        self.peak_bytes = None
        if self._meter is not None:
            self._meter.reset()
        return s, (f"vramcal: out of memory at batch_size {broke.batch_size} after {steps} steps (this process's peak "
                   f"{format_bytes(observation.peak_bytes)}, predicted {format_bytes(broke.predicted_peak_bytes)}), "
                   f"recorded in {self.source}: going on at batch_size {s.batch_size} x {s.accumulation_steps} "
                   f"accumulated ({s.batch_size * s.accumulation_steps} samples per optimizer step, "
                   f"{effective_batch_size} before)")

    def close(self) -> None:
        """Stop measuring (an exception ended the run)."""
        for meter in (self._meter, self._attached):
            if meter is not None:
                meter.close()
        self._meter = self._attached = None

    def _observation(self, steps: int, run_dir: str, out_of_memory: bool = False) -> Observation:
        s = self.sizing
        return Observation(
            recorded_utc=utc_now(), vramcal_version=__version__, batch_size=s.batch_size, data_bytes=0,
            peak_bytes=int(self.peak_bytes), predicted_peak_bytes=s.predicted_peak_bytes, upper_bytes=s.upper_bytes,
            warn_bytes=s.line_bytes, usable_bytes=s.usable_bytes, steps=steps, run_dir=run_dir,
            framework=self.framework, process_delta_bytes=s.process_delta_bytes, peak_unseen=self._unseen,
            out_of_memory=out_of_memory)

    def _observe(self, observation: Observation) -> None:
        if self.path is None:
            return
        try:
            append_observation(self.path, observation)
        except (OSError, ProfileError) as error:
            self.warn(f"vramcal: could not record this run in {self.path} ({error})")


def use_system_arrow_pool(inform: Warn = _inform) -> None:
    """Give this process Arrow's system memory pool as the trials' workers have it
    (:func:`vramcal.environment.set_arrow_pool`), and say so through ``inform``."""
    done = set_arrow_pool()
    if done:
        inform(f"vramcal: Arrow's memory pool is now the system allocator, as the trials' ({done}), so data read "
               f"from here on holds what it held in the trials")


def asked_request(who: str, asked: dict[str, Any]) -> SizeRequest:
    """What an integration (``who``) was asked beyond finding the profile, as a :class:`~vramcal.sizing.SizeRequest`.

    Raises:
        TypeError: a name that is no field of SizeRequest (the fields listed), or a value of the wrong type.
            SizingError: a value out of range.
    """
    fields = [f.name for f in dataclasses.fields(SizeRequest)]
    unknown = sorted(set(asked) - set(fields))
    if unknown:
        raise TypeError(f"{who}() has no argument {unknown[0]}=: beside the profile's (profile, model, params, "
                        f"profiles_dir, capacity_bytes) it takes what a run asks: {', '.join(fields)}")
    return SizeRequest(**asked)


def check_find(who: str, profile: Any, model: Any, params: Any, profiles_dir: Any,
               capacity_bytes: Any, own: bool = False) -> dict[str, Any]:
    """What an integration (``who``) is given to find its profile, checked in its constructor, ``capacity_bytes`` as
    bytes. ``own``: with neither ``profile`` nor ``model`` it calibrates the run's own model (:func:`own_profile`).

    Raises:
        TypeError: an argument of the wrong type. ValueError: a ``capacity_bytes`` that is no size.
            SizingError: neither ``profile`` nor ``model`` (not ``own``).
    """
    of_type("profile", profile, (Profile, str, os.PathLike), "a vramcal.Profile, a profile file's path or None",
            none=True)
    of_type("model", model, (str, ModelRef), "'regressor', 'lm', 'module:function' or a vramcal.ModelRef",
            none=True)
    mapping("params", params, "the model's arguments as a dict ({'seq_len': 256})")
    path_like("profiles_dir", profiles_dir)
    if profile is None and model is None and not own:
        raise SizingError(f"{who} needs profile=<a profile file or Profile>, or model=<what was calibrated> to find "
                          f"one under profiles_dir")
    return {"profile": profile, "model": model, "params": params, "profiles_dir": profiles_dir,
            "capacity_bytes": capacity_argument(capacity_bytes)}


def own_profile(factory: str, params: dict[str, Any], batch: Any, device: torch.device | str, find: dict[str, Any],
                trials: TrialSettings, inform: Warn = _inform) -> Path:
    """The profile of a run's own model (:mod:`vramcal.models.own`): ``factory`` (the integration's trial builder) with
    ``params`` and the shapes of ``batch`` (saved for the trials under ``profiles_dir/samples``) on ``device``; the
    matching profile under ``find["profiles_dir"]`` when one holds, else a calibration
    (:func:`vramcal.service.size.size_for`).

    Raises:
        WorkloadError: a script that trains when imported; a batch with no tensor. CalibrationError: not one sample
            fits, or the trials cannot rebuild or step the model. OSError: the profiles folder cannot be written.
    """
    refuse_training_at_import()
    ref = ModelRef.make(factory, {**params, "data": data_shapes(batch)})
    sample = save_sample(batch, Path(find["profiles_dir"]) / "samples")
    answered = size_for(ref, gpu=vramcal_device(device).gpu, capacity_bytes=find["capacity_bytes"],
                        profiles_dir=find["profiles_dir"], options={"sample": str(sample)}, trials=trials)
    if not answered.calibrated:  # a calibration said so itself: a line per trial and where it saved the profile
        inform(f"vramcal: {answered.reason}")
    return answered.path


def vramcal_device(device: torch.device | str) -> Device:
    """The vramcal device of a torch device: a CUDA GPU by its index among the visible ones, or the host.

    Raises:
        TypeError: neither a ``str`` nor a ``torch.device``. ValueError: no torch device, or neither CUDA nor the
            CPU. DeviceError: a CUDA device this machine cannot use.
    """
    import torch

    of_type("device", device, (str, torch.device), "the torch device this process trains on ('cpu', 'cuda', "
                                                   "'cuda:N' or a torch.device)")
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device={device!r} is no torch device: give 'cpu', 'cuda' or 'cuda:N'") from None
    if device.type == "cuda":
        try:
            return select_devices(str(device.index or 0))[0][0]
        except (DeviceError, NvmlError) as error:
            why = re.sub(r"^gpu=\S+: ", "", str(error).split("; use ")[0])
            raise DeviceError(f"device={str(device)!r} names a GPU this machine cannot use ({why}): train on "
                              f"device='cpu' with the host's profile, or on a GPU that is visible here") from None
    if device.type == "cpu":
        return select_devices("none")[0][0]
    raise ValueError(f"vramcal's profiles are for NVIDIA GPUs and the host CPU; this run trains on {device.type}")
