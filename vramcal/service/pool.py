"""The devices a ``gpu=`` choice names, the worker pool trials and training runs share, and one trial of a
profile's model (:func:`verify`)."""

from __future__ import annotations

import dataclasses
import json

from vramcal.calibration.creep import read_peak
from vramcal.measure.device import select
from vramcal.measure.trial import TrialRequest, TrialRunner
from vramcal.measure.worker import Workers
from vramcal.profile import Profile
from vramcal.records import Device, Trial, TrialSettings
from vramcal.service.door import door
from vramcal.sizing import SizingError, check_counts
from vramcal.units import parse_bytes

# What the worker fork server imports (the families, the trainer): trials and training runs share it.
WORKER_PRELOAD = ("vramcal.train.preload",)


def select_devices(gpu: str = "auto", capacity_bytes: int | str | None = None) -> tuple[list[Device], str | None]:
    """Resolve a ``gpu`` choice (``auto``, ``none``, ``all``, a CUDA index or a UUID) to devices.

    Args:
        capacity_bytes: a budget below the device's memory: bytes, or a size (``"1.5GiB"``:
            :func:`vramcal.units.parse_bytes`).

    Returns:
        The devices, and a one-line notice (e.g. why the host was chosen) or None.

    Raises:
        DeviceError: no such device here. NvmlError: a GPU asked for explicitly, NVML unusable.
        TypeError, ValueError: ``capacity_bytes`` is not a whole number of bytes or a size.
    """
    return select(gpu, capacity_argument(capacity_bytes))


def capacity_argument(capacity: int | str | None) -> int | None:
    """``capacity_bytes=`` as bytes: an int as it is, a size string parsed (``"1.5GiB"``), None as None.

    Raises:
        TypeError: neither (a float, a bool). ValueError: a string that is no size, or a size below one byte.
    """
    if capacity is None:
        return None
    if isinstance(capacity, bool) or not isinstance(capacity, int | str):
        raise TypeError(f"capacity_bytes= takes a whole number of bytes or a size such as '1.5GiB', not "
                        f"{type(capacity).__name__} {capacity!r}")
    try:
        value = parse_bytes(capacity) if isinstance(capacity, str) else capacity
    except ValueError as error:
        raise ValueError(f"capacity_bytes={capacity!r}: {error}") from None
    if value < 1:
        raise ValueError(f"capacity_bytes={capacity!r} is no budget: give a positive size such as '1.5GiB'")
    return value


def one_device(gpu: str, capacity_bytes: int | str | None) -> tuple[Device, str | None]:
    """The one device ``gpu`` names (:func:`select_devices`) and its notice.

    Raises:
        ValueError: ``gpu`` names several (``all``): calibrate them one at a time.
    """
    devices, notice = select_devices(gpu, capacity_bytes)
    if len(devices) != 1:
        raise ValueError(f"gpu={gpu!r} names {len(devices)} devices: calibrate them one at a time")
    return devices[0], notice


def worker_pool(extra_preload: tuple[str, ...] = ()) -> Workers:
    """The workers trials and training runs run in, forked from one server that imported :mod:`vramcal.train.preload`
    (and ``extra_preload``): the same process make-up for both."""
    return Workers((*WORKER_PRELOAD, *extra_preload))


def verify(profile: Profile, batch_size: int, seq_len: int | None = None, *,
           trials: TrialSettings = TrialSettings()) -> Trial:
    """One real trial of the profile's model at (``batch_size``, ``seq_len``) on the profile's device here (the
    host at the profile's budget), read as a calibration's verification reads it: ``peak_bytes`` includes the
    profile's step creep (:mod:`vramcal.calibration.creep`); the measured figures stay in its sources.

    Args:
        trials: the trial's steps and time limit.

    Raises:
        SizingError: the profile's device is not here; ``batch_size`` or ``seq_len`` below 1. TypeError: an
            argument of the wrong type.
    """
    door(profile=profile, trials=trials)
    check_counts(answer_batch_size=batch_size, seq_len=seq_len)
    budget = profile.device.total_bytes if profile.device.kind.budgeted else None
    device = select_devices(profile.device.gpu, budget)[0][0]
    if device.hardware_difference(profile.device):
        raise SizingError(f"the profile was made on {profile.device.name}, this is {device.name}: verify it there")
    device = dataclasses.replace(device, total_bytes=profile.device.total_bytes)
    model = profile.model.replace(seq_len=seq_len) if seq_len is not None else profile.model
    request = TrialRequest(model, batch_size, device, json.dumps(profile.data.get("options", {}), sort_keys=True),
                           trials)
    (trial,) = TrialRunner(worker_pool()).run(request, purpose="verify-answer")
    trial = dataclasses.replace(trial, seq_len=seq_len)
    return dataclasses.replace(trial, peak_bytes=read_peak(trial, profile.creep))
