"""Devices that vramcal calibrates: NVIDIA GPUs and MIG slices found through NVML, or the host's memory.

``--gpu`` follows CUDA: ``auto`` is the first GPU visible to this process (``CUDA_VISIBLE_DEVICES``), ``N`` is
CUDA index N in CUDA's order (:func:`vramcal.measure.nvml.visible_uuids`), ``all`` every visible one, a
``GPU-``/``MIG-`` UUID must be visible. Devices are then identified by UUID, never by position.
"""

from __future__ import annotations

import os
import platform
import re
import resource
import types
from collections.abc import Callable, Mapping, Sequence

from vramcal.measure.nvml import NvmlError, gpu_record, load_nvml, memory_figures, nvml_handle, nvml_query, visible_gpus
from vramcal.records import Device
from vramcal.units import format_bytes
from vramcal.words import Info, given, word


class DeviceError(ValueError):
    """A --gpu or --capacity choice that names no usable device; the message says which would work."""


# ---------------------------------------------------------------------------------------------- host

def host_device(capacity_bytes: int | None = None, proc: str = "/proc", cgroup: str = "/sys/fs/cgroup") -> Device:
    """The host's RAM as a device: ``total_bytes`` is ``capacity_bytes`` if given, else the cgroup's limit (v2
    ``memory.max``, v1 ``memory.limit_in_bytes``) where below MemTotal, else MemAvailable; never more than a hard
    ``RLIMIT_DATA`` set outside vramcal (the budget is applied as one).

    Raises:
        DeviceError: ``capacity_bytes`` is larger than the host's memory, or than that ``RLIMIT_DATA``.
    """
    meminfo = _meminfo(proc)
    total, source = _cgroup_below(meminfo, cgroup) or (meminfo["MemAvailable"], "MemAvailable")
    _, outer = resource.getrlimit(resource.RLIMIT_DATA)
    outer = None if outer == resource.RLIM_INFINITY else outer
    if outer is not None and outer < total:
        total, source = outer, "RLIMIT_DATA set outside vramcal"
    if capacity_bytes is not None:
        if capacity_bytes > meminfo["MemTotal"]:
            raise DeviceError(f"{given('capacity', format_bytes(capacity_bytes))} is more than this host's "
                              f"{format_bytes(meminfo['MemTotal'])} of RAM: give a smaller {word('capacity')}")
        if outer is not None and capacity_bytes > outer:
            raise DeviceError(f"{given('capacity', format_bytes(capacity_bytes))} is more than this process may "
                              f"hold: its RLIMIT_DATA is {format_bytes(outer)}, set outside vramcal (ulimit -d, "
                              f"prlimit --data); give a {word('capacity')} of at most that, or raise the limit")
        total, source = capacity_bytes, "--capacity"
    return Device(kind="host", name=_cpu_name(proc), total_bytes=total, total_source=source)


def check_host_world(budgets: Sequence[int], proc: str = "/proc", cgroup: str = "/sys/fs/cgroup") -> None:
    """Check that the local host ranks' ``budgets`` (bytes, one each) together fit the host's memory (MemTotal, or
    the cgroup's limit where lower), before any is forked.

    Raises:
        DeviceError: their sum is more (naming it, the sum and the most each may have).
    """
    meminfo = _meminfo(proc)
    host, what = _cgroup_below(meminfo, cgroup) or (meminfo["MemTotal"], "RAM")
    if sum(budgets) <= host:
        return
    each = (f"{format_bytes(budgets[0])} each" if len(set(budgets)) == 1 else
            ", ".join(format_bytes(b) for b in budgets))
    raise DeviceError(f"{len(budgets)} ranks' budgets ({each}) add up to {format_bytes(sum(budgets))}, more than "
                      f"this host's {format_bytes(host)} of {what}: give fewer ranks, or a {word('capacity')} of at "
                      f"most {format_bytes(host // len(budgets))} per rank")


