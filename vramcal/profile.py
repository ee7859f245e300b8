"""Profiles: the self-describing JSON file a calibration leaves in ``profiles/``, and what training adds.

One file per (device, model, implementation) at ``profiles/<device slug>/<model name>-<key>.json``. It
carries the schema version, vramcal version, UTC creation time, device and the environment seen inside
the trial processes, software versions, the model (factory and arguments), the data the trials held,
raw trials, fit, limits and verification (pytest-benchmark's habit of machine info + versions +
timestamp), and the **observations** of training runs that used it: each run's measured peak beside
the prediction, so the file accumulates evidence of how well it predicts real training.

Files are written atomically (:mod:`vramcal.files`), so a killed run leaves the previous profile
intact. Reading checks every value — types, finiteness, and that the limits agree with the file's own
fit, usable memory and verification trials — and names the first bad field in one line, so a corrupt or
hand-edited file is refused before anything is sized with it (:func:`check_profile`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import fcntl
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramcal.calibration.creep import Creep, measure_creep, steady_equivalent
from vramcal.calibration.fit import Fit
from vramcal.calibration.limits import Limits, LimitSettings, safe_batch_size
from vramcal.calibration.surface import Surface
from vramcal.files import atomic_write_text
from vramcal.models.registry import family_of
from vramcal.records import Device, Trial
from vramcal.units import format_bytes
from vramcal.workload import ModelRef

SCHEMA_VERSION = 2
DEFAULT_PROFILES_DIR = Path("profiles")


class ProfileError(ValueError):
    """A profile file that cannot be read or does not fit the request; the message says what to do."""


@dataclass(frozen=True)
class Verification:
    """The real trial behind a limit: ``passed`` when it finished with peak_bytes <= usable_bytes."""

    batch_size: int
    passed: bool
    peak_bytes: int | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
        samples_per_s, epoch_s: the run's measured training samples/s and mean epoch time (training steps and
            the validation pass) over its complete epochs; None: not measured (older runs, no complete epoch).
        forecast_samples_per_s, forecast_epoch_s: the run forecast's for the same epochs
            (:mod:`vramcal.train.timing`); None: no forecast.
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
    samples_per_s: float | None = None
    epoch_s: float | None = None
    forecast_samples_per_s: float | None = None
    forecast_epoch_s: float | None = None

    @property
    def error(self) -> float:
        """(measured − predicted) / predicted."""
        return (self.peak_bytes - self.predicted_peak_bytes) / self.predicted_peak_bytes

    @property
    def time_error(self) -> float | None:
        """(measured − forecast) / forecast of the epoch time; None without both."""
        if self.epoch_s is None or not self.forecast_epoch_s:
            return None
        return (self.epoch_s - self.forecast_epoch_s) / self.forecast_epoch_s

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
        model_info: what the factory reported about its model (parameter count, ...).
        environment: what the trial processes saw (CUDA, cuDNN, Triton, allocator settings, ...).
        observations: training runs that used the profile, oldest first.
        surface: for a calibration over several sequence lengths, the model in batch_size × seq_len and
            the limits verified at each length (``model`` then has no ``seq_len``; ``fit``, ``limits`` and
            ``verification`` are the reference length's). None for one length.
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
    warnings: tuple[str, ...] = ()
    software: dict[str, str | None] = field(default_factory=dict)
    run: dict[str, Any] = field(default_factory=dict)
    created_utc: str = ""
    vramcal_version: str = ""
    schema_version: int = SCHEMA_VERSION

    @property
    def verified(self) -> bool:
        """Both the safe and the conservative batch size ran for real within usable memory (at every
        calibrated length)."""
        return (self.limits is not None and self.limits.safe_batch_size > 0
                and all(self.verification.get(k) and self.verification[k].passed for k in ("safe", "conservative"))
                and (self.surface is None or all(entry.verified for entry in self.surface.lengths)))

    def covers(self, model: ModelRef) -> bool:
        """Whether the profile sizes ``model``: the same model, or (over several lengths) the same model at a
        seq_len inside the calibrated range."""
        if self.surface is None:
            return model == self.model
        seq_len = model.params.get("seq_len")
        return (isinstance(seq_len, int) and model.without("seq_len") == self.model
                and self.surface.covers(seq_len))

    @property
    def creep(self) -> Creep | None:
        """The step creep its steady trial measured (:mod:`vramcal.calibration.creep`; None: not measured).
        The fit, limits and verification peaks include it; the trials keep their raw peaks."""
        return measure_creep(self.trials)

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
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        """Raises: ProfileError for another schema version or a bad value (:func:`check_profile`);
        KeyError/TypeError for missing or unknown fields."""
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ProfileError(f"schema version {data.get('schema_version')!r} is not {SCHEMA_VERSION} (made by "
                               f"another vramcal, whose trials measured a different program)")
        profile = cls(
            device=Device.from_dict(data["device"]), model=ModelRef.from_dict(data["model"]),
            implementation=data["implementation"], kernel_path=data["kernel_path"],
            settings=LimitSettings(**data["settings"]),
            trials=tuple(Trial.from_dict(t) for t in data["trials"]),
            fit=Fit.from_dict(data["fit"]) if data["fit"] else None,
            limits=Limits.from_dict(data["limits"]) if data["limits"] else None,
            verification={k: Verification(**v) for k, v in data["verification"].items()},
            data=data["data"], model_info=data["model_info"], environment=data["environment"],
            observations=tuple(Observation(**o) for o in data["observations"]),
            surface=Surface.from_dict(data["surface"]) if data.get("surface") else None,
            warnings=tuple(data["warnings"]), software=data["software"], run=data["run"],
            created_utc=data["created_utc"], vramcal_version=data["vramcal_version"],
            schema_version=data["schema_version"])
        check_profile(profile)
        return profile


# ------------------------------------------------------------------------------------------- checks

def check_profile(profile: Profile) -> None:
    """Refuse a profile whose values cannot be trusted, naming the field (a corrupt or hand-edited file).

    Checks the types of every record; that every number is finite; that sizes are positive; and that
    the limits agree with the file's own evidence: usable memory with the settings and total, the safe
    size with what the fit's upper bound allows and below any failed batch size, conservative ≤ safe,
    and each verification with a recorded trial at that size.

    Raises:
        ProfileError: the first bad field and why.
    """
    surface = profile.surface
    for record in (profile, profile.device, profile.settings, profile.fit, profile.limits, *profile.trials,
                   *profile.verification.values(), *profile.observations, surface, surface and surface.fit,
                   *(surface.lengths if surface else ())):
        if record is not None:
            _check_fields(record)
    if profile.device.total_bytes <= 0:
        raise ProfileError(f"device.total_bytes = {profile.device.total_bytes} is not positive")
    if profile.fit is not None:
        _check_fit(profile.fit)
    if profile.limits is not None:
        _check_limits(profile)
    if surface is not None:
        _check_surface(profile, surface)


def _check_fields(record: Any) -> None:
    """Types against the annotations, and every float finite."""
    hints = typing.get_type_hints(type(record))
    name = type(record).__name__
    for item in dataclasses.fields(record):
        value = getattr(record, item.name)
        if not _has_type(value, hints[item.name]):
            raise ProfileError(f"{name}.{item.name} = {value!r} is not {_hint_text(hints[item.name])}")
        values = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise ProfileError(f"{name}.{item.name} = {value!r} is not a finite number")


def _check_fit(fit: Fit) -> None:
    if fit.n_points != len(fit.batch_sizes) or len(fit.batch_sizes) != len(fit.peak_bytes):
        raise ProfileError(f"fit.n_points = {fit.n_points} does not match its {len(fit.batch_sizes)} points")
    if not 0 <= fit.r_squared <= 1:
        raise ProfileError(f"fit.r_squared = {fit.r_squared} is outside [0, 1]")
    if fit.residual_stderr_bytes < 0 or fit.batch_sxx <= 0:
        raise ProfileError("fit.residual_stderr_bytes or fit.batch_sxx is negative or zero")


def _check_limits(profile: Profile) -> None:
    limits, fit, settings = profile.limits, profile.fit, profile.settings
    assert limits is not None
    if fit is None:
        raise ProfileError("limits are given without a fit")
    if limits.total_bytes != profile.device.total_bytes:
        raise ProfileError(f"limits.total_bytes = {limits.total_bytes} is not device.total_bytes "
                           f"{profile.device.total_bytes}")
    if limits.usable_bytes != settings.usable_bytes(limits.total_bytes):
        raise ProfileError(f"limits.usable_bytes = {limits.usable_bytes} does not follow from the total and the "
                           f"settings ({settings.usable_bytes(limits.total_bytes)})")
    if not 0 <= limits.conservative_batch_size <= limits.safe_batch_size:
        raise ProfileError(f"limits.conservative_batch_size = {limits.conservative_batch_size} is not within "
                           f"[0, safe_batch_size {limits.safe_batch_size}]")
    allowed = safe_batch_size(fit, limits.usable_bytes)
    trials = steady_equivalent(profile.trials)  # what the fit and the verifications were computed from
    evidence = [t for t in trials if t.batch_size == limits.safe_batch_size]
    verified = bool(evidence) and all(t.fits(limits.usable_bytes) for t in evidence)
    if limits.safe_batch_size > allowed and not verified:  # the search never reports less than what fitted
        raise ProfileError(f"limits.safe_batch_size = {limits.safe_batch_size} is above what the file's own fit "
                           f"allows in {format_bytes(limits.usable_bytes)} ({allowed}) and no trial there fitted")
    if limits.failed_batch_size is not None and limits.safe_batch_size >= limits.failed_batch_size:
        raise ProfileError(f"limits.safe_batch_size = {limits.safe_batch_size} is not below the failed batch size "
                           f"{limits.failed_batch_size}")
    sizes = {"safe": limits.safe_batch_size, "conservative": limits.conservative_batch_size}
    for name, check in profile.verification.items():
        if name not in sizes or check.batch_size != sizes[name]:
            raise ProfileError(f"verification.{name}.batch_size = {check.batch_size} is not the {name} batch size "
                               f"{sizes.get(name)}")
        if not any(t.batch_size == check.batch_size and t.peak_bytes == check.peak_bytes for t in trials):
            raise ProfileError(f"verification.{name}: no recorded trial at batch_size {check.batch_size} with "
                               f"peak_bytes {check.peak_bytes}")
        if check.passed != (check.peak_bytes is not None and check.peak_bytes <= limits.usable_bytes):
            raise ProfileError(f"verification.{name}.passed = {check.passed} contradicts its peak "
                               f"{check.peak_bytes} against usable {limits.usable_bytes}")


def _check_surface(profile: Profile, surface: Surface) -> None:
    """Each calibrated length's limits against the trials recorded at that length."""
    usable = profile.settings.usable_bytes(profile.device.total_bytes)
    for entry in surface.lengths:
        if not 0 <= entry.conservative_batch_size <= entry.safe_batch_size:
            raise ProfileError(f"surface seq_len {entry.seq_len}: conservative_batch_size "
                               f"{entry.conservative_batch_size} is not within [0, safe {entry.safe_batch_size}]")
        for name, size, peak in (("safe", entry.safe_batch_size, entry.safe_peak_bytes),
                                 ("conservative", entry.conservative_batch_size, entry.conservative_peak_bytes)):
            if peak is None:
                continue
            trials = [t for t in steady_equivalent(profile.trials)
                      if t.seq_len == entry.seq_len and t.batch_size == size]
            if not trials or not all(t.fits(usable) for t in trials) or peak not in [t.peak_bytes for t in trials]:
                raise ProfileError(f"surface seq_len {entry.seq_len}: the {name} batch size {size} has no fitting "
                                   f"trial with peak_bytes {peak}")


