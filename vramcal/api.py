"""vramcal's public API: calibrate a training step on a device, find its profile, size a run.

Every command is an adapter over these functions; a user's own script is too::

    import vramcal

    profile = vramcal.calibrate("mytrain:make_step", gpu="auto")   # real trials, verified limits, saved
    batch_size = vramcal.batch_size(profile)                        # the conservative batch size
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True)

where ``mytrain.make_step(device, **params)`` returns a :class:`vramcal.TrainingStep` (see
:mod:`vramcal.workload`). Models are named by family (``regressor``, the bundled default; ``lm``, a
Mamba-2 language model from a transformers config) or by ``module:function``.

What is decided where: :func:`model_ref` turns a model choice and a device into the profile's key
(checking the arguments and resolving ``implementation="auto"``); :func:`plan_calibration` adds the
budget and the file; :func:`run_calibration` runs the trials; :func:`vramcal.sizing.size` turns a
profile into a batch size and its predicted peak. Each returns a record that the next one takes.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramcal.calibrate.limits import LimitSettings
from vramcal.calibrate.probe import CalibrationError, calibrate_trials, check_budget
from vramcal.profile import (
    DEFAULT_PROFILES_DIR,
    Profile,
    ProfileError,
    check_profile_matches,
    load_profile,
    profile_path,
    save_profile,
)
from vramcal.records import Device, Trial
from vramcal.sizing import Purpose, Sizing, SizingError, size
from vramcal.workload import ModelRef, WorkloadError, load_factory

__all__ = ["CalibrationError", "CalibrationPlan", "LimitSettings", "Profile", "ProfileError", "Sizing",
           "SizingError", "WorkloadError", "batch_size", "calibrate", "find_profile", "load_profile",
           "model_ref", "plan_calibration", "probe_command", "run_calibration", "select_devices", "size"]


def select_devices(gpu: str = "auto", capacity_bytes: int | None = None) -> tuple[list[Device], str | None]:
    """Resolve a ``--gpu`` choice (``auto``, ``none``, ``all``, a CUDA index or a UUID) to devices.

    Returns:
        The devices, and a one-line notice (e.g. why the host was chosen) or None.

    Raises:
        DeviceError: no such device here. NvmlError: a GPU asked for explicitly, NVML unusable.
    """
    from vramcal.measure.device import select

    return select(gpu, capacity_bytes)


def model_ref(model: str | ModelRef = "regressor", params: dict[str, Any] | None = None, *, device: Device,
              implementation: str = "auto") -> ModelRef:
    """The key of what to calibrate or train on ``device``: the factory, its checked arguments, and for
    vramcal's families a concrete implementation (``auto`` picks ``mamba_ssm`` on a GPU where its
    kernels import, else ``transformers``).

    Args:
        model: ``regressor`` (params: :class:`~vramcal.models.regressor.ModelSpec` fields), ``lm``
            (params: ``config``, a JSON file or dict of ``Mamba2Config`` settings, ``seq_len``,
            ``dtype``), ``module:function`` (params: the factory's keyword arguments), or a ModelRef.

    Raises:
        ValueError: an impossible spec or config, a dtype the device cannot run, an implementation
            that cannot run here. WorkloadError: a user factory that cannot be imported.
    """
    from vramcal.models.mamba2 import resolve_implementation

    if isinstance(model, ModelRef):
        return model
    params = dict(params or {})
    if model == "regressor":
        from vramcal.models.regressor import ModelSpec

        spec = ModelSpec.from_dict(params)
        spec.validate()
        _check_dtype(device, spec.dtype)
        return spec.ref(resolve_implementation(implementation, device.kind))
    if model == "lm":
        from vramcal.models.lm import check_params, read_config

        if "config" not in params or "seq_len" not in params:
            raise ValueError("--model lm needs --model-arg config=<Mamba2Config JSON file> and --seq-len")
        params["config"] = read_config(params["config"])
        params.setdefault("dtype", "fp32")
        check_params(params["config"], params["seq_len"], params["dtype"])
        _check_dtype(device, params["dtype"])
        return ModelRef.make("lm", {**params, "implementation": resolve_implementation(implementation, device.kind)})
    ref = ModelRef.make(model, params)
    load_factory(ref)  # a missing module or function fails here, in one line, before any trial
    return ref


def _check_dtype(device: Device, dtype: str) -> None:
    if dtype == "bf16-autocast" and device.kind != "cuda":
        raise ValueError("dtype bf16-autocast is for CUDA GPUs; use --dtype fp32 on the host")
    from vramcal.measure import device as devices

    check = getattr(devices, "check_dtype", None)
    if check is not None:
        check(device, dtype)


@dataclass(frozen=True)
class CalibrationPlan:
    """A calibration, fully decided before its first trial.

    Attributes:
        device: where to measure (its ``total_bytes`` is the budget).
        model: what to calibrate (the profile's key).
        settings: reserve, margin and conservative fraction.
        options: factory arguments that do not change the model (the regressor's data file).
        path: where the profile will be written.
    """

    device: Device
    model: ModelRef
    settings: LimitSettings
    options: dict[str, Any]
    path: Path

    @property
    def usable_bytes(self) -> int:
        return self.settings.usable_bytes(self.device.total_bytes)


def plan_calibration(model: str | ModelRef = "regressor", params: dict[str, Any] | None = None, *, device: Device,
                     implementation: str = "auto", settings: LimitSettings = LimitSettings(),
                     options: dict[str, Any] | None = None, profiles_dir: Path | str = DEFAULT_PROFILES_DIR,
                     out: Path | str | None = None, unique_device: bool = False) -> CalibrationPlan:
    """Check everything knowable before the first trial (:func:`model_ref`, the budget) and place the file.

    Raises:
        ValueError, WorkloadError: see :func:`model_ref`; a budget with no usable memory.
    """
    ref = model_ref(model, params, device=device, implementation=implementation)
    check_budget(device, settings)
    options = dict(options or {})
    if ref.family == "regressor" and options.get("data") is not None:
        options["data"] = str(Path(options["data"]).resolve())
    implementation_name = ref.params.get("implementation", "factory")
    path = Path(out) if out is not None else profile_path(profiles_dir, device, ref, implementation_name,
                                                          unique_device)
    return CalibrationPlan(device, ref, settings, options, path)


def run_calibration(plan: CalibrationPlan, *, save: bool = True, on_trial: Callable[[Trial], None] | None = None,
                    max_trials: int = 16, timeout_s: float = 900.0, warmup_steps: int = 1, measured_steps: int = 2,
                    val_steps: int = 1) -> Profile:
    """Run the calibration's trials (each in a fresh worker process) and write the profile.

    A user's factory module is imported in each trial process after the meter has pinned the device
    (never preloaded into the fork server): a module that touches CUDA when imported, as
    ``DEVICE = "cuda" if torch.cuda.is_available() else "cpu"`` does, would otherwise start CUDA before
    the pin.

    Returns:
        The profile; ``profile.verified`` says whether real trials verified both limits.

    Raises:
        CalibrationError: the first trial failed: one sample does not fit, or the training step itself
            failed (the factory raised or returned something else, or the step raised; the message
            gives the error's first line and says to fix the step, not the budget).
        OSError: the profile could not be written (the previous file is untouched).
    """
    from vramcal.measure.trial import TrialRunner

    trials: list[Trial] = []

    def record(trial: Trial) -> None:
        trials.append(trial)
        if on_trial is not None:
            on_trial(trial)

    runner = TrialRunner(timeout_s=timeout_s)
    try:
        profile = calibrate_trials(plan.device, plan.model, plan.settings, options=plan.options, runner=runner,
                                   on_trial=record, max_trials=max_trials, warmup_steps=warmup_steps,
                                   measured_steps=measured_steps, val_steps=val_steps, timeout_s=timeout_s)
    except CalibrationError:
        if trials and trials[0].status == "error":
            raise CalibrationError(_step_failure(plan.model, trials[0])) from None
        raise
    if save:
        save_profile(profile, plan.path)
    return profile


def _step_failure(model: ModelRef, trial: Trial) -> str:
    """Why a calibration's first trial crashed (status ``error``), in one line: the exception's first line
    (read from the trial's traceback tail) and that the training step, not the budget, needs fixing."""
    header = _exception_header(trial.error or "")
    name = model.family or model.factory
    return (f"the training step of {name} failed in the first trial (batch_size {trial.batch_size}), before any "
            f"memory limit: {header}: fix the step (call the factory and one step by hand to see the traceback)")


def _exception_header(tail: str) -> str:
    """``Type: first line`` of the last exception in a traceback's tail (its frames are indented lines;
    the header is the first unindented line after the last frame). vramcal's own WorkloadError is shown
    by its message alone (it names the factory)."""
    lines = tail.strip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    rest = [line for line in lines[(frames[-1] + 1 if frames else 0):] if line and not line.startswith(" ")]
    header = rest[0] if rest else (lines[-1] if lines else "no error text recorded")
    kind, sep, message = header.partition(": ")
    if sep and kind.rpartition(".")[2] == "WorkloadError":
        return message[:300]
    return f"{kind.rpartition('.')[2]}{sep}{message}"[:300]


def calibrate(model: str | ModelRef = "regressor", params: dict[str, Any] | None = None, *, gpu: str = "auto",
              capacity_bytes: int | None = None, implementation: str = "auto",
              settings: LimitSettings = LimitSettings(), options: dict[str, Any] | None = None,
              profiles_dir: Path | str = DEFAULT_PROFILES_DIR, save: bool = True,
              on_trial: Callable[[Trial], None] | None = None, **trial_settings: Any) -> Profile:
    """Calibrate a training step on one device and (by default) save its profile under ``profiles_dir``.

    Args:
        model, params: see :func:`model_ref`.
        gpu: ``auto`` (the first visible GPU, else the host), ``none`` (the host), a CUDA index or a UUID.
        capacity_bytes: a budget below the device's memory (bytes); on the host, trials run under
            ``RLIMIT_DATA`` = the budget.
        settings: reserve (bytes), margin and conservative fraction.
        trial_settings: ``max_trials``, ``timeout_s``, ``warmup_steps``, ``measured_steps``, ``val_steps``.

    Returns:
        The profile: ``limits.safe_batch_size`` and ``limits.conservative_batch_size`` (samples), the fit
        ``peak_bytes = overhead_bytes + slope_bytes_per_sample × batch_size``, and ``verified``.

    Raises:
        DeviceError, NvmlError: no such device. ValueError, WorkloadError: bad model arguments.
        CalibrationError: not even one sample fits. OSError: the profile cannot be written.
    """
    devices, _ = select_devices(gpu, capacity_bytes)
    if len(devices) != 1:
        raise ValueError(f"gpu={gpu!r} names {len(devices)} devices: calibrate them one at a time")
    plan = plan_calibration(model, params, device=devices[0], implementation=implementation, settings=settings,
                            options=options, profiles_dir=profiles_dir)
    return run_calibration(plan, save=save, on_trial=on_trial, **trial_settings)


def probe_command(device: Device, ref: ModelRef) -> str:
    """The ``vramcal probe`` command line that makes a missing profile (non-default options only)."""
    gpu = "none" if device.kind == "host" else "auto"
    params = ref.params
    implementation = params.pop("implementation", None)
    if ref.family == "regressor":
        from vramcal.models.regressor import ModelSpec

        defaults = ModelSpec().to_dict()
        args = [f"--{k.replace('_', '-')} {params[k]}" for k in defaults
                if k not in ("n_features", "d_conv", "n_groups") and k in params and defaults[k] != params[k]]
    elif ref.family == "lm":
        args = ["--model lm", "--model-arg config=<its config file>", f"--seq-len {params['seq_len']}"]
    else:
        args = [f"--model {ref.factory}", *(f"--model-arg {shlex.quote(f'{k}={_arg_text(v)}')}"
                                            for k, v in params.items())]
    return " ".join(["vramcal probe", f"--gpu {gpu}", *([f"--impl {implementation}"] if implementation else []),
                     *args])


def _arg_text(value: Any) -> str:
    """A ``--model-arg`` value that reads back as ``value`` (:class:`vramcal.cli.options.KeyValue` reads JSON,
    else text)."""
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError:
            return value
    return json.dumps(value)


def find_profile(model: str | ModelRef = "regressor", params: dict[str, Any] | None = None, *,
                 device: Device | None = None, implementation: str = "auto",
                 profiles_dir: Path | str = DEFAULT_PROFILES_DIR, path: Path | str | None = None
                 ) -> tuple[Profile, Path, list[str]]:
    """The profile for a model on a device: the newest matching one under ``profiles_dir``, or ``path``.

    Returns:
        The checked profile, its path, and notices (e.g. matching files that failed their checks).

    Raises:
        SizingError: none matches (the message gives the ``vramcal probe`` command that makes one), or
            ``path`` is for another device or model (names the difference), or has no limits.
    """
    from vramcal.profile import find_profile as search

    if device is None:
        device = select_devices("auto")[0][0]
    ref = model_ref(model, params, device=device, implementation=implementation)
    notices: list[str] = []
    if path is None:
        found, notices = search(profiles_dir, device, ref)
        if found is None:
            bad = f" ({len(notices)} matching file(s) failed their checks: {notices[0]})" if notices else ""
            raise SizingError(f"no profile for {device.name} and {ref.short()} in {profiles_dir}/{bad}: run "
                              f"`{probe_command(device, ref)}` first")
        path = found
    try:
        profile = load_profile(path)
        check_profile_matches(profile, device, ref)
    except ProfileError as error:
        raise SizingError(str(error) if str(error).startswith("profile ") else f"{path}: {error}") from None
    if profile.limits is None or profile.fit is None or profile.limits.safe_batch_size < 1:
        raise SizingError(f"{path}: the profile has no usable limits (nothing fitted or nothing fits): re-run "
                          f"`{probe_command(device, ref)}`")
    return profile, Path(path), notices


def batch_size(profile: Profile, purpose: Purpose = "conservative", *, request: int | None = None,
               batch_size_min: int = 1, pool_data_bytes: int | None = None) -> int:
    """The batch size to train with: the profile's conservative (or safe) size, or ``request`` clamped to
    ``[batch_size_min, safe]`` (:func:`vramcal.sizing.size`, which also gives the predicted peak).

    Raises:
        SizingError: the profile has no limits, or the bounds are empty.
    """
    return size(profile, request, purpose=purpose, batch_size_min=batch_size_min,
                pool_data_bytes=pool_data_bytes).batch_size


# The package vramcal.calibrate (the calibration's modules) and this function share the name
# ``vramcal.calibrate``: importing the package binds the name to it, over the function that
# ``vramcal.__getattr__`` would give. This module imports the package (above), so it binds the name back
# to the public function here. (Renaming the package would remove the clash.)
sys.modules["vramcal"].calibrate = calibrate
