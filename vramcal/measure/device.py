"""Devices that vramcal calibrates: NVIDIA GPUs found through NVML, or the host's memory.

This module and :mod:`vramcal.measure.meters` are the only ones that touch NVML. Every NVML call goes through
:func:`nvml_query`, which turns driver errors into :class:`NvmlError` values with a readable message
(the pattern of nvitop's ``libnvml.py``). GPUs are identified by UUID and PCI bus id, never by position:
CUDA and NVML may order them differently, so a trial pins its GPU with ``CUDA_VISIBLE_DEVICES=<UUID>``.
"""

from __future__ import annotations

import os
import platform
import re
import types
from collections.abc import Callable
from typing import Any

from vramcal.records import Device
from vramcal.units import format_bytes


class NvmlError(RuntimeError):
    """NVML is missing or a query failed; the message says why and what to do."""


class DeviceError(ValueError):
    """A --gpu or --capacity choice that names no usable device; the message says which would work."""


# ---------------------------------------------------------------------------------------------- NVML

def load_nvml() -> types.ModuleType:
    """Import and initialise NVML from ``nvidia-ml-py`` (module ``pynvml``).

    Raises:
        NvmlError: the package or the driver library is missing, or nvmlInit failed.
    """
    try:
        import pynvml
    except ImportError as error:
        raise NvmlError("nvidia-ml-py is not installed: pip install nvidia-ml-py, or use --gpu none "
                        "to calibrate the host") from error
    try:
        pynvml.nvmlInit()
    except Exception as error:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        raise NvmlError(f"NVML could not start ({error}): the NVIDIA driver is not installed or not "
                        f"visible here; use --gpu none to calibrate the host") from error
    return pynvml


def nvml_query(nvml: types.ModuleType, func: str, *args: Any) -> Any:
    """Call ``nvml.<func>(*args)``, decoding bytes to str; every NVML call in vramcal goes through here.

    Raises:
        NvmlError: the call failed; the message names the call and NVML's reason.
    """
    try:
        value = getattr(nvml, func)(*args)
    except Exception as error:  # noqa: BLE001 - pynvml raises NVMLError subclasses per code
        raise NvmlError(f"NVML {func} failed: {error}") from error
    return value.decode() if isinstance(value, bytes) else value


def nvml_memory_info(nvml: types.ModuleType, handle: Any) -> Any:
    """Memory info from the v2 API (``total``/``reserved``/``free``/``used`` in bytes), else v1."""
    version = getattr(nvml, "nvmlMemory_v2", None)
    if version is not None:
        try:
            return nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
        except TypeError:  # an old binding without the version argument
            pass
    return nvml_query(nvml, "nvmlDeviceGetMemoryInfo", handle)


def list_gpus(nvml: types.ModuleType) -> list[Device]:
    """Every GPU NVML sees, in NVML order, with name, UUID, PCI bus id, total bytes and driver."""
    count = nvml_query(nvml, "nvmlDeviceGetCount")
    driver = nvml_query(nvml, "nvmlSystemGetDriverVersion")
    try:
        cuda = nvml_query(nvml, "nvmlSystemGetCudaDriverVersion_v2")
        cuda_version = f"{cuda // 1000}.{cuda % 1000 // 10}"
    except NvmlError:
        cuda_version = None
    gpus = []
    for index in range(count):
        handle = nvml_query(nvml, "nvmlDeviceGetHandleByIndex", index)
        pci = nvml_query(nvml, "nvmlDeviceGetPciInfo", handle)
        bus_id = pci.busId.decode() if isinstance(pci.busId, bytes) else pci.busId
        gpus.append(Device(
            kind="cuda", name=nvml_query(nvml, "nvmlDeviceGetName", handle),
            total_bytes=int(nvml_memory_info(nvml, handle).total), total_source="NVML v2 total",
            uuid=nvml_query(nvml, "nvmlDeviceGetUUID", handle), pci_bus_id=bus_id, nvml_index=index,
            driver_version=driver, cuda_driver_version=cuda_version))
    return gpus


def nvml_handle(nvml: types.ModuleType, device: Device) -> Any:
    """The NVML handle of ``device``, looked up by UUID (falling back to PCI bus id)."""
    try:
        return nvml_query(nvml, "nvmlDeviceGetHandleByUUID", device.uuid)
    except NvmlError:
        return nvml_query(nvml, "nvmlDeviceGetHandleByPciBusId", device.pci_bus_id)


# ---------------------------------------------------------------------------------------------- host