def _has_type(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, arg) for arg in args)
    if origin is typing.Literal:
        return value in args
    if origin is tuple:
        return isinstance(value, tuple) and all(_has_type(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _hint_text(hint: Any) -> str:
    return re.sub(r"\b(typing|vramcal\.[\w.]+)\.", "", str(hint)).replace("<class '", "").replace("'>", "")


# ------------------------------------------------------------------------------------------- files

def profile_name(model: ModelRef, implementation: str) -> str:
    """``<model name>-<implementation>-<model key>``: the family (or the user factory's function name), the
    implementation, and 8 hex digits of the model's key."""
    return f"{family_of(model).label(model)}-{implementation}-{model.key()}"


def profile_path(profiles_dir: Path | str, device: Device, model: ModelRef, implementation: str,
                 unique_device: bool = False) -> Path:
    """``<profiles_dir>/<device slug>/<model name>-<implementation>-<model key>.json``.

    ``unique_device`` adds the GPU's identity to the folder, for several identical cards (``--gpu all``).
    """
    slug = device.slug(unique=True) if unique_device else device.slug()
    return Path(profiles_dir) / slug / f"{profile_name(model, implementation)}.json"


def save_profile(profile: Profile, path: Path | str) -> Path:
    """Write ``profile`` as JSON (sorted keys, 2-space indent) atomically; returns the path.

    Raises:
        OSError: the folder cannot be written; the previous file is then untouched.
    """
    atomic_write_text(Path(path), json.dumps(profile.to_dict(), indent=2, sort_keys=True) + "\n")
    return Path(path)


def load_profile(path: Path | str) -> Profile:
    """Read and check a profile file (:func:`check_profile`).

    Raises:
        ProfileError: missing, unreadable, not JSON, another schema version, a missing field or a bad
            value; the message names the file (and the field) and says how to get a good one.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ProfileError(f"its top level is a JSON {type(data).__name__}, not an object")
        return Profile.from_dict(data)
    except FileNotFoundError:
        raise ProfileError(f"profile {path} does not exist: run `vramcal probe` to make one") from None
    except IsADirectoryError:
        raise ProfileError(f"profile {path} is a folder: name a profile file (*.json)") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ProfileError(f"profile {path} cannot be read ({error})") from None
    except json.JSONDecodeError as error:
        raise ProfileError(f"profile {path} is not valid JSON (line {error.lineno}): it is corrupt or "
                           f"truncated; re-run `vramcal probe` to replace it") from None
    except ProfileError as error:
        raise ProfileError(f"profile {path}: {error}; re-run `vramcal probe` to replace it") from None
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ProfileError(f"profile {path} is not a vramcal profile (bad or missing field: {error}); "
                           f"re-run `vramcal probe` to replace it") from None


def newest_profile(profiles_dir: Path | str, device: Device, model: ModelRef) -> tuple[Path | None, list[str]]:
    """The newest readable profile under ``profiles_dir`` for this device's hardware and this model.

    Returns:
        The path (None when there is none), and one line for each matching-looking file that could not
        be used (unreadable or failing its checks), so a bad file is reported rather than passed over
        in silence.
    """
    candidates, skipped = [], []
    for path in sorted(Path(profiles_dir).glob("**/*.json")):
        try:
            profile = load_profile(path)
        except ProfileError as error:
            if model.key() in path.name:
                skipped.append(str(error))
            continue
        if profile.covers(model) and device.hardware_difference(profile.device) is None:
            candidates.append((profile.created_utc, str(path)))
    return (Path(max(candidates)[1]) if candidates else None), skipped


def check_profile_matches(profile: Profile, device: Device, model: ModelRef) -> None:
    """Raises: ProfileError naming the first difference in device or model."""
    difference = device.hardware_difference(profile.device)
    if difference:
        raise ProfileError(f"the profile was made on another device ({difference}): run `vramcal probe` here")
    if not profile.covers(model):
        if profile.surface is not None and model.without("seq_len") == profile.model:
            raise ProfileError(f"seq_len {model.params.get('seq_len')} is outside the profile's calibrated lengths "
                               f"{min(profile.surface.seq_lens)}-{max(profile.surface.seq_lens)}: calibrate it "
                               f"(vramcal probe --seq-len ...)")
        ours, theirs = model.params, profile.model.params
        diffs = [f"{k}={ours.get(k)} (profile {theirs.get(k)})" for k in sorted(set(ours) | set(theirs))
                 if ours.get(k) != theirs.get(k)]
        what = ", ".join(diffs) if profile.model.factory == model.factory else f"factory {profile.model.factory}"
        raise ProfileError(f"the profile was made for another model: {what}; probe this model or pass matching "
                           f"options")


def append_observation(path: Path | str, observation: Observation) -> Profile:
    """Add a training run's observation to the profile file, atomically and under a lock (several runs
    may finish at once).

    Raises:
        ProfileError: the file is no longer a readable profile. OSError: it cannot be written.
    """
    path = Path(path)
    lock_path = path.with_name(f".{path.name}.lock")
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        profile = load_profile(path)
        profile = dataclasses.replace(profile, observations=(*profile.observations, observation))
        save_profile(profile, path)
    return profile


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