def free_bytes(device: Device, proc: str = "/proc", cgroup: str = "/sys/fs/cgroup") -> tuple[int | None, str]:
    """What ``device`` has free now (bytes) and the figure's source: on the host MemAvailable, lowered to the
    cgroup's limit minus its use; on a GPU NVML's free memory. ``(None, why)`` when it cannot be read."""
    if device.kind == "host":
        try:
            available, source = _meminfo(proc)["MemAvailable"], "MemAvailable"
        except (OSError, KeyError, ValueError):
            return None, "MemAvailable unreadable"
        room = _cgroup_room(cgroup)
        return (room, "the cgroup's limit minus its use") if room is not None and room < available else (available,
                                                                                                          source)
    try:
        nvml = load_nvml()
        return memory_figures(nvml, nvml_handle(nvml, device)).free_bytes, "NVML free memory"
    except NvmlError as error:
        return None, str(error)


def _cgroup_room(cgroup: str) -> int | None:
    limit, used = _cgroup_limit(cgroup), _cgroup_figure(cgroup, "memory.current", "memory/memory.usage_in_bytes")
    return None if limit is None or used is None else max(0, limit - used)


def _meminfo(proc: str) -> dict[str, int]:
    values = {}
    with open(os.path.join(proc, "meminfo")) as handle:
        for line in handle:
            key, rest = line.split(":", 1)
            values[key] = int(rest.split()[0]) * 1024  # /proc/meminfo reports kB (KiB)
    return values


def _cgroup_limit(cgroup: str) -> int | None:
    limit = _cgroup_figure(cgroup, "memory.max", "memory/memory.limit_in_bytes")  # v2, v1
    return limit if limit is not None and limit < 2**60 else None  # v1's "no limit" is a huge number


def _cgroup_below(meminfo: dict[str, int], cgroup: str) -> tuple[int, str] | None:
    limit = _cgroup_limit(cgroup)
    return (limit, "cgroup memory limit") if limit is not None and limit < meminfo["MemTotal"] else None


def _cgroup_figure(cgroup: str, *names: str) -> int | None:
    """The first of the cgroup's files ``names`` that holds a number (bytes)."""
    for name in names:
        try:
            with open(os.path.join(cgroup, name)) as handle:
                text = handle.read().strip()
        except OSError:
            continue
        if text.isdigit():
            return int(text)
    return None


def _cpu_name(proc: str) -> str:
    model = platform.processor() or platform.machine()
    try:
        with open(os.path.join(proc, "cpuinfo")) as handle:
            for line in handle:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    model = re.sub(r"\s+", " ", re.sub(r"\((R|TM)\)|CPU|@.*$|\d+-Core Processor", "", model)).strip()
    return f"{model} ({os.cpu_count()} cores)"


# ---------------------------------------------------------------------------------------------- select

GPU_CHOICES = "auto, none (the host), all, a CUDA index such as 0, or a GPU-/MIG- UUID"


def check_choice(gpu: str | int) -> str:
    """``gpu`` stripped, if it is a ``--gpu`` choice in form (a CUDA index may be an ``int``), checked before NVML
    is asked anything.

    Raises:
        DeviceError: any other value (``cpu``/``host`` are told to use ``none``). TypeError: not a str or an int."""
    if isinstance(gpu, int) and not isinstance(gpu, bool):
        gpu = str(gpu)
    if not isinstance(gpu, str):
        raise TypeError(f"{word('gpu')} takes {GPU_CHOICES} (a str, or a CUDA index as an int), not "
                        f"{type(gpu).__name__} {gpu!r:.40}")
    choice = gpu.strip()
    if choice in ("auto", "none", "all") or choice.isdigit() or choice.startswith(("GPU-", "MIG-")):
        return choice
    if choice.lower() in ("cpu", "host", "ram"):
        raise DeviceError(f"{given('gpu', choice)}: the host's memory is {given('gpu', 'none')}")
    raise DeviceError(f"{given('gpu', choice)}: not a device choice; give {GPU_CHOICES}")