def host_device(capacity_bytes: int | None = None, proc: str = "/proc", cgroup: str = "/sys/fs/cgroup") -> Device:
    """The host's RAM as a device.

    ``total_bytes`` is ``capacity_bytes`` if given, else the cgroup v2 ``memory.max`` (or v1
    ``memory.limit_in_bytes``) when it is set and below MemTotal, else MemAvailable from /proc/meminfo.

    Raises:
        DeviceError: ``capacity_bytes`` is larger than the host's memory.
    """
    meminfo = _meminfo(proc)
    available = meminfo["MemAvailable"]
    limit = _cgroup_limit(cgroup)
    if limit is not None and limit < meminfo["MemTotal"]:
        total, source = limit, "cgroup memory limit"
    else:
        total, source = available, "MemAvailable"
    if capacity_bytes is not None:
        if capacity_bytes > meminfo["MemTotal"]:
            raise DeviceError(f"--capacity {format_bytes(capacity_bytes)} is more than this host's "
                              f"{format_bytes(meminfo['MemTotal'])} of RAM: give a smaller --capacity")
        total, source = capacity_bytes, "--capacity"
    return Device(kind="host", name=_cpu_name(proc), total_bytes=total, total_source=source)


def _meminfo(proc: str) -> dict[str, int]:
    values = {}
    with open(os.path.join(proc, "meminfo")) as handle:
        for line in handle:
            key, rest = line.split(":", 1)
            values[key] = int(rest.split()[0]) * 1024  # /proc/meminfo reports kB (KiB)
    return values


def _cgroup_limit(cgroup: str) -> int | None:
    for name in ("memory.max", "memory/memory.limit_in_bytes"):
        try:
            with open(os.path.join(cgroup, name)) as handle:
                text = handle.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:
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

def select(gpu: str, capacity_bytes: int | None = None,
           nvml_loader: Callable[[], types.ModuleType] | None = None) -> tuple[list[Device], str | None]:
    """Resolve a ``--gpu`` choice to devices.

    Args:
        gpu: ``auto`` (first GPU, else the host), ``none`` (the host), ``all`` (every GPU), an NVML
            index such as ``0``, or a UUID such as ``GPU-5d2c...``.
        capacity_bytes: optional ``--capacity``; on a GPU it narrows ``total_bytes`` (never widens it).
        nvml_loader: returns an initialised NVML module (default :func:`load_nvml`; a fake in tests).

    Returns:
        The devices, and a one-line notice for the user (e.g. why the host was chosen) or None.

    Raises:
        DeviceError: the choice names no device here; the message lists the ones that exist.
        NvmlError: a GPU was asked for explicitly and NVML is unusable.
    """
    choice = gpu.strip()
    if choice == "none":
        return [host_device(capacity_bytes)], None
    try:
        gpus = list_gpus((nvml_loader or load_nvml)())
    except NvmlError as error:
        if choice == "auto":
            return [host_device(capacity_bytes)], _host_notice(f"no usable NVIDIA GPU ({error.__cause__ or error})",
                                                               capacity_bytes)
        raise
    if choice == "auto":
        if not gpus:
            return [host_device(capacity_bytes)], _host_notice("NVML sees no GPU", capacity_bytes)
        chosen = gpus[:1]
    elif choice == "all":
        if not gpus:
            raise DeviceError("--gpu all: NVML sees no GPU here; use --gpu none to calibrate the host")
        chosen = gpus
    elif choice.isdigit():
        index = int(choice)
        if index >= len(gpus):
            available = ", ".join(str(g.nvml_index) for g in gpus) or "none"
            raise DeviceError(f"--gpu {index}: this machine has {len(gpus)} GPU(s) (indices: {available}); "
                              f"use one of those, --gpu auto, or --gpu none")
        chosen = [gpus[index]]
    else:
        chosen = [g for g in gpus if g.uuid == choice or (g.uuid or "").startswith(choice)
                  and choice.startswith(("GPU-", "MIG-")) and len(choice) >= 8]
        if not chosen:
            listing = "; ".join(f"{g.nvml_index}: {g.uuid}" for g in gpus) or "no GPU"
            raise DeviceError(f"--gpu {choice}: no GPU with that index or UUID here ({listing}); "
                              f"use auto, none, all, an index or a UUID")
        chosen = chosen[:1]
    if capacity_bytes is not None:
        chosen = [_narrow(g, capacity_bytes) for g in chosen]
    return chosen, None


def _host_notice(reason: str, capacity_bytes: int | None) -> str:
    return f"{reason}: using the host's memory instead"


def _narrow(device: Device, capacity_bytes: int) -> Device:
    if capacity_bytes > device.total_bytes:
        raise DeviceError(f"--capacity {format_bytes(capacity_bytes)} is more than {device.name}'s "
                          f"{format_bytes(device.total_bytes)}: give a smaller --capacity or none")
    return Device(**{**device.to_dict(), "total_bytes": capacity_bytes, "total_source": "--capacity"})
