"""Which profile sizes a run: the one lookup the trainer, the tuner, the integrations and the API share. It never
warns itself: it returns notices (files passed over, :mod:`vramcal.sizing.staleness`) for each caller to say its way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramcal.arguments import of_type, path_like
from vramcal.models.registry import describe, family_of, model_ref
from vramcal.profile import (
    DEFAULT_PROFILES_DIR,
    Profile,
    ProfileError,
    check_profile_matches,
    load_profile,
    matching_profiles,
    newest_profile,
)
from vramcal.records import Device, World
from vramcal.sizing import NoLimitsError, SizeRequest, SizingError, check_counts, size, staleness
from vramcal.units import format_bytes, size_argument
from vramcal.words import word
from vramcal.workload import ModelRef


class SeveralBudgetsError(SizingError):
    """Several profiles match the run at different budgets and none was asked for: the message lists them."""


class NoProfileError(SizingError):
    """No profile under the folder matches the run; ``command`` is the ``vramcal probe`` that makes one."""

    def __init__(self, message: str, command: str) -> None:
        super().__init__(message)
        self.command = command


@dataclass(frozen=True)
class Located:
    """A profile found for a run: the checked profile, its file (None: given as an object), notices for people."""

    profile: Profile
    path: Path | None
    notices: tuple[str, ...] = ()

    @property
    def source(self) -> str:
        """Where the profile came from, for people: its file, or ``the given profile``."""
        return "the given profile" if self.path is None else str(self.path)


def locate_profile(model: str | ModelRef | None = "regressor", params: dict[str, Any] | None = None, *,
                   device: Device, profile: Profile | Path | str | None = None, implementation: str = "auto",
                   profiles_dir: Path | str = DEFAULT_PROFILES_DIR, world: World | None = None,
                   total_bytes: int | None = None, strict: bool | None = None) -> Located:
    """The profile for a run of ``model`` on ``device`` (in ``world``; None: one process): ``profile`` when given (an
    object or a file), else the newest matching file under ``profiles_dir`` (at ``total_bytes`` when given; else the
    matches must share one budget), checked against the run (``model`` None: the profile's own), with notices.

    Raises:
        StaleProfileError: ``strict`` (or ``VRAMCAL_STRICT_PROFILE=1``) and the profile is stale.
        NoProfileError: none matches (its ``command`` makes one). SeveralBudgetsError: no ``total_bytes``, and the
            matches were calibrated at several budgets. SizingError: a file that is no profile, a profile for
            another device, model or world, or one with no limits; neither ``model`` nor ``profile`` given.
        WorkloadError, ValueError: ``model`` or ``params`` are not a model vramcal can build
            (:func:`vramcal.models.registry.model_ref`).
    """
    _check(device, profile, profiles_dir, world, total_bytes, strict)
    if model is None and profile is None:
        raise SizingError("needs profile=<a profile file or Profile>, or model=<what was calibrated> to find one "
                          "under profiles_dir")
    ref = None if model is None else model_ref(model, params, device=device, implementation=implementation)
    notices: list[str] = []
    if profile is None:
        matches, skipped = matching_profiles(profiles_dir, device, ref, world, total_bytes)
        notices = list(skipped)
        if total_bytes is None:
            _one_budget(matches, device, ref)
        found = matches[-1].path if matches else None
        if found is None:
            bad = f" ({len(skipped)} matching file(s) {skipped[0]}{', ...' * (len(skipped) > 1)})" if skipped else ""
            where = f" for {world.describe()}" if world else ""
            budget = f" at {format_bytes(total_bytes)}" if total_bytes else ""
            command = probe_command(device, ref, world, suggest_budget=True)
            raise NoProfileError(f"no profile for {device.name}{budget} and {describe(ref)}{where} in {profiles_dir}/"
                                 f"{bad}: run `{command}` first", command)
        profile = found
    path = None if isinstance(profile, Profile) else Path(profile)
    located = Located(_checked(profile, path, device, ref, world), path)
    command = probe_command(located.profile.device, ref or located.profile.model, world)  # at the profile's budget
    stale = staleness.check(located.profile, located.source, device, strict=strict, command=command)
    return Located(located.profile, path, tuple(notices + ([stale] if stale else [])))


def _check(device: Any, profile: Any, profiles_dir: Any, world: Any, total_bytes: Any, strict: Any) -> None:
    """:func:`locate_profile`'s door (:mod:`vramcal.arguments`).

    Raises:
        TypeError: an argument of the wrong type, named. SizingError: ``total_bytes`` below 0.
    """
    of_type("device", device, Device, "a vramcal.records.Device (vramcal.select_devices(gpu)[0][0])")
    of_type("profile", profile, (Profile, str, os.PathLike), "a vramcal.Profile, a profile file's path or None",
            none=True)
    path_like("profiles_dir", profiles_dir)
    of_type("world", world, World, "a vramcal.records.World, or None", none=True)
    check_counts(total_bytes=total_bytes)
    of_type("strict", strict, bool, "True, False or None", none=True)


def _one_budget(matches: list[Profile], device: Device, ref: ModelRef) -> None:
    """Raises: SeveralBudgetsError: ``matches`` (no budget asked for) were calibrated at more than one budget."""
    budgets = sorted({p.device.total_bytes for p in matches})
    if len(budgets) > 1:
        listed = ", ".join(f"{p.path} ({format_bytes(p.device.total_bytes)})" for p in matches)
        raise SeveralBudgetsError(f"{len(matches)} profiles of {describe(ref)} on {device.name} were calibrated at "
                                  f"{len(budgets)} budgets: {listed}; give {word('capacity')} (one of "
                                  f"{', '.join(size_argument(b) for b in budgets)}) to choose, or name the file")


def _checked(profile: Profile | Path | str, path: Path | None, device: Device, ref: ModelRef | None,
             world: World | None) -> Profile:
    """The profile read (a file) and checked against the run. Raises: SizingError: as :func:`locate_profile`."""
    source = "the given profile" if path is None else str(path)
    try:
        found = profile if path is None else load_profile(path)
        check_profile_matches(found, device, ref, world)
    except ProfileError as error:
        raise SizingError(str(error) if str(error).startswith("profile ") else f"{source}: {error}") from None
    if found.limits is None or found.fit is None or found.limits.safe_batch_size < 1:
        command = probe_command(device, ref or found.model)
        raise NoLimitsError(f"{source}: {NoLimitsError.NO_LIMITS}: re-run `{command}` with a larger budget")
    return found


def probe_command(device: Device, ref: ModelRef, world: World | None = None, suggest_budget: bool = False) -> str:
    """The ``vramcal probe`` command line that makes a missing profile (non-default options only); with
    ``suggest_budget`` a host without ``--capacity`` gets :func:`suggested_capacity` of its (rank's) memory.

    Raises:
        TypeError: an argument of the wrong type, named.
    """
    of_type("device", device, Device, "a vramcal.records.Device (vramcal.select_devices(gpu)[0][0])")
    of_type("ref", ref, ModelRef, "a vramcal.ModelRef (vramcal.model_ref(...))")
    of_type("world", world, World, "a vramcal.records.World, or None", none=True)
    of_type("suggest_budget", suggest_budget, bool, "True or False")
    implementation = ref.params.get("implementation")
    ranks = world.probe_args() if world else []
    budget = [f"--capacity {size_argument(device.total_bytes)}"] if device.total_source == "--capacity" else []
    if device.kind.budgeted and not budget and suggest_budget:
        share = device.total_bytes // (world.nproc if world else 1)
        budget = [f"--capacity {size_argument(suggested_capacity(share))}"]
    impl = [f"--impl {implementation}"] if implementation else []
    return " ".join(["vramcal probe", f"--gpu {device.kind.gpu_choice}", *budget, *impl, *ranks,
                     *family_of(ref).probe_args(ref)])


def suggested_capacity(total_bytes: int) -> int:
    """A host budget to suggest (bytes): half of ``total_bytes`` in whole 256 MiB, within 256 MiB-4 GiB, so the
    calibration takes minutes (as ``vramcal.cli.probe.host_hint``)."""
    return min(4 * 2**30, total_bytes // 2 // 2**28 * 2**28 or 2**28)


def ddp_term(profile: Profile, profiles_dir: Path | str) -> dict[str, Any] | None:
    """The DDP term of a DDP profile (bytes): its verified safe size's per-rank peak against the prediction there
    of the newest single-process profile of its model and device (at its budget where one is), or None."""
    check = profile.verification.get("safe")
    found, _ = newest_profile(profiles_dir, profile.device, profile.model, total_bytes=profile.device.total_bytes)
    if found is None:
        found, _ = newest_profile(profiles_dir, profile.device, profile.model)
    if found is None or check is None or check.peak_bytes is None:
        return None
    try:
        single = load_profile(found)
        predicted = size(single, SizeRequest(request=check.batch_size, seq_len=profile.model.params.get("seq_len")))
    except (ProfileError, SizingError):
        return None
    at = int(single.fit.predict(check.batch_size))  # the line at the DDP size, clamped or not
    return {"profile": str(found), "batch_size": check.batch_size, "predicted_peak_bytes": at,
            "single_safe_batch_size": predicted.safe_batch_size, "ddp_peak_bytes": check.peak_bytes,
            "term_bytes": check.peak_bytes - at}