def select(gpu: str, capacity_bytes: int | None = None,
           nvml_loader: Callable[[], types.ModuleType] | None = None,
           environ: Mapping[str, str] | None = None) -> tuple[list[Device], str | None]:
    """Resolve a ``--gpu`` choice to devices visible to this process (module docstring).

    Args:
        gpu: ``auto`` (else the host), ``none`` (the host), ``all``, a CUDA index, or a UUID (or 8+ characters of it).
        capacity_bytes: ``--capacity``; on a GPU it narrows ``total_bytes`` (never widens it).
        nvml_loader, environ: NVML's loader (default :func:`load_nvml`) and where ``CUDA_VISIBLE_DEVICES`` is read.

    Returns:
        The devices, and a one-line notice (why the host was chosen) or None.

    Raises:
        DeviceError: a choice not in form (:func:`check_choice`), or naming no visible device (it lists those).
        NvmlError: a GPU was asked for explicitly and NVML is unusable.
    """
    choice, environ = check_choice(gpu), os.environ if environ is None else environ
    if choice == "none":
        return [host_device(capacity_bytes)], None
    try:
        nvml = (nvml_loader or load_nvml)()
        gpus = visible_gpus(nvml, dict(environ))
    except NvmlError as error:
        if choice == "auto":
            return [host_device(capacity_bytes)], _host_notice(f"no usable NVIDIA GPU ({error.cause})")
        raise
    hidden = _visibility(environ)
    if choice == "auto":
        if not gpus:
            return [host_device(capacity_bytes)], _host_notice(f"no GPU is visible{hidden}")
        chosen = gpus[:1]
    elif choice == "all":
        if not gpus:
            raise DeviceError(f"{given('gpu', 'all')}: no GPU is visible here{hidden}; use {given('gpu', 'none')} "
                              f"for the host's memory")
        chosen = gpus
    elif choice.isdigit():
        chosen = [_by_index(choice, gpus, hidden)]
    else:
        chosen = [_by_uuid(nvml, choice, gpus, environ)]
    if capacity_bytes is not None:
        chosen = [_narrow(g, capacity_bytes) for g in chosen]
    return chosen, None


def _by_index(choice: str, gpus: list[Device], hidden: str) -> Device:
    if int(choice) >= len(gpus):
        raise DeviceError(f"{given('gpu', choice)}: this machine has {len(gpus)} GPU(s) (indices: "
                          f"{', '.join(str(g.cuda_index) for g in gpus) or 'none'}) visible{hidden}; "
                          f"use one of those CUDA indices, {given('gpu', 'auto')}, or {given('gpu', 'none')}")
    return gpus[int(choice)]


def _visibility(environ: Mapping[str, str]) -> str:
    value = environ.get("CUDA_VISIBLE_DEVICES")
    return "" if value is None else f" (CUDA_VISIBLE_DEVICES={value!r})"


def _by_uuid(nvml: types.ModuleType, choice: str, gpus: list[Device], environ: Mapping[str, str]) -> Device:
    """The visible device whose UUID is or starts with ``choice`` (8+ characters); with ``CUDA_VISIBLE_DEVICES``
    unset, any MIG slice NVML knows (CUDA lists only a card's first)."""
    def matches(uuid: str | None) -> bool:
        return uuid == choice or (len(choice) >= 8 and choice.startswith(("GPU-", "MIG-"))
                                  and (uuid or "").startswith(choice))

    found = [g for g in gpus if matches(g.uuid)]
    if not found and choice.startswith("MIG-") and "CUDA_VISIBLE_DEVICES" not in environ:
        try:
            return gpu_record(nvml, nvml_query(nvml, "nvmlDeviceGetHandleByUUID", choice))
        except NvmlError:
            pass
    if len(found) == 1:
        return found[0]
    listing = "; ".join(f"{g.cuda_index}: {g.uuid}" for g in gpus) or "none"
    if found:
        raise DeviceError(f"{given('gpu', choice)}: matches {len(found)} GPUs ({listing}); give more of the UUID")
    raise DeviceError(f"{given('gpu', choice)}: no GPU with that index or UUID is visible here{_visibility(environ)} "
                      f"(visible: {listing}); use auto, none, all, a CUDA index or a visible UUID")


def _host_notice(reason: str) -> str:
    return Info(f"{reason}: using the host's memory instead")


def _narrow(device: Device, capacity_bytes: int) -> Device:
    if capacity_bytes > device.total_bytes:
        raise DeviceError(f"{given('capacity', format_bytes(capacity_bytes))} is more than {device.name}'s "
                          f"{format_bytes(device.total_bytes)}: give a smaller {word('capacity')} or none")
    return Device(**{**device.to_dict(), "total_bytes": capacity_bytes, "total_source": "--capacity"})
