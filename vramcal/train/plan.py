"""Everything decided before the first step: data, run folder, device, model, profile, batch size, LR, budget.

:func:`resolve` decides what runs are sized against (once per run, or once per ``vramcal tune`` study);
:func:`plan_run` decides one run. Checks run cheapest first, and the run folder is created only after every check. A
run that names its batch size trains *unchecked* without a matching profile (``Plan.sizing`` None: DESIGN.md
"Training with a profile")."""

from __future__ import annotations

import datetime as dt
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from vramcal.calibration.limits import LimitSettings
from vramcal.measure.device import free_bytes
from vramcal.models.registry import REGRESSOR
from vramcal.models.regressor.spec import RegressorSpec
from vramcal.models.regressor.step import load_windows as windows_of
from vramcal.models.regressor.windows import Windows
from vramcal.profile import Profile
from vramcal.records import Device, World
from vramcal.service.calibrate import plan_calibration
from vramcal.service.pool import select_devices
from vramcal.sizing import Sizing, SizingError, scaled_lr, size, variants
from vramcal.sizing.lookup import NoProfileError, locate_profile
from vramcal.train import checkpoint, tracking
from vramcal.train.config import ConfigError, TrainConfig, load_config
from vramcal.units import format_bytes, size_argument
from vramcal.words import Info
from vramcal.workload import ModelRef

COLLECTIVE_TIMEOUT_S = 300.0  # a rank's wait at a collective before it raises
HEAD_BYTES = 1 << 20  # the data file's first MiB, hashed into its identity (data_identity)


@dataclass(frozen=True)
class Setting:
    """What runs are sized against (decided once per run, or once per tuning study).

    Attributes:
        profile, profile_path: the profile that sizes the runs (None: an unchecked run).
        data_stats: the data's facts, with ``file``, the data file's identity (:func:`data_identity`).
        pool_data_bytes: bytes of data the run holds in the measured memory (the data term).
        host_memory_limit_bytes: ``RLIMIT_DATA`` of the training process on the host, else None.
    """

    config: TrainConfig
    device: Device
    model: ModelRef
    profile: Profile | None
    profile_path: str | None
    data_stats: dict[str, Any]
    pool_data_bytes: int
    host_memory_limit_bytes: int | None
    notices: tuple[str, ...] = ()

    @property
    def train_windows(self) -> int:
        return int(self.data_stats["train_windows"])


@dataclass(frozen=True)
class Validation:
    """How a run validates (:func:`validation`): ``batch_size`` per chunk, ``source`` (why, for people), and the
    evaluation limit's fit and safe size (``vramcal probe --eval``; None without one)."""

    batch_size: int
    source: str
    eval_overhead_bytes: float | None = None
    eval_slope_bytes_per_sample: float | None = None
    eval_safe_batch_size: int | None = None

    def predicted_at(self, batch_size: int) -> int | None:
        """The evaluation fit's prediction of a validation pass's peak at ``batch_size`` (None: no fit)."""
        if self.eval_overhead_bytes is None or self.eval_slope_bytes_per_sample is None:
            return None
        return int(self.eval_overhead_bytes + self.eval_slope_bytes_per_sample * batch_size)


def validation(profile: Profile | None, asked: int | None, train_batch_size: int) -> tuple[Validation, list[str]]:
    """The validation chunk: ``asked`` (``--val-batch-size``), else the profile's verified evaluation limit's
    conservative size, else the training batch; with a warning when above the safe size (or the training batch)."""
    found = profile.evaluation if profile is not None else None
    if found is None or not found.verified or found.fit is None:
        why = "the profile has no evaluation limit; `vramcal probe --eval` measures one"
        notices = [f"--val-batch-size {asked} is above the training batch {train_batch_size} and unchecked: {why}"] \
            if asked is not None and asked > train_batch_size else []
        return Validation(asked or train_batch_size, "--val-batch-size" if asked else f"the training batch: {why}"), \
            notices
    safe, conservative = found.limits.safe_batch_size, found.limits.conservative_batch_size  # type: ignore[union-attr]
    size = asked or conservative
    notices = [f"--val-batch-size {asked} is above the evaluation limit (safe {safe}, conservative {conservative}): "
               f"validation may run out of memory (it then halves its chunk)"] if size > safe else []
    source = "--val-batch-size" if asked else f"the evaluation limit (conservative; safe {safe})"
    return Validation(size, source, found.fit.overhead_bytes, found.fit.slope_bytes_per_sample, safe), notices


