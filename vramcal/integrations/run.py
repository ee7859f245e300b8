"""A framework's training run sized by a vramcal profile and checked against it: what the Lightning callback,
the Hugging Face ``TrainerCallback`` and the Accelerate helpers share, and what a plain PyTorch loop uses::

    run = FrameworkRun(model="mytrain:make_step", device=torch.device("cuda"))   # finds the profile
    ... build the model and the optimizer, move them to the device ...
    batch_size = run.start().batch_size   # what this process holds now: the process term, in the sizing
    ... build the DataLoader at batch_size, train ...
    print(run.finish(steps))              # the measured peak against the prediction; recorded in the profile

A process that was not made like the trials' (a framework's: other imports, loggers, its own tensors, another
allocator) holds a different amount when training starts. :meth:`FrameworkRun.start` measures it
(:func:`vramcal.measure.meters.attach_meter`, the trials' definitions) against what the trials' processes held
at the same point, carries the difference into the prediction and the limits (:mod:`vramcal.sizing`: the
process term), and clamps the batch size when it no longer fits. :meth:`FrameworkRun.finish` reads the
process's peak since then, compares it with the prediction and its upper 95 % bound
(:func:`vramcal.sizing.compare`), and appends the observation, process term included, to the profile
file. Messages speak in the caller's words: the arguments of the integration it came through.
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
from vramcal.api import capacity_argument, select_devices, size_for
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
    """A training run of a framework's process, sized by a profile (module docstring).

    Args:
        profile: a :class:`~vramcal.profile.Profile`, a profile file, or None to find the newest matching one
            for ``model`` on this run's device under ``profiles_dir`` (:func:`vramcal.sizing.lookup.locate_profile`).
        capacity_bytes: the budget the profile to find was calibrated at (bytes, or ``"1.5GiB"`` as
            :func:`vramcal.calibrate` takes it); None: the matching files must share one budget, else the run
            is refused with each file and its budget listed.
        model, params: what was calibrated (``regressor``, ``lm`` or ``module:function`` and its arguments), to
            find the profile or check the given one; ``params["seq_len"]`` is the run's length unless ``ask``
            gives one.
        device: the torch device this process trains on (``cuda:N`` or ``cpu``).
        ask: what the run asks of the profile (:class:`~vramcal.sizing.SizeRequest`: the limit, a requested
            batch size clamped to ``[batch_size_min, safe]`` with a warning, an effective batch reached by
            ``sizing.accumulation_steps``, why the gradients stay alive through the forward pass).
        world: the DDP or FSDP world this process is a rank of (its profile must be calibrated for it, or for the
            same strategy and settings at another number of ranks: then carried by the sharding model,
            :func:`vramcal.integrations.worlds.locate_world`, and said through ``inform``).
        framework: who trains (``lightning``, ``transformers.Trainer``, ``accelerate``, ``plain``), recorded.
        host_malloc: on the host, :meth:`start` gives this process the trials' glibc malloc settings
            (:func:`vramcal.environment.set_host_malloc`: with glibc's defaults the same step can hold a third
            more), and says so, and the thread stacks their processes find cached
            (:func:`vramcal.environment.cache_thread_stacks`); False keeps glibc's defaults.
        warn: how warnings reach people (default :func:`warnings.warn`): the lookup's and the sizing's.
        inform: how information reaches people (default: a line on stderr): the sizing's notices marked
            :class:`~vramcal.words.Info` (the process term, the gradient term), the malloc settings given.

    Attributes:
        sizing: the batch size and its prediction (after :meth:`start`, with the process term).
        profile, source: the profile and where it came from. held_bytes: what the process held at start.

    Raises (each one line naming the argument, before anything is looked up):
        TypeError: an argument of the wrong type (:func:`check_find`, ``ask`` no SizeRequest, ``world`` no World,
            ``device`` neither a str nor a torch.device, ``warn``/``inform`` not callable).
        ValueError: a device that is no torch device, neither a CUDA GPU nor the CPU (DeviceError: a GPU this
            machine cannot use); a ``capacity_bytes`` that is no size.
        SizingError: neither ``profile`` nor ``model``, no matching profile (or several at different budgets
            and no ``capacity_bytes``), a profile from another device, model or world, or no batch size within the
            bounds.
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
        # attached now, the earliest vramcal is in the process: before the model reaches the card where the
        # framework calls this first (Lightning's setup, the Trainer's arguments), so a baseline of the device's use
        # (no per-process NVML figure: containers) misses nothing (AttachedCudaMeter)
        self._attached: Any = attach_meter(self.device, warn=self.warn)
        self._unseen: str | None = None  # what the meter could not see (finish): the observation says so
        self._free: dict[str, Any] = {}  # the gate's reading at start()
        self.checkpointed: tuple[int, int] | None = None  # checkpoint(): (blocks recomputed, blocks found)
        self.failed = False  # the run ran out of memory (out_of_memory)

    def start(self, say_resize: bool = True) -> Sizing:
        """Training starts (the model and the optimizer are on the device, the data loaded): on the host give
        the process the trials' malloc settings (``host_malloc``), measure what it holds, size again with the
        process term and the gate (what the device has free now, :func:`vramcal.measure.device.free_bytes`,
        plus what this process holds: memory other processes took since the calibration lowers the limits),
        clamping the batch size when it no longer fits, and start measuring the peak. Returns the new sizing
        (its information given to ``inform``, its warnings to ``warn``; a batch size it lowered said through
        ``inform`` with ``say_resize``, else left to the caller to say)."""

        if self.checkpointed is None and checkpoint_every(self.variant):
            self.warn(f"vramcal: {self.source} was calibrated with checkpointing {self.variant}: call "
                      f"checkpoint(model) before start(), or the run holds more than its prediction")
        done = set_host_malloc() if self.device.kind == "host" and self.host_malloc else None
        if self.device.kind == "host" and self.host_malloc:
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
        """The model this process trains checkpointed as the profile's trials were (its :attr:`variant`:
        :func:`vramcal.models.mamba2.checkpoint_model`), so the run holds what the profile predicts; call it before
        :meth:`start`. Returns the line said (through ``inform``; a warning for a model that recomputes blocks the
        profile's trials did not), None where neither checkpoints.

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
        """The sizing at ``batch_size`` (clamped to the bounds), the process term and the gate kept: the batch a
        framework settles on (the smallest over DDP ranks).

        Raises:
            TypeError: no whole number. SizingError: below 1.
        """
        check_counts(answer_batch_size=batch_size)
        self.sizing = size(self.profile, self.ask.replace(request=batch_size), process_bytes=self.held_bytes,
                           **self._free)
        return self.sizing

    def finish(self, steps: int = 0, run_dir: str = "") -> tuple[str, list[str]]:
        """The process's peak since :meth:`start` against the prediction (one line, and warnings), and the
        observation appended to the profile file (a failure to write it is a warning). After an out-of-memory
        error (:meth:`out_of_memory`, recorded then) the peak may be the failed step's (the host's data-segment
        peak is never reset): it is said, not recorded nor warned about.

        Raises:
            RuntimeError: :meth:`start` was not called. TypeError: ``steps`` no whole number, ``run_dir`` no str.
                ValueError: ``steps`` below 0.
        """
        _steps(steps)
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
        """:meth:`finish`, said: its line printed to stderr by the main process, its warnings through ``warn``
        (every process); returns the line.

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
        ``out_of_memory``: the batch size, the step, this process's peak, the prediction it broke), and the sizing it
        goes on with: at most the largest batch size below the failed one that a trial of the profile ran
        (:func:`vramcal.sizing.run_failure_cap`), ``effective_batch_size`` samples per optimizer step kept by
        accumulation (the fewest micro-batches that reach it: :func:`vramcal.sizing.accumulation`). Returns the
        sizing and the line that says so.

        Raises:
            SizingError: no trial ran below the failed size (one line: the size to use, and how to go on).
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


