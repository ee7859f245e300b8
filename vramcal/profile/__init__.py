"""Profiles: the self-describing JSON file a calibration leaves in ``profiles/``, and what training adds.

One file per (device, model, implementation) at ``profiles/<device slug>/<model name>-<key>.json``. It
carries the schema version, vramcal version, UTC creation time, device and the environment seen inside
the trial processes, software versions, the model (factory and arguments), the data the trials held,
raw trials, fit, limits and verification (pytest-benchmark's habit of machine info + versions +
timestamp), and the **observations** of training runs that used it: each run's measured peak beside
the prediction, so the file accumulates evidence of how well it predicts real training.

Files are written atomically (:mod:`vramcal.files`), so a killed run leaves the previous profile
intact. Reading goes through one checked schema: every field typed and ranged (:meth:`Profile.from_dict`,
the records' own ``from_dict``, :mod:`vramcal.schema`), then related to the others by the rules the writer
follows (:mod:`vramcal.profile.checks`); the first bad field is named in one line, so a corrupt or
hand-edited file is refused before anything is sized with it, and whatever a calibration writes reads back.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import fcntl
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramcal.calibration.creep import Creep, CreepRule, measure_creep
from vramcal.calibration.fit import Fit
from vramcal.calibration.limits import Limits, LimitSettings
from vramcal.calibration.surface import Surface
from vramcal.files import atomic_write_text
from vramcal.models.registry import family_of
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
                                              "world_size": AT_LEAST_ONE})


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
        world: the DDP world the trials ran in (every limit is then per rank), or None for one process.
        single_process: in a DDP profile, the DDP term: the per-rank peak at the safe size against a
            single-process profile of the same model and device (``profile``, ``batch_size``,
            ``predicted_peak_bytes``, ``ddp_peak_bytes``, ``term_bytes``), when one was found.
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
    world: World | None = None
    single_process: dict[str, Any] | None = None
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
        plateau = self.run.get("plateau_steps")
        return measure_creep(self.trials, *([plateau] if isinstance(plateau, int) else []), rule=self.creep_rule)

    @property
    def creep_rule(self) -> CreepRule:
        """Which steady trial's creep counts where two ran (:func:`~vramcal.calibration.creep.measure_creep`):
        the calibration's ``run.creep_rule``; ``last`` in profiles made before it was recorded."""
        return "largest" if self.run.get("creep_rule") == "largest" else "last"

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
            "world": self.world.to_dict() if self.world else None, "single_process": self.single_process,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        """The profile a file's JSON object holds: every field typed and ranged (:mod:`vramcal.schema`), then
        related to the others (:func:`vramcal.profile.checks.check_profile`).

        Raises:
            ProfileError: not a vramcal profile, another schema version, or the first bad field and why (one
                line naming the field; :func:`load_profile` adds the file and the fix).
        """
        _check_identity(data)
        missing = [key for key in FIELDS if key not in data and key not in OPTIONAL]
        if missing:
            raise ProfileError(f"{missing[0]} is missing")
        try:
            profile = read_record(cls, {k: v for k, v in data.items() if k not in DERIVED}, "", readers=_READERS)
        except SchemaError as error:
            raise ProfileError(str(error)) from None
        check_profile(profile)
        check_derived(profile, {k: data[k] for k in DERIVED if k in data})
        return profile


# The keys :meth:`Profile.to_dict` writes: the fields, and three derived from them (checked against them where a
# file has them: ``creep`` came with the step creep, so earlier files of the schema lack it).
FIELDS = tuple(f.name for f in dataclasses.fields(Profile))
# Came later than the schema: the calibration over several lengths (surface), DDP (world, single_process).
OPTIONAL = ("surface", "world", "single_process")
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
    "surface": _nullable(Surface.from_dict), "data": _read_data, "world": _nullable(World.from_dict),
}


# ------------------------------------------------------------------------------------------- files

def profile_name(model: ModelRef, implementation: str, world: World | None = None) -> str:
    """``<model name>-<implementation>-<model key>``: the family (or the user factory's function name), the
    implementation, and 8 hex digits of the model's key; a DDP world adds ``-ddp<ranks>`` (and 6 hex digits
    of its settings when they are not DDP's defaults)."""
    name = f"{family_of(model).label(model)}-{implementation}-{model.key()}"
    if world is None:
        return name
    settings = {k: v for k, v in world.to_dict().items() if k not in ("nproc", "backend")}
    default = settings == {k: v for k, v in World(2).to_dict().items() if k not in ("nproc", "backend")}
    tail = "" if default else "-" + hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:6]
    return f"{name}-ddp{world.nproc}{tail}"


