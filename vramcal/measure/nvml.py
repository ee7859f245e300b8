"""The NVML boundary: loading NVML, the one query wrapper, memory and process figures, visible GPUs.

Every NVML call in vramcal goes through :func:`nvml_query`, which turns the driver's errors into
:class:`NvmlError` with a readable message (nvitop's ``libnvml.py`` pattern). What nvitop does here:

- ``nvitop.api.libnvml`` is the namespace the queries are looked up in: pynvml's functions, with
  ``nvmlDeviceGetMemoryInfo`` choosing the v2 struct only when the driver exports the v2 symbol, and
  ``nvmlDeviceGet*RunningProcesses`` choosing the v3/v2/v1 struct layout the driver has. vramcal does
  not use nvitop's ``nvmlQuery`` (it turns errors into ``NA`` values and logs them); nor nvitop's
  ``nvmlInit`` (it logs a coloured "FATAL ERROR" when the driver is missing, the ordinary case on a
  CPU machine): NVML is started with pynvml's ``nvmlInit``.
- :func:`visible_uuids` is nvitop's ``normalize_cuda_visible_devices``: it asks the CUDA driver itself
  (``cuInit``, ``cuDeviceGetUuid``, in a throw-away process, so this one never creates a CUDA context)
  which devices ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` make visible, in CUDA's order:
  PCI bus order under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, else CUDA's default "fastest first". It
  follows CUDA's MIG rules (``MIG-<UUID>`` and the legacy ``MIG-GPU-<UUID>/gi/ci`` forms; one MIG
  device at most is visible to a process; a MIG-enabled GPU listed by index shows its first slice).
  Where the CUDA driver cannot be asked, nvitop falls back to NVML, whose order is the PCI bus order:
  the same as CUDA's on machines whose GPUs are all one model, or under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.

Written here by hand: the v2 -> v1 memory retry when the v2 symbol exists but the call is refused
(vGPU, some MIG set-ups), building :class:`~vramcal.records.Device` records, and the MIG slice's
identity (its name, memory and UUID from its own handle; bus id, index and compute capability from
its parent's).
"""

from __future__ import annotations

import os
import types
from dataclasses import dataclass
from typing import Any

from vramcal.records import Device
from vramcal.words import given

# NVML_VALUE_NOT_AVAILABLE for 64-bit figures (nvml.h): a per-process figure NVML could not measure.
NOT_AVAILABLE = 2**64 - 1


class NvmlError(RuntimeError):
    """NVML is missing or a query failed; the message says why and what to do, ``cause`` why alone (for a notice
    where the host was chosen already: ``--gpu auto`` on a machine without a GPU)."""

    def __init__(self, message: str, cause: str | None = None) -> None:
        super().__init__(message)
        self.cause = cause or message


def load_nvml() -> types.ModuleType:
    """Start NVML and return the namespace vramcal queries it through (``nvitop.api.libnvml``).

    Raises:
        NvmlError: nvidia-ml-py or nvitop is not installed, or the driver is missing or not loaded.
    """
    try:
        import pynvml
        from nvitop.api import libnvml
    except ImportError as error:
        missing = f"{error.name or 'nvidia-ml-py'} is not installed"
        raise NvmlError(f"{missing}: pip install nvidia-ml-py nvitop, or use {given('gpu', 'none')} for the host's "
                        f"memory", missing) from error
    try:
        pynvml.nvmlInit()
    except Exception as error:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        raise NvmlError(f"NVML could not start ({error}): the NVIDIA driver is not installed or not "
                        f"visible here; use {given('gpu', 'none')} for the host's memory",
                        f"NVML could not start: {error}") from error
    return libnvml