def _steps(steps: Any) -> None:
    """Raises: TypeError: ``steps`` no whole number. ValueError: below 0."""
    of_type("steps", steps, int, "the optimizer steps done, a whole number >= 0")
    if steps < 0:
        raise ValueError(f"steps={steps} is below 0: give the optimizer steps done")


def use_system_arrow_pool(inform: Warn = _inform) -> None:
    """Give this process Arrow's system memory pool, as the trials' workers have it, before the framework reads
    its data (:func:`vramcal.environment.set_arrow_pool`: Arrow's default reserves a 1 GiB mapping that the host's
    meter counts), and say so through ``inform``. The integrations call it when they are made."""
    done = set_arrow_pool()
    if done:
        inform(f"vramcal: Arrow's memory pool is now the system allocator, as the trials' ({done}), so data read "
               f"from here on holds what it held in the trials")


def asked_request(who: str, asked: dict[str, Any]) -> SizeRequest:
    """What an integration (``who``) was asked beyond finding the profile, as the run's
    :class:`~vramcal.sizing.SizeRequest` (checked when made).

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
    """What an integration (``who``) is given to find its profile, checked where it is given (its constructor):
    the arguments, with ``capacity_bytes`` as bytes (:func:`vramcal.api.capacity_argument`). ``own``: the
    integration calibrates the run's own model when given neither ``profile`` nor ``model`` (:func:`own_profile`).

    Raises:
        TypeError: ``profile`` neither a Profile, a path nor None; ``model`` neither a name nor a ModelRef;
            ``params`` no dict; ``profiles_dir`` no path; ``capacity_bytes`` neither bytes nor a size.
        ValueError: a ``capacity_bytes`` that is no size. SizingError: neither ``profile`` nor ``model`` (not
            ``own``).
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
    """The profile of a run's own model (:mod:`vramcal.models.own`), which an integration calibrates without a
    factory of the user's: ``factory`` (the integration's trial builder) with ``params`` and the shapes of ``batch``,
    a batch of the run's own data (saved for the trials under ``profiles_dir/samples``), on the run's ``device``. The
    matching profile under ``find["profiles_dir"]`` at ``find["capacity_bytes"]`` when one holds (said through
    ``inform``), else a calibration there, verified and saved, a line per trial (:func:`vramcal.api.size_for`).

    Raises:
        WorkloadError: a script imported to rebuild a model trains at its top level; a batch that holds no tensor.
        CalibrationError: not even one sample fits, or the trials cannot rebuild or step the model (its first line).
        OSError: the profiles folder cannot be written.
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
    """The vramcal device of a torch device (``device=``): a CUDA GPU by its index among the visible ones, or the
    host.

    Raises:
        TypeError: neither a ``str`` nor a ``torch.device``. ValueError: no torch device (``'bogus'``), or another
            kind than CUDA and the CPU (MPS, TPU, ...). DeviceError: a CUDA device this machine cannot use.
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
