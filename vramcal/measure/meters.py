"""The meter: one definition of peak_bytes (DESIGN.md), used by trial processes, the trainer and the
framework integrations alike.

    meter = open_meter(device, host_limit_bytes)  # first thing in the process, before CUDA starts
    meter.check_pinned()                           # once CUDA has started (GPU; no-op on the host)
    ...build, warm up...
    meter.reset()                                  # the measured span starts here
    ...measured steps...
    figures = meter.read()                         # peak_bytes and every source
    meter.environment(); meter.close()

On a GPU, ``peak_bytes = max(NVML peak, nvml_overhead_bytes + torch.cuda.max_memory_reserved())``: the
NVML peak comes from :class:`~vramcal.measure.sampler.NvmlSampler` (baseline before CUDA started, so the
context, weights and data count), the overhead (NVML usage minus torch's reserved memory: the CUDA
context, cuBLAS workspaces, kernels) is re-measured at each :meth:`CudaMeter.reset`. On the host,
``peak_bytes = max(VmHWM, data-segment peak)``: the figure the host budget (``RLIMIT_DATA``) binds.

A process that was not started for measuring (a Lightning, Hugging Face or Accelerate run: CUDA may have
started, no budget is set) is measured by :func:`attach_meter`, by the same definitions from the moment it
is attached.

With :mod:`vramcal.measure.nvml`, the only module that touches NVML or ``torch.cuda`` memory functions.
"""

from __future__ import annotations

import importlib.metadata
import os
import resource
import sys
from collections.abc import Callable
from typing import Any, Protocol

