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

import dataclasses
import json
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramcal.calibration.creep import STEADY_STEPS
from vramcal.calibration.limits import LimitSettings
from vramcal.calibration.probe import CalibrationError, calibrate_trials, check_budget
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

__all__ = ["Answer", "CalibrationError", "CalibrationPlan", "LimitSettings", "Profile", "ProfileError", "Sizing",
           "SizingError", "WorkloadError", "answer", "batch_size", "calibrate", "find_profile", "load_profile",
           "model_ref", "plan_calibration", "probe_command", "run_calibration", "select_devices", "size", "verify"]


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
        model: ``regressor`` (params: :class:`~vramcal.models.regressor.RegressorSpec` fields), ``lm``
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
        from vramcal.models.regressor.spec import RegressorSpec

        spec = RegressorSpec.from_dict(params)
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
        seq_lens: two or more sequence lengths calibrated at once (issue 13), else ().
    """

    device: Device
    model: ModelRef
    settings: LimitSettings
    options: dict[str, Any]
    path: Path
    seq_lens: tuple[int, ...] = ()

    @property
    def usable_bytes(self) -> int:
        return self.settings.usable_bytes(self.device.total_bytes)


def plan_calibration(model: str | ModelRef = "regressor", params: dict[str, Any] | None = None, *, device: Device,
                     implementation: str = "auto", settings: LimitSettings = LimitSettings(),
                     options: dict[str, Any] | None = None, profiles_dir: Path | str = DEFAULT_PROFILES_DIR,
                     out: Path | str | None = None, unique_device: bool = False,
                     seq_lens: str | Sequence[int] = ()) -> CalibrationPlan:
    """Check everything knowable before the first trial (:func:`model_ref`, the budget) and place the file.

    Args:
        seq_lens: calibrate several sequence lengths at once (one profile holding the model in
            batch_size × seq_len, :mod:`vramcal.calibration.surface`): a list, or a text as ``--seq-len``
            takes it (``"128,512,2048"``, or a range ``"128:2048"``: its ends and their geometric middle);
            each a multiple of the model's chunk_size; the factory must take ``seq_len``. A single length
            is a one-length calibration at it.

    Raises:
        ValueError, WorkloadError: see :func:`model_ref`; lengths that are not multiples of chunk_size or a
            factory without ``seq_len``; a budget with no usable memory.
    """
    from vramcal.calibration.fit2d import parse_seq_lens

    text = seq_lens if isinstance(seq_lens, str) else ",".join(map(str, seq_lens))
    lengths = parse_seq_lens(text) if text else ()
    if lengths:
        params = {**(params or {}), "seq_len": lengths[0]}
    ref = model_ref(model, params, device=device, implementation=implementation)
    if lengths:
        lengths = _check_lengths(ref, text, device, implementation)
        ref = ref.replace(seq_len=lengths[0]) if len(lengths) == 1 else ref
    check_budget(device, settings)
    options = dict(options or {})
    if ref.family == "regressor" and options.get("data") is not None:
        options["data"] = str(Path(options["data"]).resolve())
    implementation_name = ref.params.get("implementation", "factory")
    key = ref.without("seq_len") if len(lengths) > 1 else ref
    path = Path(out) if out is not None else profile_path(profiles_dir, device, key, implementation_name,
                                                          unique_device)
    return CalibrationPlan(device, ref, settings, options, path, lengths if len(lengths) > 1 else ())


def _check_lengths(ref: ModelRef, text: str, device: Device, implementation: str) -> tuple[int, ...]:
    """The lengths ``text`` asks for (:func:`vramcal.calibration.fit2d.design_lengths`), each a multiple of the
    model's chunk_size and a model the family accepts at it."""
    from vramcal.calibration.fit2d import design_lengths
    from vramcal.calibration.probe import chunk_size
    from vramcal.workload import accepts

    if not ref.family and not accepts(load_factory(ref), "seq_len"):
        raise ValueError(f"--seq-len: {ref.factory} takes no seq_len argument")
    lengths = design_lengths(text, chunk_size(ref))
    for length in lengths:  # e.g. the regressor's spec checks at every length
        model_ref(ref.factory if not ref.family else ref.family,
                  {k: v for k, v in ref.params.items() if k != "implementation"} | {"seq_len": length},
                  device=device, implementation=implementation)
    return lengths


