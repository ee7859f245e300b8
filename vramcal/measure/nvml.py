"""The NVML boundary: loading NVML, the one query wrapper (:func:`nvml_query`, errors as :class:`NvmlError`), memory
and process figures, visible GPUs.

Queries go through ``nvitop.api.libnvml`` (pynvml's functions with the driver's v2/v3 struct chosen per symbol;
not nvitop's ``nvmlQuery``/``nvmlInit``, which log). :func:`visible_uuids` is nvitop's
``normalize_cuda_visible_devices`` (the CUDA driver asked in a throw-away process: CUDA's order and MIG rules).
Written here: the v2 -> v1 memory retry, :class:`~vramcal.records.Device` records, a MIG slice's identity.

:class:`NvmlSampler` samples one GPU (or MIG slice) in a background thread: the NVML half of DESIGN.md's peak_bytes.

This process's memory (``source``), by preference: ``process``, NVML's per-process figure for this PID;
``device-delta-minus-others`` where NVML lists none for it (a container's PID namespace), the device-wide change
since the baseline minus the change of each other process listed at the baseline; ``device-delta`` with no such
process (or where NVML refuses to list them). The baseline is taken once, before this process starts CUDA, after
the device-wide figure settles; a process appearing later is never subtracted (it may be this one: errs high).
"""

from __future__ import annotations

import os
import threading
import time
import types
from collections.abc import Callable
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
    """One NVML memory reading of a GPU or MIG slice, in bytes; ``reserved_bytes`` is the driver's and firmware's
    share of ``total_bytes`` (v2; 0 from v1, whose total leaves it out on most drivers); ``version`` 2 or 1."""

    total_bytes: int
    reserved_bytes: int
    used_bytes: int
    free_bytes: int
    version: int


def memory_figures(nvml: types.ModuleType, handle: Any) -> MemoryFigures:
    """Memory of ``handle``: v2 where the driver exports it, else v1, also where v2 is refused (vGPU, some MIG).

    Raises:
        NvmlError: both calls failed.
    """
    try:
        info = nvml_query(nvml, "nvmlDeviceGetMemoryInfo", handle)  # nvitop's: v2 if the driver has the symbol
    except NvmlError:
        import pynvml

        info = nvml_query(pynvml, "nvmlDeviceGetMemoryInfo", handle)  # pynvml without a version: v1
    reserved = getattr(info, "reserved", None)
    return MemoryFigures(total_bytes=int(info.total), reserved_bytes=int(reserved or 0), used_bytes=int(info.used),
                         free_bytes=int(info.free), version=2 if reserved is not None else 1)


def process_figures(nvml: types.ModuleType, handle: Any) -> dict[int, int | None]:
    """Compute processes on ``handle`` (a slice's on a MIG handle): PID -> used bytes, None where NVML gives no
    figure (containers). One NVML call.

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
    """A :class:`Device` for a GPU or MIG slice handle: ``total_bytes`` is NVML v2 ``total - reserved`` (what a
    process can allocate), the raw figures kept; a slice's memory and UUID are its own, its bus id, index and
    compute capability its parent's.

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


def visible_uuids(cuda_visible_devices: str | None = None) -> list[str]:
    """``GPU-``/``MIG-`` UUIDs CUDA shows this process for ``CUDA_VISIBLE_DEVICES`` = ``cuda_visible_devices``
    (None: unset), in CUDA index order; empty when it hides every device or is invalid."""
    from nvitop.api.device import normalize_cuda_visible_devices

    return [uuid for uuid in normalize_cuda_visible_devices(cuda_visible_devices).split(",") if uuid]


def visible_gpus(nvml: types.ModuleType, environ: dict[str, str] | None = None) -> list[Device]:
    """The GPUs (or MIG slice) this process may use, in CUDA order, with ``cuda_index`` set; ``CUDA_VISIBLE_DEVICES``
    from ``environ`` (default ``os.environ``), ``CUDA_DEVICE_ORDER`` from ``os.environ`` (the driver's child reads it).

    Raises:
        NvmlError: a query failed.
    """
    environ = os.environ if environ is None else environ
    uuids = visible_uuids(environ.get("CUDA_VISIBLE_DEVICES"))
    return [gpu_record(nvml, nvml_query(nvml, "nvmlDeviceGetHandleByUUID", uuid), cuda_index=index)
            for index, uuid in enumerate(uuids)]


# ---------------------------------------------------------------------------------------------- the sampler

# NVML need only catch what torch's peaks cannot see (context, workspaces, kernels), which stays once it appears:
# 10 ms sees it several times a step at one NVML call (tens of microseconds) a sample.
NVML_SAMPLE_INTERVAL_S = 0.010
BASELINE_SETTLE_S = 3.0  # longest wait for the device-wide figure to stop changing before the baseline
_SETTLE_POLL_S = 0.05
_SETTLE_TOLERANCE_BYTES = 4 * 2**20  # NVML reports in whole pages; a few MiB of jitter is not a release


