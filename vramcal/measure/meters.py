"""The meter: one definition of peak_bytes (DESIGN.md), for trial processes, the trainer and the integrations.

    meter = open_meter(device, host_limit_bytes)  # first thing in the process, before CUDA starts
    meter.check_pinned()                           # once CUDA has started (GPU; no-op on the host)
    meter.reset()                                  # after build and warm-up: the measured span starts
    figures = meter.read()                         # peak_bytes and every source
    meter.environment(); meter.close()

GPU: ``peak_bytes = max(NVML peak, nvml_overhead_bytes + torch.cuda.max_memory_reserved())``, the NVML peak from
:class:`~vramcal.measure.nvml.NvmlSampler`, the overhead (NVML usage minus torch's reserved: context, workspaces,
kernels) re-measured at each reset. Host: ``peak_bytes = max(VmHWM - RssFile, data-segment peak)``: what
``RLIMIT_DATA`` binds, and the resident peak without the page cache of mapped files. A process not started for
measuring (a framework's run) is measured by :func:`attach_meter`.
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Callable
from typing import Any, Protocol

from vramcal import environment as env
from vramcal.measure.nvml import BASELINE_SETTLE_S, NvmlError, NvmlSampler, load_nvml, nvml_handle
from vramcal.records import Device, Kind
from vramcal.units import format_bytes


class MeterError(RuntimeError):
    """The meter cannot measure what it was asked to; the message says why and what to do."""


class Meter(Protocol):
    kind: str

    def check_pinned(self) -> None: ...
    def held_bytes(self) -> int: ...
    def reset(self) -> None: ...
    def read(self) -> dict[str, Any]: ...
    def environment(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


def open_meter(device: Device, host_limit_bytes: int | None = None, *, settle_s: float = BASELINE_SETTLE_S,
               nvml_loader: Any = None) -> Meter:
    """Start measuring this process on ``device``; call it before CUDA is initialised.

    GPU: pins ``CUDA_VISIBLE_DEVICES`` to the device's UUID, waits up to ``settle_s`` for its used memory to
    settle, takes the baseline and starts the sampler. Host: sets ``RLIMIT_DATA`` to ``host_limit_bytes`` if given.

    Raises:
        MeterError: CUDA was already initialised, the device has no UUID, or an outer RLIMIT_DATA is below the budget.
        NvmlError: NVML is unusable.
        MemoryError: the host budget is at or below what this process already holds (the limit is left unset).
    """
    if device.kind == "cuda":
        return CudaMeter(device, settle_s=settle_s, nvml_loader=nvml_loader)
    return HostMeter(host_limit_bytes)


# ---------------------------------------------------------------------------------------------- GPU

class CudaMeter:
    """The GPU meter (:func:`open_meter`); CUDA never kills a process for device memory (``killed_for_memory``:
    :mod:`vramcal.measure.evidence`)."""

    kind = "cuda"
    killed_for_memory = False

    @staticmethod
    def worker_environment() -> dict[str, str]:
        """A GPU worker's fork server's defaults: the workers' without the host's own, and Triton's caches."""
        return {**{name: value for name, value in env.WORKER_DEFAULTS.items() if name not in env.HOST_ONLY},
                env.TRITON_ENV[0]: str(env.triton_cache_dir()), env.TRITON_ENV[1]: "1"}

    def __init__(self, device: Device, settle_s: float = BASELINE_SETTLE_S, nvml_loader: Any = None) -> None:
        if not device.uuid:
            raise MeterError(f"{device.name} has no UUID to pin: select it with vramcal.measure.device.select")
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            raise MeterError("CUDA was initialised before the meter opened, so CUDA_VISIBLE_DEVICES can no longer "
                             "be pinned and the baseline would leave this process's context out: open the meter "
                             "before any CUDA call")
        self.device = device
        os.environ["CUDA_VISIBLE_DEVICES"] = device.uuid
        nvml = (nvml_loader or load_nvml)()
        self._sampler = NvmlSampler(nvml, nvml_handle(nvml, device), settle_s=settle_s).start()
        self.nvml_overhead_bytes = 0

    def check_pinned(self) -> None:
        """Raise unless torch's current CUDA device is the chosen one (compared by UUID).

        Raises:
            MeterError: something touched CUDA before the pin: the steps would run on another device.
        """
        import torch

        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        wanted = {_uuid_body(self.device.uuid), _uuid_body(self.device.parent_uuid)} - {""}
        if _uuid_body(str(props.uuid)) not in wanted:
            raise MeterError(f"torch runs on {props.name} ({props.uuid}) but the meter measures {self.device.name} "
                             f"({self.device.uuid}): CUDA started before CUDA_VISIBLE_DEVICES was pinned; open the "
                             f"meter before anything touches CUDA")

    def held_bytes(self) -> int:
        """What this process holds on the GPU now (NVML's figure: context, weights, data), bytes."""
        synchronize(Kind.CUDA)
        return self._sampler.current_bytes()

    def reset(self) -> None:
        """Synchronize; reset torch's and the sampler's peaks; re-measure the NVML overhead."""
        self.nvml_overhead_bytes = reset_cuda_span(self._sampler)

    def read(self) -> dict[str, Any]:
        """Figures since the last :meth:`reset` (bytes): ``peak_bytes`` and every source.

        Raises:
            MeterError: NVML stopped answering during the span.
        """
        synchronize(Kind.CUDA)
        if self._sampler.checked_sample() is not None:
            raise MeterError(f"NVML stopped answering while measuring ({self._sampler.error}): the figures are "
                             f"incomplete; check the GPU with nvidia-smi and run again")
        return cuda_peaks(self._sampler, self.nvml_overhead_bytes)

    def environment(self) -> dict[str, Any]:
        """What changes GPU memory besides the model (read after CUDA started), and the worker's settings."""
        import torch

        major, minor = torch.cuda.get_device_capability()
        return {"torch_version": torch.__version__, "torch_cuda_version": torch.version.cuda,
                "cudnn_version": torch.backends.cudnn.version(), "triton_version": env.package_version("triton"),
                "compute_capability": f"{major}.{minor}",
                **{name: os.environ.get(name) for name in (*env.ALLOCATOR_ENV, *env.TRITON_ENV, *env.HOST_ONLY)}}

    def close(self) -> None:
        self._sampler.stop()