def nvml_query(nvml: types.ModuleType, func: str, *args: Any, **kwargs: Any) -> Any:
    """Call ``nvml.<func>(*args, **kwargs)``, decoding bytes to str; every NVML call in vramcal goes here.

    Raises:
        NvmlError: the call failed (or the binding lacks it); the message names the call and NVML's reason.
    """
    try:
        value = getattr(nvml, func)(*args, **kwargs)
    except AttributeError as error:
        raise NvmlError(f"NVML {func} is missing from this nvidia-ml-py: pip install -U nvidia-ml-py") from error
    except Exception as error:  # noqa: BLE001 - pynvml raises an NVMLError subclass per return code
        raise NvmlError(f"NVML {func} failed: {str(error) or type(error).__name__}") from error
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True)
class MemoryFigures:
    """One NVML memory reading of a GPU or MIG slice, in bytes.

    ``reserved_bytes`` is the driver's and firmware's share of ``total_bytes`` (v2 only; 0 from v1,
    where ``total`` already leaves it out on most drivers). ``version`` is 2 or 1.
    """

    total_bytes: int
    reserved_bytes: int
    used_bytes: int
    free_bytes: int
    version: int


def nvml_memory_info(nvml: types.ModuleType, handle: Any) -> Any:
    """NVML's memory struct of ``handle`` (``total``/``free``/``used``, and ``reserved`` from v2; bytes):
    v2 where the driver exports it, else v1; v1 also when v2 exists but is refused (vGPU, some MIG set-ups).

    Raises:
        NvmlError: both calls failed.
    """
    try:
        return nvml_query(nvml, "nvmlDeviceGetMemoryInfo", handle)  # nvitop's: v2 if the driver has the symbol
    except NvmlError:
        import pynvml

        return nvml_query(pynvml, "nvmlDeviceGetMemoryInfo", handle)  # pynvml without a version: v1


def memory_figures(nvml: types.ModuleType, handle: Any) -> MemoryFigures:
    """Memory of ``handle`` as :class:`MemoryFigures` (see :func:`nvml_memory_info`).

    Raises:
        NvmlError: both calls failed.
    """
    info = nvml_memory_info(nvml, handle)
    reserved = getattr(info, "reserved", None)
    return MemoryFigures(total_bytes=int(info.total), reserved_bytes=int(reserved or 0), used_bytes=int(info.used),
                         free_bytes=int(info.free), version=2 if reserved is not None else 1)


def process_figures(nvml: types.ModuleType, handle: Any) -> dict[int, int | None]:
    """Compute processes on ``handle``: PID -> used bytes, None where NVML gives no figure (containers).

    One NVML call. On a MIG slice's handle, NVML lists the slice's processes.

    Raises:
        NvmlError: the call failed.
    """
    figures: dict[int, int | None] = {}
    for process in nvml_query(nvml, "nvmlDeviceGetComputeRunningProcesses", handle):
        used = getattr(process, "usedGpuMemory", None)
        figures[int(process.pid)] = None if used is None or used >= NOT_AVAILABLE else int(used)
    return figures


def is_mig_uuid(uuid: str | None) -> bool:
    return bool(uuid) and uuid.startswith("MIG-")  # type: ignore[union-attr]


def nvml_handle(nvml: types.ModuleType, device: Device) -> Any:
    """The NVML handle of ``device`` (a MIG slice's own handle for a ``MIG-`` UUID), by UUID, else PCI bus id.

    Raises:
        NvmlError: neither lookup found the device.
    """
    try:
        return nvml_query(nvml, "nvmlDeviceGetHandleByUUID", device.uuid)
    except NvmlError:
        if is_mig_uuid(device.uuid) or not device.pci_bus_id:
            raise
        return nvml_query(nvml, "nvmlDeviceGetHandleByPciBusId", device.pci_bus_id)


def _system_versions(nvml: types.ModuleType) -> tuple[str, str | None]:
    driver = nvml_query(nvml, "nvmlSystemGetDriverVersion")
    try:
        cuda = nvml_query(nvml, "nvmlSystemGetCudaDriverVersion_v2")
    except NvmlError:
        return driver, None
    return driver, f"{cuda // 1000}.{cuda % 1000 // 10}"