from vramcal.environment import ALLOCATOR_ENV, HOST_MALLOC_ENV, HOST_ONLY, TRITON_ENV, WORKER_DEFAULTS, triton_cache_dir
from vramcal.measure.nvml import NvmlError, load_nvml, nvml_handle
from vramcal.measure.sampler import BASELINE_SETTLE_S, NvmlSampler
from vramcal.records import Device
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

    GPU: pins ``CUDA_VISIBLE_DEVICES`` to the device's UUID (a MIG slice's ``MIG-`` UUID), waits up to
    ``settle_s`` for the device's used memory to settle, takes the baseline and starts the sampler.
    Host: sets ``RLIMIT_DATA`` to ``host_limit_bytes`` when given.

    Raises:
        MeterError: CUDA was already initialised in this process, or the device has no UUID.
        NvmlError: NVML is unusable.
        MemoryError: the host budget is at or below the data segment this process already holds (no batch
            size can fit; the limit is left unset).
    """
    if device.kind == "cuda":
        return CudaMeter(device, settle_s=settle_s, nvml_loader=nvml_loader)
    return HostMeter(host_limit_bytes)


# ---------------------------------------------------------------------------------------------- GPU

class CudaMeter:
    """The GPU meter; see :func:`open_meter`.

    What else differs for a GPU's workers: CUDA raises an out-of-memory error for device memory and never kills a
    process for it (``killed_for_memory``: a GPU worker killed by the kernel's out-of-memory killer ran out of the
    host's memory, :mod:`vramcal.measure.evidence`); their environment (:meth:`worker_environment`).
    """

    kind = "cuda"
    killed_for_memory = False

    @staticmethod
    def worker_environment() -> dict[str, str]:
        """What a GPU worker's fork server starts with unless the caller set it: the workers' defaults without the
        host's own (:data:`vramcal.environment.HOST_ONLY`), and Triton's caches kept across trials
        (:data:`vramcal.environment.TRITON_ENV`, under :func:`vramcal.environment.triton_cache_dir`)."""
        return {**{name: value for name, value in WORKER_DEFAULTS.items() if name not in HOST_ONLY},
                TRITON_ENV[0]: str(triton_cache_dir()), TRITON_ENV[1]: "1"}

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
            MeterError: something touched CUDA before the pin (e.g. a ``__main__`` re-imported by the
                fork server's children), so the steps would run on another device than the one metered.
        """
        import torch

        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        wanted = {_uuid_body(self.device.uuid), _uuid_body(self.device.parent_uuid)} - {""}
        if _uuid_body(str(props.uuid)) not in wanted:
            raise MeterError(f"torch runs on {props.name} ({props.uuid}) but the meter measures {self.device.name} "
                             f"({self.device.uuid}): CUDA started before CUDA_VISIBLE_DEVICES was pinned; open the "
                             f"meter before anything touches CUDA")

    def held_bytes(self) -> int:
        """What this process holds on the GPU now (NVML's figure: the context, weights, data; the process term)."""
        synchronize("cuda")
        return self._sampler.current_bytes()

    def reset(self) -> None:
        """Synchronize; reset torch's and the sampler's peaks; re-measure the NVML overhead."""
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self._sampler.reset_peaks()
        self.nvml_overhead_bytes = self._sampler.current_bytes() - int(torch.cuda.memory_reserved())

    def read(self) -> dict[str, Any]:
        """Figures since the last :meth:`reset` (bytes): ``peak_bytes`` and every source.

        Raises:
            MeterError: NVML stopped answering during the span.
        """
        synchronize("cuda")
        if self._sampler.error is None:
            try:
                self._sampler.sample()
            except NvmlError as error:
                self._sampler.error = str(error)
        if self._sampler.error is not None:
            raise MeterError(f"NVML stopped answering while measuring ({self._sampler.error}): the figures are "
                             f"incomplete; check the GPU with nvidia-smi and run again")
        return cuda_peaks(self._sampler, self.nvml_overhead_bytes)

    def environment(self) -> dict[str, Any]:
        """What changes GPU memory use besides the model, read after CUDA started, and what the worker ran with
        (Triton's caches; the host's settings, unset unless the caller set them) (for the profile)."""
        import torch

        major, minor = torch.cuda.get_device_capability()
        return {"torch_version": torch.__version__, "torch_cuda_version": torch.version.cuda,
                "cudnn_version": torch.backends.cudnn.version(), "triton_version": _version("triton"),
                "compute_capability": f"{major}.{minor}",
                **{name: os.environ.get(name) for name in (*ALLOCATOR_ENV, *TRITON_ENV, *HOST_ONLY)}}

    def close(self) -> None:
        self._sampler.stop()


def _uuid_body(uuid: str | None) -> str:
    """A UUID without its ``GPU-``/``MIG-`` prefix, lower case (torch prints CUDA's UUIDs bare)."""
    text = (uuid or "").strip().lower()
    return text.split("-", 1)[1] if text.startswith(("gpu-", "mig-")) else text


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------- host

class HostMeter:
    """The host meter; see :func:`open_meter`. ``RLIMIT_DATA`` stays for the life of the process. The kernel's
    out-of-memory killer guards the host's memory (``killed_for_memory``)."""

    kind = "host"
    killed_for_memory = True

    @staticmethod
    def worker_environment() -> dict[str, str]:
        """What a host worker's fork server starts with unless the caller set it
        (:data:`vramcal.environment.WORKER_DEFAULTS`)."""
        return dict(WORKER_DEFAULTS)

    def __init__(self, host_limit_bytes: int | None = None) -> None:
        self._highest: dict[str, int] | None = None  # the highest reading since the last reset (read)
        if host_limit_bytes is not None:
            held = read_status_bytes("VmData")
            if held >= host_limit_bytes:
                # every allocation would fail, wherever it happens first (a library's thread, a parquet read):
                # a budget problem, said as one, not the failure of whatever ran into it
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
        """:func:`host_peaks`, never below a reading since the last reset: the data-segment peak is VmPeak less the
        mappings that are not data at the time of reading, so a mapping that is there now and was not at the peak
        lowers it by its size (seen: a steady trial's peak so far 116 KiB lower one step than the step before)."""
        peaks = host_peaks()
        if self._highest is not None and self._highest["peak_bytes"] > peaks["peak_bytes"]:
            return self._highest
        self._highest = peaks
        return peaks

    def environment(self) -> dict[str, Any]:
        """The malloc-relevant settings of this process (for the profile)."""
        import torch

        return {"torch_version": torch.__version__, "torch_num_threads": torch.get_num_threads(),
                **{name: os.environ.get(name) for name in HOST_MALLOC_ENV}}

    def close(self) -> None:
        """Nothing to stop on the host."""


# The meter of each kind of device (:data:`vramcal.records.DeviceKind`), and with it what else differs between them
METERS: dict[str, type[CudaMeter] | type[HostMeter]] = {"cuda": CudaMeter, "host": HostMeter}


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
    resident set (VmRSS) and its data segment (VmData), bytes."""
    return max(read_status_bytes("VmRSS"), read_status_bytes("VmData"))


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


def torch_cuda_reset_peaks() -> None:
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()


def torch_cuda_reserved_bytes() -> int:
    import torch

    return int(torch.cuda.memory_reserved())


def torch_cuda_empty_cache() -> None:
    """Return the CUDA caching allocator's free blocks to the driver (after an out-of-memory error)."""
    import torch

    torch.cuda.empty_cache()


def synchronize(device_kind: str) -> None:
    if device_kind == "cuda":
        import torch

        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- attached

class AttachedMeter(Protocol):
    """A meter attached to a running process (:func:`attach_meter`); ``definition`` says what it measured, and
    ``unseen`` what of the process it cannot see (None: nothing; else its peak is a lower bound)."""

    definition: str
    unseen: str | None

    def held_bytes(self) -> int: ...
    def reset(self) -> None: ...
    def read(self) -> int: ...
    def close(self) -> None: ...


def attach_meter(device: Device, warn: Callable[[str], None] = print) -> AttachedMeter:
    """A meter for this already running process on ``device`` (a CUDA GPU it trains on, or the host), by the
    trials' definitions: on a GPU ``max(NVML per-process peak, NVML overhead at reset +
    torch.cuda.max_memory_reserved())``, NVML sampled every 10 ms by a background thread from the first
    ``reset()`` (where NVML is unusable, ``torch.cuda.max_memory_reserved()`` alone, which leaves out the CUDA
    context: ``warn`` says so); on the host ``max(VmHWM since reset, peak of the data segment over the process's
    life)``. Attach it before the model reaches the card: where NVML gives no per-process figure its baseline is
    the device's use now (:class:`AttachedCudaMeter`).

    Args:
        warn: called with one line when the meter falls back to a weaker figure.
    """
    return AttachedCudaMeter(device, warn) if device.kind == "cuda" else AttachedHostMeter()


class AttachedHostMeter:
    """The host peak of this process (:func:`host_peaks`).

    VmHWM is reset by :meth:`reset`; the data-segment peak cannot be reset, so where it was reached before
    (a long-lived process, a notebook) the figure is an upper bound of the span's, and the definition says so.
    """

    unseen = None  # the kernel's figures are the whole process's

    def __init__(self) -> None:
        self.definition = "host peak: max(VmHWM since fit start, data-segment peak of the process)"
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
    """The GPU peak of this process (:func:`cuda_peaks`): NVML sampled in a thread, and torch's allocator peak.
    Without NVML, torch's reserved peak alone (with a warning).

    NVML's figure is this process's own where NVML lists it with one; else (a container's PID namespace hides it:
    :mod:`vramcal.measure.sampler`) the device's use since the baseline, taken when the meter is made. Made before
    CUDA started in this process, that covers all of it. Made after, what the process held then is not in the
    change: torch's reserved memory at the baseline is counted back in, and what lies outside torch's allocator
    (the CUDA context, ~0.3-0.5 GiB, and any library's own allocations) is not seen: ``unseen`` says so, the peak
    and :meth:`held_bytes` are lower bounds, and the definition says it.
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
            try:
                self._sampler.sample()  # does NVML give this process's own figure?
            except NvmlError as error:
                self._sampler.error = str(error)  # read() says so
            if self._sampler.source != "process":  # the device-wide change from here: what CUDA holds now is out
                self._before_bytes = before
                self.unseen = ("NVML gives no per-process figure here (a container?) and CUDA had started before "
                               "vramcal attached, so the CUDA context and memory outside torch's allocator held "
                               "then are not seen")
                self.definition += f", a lower bound: {self.unseen}"

    def held_bytes(self) -> int:
        """This process's GPU memory now (NVML, with torch's reserved memory at the baseline where NVML's figure
        is the change since it; without NVML, torch's reserved memory)."""
        synchronize("cuda")
        if self._sampler is None:
            return torch_cuda_reserved_bytes()
        return self._sampler.current_bytes() + self._before_bytes

    def reset(self) -> None:
        """The measured span starts: torch's and the sampler's peaks reset (its thread started at the first)."""
        torch_cuda_reset_peaks()
        if self._sampler is not None:
            if not self._sampling:
                self._sampler.start()
                self._sampling = True
            self._sampler.reset_peaks()
            self._overhead_bytes = self.held_bytes() - torch_cuda_reserved_bytes()

    def read(self) -> int:
        synchronize("cuda")
        if self._sampler is not None:
            try:
                self._sampler.sample()
            except NvmlError as error:
                self._sampler.error = str(error)
            if self._sampler.error is None:
                figures = cuda_peaks(self._sampler, self._overhead_bytes)
                return max(figures["peak_bytes"], figures["nvml_peak_bytes"] + self._before_bytes)
            self._warn(f"NVML stopped answering ({self._sampler.error}): the peak is "
                       f"torch.cuda.max_memory_reserved() alone, without the CUDA context")
            self.definition = "GPU peak: torch.cuda.max_memory_reserved() only (NVML failed)"
        return torch_cuda_peaks()["torch_max_reserved_bytes"]

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.stop()