def _uuid_body(uuid: str | None) -> str:
    """A UUID without its ``GPU-``/``MIG-`` prefix, lower case (torch prints CUDA's UUIDs bare)."""
    text = (uuid or "").strip().lower()
    return text.split("-", 1)[1] if text.startswith(("gpu-", "mig-")) else text


# ---------------------------------------------------------------------------------------------- host

class HostMeter:
    """The host meter (:func:`open_meter`); ``RLIMIT_DATA`` stays for the process's life."""

    kind = "host"
    killed_for_memory = True

    @staticmethod
    def worker_environment() -> dict[str, str]:
        """A host worker's fork server's defaults (:data:`vramcal.environment.WORKER_DEFAULTS`)."""
        return dict(env.WORKER_DEFAULTS)

    def __init__(self, host_limit_bytes: int | None = None) -> None:
        self._highest: dict[str, int] | None = None  # the highest reading since the last reset
        if host_limit_bytes is not None:
            held = read_status_bytes("VmData")
            if held >= host_limit_bytes:
                raise MemoryError(f"the host budget {format_bytes(host_limit_bytes)} is below the "
                                  f"{format_bytes(held)} this process held before its step (the interpreter, torch "
                                  f"and the libraries it imported)")
            _, hard = resource.getrlimit(resource.RLIMIT_DATA)
            if hard != resource.RLIM_INFINITY and hard < host_limit_bytes:
                raise MeterError(f"this process's RLIMIT_DATA is {format_bytes(hard)}, set outside vramcal (ulimit -d, "
                                 f"prlimit --data), below the host budget of {format_bytes(host_limit_bytes)}: raise "
                                 f"the limit, or give --capacity {format_bytes(hard)} or less")
            resource.setrlimit(resource.RLIMIT_DATA, (host_limit_bytes, host_limit_bytes))

    def check_pinned(self) -> None:
        """Nothing to pin on the host."""

    def held_bytes(self) -> int:
        """What this process holds now (:func:`host_held_bytes`)."""
        return host_held_bytes()

    def reset(self) -> None:
        """Reset VmHWM (the data-segment peak cannot be reset: it covers the whole process life)."""
        reset_peak_rss()
        self._highest = None

    def read(self) -> dict[str, Any]:
        """:func:`host_peaks`, never below a reading since the last reset (a mapping made after the data-segment
        peak lowers :func:`peak_data_bytes` by its size)."""
        peaks = host_peaks()
        if self._highest is not None and self._highest["peak_bytes"] > peaks["peak_bytes"]:
            return self._highest
        self._highest = peaks
        return peaks

    def environment(self) -> dict[str, Any]:
        """The malloc-relevant settings of this process (for the profile)."""
        import torch

        return {"torch_version": torch.__version__, "torch_num_threads": torch.get_num_threads(),
                **{name: os.environ.get(name) for name in env.HOST_MALLOC_ENV}}

    def close(self) -> None:
        """Nothing to stop on the host."""