def gpu_record(nvml: types.ModuleType, handle: Any, cuda_index: int | None = None) -> Device:
    """A :class:`Device` for a GPU or MIG slice handle.

    ``total_bytes`` is what a process can use: NVML v2 ``total - reserved`` (``reserved`` is the
    driver's and firmware's share, which no process can allocate); the raw figures are kept as
    ``nvml_total_bytes`` and ``nvml_reserved_bytes``. A MIG slice's memory and UUID are its own, its
    bus id, NVML index and compute capability its parent GPU's.

    Raises:
        NvmlError: a query failed.
    """
    uuid = nvml_query(nvml, "nvmlDeviceGetUUID", handle)
    parent = nvml_query(nvml, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", handle) if is_mig_uuid(uuid) else None
    physical = parent if parent is not None else handle
    pci = nvml_query(nvml, "nvmlDeviceGetPciInfo", physical)
    bus_id = pci.busId.decode() if isinstance(pci.busId, bytes) else str(pci.busId)
    try:
        major, minor = nvml_query(nvml, "nvmlDeviceGetCudaComputeCapability", physical)
        capability: str | None = f"{major}.{minor}"
    except NvmlError:
        capability = None
    memory = memory_figures(nvml, handle)
    driver, cuda_version = _system_versions(nvml)
    return Device(
        kind="cuda", name=nvml_query(nvml, "nvmlDeviceGetName", handle),
        total_bytes=memory.total_bytes - memory.reserved_bytes,
        total_source=f"NVML v{memory.version} total - reserved" if memory.version == 2 else "NVML v1 total",
        uuid=uuid, pci_bus_id=bus_id, nvml_index=nvml_query(nvml, "nvmlDeviceGetIndex", physical),
        driver_version=driver, cuda_driver_version=cuda_version, cuda_index=cuda_index,
        compute_capability=capability, nvml_total_bytes=memory.total_bytes,
        nvml_reserved_bytes=memory.reserved_bytes if memory.version == 2 else None,
        parent_uuid=nvml_query(nvml, "nvmlDeviceGetUUID", parent) if parent is not None else None)


def list_gpus(nvml: types.ModuleType) -> list[Device]:
    """Every physical GPU NVML sees, in NVML order (PCI bus order), whether visible to CUDA or not.

    Raises:
        NvmlError: a query failed.
    """
    count = nvml_query(nvml, "nvmlDeviceGetCount")
    return [gpu_record(nvml, nvml_query(nvml, "nvmlDeviceGetHandleByIndex", index)) for index in range(count)]


def visible_uuids(cuda_visible_devices: str | None = None) -> list[str]:
    """UUIDs of the devices CUDA shows this process, in CUDA index order (nvitop's parser; see above).

    Args:
        cuda_visible_devices: the variable's value; None means unset (every GPU is visible).

    Returns:
        ``GPU-...`` and ``MIG-...`` UUIDs; empty when the value hides every device or is invalid.
    """
    from nvitop.api.device import normalize_cuda_visible_devices

    return [uuid for uuid in normalize_cuda_visible_devices(cuda_visible_devices).split(",") if uuid]


def visible_gpus(nvml: types.ModuleType, environ: dict[str, str] | None = None) -> list[Device]:
    """The GPUs (or MIG slice) this process may use, in CUDA order, with ``cuda_index`` set.

    ``CUDA_VISIBLE_DEVICES`` is read from ``environ`` (default ``os.environ``); ``CUDA_DEVICE_ORDER``
    from ``os.environ`` (the CUDA driver, asked in a child process, reads it there).

    Raises:
        NvmlError: a query failed.
    """
    environ = os.environ if environ is None else environ
    uuids = visible_uuids(environ.get("CUDA_VISIBLE_DEVICES"))
    return [gpu_record(nvml, nvml_query(nvml, "nvmlDeviceGetHandleByUUID", uuid), cuda_index=index)
            for index, uuid in enumerate(uuids)]
