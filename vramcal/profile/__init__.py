"""Profiles: the self-describing JSON file a calibration leaves in ``profiles/``, and what training adds to it.

One file per (device, model, implementation) at ``profiles/<device slug>/<profile name>.json``, written atomically
(:mod:`vramcal.files`). :mod:`~vramcal.profile.record` holds the records (each field typed and ranged),
:mod:`~vramcal.profile.checks` their relations; this package, the files. A bad file is refused in one line.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import fcntl
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from vramcal.files import atomic_write
from vramcal.models.registry import family_of
from vramcal.profile.checks import read_profile
from vramcal.profile.record import (
    DEFAULT_PROFILES_DIR,
    SCHEMA_VERSION,
    Observation,
    Profile,
    ProfileError,
    Verification,
)
from vramcal.records import Device, World
from vramcal.workload import ModelRef

__all__ = ["DEFAULT_PROFILES_DIR", "SCHEMA_VERSION", "Observation", "Profile", "ProfileError", "Verification",
           "append_observation", "check_profile_matches", "left_out", "load_profile", "matching_profiles",
           "newest_profile", "profile_name", "profile_path", "profiles_under", "save_profile", "utc_now",
           "world_difference"]


def profile_name(model: ModelRef, implementation: str, world: World | None = None) -> str:
    """``<model name>-<implementation>-<model key>``; a world adds ``-ddp<ranks>`` or ``-fsdp<ranks>`` (and 6 hex
    digits of its settings when they are not the defaults)."""
    name = f"{family_of(model).label(model)}-{implementation}-{model.key()}"
    if world is None:
        return name
    settings = world.settings()
    default = settings == World(2, strategy=world.strategy).settings()
    tail = "" if default else "-" + hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:6]
    return f"{name}-{world.strategy}{world.nproc}{tail}"


def profile_path(profiles_dir: Path | str, device: Device, model: ModelRef, implementation: str,
                 unique_device: bool = False, world: World | None = None) -> Path:
    """``<profiles_dir>/<device slug>/<profile name>.json``; a host ``--capacity`` adds it (``-1.5gib``);
    ``unique_device`` adds the GPU's identity to the folder (several identical cards)."""
    slug = device.slug(unique=True) if unique_device else device.slug()
    budget, total = "", device.total_bytes
    if device.kind.budgeted and device.total_source == "--capacity":
        budget = f"-{total / 2**30:.4g}gib" if total >= 2**30 else f"-{total / 2**20:.4g}mib"
    return Path(profiles_dir) / slug / f"{profile_name(model, implementation, world)}{budget}.json"


def save_profile(profile: Profile, path: Path | str, keep_previous: Path | None = None) -> Path:
    """Write ``profile`` as JSON (sorted keys, 2-space indent) atomically, the file replaced kept as
    ``keep_previous`` when given; returns the path (``profile.path`` is left as it was).

    Raises:
        OSError: the folder cannot be written; the previous file is then untouched.
    """
    text = json.dumps(profile.to_dict(), indent=2, sort_keys=True) + "\n"
    atomic_write(Path(path), lambda handle: handle.write(text.encode()), keep_previous=keep_previous)
    return Path(path)


def replaced_name(path: Path) -> Path:
    """``<name>.replaced-<UTC time>`` (then ``-2``, ...) beside ``path``: where a replaced profile is kept, a name no
    lookup of ``*.json`` reads."""
    stamp = f"{path.name}.replaced-{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}"
    taken = {p.name for p in path.parent.glob(f"{stamp}*")}
    return path.with_name(next(n for n in (stamp, *(f"{stamp}-{i}" for i in range(2, len(taken) + 2)))
                               if n not in taken))