# The meter of each kind of device (:data:`vramcal.records.Kind`)
METERS: dict[Kind, type[CudaMeter] | type[HostMeter]] = {Kind.CUDA: CudaMeter, Kind.HOST: HostMeter}


def read_status_bytes(field: str, pid: int | str = "self") -> int:
    """A ``/proc/<pid>/status`` memory field (``VmHWM``, ``VmRSS``, ``VmData``) in bytes.

    Raises:
        KeyError: the kernel does not report the field.
    """
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # the kernel reports kB (KiB)
    raise KeyError(f"{field} not in /proc/{pid}/status")


def host_held_bytes() -> int:
    """What this process holds now, the current counterpart of the host ``peak_bytes``: the larger of its
    resident set less file-backed pages (``VmRSS - RssFile``) and its data segment (VmData), bytes."""
    return max(read_status_bytes("VmRSS") - read_status_bytes("RssFile"), read_status_bytes("VmData"))


def peak_data_bytes() -> int:
    """Peak of this process's data segment (VmData), bytes: ``VmPeak - (VmSize - VmData)``, the rest of the
    address space (code, libraries, mapped files) being constant while steps run. ``RLIMIT_DATA`` limits it."""
    status = {field: read_status_bytes(field) for field in ("VmPeak", "VmSize", "VmData")}
    return status["VmPeak"] - (status["VmSize"] - status["VmData"])


def host_peaks() -> dict[str, int]:
    """DESIGN.md's host ``peak_bytes`` with its sources: max(VmHWM since :func:`reset_peak_rss` less the
    file-backed pages resident now, the data-segment peak of the process's life), bytes. File-backed pages
    (libraries, mapped files: ``RssFile``) are page cache the kernel reclaims, and how many of them a process
    maps depends on how the files were last read (a freshly installed library maps more), not on its step."""
    rss_peak, data_peak = read_status_bytes("VmHWM") - read_status_bytes("RssFile"), peak_data_bytes()
    return {"peak_bytes": max(rss_peak, data_peak), "rss_peak_bytes": rss_peak, "data_peak_bytes": data_peak}


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return False
    return True


# ---------------------------------------------------------------------------------------------- torch.cuda

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
            "nvml_peak_bytes": nvml_peak, "nvml_source": sampler.source,
            "nvml_overhead_bytes": nvml_overhead_bytes, **torch_peaks}


def reset_cuda_span(sampler: NvmlSampler) -> int:
    """Reset torch's and ``sampler``'s peaks; the NVML overhead now (NVML's usage minus torch's reserved), bytes."""
    torch_cuda_reset_peaks()
    sampler.reset_peaks()
    return sampler.current_bytes() - torch_cuda_reserved_bytes()


def torch_cuda_reset_peaks() -> None:
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()


def torch_cuda_reserved_bytes() -> int:
    import torch

    return int(torch.cuda.memory_reserved())


def empty_cache(device_kind: Kind) -> None:
    """Return a card's caching allocator's free blocks to the driver (after an out-of-memory error); the host's
    allocator has none to return."""
    if Kind(device_kind).cuda_kernels:
        import torch

        torch.cuda.empty_cache()


def synchronize(device_kind: Kind) -> None:
    """Wait for a card's queued kernels (the host's ops run as they are called)."""
    if Kind(device_kind).cuda_kernels:
        import torch

        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- attached

class AttachedMeter(Protocol):
    """A meter attached to a running process (:func:`attach_meter`): ``definition`` is what it measured, ``unseen``
    what it cannot see (None: nothing; else its peak is a lower bound)."""

    definition: str
    unseen: str | None

    def held_bytes(self) -> int: ...
    def reset(self) -> None: ...
    def read(self) -> int: ...
    def close(self) -> None: ...


def attach_meter(device: Device, warn: Callable[[str], None] = print) -> AttachedMeter:
    """A meter for this already running process on ``device``, by the trials' definitions (module docstring),
    the NVML sampler started at the first ``reset()``. Attach it before the model reaches the card.

    Args:
        warn: called with one line when the meter falls back to a weaker figure (no NVML: torch's reserved peak).
    """
    return AttachedCudaMeter(device, warn) if device.kind == "cuda" else AttachedHostMeter()


