"""The profile's records: what a calibration's file holds, each field typed and ranged when read.

:class:`Profile` (device, model, settings, trials, fit, limits, verification, the surface of several lengths,
the DDP world, and the :class:`Observation` of each training run that used it) and :class:`Verification`;
:class:`ProfileError`, the one-line refusal every reader of a profile gives. The relations between the fields
are :mod:`vramcal.profile.checks`; the files, :mod:`vramcal.profile`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramcal.calibration.creep import Creep, CreepRule, measure_creep
from vramcal.calibration.evaluation import EvalLimits
from vramcal.calibration.fit import Fit
from vramcal.calibration.lengths import LengthSizing
from vramcal.calibration.limits import Limits, LimitSettings
from vramcal.calibration.surface import Surface
from vramcal.records import Device, Trial, World
from vramcal.schema import (
    AT_LEAST_ONE,
    NON_NEGATIVE,
    POSITIVE,
    SchemaError,
    kind,
    plain,
    read_list,
    read_map,
    read_number,
    read_record,
)
from vramcal.workload import ModelRef, WorkloadError


class ProfileError(ValueError):
    """A profile file that cannot be read or does not fit the request; the message says what to do."""


SCHEMA_VERSION = 2
DEFAULT_PROFILES_DIR = Path("profiles")


@dataclass(frozen=True)
class Verification:
    """The real trial behind a limit: ``passed`` when it finished with peak_bytes <= usable_bytes."""

    batch_size: int
    passed: bool
    peak_bytes: int | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "verification") -> Verification:
        """Raises: SchemaError: a field missing, unknown, of the wrong type or out of range (named)."""
        return read_record(cls, data, where, {"batch_size": AT_LEAST_ONE, "peak_bytes": POSITIVE})


@dataclass(frozen=True)
class Observation:
    """One training run that used the profile: what it measured against what the profile predicted.

    Attributes:
        recorded_utc: when the run ended (ISO 8601, UTC).
        vramcal_version: the vramcal that trained.
        batch_size: samples per optimizer step of the run.
        data_bytes: bytes of data the run held in the measured memory (all of it on the host).
        peak_bytes: the run's measured peak, by the trials' definition (DESIGN.md).
        predicted_peak_bytes, upper_bytes: the profile's point prediction and upper 95 % bound for
            the run, the data term included.
        usable_bytes: the profile's usable memory.
        steps: optimizer steps the run made.
        run_dir: the run folder.
        rank, world_size: under DDP, the rank this observation is of and the world's ranks (each rank records
            its own peak against its own profile); None for one process.
        framework: who trained, when not ``vramcal train`` (``lightning``, ``transformers.Trainer``,
            ``accelerate``, ``plain``).
        process_delta_bytes: the process term in the prediction (:mod:`vramcal.sizing`), when measured.
        samples_per_s, epoch_s: the run's measured training samples/s and mean epoch time (training steps and
            the validation pass) over its complete epochs; None: not measured (older runs, no complete epoch).
        forecast_samples_per_s, forecast_epoch_s: the run forecast's for the same epochs
            (:mod:`vramcal.train.timing`); None: no forecast.
        time_band: how far (a fraction) the epoch time may land from the forecast by the step times' own noise,
            at least 25 % (:func:`vramcal.forecast.time_band`); None: not recorded (older runs: 25 %).
        warn_bytes: the warning line the run was held against (:attr:`vramcal.sizing.Sizing.line_bytes`); None
            in older runs, held against ``upper_bytes`` (:attr:`line_bytes`).
        train_samples, val_samples, data_source: the epoch the run's forecast counted (its own windows: its data
            and stride; under DDP this rank's share) and where they came from, which the report's forecast counts
            (:func:`vramcal.forecast.default_dataset`); None: not recorded (older runs, no forecast).
        peak_unseen: what of the process ``peak_bytes`` leaves out, which makes it a lower bound (a framework's run
            on a GPU where NVML gives no per-process figure and CUDA started before vramcal attached:
            :class:`vramcal.measure.meters.AttachedCudaMeter`); None: nothing.
        out_of_memory: the run ran out of memory at ``batch_size`` after ``steps`` steps, its peak then
            ``peak_bytes`` against ``predicted_peak_bytes``: evidence that caps what later runs take
            (:func:`vramcal.sizing.run_failure_cap`).
    """

    recorded_utc: str
    vramcal_version: str
    batch_size: int
    data_bytes: int
    peak_bytes: int
    predicted_peak_bytes: int
    upper_bytes: int
    usable_bytes: int
    steps: int
    run_dir: str
    rank: int | None = None
    world_size: int | None = None
    framework: str | None = None
    process_delta_bytes: int | None = None
    samples_per_s: float | None = None
    epoch_s: float | None = None
    forecast_samples_per_s: float | None = None
    forecast_epoch_s: float | None = None
    time_band: float | None = None
    warn_bytes: int | None = None
    train_samples: int | None = None
    val_samples: int | None = None
    data_source: str | None = None
    peak_unseen: str | None = None
    out_of_memory: bool = False

    @property
    def line_bytes(self) -> int:
        """The warning line the run was held against: ``warn_bytes``, or ``upper_bytes`` in an older record."""
        return self.warn_bytes or self.upper_bytes

    @property
    def error(self) -> float:
        """(measured − predicted) / predicted; infinite when the prediction is not positive (a line fitted near
        the limit, with a negative overhead, predicts nothing at small batches)."""
        if self.predicted_peak_bytes <= 0:
            return math.inf
        return (self.peak_bytes - self.predicted_peak_bytes) / self.predicted_peak_bytes

    @property
    def time_error(self) -> float | None:
        """(measured − forecast) / forecast of the epoch time; None without both."""
        if self.epoch_s is None or not self.forecast_epoch_s:
            return None
        return (self.epoch_s - self.forecast_epoch_s) / self.forecast_epoch_s

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "observations[0]") -> Observation:
        """Raises: SchemaError: a field missing, unknown, of the wrong type or out of range (named)."""
        return read_record(cls, data, where, {"batch_size": AT_LEAST_ONE, "data_bytes": NON_NEGATIVE,
                                              "peak_bytes": POSITIVE, "usable_bytes": POSITIVE,
                                              "steps": NON_NEGATIVE, "rank": NON_NEGATIVE,
                                              "world_size": AT_LEAST_ONE, "warn_bytes": POSITIVE,
                                              "train_samples": AT_LEAST_ONE, "val_samples": NON_NEGATIVE})


@dataclass(frozen=True)
class Profile:
    """A calibration result. ``fit``/``limits`` are None when the search could not fit a line.

    Attributes:
        model: what was calibrated (the factory and its arguments).
        implementation: the Mamba-2 implementation (``transformers``, ``mamba_ssm``; ``factory`` for a
            user's model, whose kernels are in ``kernel_path``).
        kernel_path: the kernels that ran, as seen inside the trial processes.
        data: the data the trials held: ``source``, ``data_bytes`` (host memory), ``on_device`` and
            ``pool_bytes`` (the part in the measured memory: all of it on the host).
        model_info: what the factory reported about its model (parameter count, ...), and ``gradient_bytes``
            (what vramcal counted in the trial: the bytes of the gradients a step holds).
        environment: what the trial processes saw (CUDA, cuDNN, Triton, allocator settings, ...).
        observations: training runs that used the profile, oldest first.
        surface: for a calibration over several sequence lengths, the model in batch_size × seq_len and
            the limits verified at each length (``model`` then has no ``seq_len``; ``fit``, ``limits`` and
            ``verification`` are the reference length's). None for one length.
        lengths: over several lengths, the bucket table and the token budget, and the trials that verify them at
            their worst case (:mod:`vramcal.calibration.lengths`); None for one length and older profiles.
        evaluation: the evaluation limit (the evaluation pass alone, :mod:`vramcal.calibration.evaluation`), when
            the calibration measured it (``vramcal probe --eval``); None otherwise and in older profiles.
        world: the DDP world the trials ran in (every limit is then per rank), or None for one process.
        single_process: in a DDP profile, the DDP term: the per-rank peak at the safe size against a
            single-process profile of the same model and device (``profile``, ``batch_size``,
            ``predicted_peak_bytes``, ``ddp_peak_bytes``, ``term_bytes``), when one was found.
        path: the file the profile was read from (:func:`vramcal.profile.load_profile`) or written to (a
            calibration's); None for one built in memory. Not part of the file, nor of equality.
    """

    device: Device
    model: ModelRef
    implementation: str
    kernel_path: str
    settings: LimitSettings
    trials: tuple[Trial, ...]
    fit: Fit | None
    limits: Limits | None
    verification: dict[str, Verification] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    model_info: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    observations: tuple[Observation, ...] = ()
    surface: Surface | None = None
    lengths: LengthSizing | None = None
    evaluation: EvalLimits | None = None
    world: World | None = None
    single_process: dict[str, Any] | None = None
    warnings: tuple[str, ...] = ()
    software: dict[str, str | None] = field(default_factory=dict)
    run: dict[str, Any] = field(default_factory=dict)
    created_utc: str = ""
    vramcal_version: str = ""
    schema_version: int = SCHEMA_VERSION
    path: Path | None = field(default=None, compare=False, repr=False)

    @property
    def verified(self) -> bool:
        """Both the safe and the conservative batch size ran for real within usable memory (at every
        calibrated length)."""
        return (self.limits is not None and self.limits.safe_batch_size > 0
                and all(self.verification.get(k) and self.verification[k].passed for k in ("safe", "conservative"))
                and (self.surface is None or all(entry.verified for entry in self.surface.lengths)))

    def covers(self, model: ModelRef) -> bool:
        """Whether the profile sizes ``model``: the same model, or (over several lengths) the same model at a
        seq_len inside the calibrated range, or with no seq_len (a run of every length in it: a language model's on
        documents of every length, :mod:`vramcal.train.lm_plan`)."""
        if self.surface is None or "seq_len" not in model.params:
            return model == self.model
        seq_len = model.params.get("seq_len")
        return (isinstance(seq_len, int) and model.without("seq_len") == self.model
                and self.surface.covers(seq_len))

    @property
    def creep(self) -> Creep | None:
        """The step creep its steady trial measured (:mod:`vramcal.calibration.creep`; None: not measured).
        The fit, limits and verification peaks include it; the trials keep their raw peaks."""
        plateau = self.run.get("plateau_steps")
        return measure_creep(self.trials, *([plateau] if isinstance(plateau, int) else []), rule=self.creep_rule)

    @property
    def creep_rule(self) -> CreepRule:
        """Which steady trial's creep counts where two ran (:func:`~vramcal.calibration.creep.measure_creep`):
        the calibration's ``run.creep_rule``; ``last`` in profiles made before it was recorded."""
        return "largest" if self.run.get("creep_rule") == "largest" else "last"

    def __iter__(self):
        """Code written for vramcal 0.1, whose ``find_profile`` returned ``(profile, path, notices)``, unpacks the
        answer: it gets this line instead of "cannot unpack non-iterable Profile object".

        Raises:
            TypeError: always; a profile is one record, not a tuple.
        """
        raise TypeError("vramcal.find_profile() returns the Profile itself since vramcal 0.2 (0.1 returned "
                        "(profile, path, notices)): write `profile = vramcal.find_profile(...)`, or take the path "
                        "and notices from vramcal.locate_profile(...).path and .notices")

    @property
    def held_bytes(self) -> int | None:
        """What the trials' processes held when their step was built, before the first step (the median over the
        short trials that recorded it; None in profiles made before it was recorded): the baseline of the
        process term (:mod:`vramcal.sizing`)."""
        import statistics

        held = [t.held_bytes for t in self.trials if t.ok and t.held_bytes is not None and t.purpose != "steady"]
        return int(statistics.median(held)) if held else None

    @property
    def reference_trials(self) -> list[Trial]:
        """The trials of the one-length fit, limits and verification: all of them, or for a calibration over
        several lengths those at the reference length (the others are the surface's)."""
        if self.surface is None:
            return list(self.trials)
        return [t for t in self.trials if t.seq_len in (None, self.surface.reference_seq_len)]

    @property
    def pool_data_bytes(self) -> int:
        """Bytes of data the trials held in the measured memory (the data term of sizing)."""
        return int(self.data.get("pool_bytes", 0))

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version, "vramcal_version": self.vramcal_version,
            "created_utc": self.created_utc, "device": self.device.to_dict(), "environment": self.environment,
            "software": self.software, "model": self.model.to_dict(), "model_key": self.model.key(),
            "implementation": self.implementation, "kernel_path": self.kernel_path,
            "settings": self.settings.to_dict(), "run": self.run, "data": self.data, "model_info": self.model_info,
            "trials": [t.to_dict() for t in self.trials],
            "fit": self.fit.to_dict() if self.fit else None,
            "limits": self.limits.to_dict() if self.limits else None,
            "verification": {k: v.to_dict() for k, v in self.verification.items()},
            "verified": self.verified, "warnings": list(self.warnings),
            "creep": self.creep.to_dict() if self.creep else None,
            "observations": [o.to_dict() for o in self.observations],
            "surface": self.surface.to_dict() if self.surface else None,
            "lengths": self.lengths.to_dict() if self.lengths else None,
            "evaluation": self.evaluation.to_dict() if self.evaluation else None,
            "world": self.world.to_dict() if self.world else None, "single_process": self.single_process,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        """The profile a file's JSON object holds, every field typed and ranged (:mod:`vramcal.schema`); how the
        fields relate to each other is checked by :func:`vramcal.profile.checks.read_profile`, which reads files.

        Raises:
            ProfileError: not a vramcal profile, another schema version, or the first bad field and why (one
                line naming the field; :func:`vramcal.profile.load_profile` adds the file and the fix).
        """
        _check_identity(data)
        if "path" in data:  # where a profile lies is not written in it
            raise ProfileError("path is not a field of a profile file: remove it")
        missing = [key for key in FIELDS if key not in data and key not in OPTIONAL]
        if missing:
            raise ProfileError(f"{missing[0]} is missing")
        try:
            profile = read_record(cls, {k: v for k, v in data.items() if k not in DERIVED}, "", readers=_READERS)
        except SchemaError as error:
            raise ProfileError(str(error)) from None
        return profile


# The keys :meth:`Profile.to_dict` writes: the fields, and three derived from them (checked against them where a
# file has them: ``creep`` came with the step creep, so earlier files of the schema lack it).
FIELDS = tuple(f.name for f in dataclasses.fields(Profile) if f.name != "path")
# Came later than the schema: the calibration over several lengths (surface), DDP (world, single_process), lengths
# that vary (lengths), the evaluation limit (evaluation).
OPTIONAL = ("surface", "world", "single_process", "lengths", "evaluation")
DERIVED = ("model_key", "verified", "creep")


def _check_identity(data: dict[str, Any]) -> None:
    """Raises: ProfileError: no profile at all, or one of another schema version."""
    if not isinstance(data, dict):
        raise ProfileError(f"its top level is {kind(data)}, not a JSON object: it is not a vramcal profile")
    version = data.get("schema_version")
    if "schema_version" not in data and not {"device", "trials", "fit", "limits"} & set(data):
        raise ProfileError("it is not a vramcal profile (it has no schema_version, device or trials): name a file "
                           "that `vramcal probe` wrote")
    if version != SCHEMA_VERSION or isinstance(version, bool):
        raise ProfileError(f"schema_version {version!r} is not {SCHEMA_VERSION} (made by another vramcal, whose "
                           f"trials measured a different program)")


def _nullable(read: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    return lambda value, path: None if value is None else read(value, path)


def _read_model(value: Any, path: str) -> ModelRef:
    """Raises: SchemaError: not ``{"factory": "module:function", "params": {...}}``."""
    if not isinstance(value, dict) or set(value) != {"factory", "params"}:
        raise SchemaError(path, f"{path} is not an object of factory and params")
    if not isinstance(value["factory"], str) or not isinstance(value["params"], dict):
        raise SchemaError(path, f"{path}.factory must be a string and {path}.params an object")
    try:
        return ModelRef.make(value["factory"], plain(value["params"], f"{path}.params"))
    except WorkloadError as error:
        raise SchemaError(path, f"{path}: {error}") from None


def _read_data(value: Any, path: str) -> dict[str, Any]:
    """The data the trials held: an object whose byte counts are whole numbers >= 0 and ``on_device`` a bool.

    Raises:
        SchemaError: a bad value, named.
    """
    data = plain(value, path) if isinstance(value, dict) else None
    if data is None:
        raise SchemaError(path, f"{path} is {kind(value)}, not an object")
    for key in ("pool_bytes", "data_bytes"):
        if key in data:
            read_number(data[key], f"{path}.{key}", int, NON_NEGATIVE)
    if not isinstance(data.get("on_device", False), bool):
        raise SchemaError(f"{path}.on_device", f"{path}.on_device = {data['on_device']!r} is not true or false")
    return data


_READERS = {
    "device": Device.from_dict, "model": _read_model, "settings": LimitSettings.from_dict,
    "trials": lambda value, path: read_list(value, path, Trial.from_dict),
    "fit": _nullable(Fit.from_dict), "limits": _nullable(Limits.from_dict),
    "verification": lambda value, path: read_map(value, path, Verification.from_dict, ("safe", "conservative")),
    "observations": lambda value, path: read_list(value, path, Observation.from_dict),
    "surface": _nullable(Surface.from_dict), "lengths": _nullable(LengthSizing.from_dict),
    "evaluation": _nullable(EvalLimits.from_dict), "data": _read_data, "world": _nullable(World.from_dict),
}
