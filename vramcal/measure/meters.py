"""Memory meters used inside a trial process: NVML sampling and torch allocator peaks (GPU), VmHWM (host).

With :mod:`vramcal.measure.device`, the only module that touches NVML or ``torch.cuda`` memory functions. The
definitions are DESIGN.md's: a GPU trial's ``peak_bytes`` is the larger of (a) the NVML per-process
used memory, sampled in a background thread, and (b) the NVML overhead measured after warm-up plus
``torch.cuda.max_memory_reserved()``. When NVML reports no per-process figure (common in containers,
where the PID namespace hides the process), (a) falls back to the change in device-wide used memory
since before CUDA was initialised.
"""

from __future__ import annotations

import os
import threading
import time
import types
from typing import Any

from vramcal.measure.device import NvmlError, nvml_memory_info, nvml_query

NVML_SAMPLE_INTERVAL_S = 0.002


def is_out_of_memory(error: BaseException) -> bool:
    """True for an allocator out-of-memory error, the one place vramcal classifies them.

    ``torch.OutOfMemoryError`` (CUDA caching allocator) by type; ``MemoryError`` (Python); and the CPU
    allocator's failure, which torch raises as a plain ``RuntimeError`` from ``alloc_cpu.cpp``
    (``DefaultCPUAllocator: can't allocate memory``), so that one is recognised by its message.
    """
    import torch

    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(error)


# ---------------------------------------------------------------------------------------------- host

def read_status_bytes(field: str, pid: int | str = "self") -> int:
    """A ``/proc/<pid>/status`` memory field (``VmHWM``, ``VmRSS``, ``VmData``) in bytes."""
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # the kernel reports kB (KiB)
    raise KeyError(f"{field} not in /proc/{pid}/status")


def peak_data_bytes() -> int:
    """Peak size of this process's data segment (VmData: heap and private anonymous mappings), bytes.

    The kernel keeps the peak of the whole address space (VmPeak) but not of VmData, and the rest of the
    address space (code, libraries, mapped files) does not change while training steps run, so
    ``VmPeak - (VmSize - VmData)`` is the data segment's peak. It is what ``RLIMIT_DATA`` limits: the
    host budget of vramcal's trials fails exactly when this figure would pass it.
    """
    status = {field: read_status_bytes(field) for field in ("VmPeak", "VmSize", "VmData")}
    return status["VmPeak"] - (status["VmSize"] - status["VmData"])


def host_peaks() -> dict[str, int]:
    """DESIGN.md's host ``peak_bytes`` with its sources: the larger of the resident peak (VmHWM, since
    the last :func:`reset_peak_rss`) and the data-segment peak (:func:`peak_data_bytes`, whole process
    life), the figure that the host budget ``RLIMIT_DATA`` limits."""
    rss_peak, data_peak = read_status_bytes("VmHWM"), peak_data_bytes()
    return {"peak_bytes": max(rss_peak, data_peak), "rss_peak_bytes": rss_peak, "data_peak_bytes": data_peak}


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0).

    Returns:
        False when the kernel refuses; the peak then also covers the warm-up.
    """
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return False
    return True


# ---------------------------------------------------------------------------------------------- GPU

class NvmlSampler:
    """Samples NVML memory of one GPU in a background thread.

    Tracks the peak of this process's used memory (``nvmlDeviceGetComputeRunningProcesses``) and the
    peak of device-wide used memory minus ``baseline_bytes`` (device used before this process
    initialised CUDA). ``process_peak_bytes`` stays None when NVML never listed this PID with a figure.
    """

    def __init__(self, nvml: types.ModuleType, handle: Any, pid: int | None = None,
                 interval_s: float = NVML_SAMPLE_INTERVAL_S) -> None:
        self._nvml, self._handle, self._pid = nvml, handle, pid or os.getpid()
        self._interval_s = interval_s
        self.baseline_bytes = self.device_used_bytes()
        self.process_peak_bytes: int | None = None
        self.device_delta_peak_bytes = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vramcal-nvml", daemon=True)

    def device_used_bytes(self) -> int:
        return int(nvml_memory_info(self._nvml, self._handle).used)

    def process_used_bytes(self) -> int | None:
        """This PID's used GPU memory in bytes, or None when NVML does not report it."""
        for func in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            try:
                processes = nvml_query(self._nvml, func, self._handle)
            except NvmlError:
                continue
            for process in processes:
                used = getattr(process, "usedGpuMemory", None)
                if process.pid == self._pid and used is not None and used < 2**63 - 1:
                    return int(used)
        return None

    def sample(self) -> None:
        used = self.process_used_bytes()
        if used is not None:
            self.process_peak_bytes = max(self.process_peak_bytes or 0, used)
        self.device_delta_peak_bytes = max(self.device_delta_peak_bytes,
                                           self.device_used_bytes() - self.baseline_bytes)
        self.samples += 1

    def current_bytes(self) -> int:
        """This process's GPU memory now: the per-process figure, else the device-wide change."""
        used = self.process_used_bytes()
        return used if used is not None else self.device_used_bytes() - self.baseline_bytes

    def reset_peaks(self) -> None:
        self.process_peak_bytes = None
        self.device_delta_peak_bytes = 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(self._interval_s)

    def __enter__(self) -> NvmlSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def peak_bytes(self) -> int:
        """The NVML figure for this process: per-process peak, else the device-wide peak change."""
        if self.process_peak_bytes is not None:
            return self.process_peak_bytes
        return self.device_delta_peak_bytes


def torch_cuda_peaks() -> dict[str, int]:
    """``torch.cuda`` allocator peaks since the last reset, in bytes (current device)."""
    import torch

    return {"torch_max_allocated_bytes": int(torch.cuda.max_memory_allocated()),
            "torch_max_reserved_bytes": int(torch.cuda.max_memory_reserved())}


def cuda_peaks(sampler: NvmlSampler, nvml_overhead_bytes: int) -> dict[str, Any]:
    """DESIGN.md's GPU ``peak_bytes`` with its sources, since the last resets of ``sampler`` and torch:
    ``max(NVML peak, nvml_overhead_bytes + torch.cuda.max_memory_reserved())``."""
    torch_peaks = torch_cuda_peaks()
    nvml_peak = sampler.peak_bytes()
    return {"peak_bytes": max(nvml_peak, nvml_overhead_bytes + torch_peaks["torch_max_reserved_bytes"]),
            "nvml_peak_bytes": nvml_peak,
            "nvml_source": "process" if sampler.process_peak_bytes is not None else "device-delta",
            "nvml_overhead_bytes": nvml_overhead_bytes, **torch_peaks}


def torch_cuda_reset_peaks() -> None:
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()


def torch_cuda_reserved_bytes() -> int:
    import torch

    return int(torch.cuda.memory_reserved())


def torch_cuda_empty_cache() -> None:
    import torch

    torch.cuda.empty_cache()


def synchronize(device_kind: str) -> None:
    if device_kind == "cuda":
        import torch

        torch.cuda.synchronize()