class AttachedHostMeter:
    """The host peak of this process (:func:`host_peaks`); where the data-segment peak (never reset) was reached
    before the span, an upper bound, and the definition says so."""

    unseen = None  # the kernel's figures are the whole process's

    def __init__(self) -> None:
        self.definition = ("host peak: max(VmHWM since fit start less file-backed pages, data-segment peak of the "
                           "process)")
        self._data_peak_at_start = peak_data_bytes()

    def held_bytes(self) -> int:
        return host_held_bytes()

    def reset(self) -> None:
        reset_peak_rss()
        self._data_peak_at_start = peak_data_bytes()

    def read(self) -> int:
        peaks = host_peaks()
        earlier = ", reached earlier in the process: an upper bound of this span's peak"
        if peaks["data_peak_bytes"] > peaks["rss_peak_bytes"] and peaks["data_peak_bytes"] <= self._data_peak_at_start \
                and earlier not in self.definition:
            self.definition += earlier
        return peaks["peak_bytes"]

    def close(self) -> None:
        """Nothing to stop."""


class AttachedCudaMeter:
    """The GPU peak of this process (:func:`cuda_peaks`); without NVML, torch's reserved peak alone.

    Where NVML gives no per-process figure (:class:`~vramcal.measure.nvml.NvmlSampler`) and CUDA started before the
    meter was made, torch's reserved memory then is counted back in, but the CUDA context and other allocations
    outside torch's are not seen: ``unseen`` says so, and the peak and :meth:`held_bytes` are lower bounds.
    """

    def __init__(self, device: Device, warn: Callable[[str], None] = print) -> None:
        self._overhead_bytes, self._warn, self.unseen, self._sampling = 0, warn, None, False
        torch = sys.modules.get("torch")
        before = torch_cuda_reserved_bytes() if torch is not None and torch.cuda.is_initialized() else None
        try:
            nvml = load_nvml()
            self._sampler: NvmlSampler | None = NvmlSampler(nvml, nvml_handle(nvml, device))
            self.definition = "GPU peak: max(NVML peak, NVML overhead + torch.cuda.max_memory_reserved())"
        except NvmlError as error:
            self._sampler = None
            self.definition = "GPU peak: torch.cuda.max_memory_reserved() only (no NVML: no CUDA context)"
            warn(f"NVML is unusable ({error}): the peak will be torch.cuda.max_memory_reserved() alone, which leaves "
                 f"out the CUDA context that the profile counts")
        self._before_bytes = 0
        if self._sampler is not None and before is not None:
            self._sampler.checked_sample()  # does NVML give this process's own figure? (an error: read() says so)
            if self._sampler.source != "process":
                self._before_bytes = before
                self.unseen = ("NVML gives no per-process figure here (a container?) and CUDA had started before "
                               "vramcal attached, so the CUDA context and memory outside torch's allocator held "
                               "then are not seen")
                self.definition += f", a lower bound: {self.unseen}"

    def held_bytes(self) -> int:
        """This process's GPU memory now, bytes (without NVML, torch's reserved memory)."""
        synchronize(Kind.CUDA)
        if self._sampler is None:
            return torch_cuda_reserved_bytes()
        return self._sampler.current_bytes() + self._before_bytes

    def reset(self) -> None:
        """The measured span starts: torch's and the sampler's peaks reset (its thread started at the first)."""
        if self._sampler is None:
            return torch_cuda_reset_peaks()
        if not self._sampling:
            self._sampler.start()
            self._sampling = True
        self._overhead_bytes = reset_cuda_span(self._sampler) + self._before_bytes

    def read(self) -> int:
        synchronize(Kind.CUDA)
        if self._sampler is not None:
            if self._sampler.checked_sample() is None:
                figures = cuda_peaks(self._sampler, self._overhead_bytes)
                return max(figures["peak_bytes"], figures["nvml_peak_bytes"] + self._before_bytes)
            self._warn(f"NVML stopped answering ({self._sampler.error}): the peak is "
                       f"torch.cuda.max_memory_reserved() alone, without the CUDA context")
            self.definition = "GPU peak: torch.cuda.max_memory_reserved() only (NVML failed)"
        return torch_cuda_peaks()["torch_max_reserved_bytes"]

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.stop()
