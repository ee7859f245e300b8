"""Profiles: the self-describing JSON file a calibration leaves in ``profiles/``.

One file per (device, model spec, implementation) at
``profiles/<device slug>/<implementation>-<spec key>.json``. It carries the schema version, vramcal
version, UTC creation time, device, software versions, model spec, raw trials, fit, limits and
verification (pytest-benchmark's habit of machine info + versions + timestamp). Written atomically
(temporary file in the same folder, fsync, ``os.replace``), so a killed run leaves the previous
profile intact; read back through the same dataclasses, with one-line errors for bad files.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramcal.calibrate.fit import Fit
from vramcal.calibrate.limits import Limits, LimitSettings
from vramcal.files import atomic_write_text
from vramcal.model import ModelSpec
from vramcal.records import Device, Trial

SCHEMA_VERSION = 1
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
        return {"batch_size": self.batch_size, "passed": self.passed, "peak_bytes": self.peak_bytes}


@dataclass(frozen=True)
class Profile:
    """A calibration result. ``fit``/``limits`` are None when the search could not fit a line."""

    device: Device
    spec: ModelSpec
    implementation: str
    kernel_path: str
    settings: LimitSettings
    trials: tuple[Trial, ...]
    fit: Fit | None
    limits: Limits | None
    verification: dict[str, Verification] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    software: dict[str, str | None] = field(default_factory=dict)
    run: dict[str, Any] = field(default_factory=dict)
    created_utc: str = ""
    vramcal_version: str = ""
    schema_version: int = SCHEMA_VERSION

    @property
    def verified(self) -> bool:
        """Both the safe and the conservative batch size ran for real within usable memory."""
        return (self.limits is not None and self.limits.safe_batch_size > 0
                and all(self.verification.get(k) and self.verification[k].passed
                        for k in ("safe", "conservative")))

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version, "vramcal_version": self.vramcal_version,
            "created_utc": self.created_utc, "device": self.device.to_dict(), "software": self.software,
            "spec": self.spec.to_dict(), "spec_key": self.spec.key(), "implementation": self.implementation,
            "kernel_path": self.kernel_path, "settings": self.settings.to_dict(), "run": self.run,
            "trials": [t.to_dict() for t in self.trials],
            "fit": self.fit.to_dict() if self.fit else None,
            "limits": self.limits.to_dict() if self.limits else None,
            "verification": {k: v.to_dict() for k, v in self.verification.items()},
            "verified": self.verified, "warnings": list(self.warnings),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        """Raises: ProfileError for another schema version; KeyError/TypeError for missing fields."""
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ProfileError(f"schema version {data.get('schema_version')!r} is not {SCHEMA_VERSION}")
        profile = cls(
            device=Device.from_dict(data["device"]), spec=ModelSpec.from_dict(data["spec"]),
            implementation=data["implementation"], kernel_path=data["kernel_path"],
            settings=LimitSettings(**data["settings"]),
            trials=tuple(Trial.from_dict(t) for t in data["trials"]),
            fit=Fit.from_dict(data["fit"]) if data["fit"] else None,
            limits=Limits.from_dict(data["limits"]) if data["limits"] else None,
            verification={k: Verification(**v) for k, v in data["verification"].items()},
            warnings=tuple(data["warnings"]), software=data["software"], run=data["run"],
            created_utc=data["created_utc"], vramcal_version=data["vramcal_version"],
            schema_version=data["schema_version"])
        for record in (profile, profile.device, profile.spec, profile.settings, profile.fit, profile.limits,
                       *profile.trials, *profile.verification.values()):
            if record is not None:
                check_field_types(record)
        if profile.limits is not None and min(profile.limits.safe_batch_size,
                                              profile.limits.conservative_batch_size) < 0:
            raise ValueError("negative batch size in limits")
        return profile


def check_field_types(record: Any) -> None:
    """Check a dataclass read from JSON against its annotations (int, float, str, bool, ``X | None``,
    ``Literal``, ``tuple[T, ...]``, ``dict``), so a hand-edited profile fails here in one line and not
    later in arithmetic.

    Raises:
        TypeError: the first field whose value does not have the annotated type, by name.
    """
    hints = typing.get_type_hints(type(record))
    for item in dataclasses.fields(record):
        value = getattr(record, item.name)
        if not _has_type(value, hints[item.name]):
            raise TypeError(f"{type(record).__name__}.{item.name} = {value!r} is not {hints[item.name]}")


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


def profile_path(profiles_dir: Path, device: Device, spec: ModelSpec, implementation: str) -> Path:
    """``<profiles_dir>/<device slug>/<implementation>-<spec key>.json``."""
    return Path(profiles_dir) / device.slug() / f"{implementation}-{spec.key()}.json"


def save_profile(profile: Profile, path: Path) -> Path:
    """Write ``profile`` as JSON (sorted keys, 2-space indent) atomically; returns the path."""
    atomic_write_text(Path(path), json.dumps(profile.to_dict(), indent=2, sort_keys=True) + "\n")
    return Path(path)


def load_profile(path: Path | str) -> Profile:
    """Read a profile file.

    Raises:
        ProfileError: missing, unreadable, not JSON, another schema version or missing fields; the
            message names the file and says how to get a good one.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        return Profile.from_dict(data)
    except FileNotFoundError:
        raise ProfileError(f"profile {path} does not exist: run `vramcal probe` to make one") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ProfileError(f"profile {path} cannot be read ({error})") from None
    except json.JSONDecodeError as error:
        raise ProfileError(f"profile {path} is not valid JSON (line {error.lineno}): it is corrupt or "
                           f"truncated; re-run `vramcal probe` to replace it") from None
    except ProfileError as error:
        raise ProfileError(f"profile {path}: {error}; re-run `vramcal probe` with this vramcal") from None
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ProfileError(f"profile {path} is not a vramcal profile (bad or missing field: {error}); "
                           f"re-run `vramcal probe` to replace it") from None


def find_profile(profiles_dir: Path, device: Device, spec: ModelSpec,
                 implementation: str | None = None) -> Path | None:
    """The newest readable profile under ``profiles_dir`` for this device's hardware and this spec.

    Looks in the device's folder first, then everywhere below ``profiles_dir``; unreadable files are
    skipped. ``implementation`` None accepts any implementation.
    """
    profiles_dir = Path(profiles_dir)
    candidates = []
    for path in sorted(profiles_dir.glob("**/*.json")):
        try:
            profile = load_profile(path)
        except ProfileError:
            continue
        if (profile.spec == spec and device.same_hardware(profile.device) is None
                and implementation in (None, profile.implementation)):
            candidates.append((profile.created_utc, path))
    return max(candidates)[1] if candidates else None


def check_profile_matches(profile: Profile, device: Device, spec: ModelSpec) -> None:
    """Raises: ProfileError naming the first difference in device or spec."""
    difference = device.same_hardware(profile.device)
    if difference:
        raise ProfileError(f"the profile was made on another device ({difference}): run `vramcal probe` here")
    if profile.spec != spec:
        diffs = [f"{k}={v} (profile {profile.spec.to_dict()[k]})" for k, v in spec.to_dict().items()
                 if profile.spec.to_dict()[k] != v]
        raise ProfileError(f"the profile was made for another model spec: {', '.join(diffs)}; "
                           f"probe this spec or pass matching options")
