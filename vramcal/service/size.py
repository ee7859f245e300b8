"""The batch size for a model on a device in one call (:func:`size_for`): from the matching profile when one
holds, else from a calibration."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from vramcal.calibration.limits import LimitSettings
from vramcal.measure.device import free_bytes
from vramcal.models.registry import model_ref
from vramcal.profile import DEFAULT_PROFILES_DIR, Profile, load_profile, newest_profile, replaced_name
from vramcal.records import Device, TrialSettings
from vramcal.service.calibrate import plan_calibration, run_said
from vramcal.service.door import door
from vramcal.service.pool import one_device
from vramcal.sizing import Limit, NoLimitsError, SizeRequest, Sizing, SizingError, size, staleness
from vramcal.sizing.lookup import locate_profile
from vramcal.sizing.staleness import StaleProfileError
from vramcal.words import word
from vramcal.workload import ModelRef


@dataclasses.dataclass(frozen=True)
class Answered:
    """What :func:`size_for` answered: the batch size (samples), its sizing, the profile and its file, whether this
    call calibrated, and why (``reason``; ``left_out``: a line per matching file it could not read)."""

    batch_size: int
    sizing: Sizing
    profile: Profile
    path: Path
    calibrated: bool
    reason: str
    left_out: tuple[str, ...] = ()


def size_for(model: str | ModelRef = "regressor", params: dict[str, Any] | None = None, *, gpu: str = "auto",
             capacity_bytes: int | str | None = None, implementation: str = "auto",
             options: dict[str, Any] | None = None, profiles_dir: Path | str = DEFAULT_PROFILES_DIR,
             settings: LimitSettings = LimitSettings(), trials: TrialSettings = TrialSettings(),
             limit: Limit = "conservative", seq_len: int | None = None, progress: bool = True) -> Answered:
    """The batch size for a model on a device in one call: from the matching profile under ``profiles_dir`` when
    one holds (made under the software and settings running now, strictly: :mod:`vramcal.sizing.staleness`), else
    from a calibration saved there, saying why; a stale file it replaces is kept beside it
    (:func:`vramcal.profile.replaced_name`). The size is gated by what the device has free now
    (:func:`vramcal.measure.device.free_bytes`).

    Args:
        model, params, gpu, capacity_bytes, implementation, options, settings, trials, progress: as
            :func:`vramcal.api.calibrate`. limit, seq_len: as :class:`~vramcal.sizing.SizeRequest`.

    Raises:
        NoLimitsError: the matching or new profile has no usable limits (``vramcal size`` exits 3). Otherwise as
            :func:`vramcal.api.calibrate` and :func:`vramcal.sizing.size`.
    """
    door(implementation=implementation, options=options, profiles_dir=profiles_dir, settings=settings, trials=trials,
         progress=progress)
    ask = SizeRequest(limit=limit, seq_len=seq_len)
    device, notice = one_device(gpu, capacity_bytes)
    budget = device.total_bytes if device.kind.budgeted else None
    ref = model_ref(model, params, device=device, implementation=implementation)
    found, skipped = newest_profile(profiles_dir, device, ref, None, budget)
    why = (f"calibrating: no profile of this model on this device{' at this budget' * (budget is not None)} under "
           f"{profiles_dir}/" + (f" ({len(skipped)} matching file(s) left out)" if skipped else ""))
    if found is not None:
        answered = _from_profile(found, ref, device, ask)
        if isinstance(answered, Answered):
            return dataclasses.replace(answered, left_out=tuple(skipped))
        why = f"calibrating again: {answered}"
    plan = plan_calibration(ref, device=device, settings=settings, options=options, profiles_dir=profiles_dir,
                            trials=trials)
    if plan.path.is_file():  # a stale or unreadable profile where the new one goes: kept, not overwritten
        plan = dataclasses.replace(plan, keep_previous=replaced_name(plan.path))
        why += f"; the file it replaces, {plan.path}, is kept as {plan.keep_previous.name}"
    profile = run_said(plan, notice, capacity_bytes is None, progress=progress, why=why)
    try:
        sizing = size(profile, ask, **_gate(device))
    except NoLimitsError:
        raise _no_limits(plan.path, profile) from None
    return Answered(sizing.batch_size, sizing, profile, plan.path, True, why, tuple(skipped))


def _from_profile(found: Path, ref: ModelRef, device: Device, ask: SizeRequest) -> Answered | str:
    """The answer from the matching profile ``found``, or why it is calibrated again.

    Raises:
        NoLimitsError: it holds (not stale) but has no usable limits.
    """
    try:
        located = locate_profile(ref, device=device, profile=found, strict=True)
        sizing = size(located.profile, ask, **_gate(device))
    except NoLimitsError:
        stale = staleness.check(load_profile(found), str(found), device, strict=False)
        if stale is None:
            raise _no_limits(found, load_profile(found)) from None
        return stale
    except (StaleProfileError, SizingError) as error:
        return str(error)
    return Answered(sizing.batch_size, sizing, located.profile, found, False, f"from the matching profile {found}")


def _no_limits(path: Path, profile: Profile) -> NoLimitsError:
    ok = sum(t.ok for t in profile.trials)
    why = (f"no line fitted to its {ok} successful trial(s)" if profile.fit is None else
           "its fitted peak does not rise with batch_size" if profile.limits is None else
           "not one sample fits its usable memory by the fit")
    return NoLimitsError(f"{path}: the profile has no usable limits ({why}), and calibrating again at its budget gives "
                         f"the same: give a larger {word('capacity')} or a smaller {word('reserve')} or "
                         f"{word('margin')}, and check that the step's memory grows with its batch")


def _gate(device: Device) -> dict[str, Any]:
    free, source = free_bytes(device)
    return {"free_bytes": free, "free_source": source}