def settled(read: Callable[[], int], settle_s: float, poll_s: float = _SETTLE_POLL_S,
            tolerance_bytes: int = _SETTLE_TOLERANCE_BYTES, clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], None] = time.sleep) -> int:
    """``read()`` (bytes) once three readings ``poll_s`` apart agree within ``tolerance_bytes``, else at
    ``settle_s``."""
    deadline, readings = clock() + settle_s, [read()]
    while clock() < deadline:
        sleep(poll_s)
        readings.append(read())
        if len(readings) >= 3 and max(readings[-3:]) - min(readings[-3:]) <= tolerance_bytes:
            break
    return readings[-1]


class NvmlSampler:
    """Samples one GPU's NVML memory in a background thread (module docstring).

    Args:
        nvml: the NVML namespace (:func:`vramcal.measure.nvml.load_nvml`); handle: the device's (a slice's own).
        pid: the process measured (default: this one). interval_s: seconds between samples.
        settle_s: longest wait for device-wide used memory to settle before the baseline (0: none).

    Attributes (bytes): ``baseline_bytes`` (device-wide used at the baseline), ``process_peak_bytes`` (None while
    NVML gave no per-process figure), ``device_delta_peak_bytes``; ``samples``; ``error``: why the thread stopped.
    """

    def __init__(self, nvml: types.ModuleType, handle: Any, pid: int | None = None,
                 interval_s: float = NVML_SAMPLE_INTERVAL_S, settle_s: float = 0.0) -> None:
        self._nvml, self._handle, self._pid = nvml, handle, pid or os.getpid()
        self._interval_s = interval_s
        self._lists_processes = True
        self.baseline_bytes = settled(self.device_used_bytes, settle_s) if settle_s > 0 else self.device_used_bytes()
        self._others_baseline = {pid: used for pid, used in self._processes().items()
                                 if pid != self._pid and used is not None}
        self.process_peak_bytes: int | None = None
        self.device_delta_peak_bytes = 0
        self.samples = 0
        self.error: str | None = None
        self._lock = threading.Lock()  # a sample and a reset never interleave (the thread and the caller)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vramcal-nvml", daemon=True)

    @property
    def source(self) -> str:
        """Which figure :meth:`peak_bytes` is: ``process``, ``device-delta-minus-others`` or ``device-delta``."""
        if self.process_peak_bytes is not None:
            return "process"
        return "device-delta-minus-others" if self._others_baseline else "device-delta"

    def _processes(self) -> dict[int, int | None]:
        """PID -> used bytes; {} from the first refusal on (no permission on a MIG slice in a container)."""
        if self._lists_processes:
            try:
                return process_figures(self._nvml, self._handle)
            except NvmlError:
                self._lists_processes = False
        return {}

    def device_used_bytes(self) -> int:
        """Device-wide (or MIG-slice-wide) used memory now, bytes."""
        return memory_figures(self._nvml, self._handle).used_bytes

    def _device_delta(self, processes: dict[int, int | None]) -> int:
        others_change = sum((processes.get(pid) or 0) - used for pid, used in self._others_baseline.items())
        return self.device_used_bytes() - self.baseline_bytes - others_change

    def current_bytes(self) -> int:
        """This process's GPU memory now, bytes: the per-process figure, else the device-wide change."""
        processes = self._processes()
        mine = processes.get(self._pid)
        return mine if mine is not None else self._device_delta(processes)

    def sample(self) -> None:
        """One sample: one NVML call where NVML lists this PID with a figure, else two."""
        with self._lock:
            processes = self._processes()
            mine = processes.get(self._pid)
            if mine is not None:
                self.process_peak_bytes = max(self.process_peak_bytes or 0, mine)
            else:
                self.device_delta_peak_bytes = max(self.device_delta_peak_bytes, self._device_delta(processes))
            self.samples += 1

    def checked_sample(self) -> str | None:
        """:meth:`sample` unless NVML failed before; a failure is kept in ``error``, which is returned."""
        if self.error is None:
            try:
                self.sample()
            except NvmlError as error:
                self.error = str(error)
        return self.error

    def reset_peaks(self) -> None:
        """Forget the peaks (not the baseline): the next samples start the measured span."""
        with self._lock:
            self.process_peak_bytes = None
            self.device_delta_peak_bytes = 0

    def peak_bytes(self) -> int:
        """The NVML figure for this process: per-process peak, else the device-wide peak change."""
        return self.process_peak_bytes if self.process_peak_bytes is not None else self.device_delta_peak_bytes

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except NvmlError as error:
                self.error = str(error)
                return
            self._stop.wait(self._interval_s)

    def start(self) -> NvmlSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and take a last sample."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.error is None:
            self.sample()

    def __enter__(self) -> NvmlSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