def load_profile(path: Path | str) -> Profile:
    """Read and check a profile file (:func:`vramcal.profile.checks.read_profile`); its ``path`` is set.

    Raises:
        ProfileError: no readable profile file, or a bad field: one line naming the file (and the field) and the
            fix. TypeError: ``path`` is no path.
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"load_profile() takes a profile file's path, not {type(path).__name__} {path!r:.40}")
    path = Path(path)
    replace = "re-run `vramcal probe` to replace it"
    try:
        text = _read_text(path)
        if not text.strip():
            raise ProfileError(f"profile {path} is empty: it is no profile (a write was cut short?); {replace}")
        return dataclasses.replace(read_profile(json.loads(text)), path=path)
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
    """The newest of :func:`matching_profiles` (None when there is none), and its lines for the files skipped."""
    found, skipped = matching_profiles(profiles_dir, device, model, world, total_bytes)
    return (found[-1].path if found else None), skipped


def matching_profiles(profiles_dir: Path | str, device: Device, model: ModelRef, world: World | None = None,
                      total_bytes: int | None = None, any_size: bool = False) -> tuple[list[Profile], list[str]]:
    """:func:`profiles_where` for this model and DDP ``world`` (None: one process; ``any_size``: that world at any
    number of ranks, :func:`vramcal.sizing.sharding.carried`), a bad file of this model named."""
    def same_world(profile: Profile) -> bool:
        return profile.world == world or (any_size and None not in (profile.world, world)
                                          and dataclasses.replace(profile.world, nproc=world.nproc) == world)

    return profiles_where(profiles_dir, device, lambda p: p.covers(model) and same_world(p), total_bytes,
                          name_hint=model.key())


def profiles_where(profiles_dir: Path | str, device: Device, wanted: Callable[[Profile], bool],
                   total_bytes: int | None = None, name_hint: str | None = None) -> tuple[list[Profile], list[str]]:
    """The readable profiles under ``profiles_dir`` of this device's hardware (at ``total_bytes`` when given) that
    ``wanted`` keeps, oldest first (``created_utc``, then path), and a line for each unreadable file whose name
    holds ``name_hint``."""
    found, unreadable = profiles_under(profiles_dir)
    skipped = [left_out(path, why) for path, why in unreadable if name_hint is not None and name_hint in path.name]
    candidates = [p for p in found if device.hardware_difference(p.device) is None
                  and total_bytes in (None, p.device.total_bytes) and wanted(p)]
    return sorted(candidates, key=lambda p: (p.created_utc, str(p.path))), skipped


def profiles_under(folder: Path | str) -> tuple[list[Profile], list[tuple[Path, str]]]:
    """Every ``**/*.json`` below ``folder`` in path order: the readable profiles, and (path, why) for the others."""
    found, unreadable = [], []
    for path in sorted(Path(folder).glob("**/*.json")):
        try:
            found.append(load_profile(path))
        except ProfileError as error:
            unreadable.append((path, str(error)))
    return found, unreadable


def left_out(path: Path | str, why: str) -> str:
    """``left out <path>: <why>``, for a file a command over a folder does not use."""
    return f"left out {path}: {why.removeprefix(f'profile {path}').lstrip(': ')}"


def check_profile_matches(profile: Profile, device: Device, model: ModelRef | None, world: World | None = None) -> None:
    """Raises: ProfileError naming the first difference in device, DDP world or model (None: the profile's own
    model is the run's)."""
    difference = device.hardware_difference(profile.device)
    if difference:
        raise ProfileError(f"the profile was made on another device ({difference}): run `vramcal probe` here")
    if profile.world != world:
        raise ProfileError(world_difference(profile.world, world))
    if model is not None and not profile.covers(model):
        if profile.surface is not None and model.without("seq_len") == profile.model:
            raise ProfileError(f"seq_len {model.params.get('seq_len')} is outside the profile's calibrated lengths "
                               f"{min(profile.surface.seq_lens)}-{max(profile.surface.seq_lens)}: calibrate it "
                               f"(vramcal probe --seq-len ...)")
        ours, theirs, family = model.params, profile.model.params, family_of(model)
        diffs = [f"{k}={family.setting(model, k)} (the profile's: {family.setting(profile.model, k)})"
                 for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)]
        what = ", ".join(diffs) if profile.model.factory == model.factory else f"factory {profile.model.factory}"
        raise ProfileError(f"the profile was made for another model: {what}; probe this model or pass matching "
                           f"options")


def world_difference(calibrated: World | None, run: World | None) -> str:
    """Why a profile of ``calibrated`` cannot size a run of ``run`` (None: one process), and the probe that can."""
    what = calibrated.describe() if calibrated else "one process"
    if run is None:
        return (f"the profile was calibrated for {what}, this run is one process: calibrate it without --nproc, or "
                f"train with the profile's world")
    return (f"the profile was calibrated for {what}, this run is {run.describe()}: a rank's memory depends on the "
            f"world (gradient buckets, communication buffers, gathered shards); calibrate it with "
            f"`vramcal probe {' '.join(run.probe_args())}`")


def append_observation(path: Path | str, observation: Observation) -> Profile:
    """Add a training run's observation to the profile file, atomically and under a lock.

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
