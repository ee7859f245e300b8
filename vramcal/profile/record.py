"""The profile's records, each field typed and ranged when read: :class:`Profile`, :class:`Observation`,
:class:`Verification`, and :class:`ProfileError`, the one-line refusal every reader of a profile gives.
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
    """One training run that used the profile: what it measured against what the profile predicted (bytes).

    Attributes:
        recorded_utc: when the run ended (ISO 8601, UTC). batch_size: samples per optimizer step.
        data_bytes: data held in the measured memory. peak_bytes: the measured peak (the trials' definition).
        predicted_peak_bytes, upper_bytes: the prediction and its upper 95 % bound, the data term included.
        rank, world_size: under DDP, this rank and the world's ranks; None for one process.
        framework: who trained when not ``vramcal train``. process_delta_bytes: the process term, when measured.
        samples_per_s, epoch_s: measured over complete epochs; forecast_samples_per_s, forecast_epoch_s: the
            forecast's (:mod:`vramcal.train.timing`); time_band: the epoch time's allowed fraction off
            (:func:`vramcal.forecast.time_band`). None: not measured or recorded (older runs).
        warn_bytes: the warning line held against (None in older runs: ``upper_bytes``, :attr:`line_bytes`).
        train_samples, val_samples, data_source: the epoch the forecast counted
            (:func:`vramcal.forecast.default_dataset`).
        peak_unseen: what ``peak_bytes`` leaves out, making it a lower bound
            (:class:`vramcal.measure.meters.AttachedCudaMeter`); None: nothing.
        out_of_memory: the run ran out of memory at ``batch_size`` after ``steps`` steps
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
        """``warn_bytes``, or ``upper_bytes`` in an older record."""
        return self.warn_bytes or self.upper_bytes

    @property
    def error(self) -> float:
        """(measured − predicted) / predicted; infinite when the prediction is not positive."""
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
    """A calibration result; ``fit``/``limits`` None when no line could be fitted.

    Attributes:
        implementation: ``transformers``, ``mamba_ssm`` or ``factory`` (a user's model: see ``kernel_path``).
        data: ``source``, ``data_bytes`` (host memory), ``on_device``, ``pool_bytes`` (in the measured memory).
        model_info: what the factory reported (parameter count, ...) and the ``gradient_bytes`` counted.
        environment: what the trial processes saw (CUDA, cuDNN, Triton, allocator settings, ...).
        surface: over several seq_lens, the model in batch_size × seq_len (``model`` then has no ``seq_len``; fit,
            limits and verification are the reference length's); lengths: the bucket table and token budget
            (:mod:`vramcal.calibration.lengths`); evaluation: ``probe --eval``'s limit. None: not calibrated.
        world: the DDP/FSDP world (limits per rank); single_process: its world term against a single-process
            profile, when one was found. None: one process.
        path: the file read or written (not part of the file, nor of equality); None in memory.
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
        """The safe and conservative batch sizes ran within usable memory (at every calibrated length)."""
        return (self.limits is not None and self.limits.safe_batch_size > 0
                and all(self.verification.get(k) and self.verification[k].passed for k in ("safe", "conservative"))
                and (self.surface is None or all(entry.verified for entry in self.surface.lengths)))

    def covers(self, model: ModelRef) -> bool:
        """Whether the profile sizes ``model``: the same, or over several lengths at a seq_len in range or none."""
        if self.surface is None or "seq_len" not in model.params:
            return model == self.model
        seq_len = model.params.get("seq_len")
        return (isinstance(seq_len, int) and model.without("seq_len") == self.model
                and self.surface.covers(seq_len))

    @property
    def creep(self) -> Creep | None:
        """The step creep its steady trial measured (:mod:`vramcal.calibration.creep`), None if not."""
        plateau = self.run.get("plateau_steps")
        return measure_creep(self.trials, *([plateau] if isinstance(plateau, int) else []), rule=self.creep_rule)

    @property
    def creep_rule(self) -> CreepRule:
        """Which steady trial's creep counts where two ran: ``run.creep_rule``, else ``last``."""
        return "largest" if self.run.get("creep_rule") == "largest" else "last"

    def __iter__(self):
        """Raises: TypeError: always, saying how vramcal 0.1's ``(profile, path, notices)`` is written now."""
        raise TypeError("vramcal.find_profile() returns the Profile itself since vramcal 0.2 (0.1 returned "
                        "(profile, path, notices)): write `profile = vramcal.find_profile(...)`, or take the path "
                        "and notices from vramcal.locate_profile(...).path and .notices")

    @property
    def held_bytes(self) -> int | None:
        """The short trials' median of what a process held once its step was built (the process term's baseline,
        :mod:`vramcal.sizing`); None where not recorded."""
        import statistics

        held = [t.held_bytes for t in self.trials if t.ok and t.held_bytes is not None and t.purpose != "steady"]
        return int(statistics.median(held)) if held else None

    @property
    def reference_trials(self) -> list[Trial]:
        """The trials of the one-length fit: all, or over several lengths those at the reference length."""
        if self.surface is None:
            return list(self.trials)
        return [t for t in self.trials if t.seq_len in (None, self.surface.reference_seq_len)]

    @property
    def pool_data_bytes(self) -> int:
        """Bytes of data the trials held in the measured memory (the data term of sizing)."""
        return int(self.data.get("pool_bytes", 0))

    def to_dict(self) -> dict[str, Any]:
        """The file's JSON object: the fields (records by their ``to_dict``) and the :data:`DERIVED` keys."""
        return {**{name: _written(getattr(self, name)) for name in FIELDS}, "model_key": self.model.key(),
                "verified": self.verified, "creep": _written(self.creep)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        """A file's JSON object, each field typed and ranged (:mod:`vramcal.schema`; relations:
        :func:`vramcal.profile.checks.read_profile`).

        Raises:
            ProfileError: not a vramcal profile, another schema version, or the first bad field (one line).
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


# The keys :meth:`Profile.to_dict` writes: the fields, and three derived from them (earlier files may lack creep)
FIELDS = tuple(f.name for f in dataclasses.fields(Profile) if f.name != "path")
# Came later than the schema
OPTIONAL = ("surface", "world", "single_process", "lengths", "evaluation")
DERIVED = ("model_key", "verified", "creep")


def _written(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, tuple | list):
        return [_written(item) for item in value]
    return {key: _written(item) for key, item in value.items()} if isinstance(value, dict) else value


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
    """Raises: SchemaError: ``data`` not an object of whole byte counts >= 0 and a bool ``on_device``."""
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