def run_calibration(plan: CalibrationPlan, *, save: bool = True, on_trial: Callable[[Trial], None] | None = None,
                    max_trials: int = 16, timeout_s: float = 900.0, warmup_steps: int = 1, measured_steps: int = 2,
                    val_steps: int = 1, steady_steps: int = STEADY_STEPS, boundary: bool = True) -> Profile:
    """Run the calibration's trials (each in a fresh worker process) and write the profile.

    A user's factory module is imported in each trial process after the meter has pinned the device
    (never preloaded into the fork server): a module that touches CUDA when imported, as
    ``DEVICE = "cuda" if torch.cuda.is_available() else "cpu"`` does, would otherwise start CUDA before
    the pin.

    Args:
        save: write the profile to ``plan.path`` (atomically).
        on_trial: called with each finished trial, in order.
        max_trials: at most this many trials (>= 1; several lengths add 4 per extra length).
        timeout_s: seconds before one trial's process is killed (the trial then counts as ``timeout``).
        warmup_steps, measured_steps, val_steps: training steps per trial: unmeasured, measured (>= 2: the
            peak is the largest of them), and validation batches.
        steady_steps: measured steps of the one steady trial at the verified safe size, which measures how
            much more a long run peaks than a trial (the step creep, calibration/creep.py); 0: none.
        boundary: measure near the out-of-memory boundary (calibration/search.py, rule 3).

    Returns:
        The profile; ``profile.verified`` says whether real trials verified both limits.

    Raises:
        ValueError: ``measured_steps`` below 2, ``steady_steps`` below 0 or ``max_trials`` below 1.
        CalibrationError: the first trial failed: one sample does not fit, or the training step itself
            failed (the factory raised or returned something else, or the step raised; the message
            gives the error's first line and says to fix the step, not the budget).
        OSError: the profile could not be written (the previous file is untouched).
    """
    from vramcal.measure.trial import TrialRunner

    profile = calibrate_trials(plan.device, plan.model, plan.settings, options=plan.options,
                               runner=TrialRunner(timeout_s=timeout_s), on_trial=on_trial, max_trials=max_trials,
                               warmup_steps=warmup_steps, measured_steps=measured_steps, val_steps=val_steps,
                               steady_steps=steady_steps, timeout_s=timeout_s, seq_lens=plan.seq_lens,
                               boundary=boundary)
    if save:
        save_profile(profile, plan.path)
    return profile


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
        trial_settings: ``max_trials``, ``timeout_s``, ``warmup_steps``, ``measured_steps``, ``val_steps``,
            ``steady_steps``, ``boundary`` (:func:`run_calibration`).

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
        from vramcal.models.regressor.spec import RegressorSpec

        defaults = RegressorSpec().to_dict()
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
        WorkloadError, ValueError: ``model`` or ``params`` are not a model vramcal can build (:func:`model_ref`).
        DeviceError, NvmlError: ``device`` is None and no device can be selected.
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
               batch_size_min: int = 1, pool_data_bytes: int | None = None, seq_len: int | None = None) -> int:
    """The batch size to train with (samples): the profile's conservative (or safe) size, or ``request``
    clamped to ``[batch_size_min, safe]`` (:func:`vramcal.sizing.size`, which also gives the predicted peak).

    Args:
        pool_data_bytes: the run's data bytes in the measured memory (None: as much as the calibration held).
        seq_len: the run's sequence length; required for a profile calibrated over several lengths.

    Raises:
        SizingError: the profile has no limits, the bounds are empty, or ``seq_len`` is missing for, or
            outside, what the profile calibrated.
    """
    return size(profile, request, purpose=purpose, batch_size_min=batch_size_min,
                pool_data_bytes=pool_data_bytes, seq_len=seq_len).batch_size