@dataclass(frozen=True)
class Plan:
    """A run, fully decided; sent to the worker that trains.

    Attributes:
        sizing: the batch size and its prediction (under DDP this rank's); None: unchecked, nothing predicted.
        lr: the peak learning rate after ``lr_scaling`` (under DDP set in the worker, from the global batch).
        world, rank: the DDP/FSDP world this rank trains in, or None for one process.
        validation: how it validates; None in runs planned before it was recorded.
    """

    config: TrainConfig
    run_dir: Path
    device: Device
    model: ModelRef
    sizing: Sizing | None
    profile_path: str | None
    lr: float
    data_stats: dict[str, Any]
    host_memory_limit_bytes: int | None
    resume: bool = False
    notices: tuple[str, ...] = ()
    world: World | None = None
    rank: int = 0
    validation: Validation | None = None

    @property
    def batch_size(self) -> int:
        """Samples per forward/backward: what the profile sized (the micro-batch of an effective batch)."""
        return self.config.batch_size if self.sizing is None else self.sizing.batch_size

    @property
    def step_batch_size(self) -> int:
        """Samples per optimizer step: the effective batch, else the batch size."""
        effective = self.config.effective_batch_size if self.sizing is None else self.sizing.effective_batch_size
        return effective or self.batch_size

    @property
    def implementation(self) -> str:
        return str(self.model.params.get("implementation"))

    def factory_options(self) -> dict[str, Any]:
        """The regressor factory's arguments beyond the model's key: the data and the optimizer."""
        c = self.config
        return {**c.data_options(), "lr": self.lr, "weight_decay": c.weight_decay, "max_grad_norm": c.max_grad_norm,
                "seed": c.seed}

    def record(self) -> dict[str, Any]:
        """The content of ``run.json``."""
        return {"config": self.config.to_dict(), "device": self.device.to_dict(), "model": self.model.to_dict(),
                "implementation": self.implementation, "sizing": self.sizing and asdict(self.sizing),
                "profile": self.profile_path,
                "lr": self.lr, "data": self.data_stats, "host_memory_limit_bytes": self.host_memory_limit_bytes,
                "notices": list(self.notices), "validation": self.validation and asdict(self.validation),
                "written_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}

    @classmethod
    def from_record(cls, record: dict[str, Any], run_dir: Path) -> Plan:
        """The plan a run folder's ``run.json`` describes (for ``--resume``)."""
        return cls(config=TrainConfig.from_dict(record["config"]), run_dir=Path(run_dir),
                   device=Device.from_dict(record["device"]), model=ModelRef.from_dict(record["model"]),
                   sizing=record["sizing"] and Sizing.from_dict(record["sizing"]),
                   profile_path=record["profile"], lr=record["lr"], data_stats=record["data"],
                   host_memory_limit_bytes=record["host_memory_limit_bytes"], resume=True,
                   validation=Validation(**record["validation"]) if record.get("validation") else None)


def data_identity(path: str | Path) -> dict[str, Any]:
    """The data file's identity the worker checks before any step: ``size_bytes``, ``mtime_ns`` and ``head_sha256``
    (of its first :data:`HEAD_BYTES`: hashing gigabytes would cost every run seconds).

    Raises:
        OSError: the file cannot be read.
    """
    import hashlib

    with open(path, "rb") as file:
        stat = os.fstat(file.fileno())
        head = hashlib.sha256(file.read(HEAD_BYTES)).hexdigest()
    return {"size_bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "head_sha256": head}


def load_windows(config: TrainConfig) -> Windows:
    """Bars from ``config.data`` cut into windows (:func:`vramcal.models.regressor.step.load_windows`).

    Raises:
        DataError: as that function.
    """

    return windows_of(config.data, config.spec.seq_len, config.stride, config.val_fraction)


def resolve(config: TrainConfig, capacity_bytes: int | None = None, *, world: World | None = None,
            budget_matches: bool = False, unchecked: bool = False) -> Setting:
    """Decide what runs of ``config`` are sized against (module docstring).

    Args:
        capacity_bytes: ``--capacity``: the host budget (default: the profile's), or a GPU narrowed.
        world: the DDP world a rank of which is being sized (its profile must be calibrated for it).
        budget_matches: take the profile calibrated at ``capacity_bytes`` (always so on the host).
        unchecked: with no matching profile and ``config.batch_size`` given, an unchecked setting, not a refusal.

    Raises:
        ValueError, DataError, DeviceError, NvmlError, SizingError, ConfigError (a ``report_to`` not installed):
            one-line messages.
    """

    tracking.check_reporters(config.report_to)
    windows = load_windows(config)
    device, notices = run_device(config, capacity_bytes)
    if config.variant == "auto":
        config = _chosen_variant(config, device, capacity_bytes, world, notices)
    model = REGRESSOR.ref(config.spec, device, config.implementation)  # the spec was checked when the config was made
    located = located_profile(config, device, model, capacity_bytes, world, budget_matches, unchecked, notices)
    limit = host_limit(device, located and located.profile, capacity_bytes, notices)
    pool = windows.pipeline_bytes if device.kind.holds_data or config.data_on_device else 0
    return Setting(config, device, model, located and located.profile, located and str(located.path),
                   {**windows.stats(), "file": data_identity(config.data)}, pool, limit, tuple(notices))


def host_limit(device: Device, profile: Profile | None, capacity_bytes: int | None, notices: list[str]) -> int | None:
    """The training process's host budget (``RLIMIT_DATA``; None on a GPU), its notices added to ``notices``."""
    if not device.kind.budgeted:
        return None
    calibrated = profile.device.total_bytes if profile else device.total_bytes
    limit = capacity_bytes or calibrated
    if profile and limit != calibrated:
        notices.append(f"the profile was calibrated at a budget of {format_bytes(calibrated)}, this run's is "
                       f"{format_bytes(limit)}: its limits describe the calibration's budget "
                       f"(`vramcal probe --capacity {size_argument(limit)}` calibrates this one)")
    notices.append(Info(f"host budget: the training process may hold at most {format_bytes(limit)} of data "
                        f"segment (RLIMIT_DATA: heap and private mappings, as the calibration's trials"
                        f"{'' if capacity_bytes else '; --capacity to change it'}); this command's own process "
                        f"and the worker fork server are outside it (together a few hundred MiB resident)"))
    return limit


def _chosen_variant(config: TrainConfig, device: Device, capacity_bytes: int | None, world: World | None,
                    notices: list[str]) -> TrainConfig:
    """``variant auto``: ``config`` with its fastest calibrated variant's spec
    (:func:`vramcal.sizing.variants.choose`)."""
    named = REGRESSOR.ref(config.spec, device, config.implementation)
    total = capacity_bytes if device.kind.budgeted else None
    found = variants.variants_of(named, device, config.profiles_dir, world=world, total_bytes=total)
    if not found:
        notices.append(f"--variant auto: no calibrated variant of this model in {config.profiles_dir}/: training "
                       f"the spec as given")
        return config
    choice = variants.choose(found, config.size_request(), named)
    notices.append(Info(f"--variant auto, of {len(found)} calibrated: {choice.reason}"))
    notices += [Info(f"--variant auto passed over {line}") for line in choice.passed_over]
    spec, _ = RegressorSpec.from_ref(choice.chosen.profile.model)
    return config.replace(spec=spec)


def located_profile(config: TrainConfig, device: Device, model: ModelRef, capacity_bytes: int | None,
                    world: World | None, budget_matches: bool, unchecked: bool, notices: list[str]):
    """The run's profile located (None: an unchecked run), its notices added to ``notices``.

    Raises:
        SizingError: as :func:`resolve`.
    """
    try:
        located = locate_profile(model, device=device,
                                 profile=None if config.profile == "auto" else config.profile,
                                 profiles_dir=config.profiles_dir, world=world,
                                 total_bytes=capacity_bytes if budget_matches or device.kind.budgeted else None)
    except NoProfileError as error:
        if capacity_bytes is not None and device.kind.budgeted:
            try:  # the probe the refusal names could not calibrate this budget either: say why instead
                LimitSettings().check(capacity_bytes)
            except ValueError as small:
                raise SizingError(f"no profile at this budget, and none can be made: {small}") from None
        if not unchecked or config.batch_size is None:
            raise
        notices.append(f"--batch-size {config.batch_size} is unchecked against memory: no profile matches this run "
                       f"in {config.profiles_dir}/ (`{error.command}` measures what fits); the run's peak is "
                       f"measured" + (", and an out-of-memory step halves the micro-batch" if world is None else ""))
        return None
    notices += list(located.notices)
    return located


def calibration_plan(config: TrainConfig, capacity_bytes: int | None = None):
    """The calibration ``vramcal train --probe`` runs first: this run's model, device and data.

    Raises:
        ConfigError: a profile file named. DataError, DeviceError, NvmlError, ValueError: as :func:`resolve`.
    """

    if config.profile != "auto":
        raise ConfigError("--probe writes a new profile: leave --profile at auto")
    load_windows(config)
    device, _ = run_device(config, capacity_bytes)
    return plan_calibration("regressor", config.spec.to_dict(), device=device,
                                implementation=config.implementation, options=config.data_options(),
                                profiles_dir=config.profiles_dir)


def run_device(config: TrainConfig, capacity_bytes: int | None) -> tuple[Device, list[str]]:
    """The one device a run trains on, and notices (why the host, which of several GPUs)."""

    devices, notice = select_devices(config.gpu, capacity_bytes)
    notices = [notice] if notice else []
    if len(devices) > 1:
        notices.append(Info(f"--gpu {config.gpu}: training uses one GPU, {devices[0].name} ({devices[0].uuid})"))
    return devices[0], notices


def plan_run(config: TrainConfig, run_dir: Path, setting: Setting, prepare: bool = True, ranks: int = 1) -> Plan:
    """Decide a new run of ``config`` in ``run_dir`` against ``setting`` (from :func:`resolve`), sized with what its
    device has free now (:func:`vramcal.measure.device.free_bytes`; host ranks take ``1/ranks`` of it).

    Args:
        prepare: check and create the run folder (a DDP rank's launcher did it already: False).
        ranks: the world's size: each rank's batch is clamped to its share of the training windows.

    Raises:
        SizingError: no batch size within the bounds. RunDirError: the folder holds a run or is unwritable.
    """
    config = config.replace(spec=setting.config.spec)  # the model the setting sized: as given, or a chosen variant
    if prepare:
        checkpoint.check_run_dir(run_dir, resume=False)
    if setting.profile is None:
        return _unchecked_plan(config, run_dir, setting, prepare, ranks)
    ask = config.size_request()
    free, source = free_bytes(setting.device)  # the gate: memory taken since the calibration
    if free is not None and ranks > 1 and setting.device.kind.shared:
        free, source = free // ranks, f"{source}, 1/{ranks} of it for each host rank"
    sizing = size(setting.profile, ask, pool_data_bytes=setting.pool_data_bytes, free_bytes=free, free_source=source)
    notices = list(setting.notices) + list(sizing.notices)
    if config.effective_batch_size is not None and config.effective_batch_size > setting.train_windows:
        raise SizingError(f"--effective-batch-size {config.effective_batch_size} is more than the "
                          f"{setting.train_windows} training windows: lower it, or use more data or a smaller --stride")
    n_train = setting.train_windows // ranks  # a rank's share
    share = f" ({setting.train_windows} over {ranks} ranks)" if ranks > 1 else ""
    if config.effective_batch_size is None and sizing.batch_size > n_train:
        if n_train < config.batch_size_min:
            raise SizingError(f"--batch-size-min {config.batch_size_min} is more than the {n_train} training "
                              f"windows{share}: lower it, or use more data or a smaller --stride")
        notices.append(Info(f"batch size {sizing.batch_size} is more than the {n_train} training windows{share}: "
                            f"one step per epoch of {n_train} samples{' per rank' * (ranks > 1)} (a smaller --stride "
                            f"gives more windows)"))
        capped = size(setting.profile, ask.replace(request=n_train), pool_data_bytes=setting.pool_data_bytes,
                      free_bytes=free, free_source=source)
        sizing = replace(capped, source=sizing.source, capped_by_data=True)
    return _made(config, run_dir, setting, sizing, notices, prepare)


def _unchecked_plan(config: TrainConfig, run_dir: Path, setting: Setting, prepare: bool, ranks: int) -> Plan:
    """:func:`plan_run` without a profile: the config's batch size, capped by the training windows."""
    notices, n_train = list(setting.notices), setting.train_windows // ranks
    effective = config.effective_batch_size
    if effective is not None and effective < config.batch_size:
        raise SizingError(f"--effective-batch-size {effective} is below --batch-size {config.batch_size}: the batch "
                          f"size is the micro-batch that accumulates to it; raise the one or lower the other")
    if (effective or config.batch_size) > n_train:
        if effective is not None:
            raise SizingError(f"--effective-batch-size {effective} is more than the {n_train} training windows: "
                              f"lower it, or use more data or a smaller --stride")
        notices.append(Info(f"batch size {config.batch_size} is more than the {n_train} training windows: one step "
                            f"per epoch of {n_train} samples (a smaller --stride gives more windows)"))
        config = config.replace(batch_size=n_train)
    return _made(config, run_dir, setting, None, notices, prepare)


def _made(config: TrainConfig, run_dir: Path, setting: Setting, sizing: Sizing | None, notices: list[str],
          prepare: bool) -> Plan:
    """The plan decided, its LR scaled to its step's batch, its validation chosen, its folder created if ``prepare``."""
    plan = Plan(config=config, run_dir=Path(run_dir), device=setting.device, model=setting.model, sizing=sizing,
                profile_path=setting.profile_path, lr=config.lr, data_stats=setting.data_stats,
                host_memory_limit_bytes=setting.host_memory_limit_bytes)
    validated, warned = validation(setting.profile, config.val_batch_size, plan.batch_size)
    if prepare:
        checkpoint.prepare_run_dir(run_dir, resume=False)
    return replace(plan, lr=scaled_lr(config.lr, plan.step_batch_size, config.reference_batch_size, config.lr_scaling),
                   notices=tuple(notices + warned), validation=validated)


def resumed(run_dir: Path, overrides: dict[str, Any], stays: str) -> tuple[Plan, TrainConfig]:
    """The saved plan of the run in ``run_dir`` on the device found now (with the run's own budget), and its saved
    config with ``overrides``; a notice where the hardware differs (``stays``: what the run keeps, ``{}`` its batch).

    Raises:
        RunDirError: nothing to resume, or an unreadable run record. ConfigError: a bad override.
        DeviceError, NvmlError: the device is not here.
    """
    run_dir = checkpoint.prepare_run_dir(run_dir, resume=True)
    try:
        plan = Plan.from_record(json.loads((run_dir / checkpoint.RUN).read_text()), run_dir)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise checkpoint.RunDirError(f"{run_dir / checkpoint.RUN} is not a readable run record ({error}): start "
                                     f"a new run") from None
    config = load_config(run_dir / checkpoint.CONFIG).replace(**overrides)
    device = select_devices(config.gpu)[0][0]  # a GPU is pinned by its UUID
    difference = device.hardware_difference(plan.device)
    notices = (f"resuming on other hardware than the run started on ({difference}); {stays.format(plan.batch_size)}",
               ) if difference else ()
    return replace(plan, config=config, device=replace(device, total_bytes=plan.device.total_bytes),
                   notices=notices), config


def plan_resume(run_dir: Path, overrides: dict[str, Any]) -> Plan:
    """The continuation of the run in ``run_dir``: its saved plan with :data:`~vramcal.train.config.RESUME_OVERRIDES`
    in ``overrides`` replaced (the worker checks the data).

    Raises:
        RunDirError: nothing to resume. DataError: the data file is gone or unreadable.
        DeviceError, NvmlError: the device is not here.
    """
    plan, config = resumed(run_dir, overrides, "the batch size stays {}")
    lr = scaled_lr(config.lr, plan.batch_size, config.reference_batch_size, config.lr_scaling) \
        if "lr" in overrides else plan.lr  # scaled to the run's batch as at its start
    # the data file's identity as the run started (None for a run recorded without one): the worker checks it
    return replace(plan, lr=lr, data_stats={**load_windows(config).stats(), "file": plan.data_stats.get("file")})