def profile_path(profiles_dir: Path | str, device: Device, model: ModelRef, implementation: str,
                 unique_device: bool = False, world: World | None = None) -> Path:
    """``<profiles_dir>/<device slug>/<profile name>.json`` (:func:`profile_name`); a host budget given as
    ``--capacity`` adds it (``-1.5gib``), so calibrations of the host at two budgets (the ranks of a DDP run
    with budgets of their own) keep two files.

    ``unique_device`` adds the GPU's identity to the folder, for several identical cards (``--gpu all``).
    """
    slug = device.slug(unique=True) if unique_device else device.slug()
    budget, total = "", device.total_bytes
    if device.kind == "host" and device.total_source == "--capacity":
        budget = f"-{total / 2**30:.4g}gib" if total >= 2**30 else f"-{total / 2**20:.4g}mib"
    return Path(profiles_dir) / slug / f"{profile_name(model, implementation, world)}{budget}.json"


def save_profile(profile: Profile, path: Path | str) -> Path:
    """Write ``profile`` as JSON (sorted keys, 2-space indent) atomically; returns the path.

    Raises:
        OSError: the folder cannot be written; the previous file is then untouched.
    """
    atomic_write_text(Path(path), json.dumps(profile.to_dict(), indent=2, sort_keys=True) + "\n")
    return Path(path)


def load_profile(path: Path | str) -> Profile:
    """Read and check a profile file (:meth:`Profile.from_dict`, :func:`check_profile`).

    Raises:
        ProfileError: missing, a folder or no regular file, unreadable, empty, not JSON, nested too deeply,
            not a vramcal profile, another schema version, a missing field or a bad value; one line naming
            the file (and the field) and how to get a good one.
    """
    path = Path(path)
    replace = "re-run `vramcal probe` to replace it"
    try:
        text = _read_text(path)
        if not text.strip():
            raise ProfileError(f"profile {path} is empty: it is no profile (a write was cut short?); {replace}")
        return Profile.from_dict(json.loads(text))
    except json.JSONDecodeError as error:
        raise ProfileError(f"profile {path} is not valid JSON (line {error.lineno}): it is corrupt or "
                           f"truncated; {replace}") from None
    except RecursionError:
        raise ProfileError(f"profile {path} is nested too deeply to be a profile: it is corrupt; {replace}") from None
    except ProfileError as error:
        if str(error).startswith(f"profile {path} "):
            raise
        raise ProfileError(f"profile {path}: {error}; {replace}") from None


def _read_text(path: Path) -> str:
    """Raises: ProfileError: no such file, a folder, no regular file (a device or pipe), unreadable."""
    if not path.exists():
        raise ProfileError(f"profile {path} does not exist: run `vramcal probe` to make one, or name an existing "
                           f"file")
    if path.is_dir():
        raise ProfileError(f"profile {path} is a folder: name a profile file (*.json)")
    if not path.is_file():
        raise ProfileError(f"profile {path} is not a regular file (a device, pipe or socket): name a profile file "
                           f"(*.json)")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ProfileError(f"profile {path} is not UTF-8 text: it is no profile; name a profile file (*.json)") \
            from None
    except OSError as error:
        raise ProfileError(f"profile {path} cannot be read ({error.strerror or error}): check its permissions") \
            from None


def newest_profile(profiles_dir: Path | str, device: Device, model: ModelRef, world: World | None = None,
                   total_bytes: int | None = None) -> tuple[Path | None, list[str]]:
    """The newest readable profile under ``profiles_dir`` for this device's hardware, this model and this DDP
    ``world`` (None: one process), and, when ``total_bytes`` is given, this budget.

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
        if (profile.covers(model) and device.hardware_difference(profile.device) is None and profile.world == world
                and total_bytes in (None, profile.device.total_bytes)):
            candidates.append((profile.created_utc, str(path)))
    return (Path(max(candidates)[1]) if candidates else None), skipped


def check_profile_matches(profile: Profile, device: Device, model: ModelRef, world: World | None = None) -> None:
    """Raises: ProfileError naming the first difference in device, DDP world or model."""
    difference = device.hardware_difference(profile.device)
    if difference:
        raise ProfileError(f"the profile was made on another device ({difference}): run `vramcal probe` here")
    if profile.world != world:
        raise ProfileError(world_difference(profile.world, world))
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


def world_difference(calibrated: World | None, run: World | None) -> str:
    """Why a profile of ``calibrated`` cannot size a run of ``run`` (DDP worlds; None: one process), with the
    command that calibrates the run's: a DDP rank holds gradient buckets and communication buffers a single
    process does not, and they differ with the world's settings."""
    what = calibrated.describe() if calibrated else "one process"
    if run is None:
        return (f"the profile was calibrated for {what}, this run is one process: calibrate it without --nproc, or "
                f"train with the profile's world")
    return (f"the profile was calibrated for {what}, this run is {run.describe()}: a rank's memory depends on the "
            f"world (gradient buckets, communication buffers); calibrate it with `vramcal probe --nproc "
            f"{run.nproc}` and the same DDP settings")


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


from vramcal.profile.checks import check_derived, check_profile  # noqa: E402 - the checks read the records above