@dataclass(frozen=True)
class Answer:
    """A profile's answer at a sequence length or a batch size (``vramcal limits --seq-len/--batch-size``).

    Attributes:
        seq_len: the length answered at (for ``--batch-size``: the longest that fits).
        batch_size: the batch size answered at (for ``--seq-len``: the safe one).
        safe_batch_size, conservative_batch_size: the limits at ``seq_len``.
        basis: ``verified`` (a calibrated length), ``not verified``, or an interpolation note.
        predicted_peak_bytes, upper_bytes, usable_bytes: the model's figures at (batch_size, seq_len).
    """

    seq_len: int
    batch_size: int
    safe_batch_size: int
    conservative_batch_size: int
    basis: str
    predicted_peak_bytes: int
    upper_bytes: int
    usable_bytes: int


def answer(profile: Profile, *, seq_len: int | None = None, batch_size: int | None = None) -> Answer:
    """The safe and conservative batch sizes at ``seq_len``, or the longest seq_len at ``batch_size``
    (a multiple of chunk_size inside the calibrated range whose upper 95 % bound fits in usable memory).

    Raises:
        SizingError: both or neither given; the profile covers one length only and ``seq_len`` is another
            (or ``batch_size`` is asked); a length outside the calibrated range or not a multiple of
            chunk_size; no length fits ``batch_size``.
    """
    from vramcal.calibration.surface import longest_at
    from vramcal.sizing import length_model

    if (seq_len is None) == (batch_size is None):
        raise SizingError("give --seq-len or --batch-size (one of them)")
    surface, usable = profile.surface, profile.settings.usable_bytes(profile.device.total_bytes)
    own = profile.model.params.get("seq_len")
    if surface is None and (batch_size is not None or seq_len != own):
        raise SizingError(f"the profile was calibrated at seq_len {own} only: calibrate several lengths "
                          f"(vramcal probe --seq-len {own},{seq_len or 2 * own}) to answer at others")
    if batch_size is not None:
        seq_len = longest_at(surface, batch_size, usable)
        if seq_len < 1:
            raise SizingError(f"no seq_len in {min(surface.seq_lens)}-{max(surface.seq_lens)} fits batch_size "
                              f"{batch_size} within usable memory")
    model = length_model(profile, seq_len)
    sizing = size(profile, batch_size, purpose="safe", seq_len=seq_len) if batch_size is None else None
    batch = batch_size if batch_size is not None else sizing.batch_size
    basis = "verified" if model.verified else (model.basis or "not verified")
    return Answer(seq_len, batch, model.limits.safe_batch_size, model.limits.conservative_batch_size, basis,
                  int(model.predict(batch)), int(model.upper(batch)), model.limits.usable_bytes)


def verify(profile: Profile, batch_size: int, seq_len: int | None = None, *, timeout_s: float = 900.0) -> Trial:
    """One real trial of the profile's model at (``batch_size``, ``seq_len``) on the profile's device here
    (the host at the profile's budget), as a calibration's verification runs it and reads it: its
    ``peak_bytes`` includes the profile's step creep at that size (:mod:`vramcal.calibration.creep`), and the
    measured figures stay in its sources (``rss_peak_bytes``, ``data_peak_bytes``, ``nvml_peak_bytes``, ...).

    Raises:
        SizingError: the profile's device is not here.
    """
    from vramcal.calibration.creep import read_peak
    from vramcal.measure.trial import TrialRequest, TrialRunner

    gpu = "none" if profile.device.kind == "host" else (profile.device.uuid or "auto")
    device = select_devices(gpu, profile.device.total_bytes if profile.device.kind == "host" else None)[0][0]
    if device.same_hardware(profile.device):
        raise SizingError(f"the profile was made on {profile.device.name}, this is {device.name}: verify it there")
    device = dataclasses.replace(device, total_bytes=profile.device.total_bytes)
    model = profile.model.replace(seq_len=seq_len) if seq_len is not None else profile.model
    request = TrialRequest(model, batch_size, device, json.dumps(profile.data.get("options", {}), sort_keys=True),
                           host_memory_limit_bytes=device.total_bytes if device.kind == "host" else None)
    trial = dataclasses.replace(TrialRunner(timeout_s=timeout_s).run(request, purpose="verify-answer"), seq_len=seq_len)
    return dataclasses.replace(trial, peak_bytes=read_peak(trial, profile.creep))
