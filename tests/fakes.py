"""Fakes at the hardware boundary: trial runners with known memory, and a fake pynvml module."""

from __future__ import annotations

import ast
import ctypes
import os
import re
import subprocess
import types
from collections.abc import Callable

from vramcal.records import Trial

GIB = 2**30


def run_policy(memory: Callable[[int], float], settings, oom_above: int | None = None,
               creep: Callable[[int], float] | None = None,
               unmeasured: Callable[[int, int], str | None] | None = None) -> list[Trial]:
    """Drive the real search policy with a fake trial runner: peak = memory(batch_size), plus
    ``creep(batch_size)`` for the steady trial (the long one).

    A batch above ``oom_above`` (or whose peak exceeds the device's total) is recorded as ``oom``;
    ``unmeasured(batch_size, n)`` names a status (``error``, ``timeout``) for the n-th trial (from 0) at a size.
    """
    from vramcal.calibration.search import next_batch_size

    trials: list[Trial] = []
    while (step := next_batch_size(trials, settings)) is not None:
        peak = int(memory(step.batch_size) + (creep(step.batch_size) if creep and step.purpose == "steady" else 0))
        status = unmeasured and unmeasured(step.batch_size, sum(t.batch_size == step.batch_size for t in trials))
        if status:
            trials.append(Trial(step.batch_size, status, purpose=step.purpose, error=f"{status} (injected)"))
        elif (oom_above is not None and step.batch_size > oom_above) or peak > settings.total_bytes:
            trials.append(Trial(step.batch_size, "oom", purpose=step.purpose, error="CUDA out of memory"))
        else:
            if step.verifies:  # the steady trial's first steps: a short trial at its size
                trials.append(Trial(step.batch_size, "ok", int(memory(step.batch_size)), purpose="verify-conservative"))
            trials.append(Trial(step.batch_size, "ok", peak, purpose=step.purpose))
        assert len(trials) <= settings.max_trials
    return trials


class FakeTrialRunner:
    """A trial runner at the hardware boundary for :func:`vramcal.service.calibrator.run_trials`: each trial's peak is
    ``memory(batch_size, seq_len)`` bytes (``seq_len`` from the trial's model), plus a deterministic wobble of up
    to ``noise`` bytes; a peak above ``total_bytes`` is recorded as ``oom``. The steady trial creeps: after its
    n-th measured step its peak is ``creep * curve(n)`` bytes per token (per sample when the model has no
    seq_len) higher (``curve``: the share of the creep reached by step n; default all of it from the first
    step), and ``epoch_rise`` bytes per token more after its epoch's end; it runs its epoch's end and stops as the
    real trial does (:func:`vramcal.measure.trial.steps`: :func:`vramcal.calibration.creep.epoch_end_due`, then
    :func:`~vramcal.calibration.creep.steady_done`), at most ``steady_steps`` steps. Everything above the runner
    is the real code."""

    context: dict = {}

    def __init__(self, memory: Callable[[int, int], float], total_bytes: int, creep: float = 0.0, noise: int = 0,
                 curve: Callable[[int], float] = lambda n: 1.0, epoch_rise: float = 0.0):
        self.memory, self.total_bytes, self.creep, self.noise, self.curve = memory, total_bytes, creep, noise, curve
        self.epoch_rise = epoch_rise
        self.runs = 0

    def run(self, request, purpose: str = "") -> tuple[Trial, ...]:
        from vramcal.calibration.creep import epoch_end_due, steady_done

        self.runs += 1
        b, length = request.batch_size, request.model.params.get("seq_len") or 1
        wobble = ((self.runs * 7919) % 13 - 6) * self.noise // 6
        short = peak = int(self.memory(b, length) + wobble)  # a steady trial's first steps read as a short trial
        curve, end = None, None
        if request.steady:
            curve = []
            while len(curve) < request.measured_steps:
                rise = self.epoch_rise if end is not None else 0.0
                curve.append(int(peak + (self.creep * self.curve(len(curve) + 1) + rise) * b * length))
                curve[-1] = max(curve[-1], curve[-2] if len(curve) > 1 else 0)  # the peak so far
                if end is None:
                    end = len(curve) if epoch_end_due(curve, request.settings) else None
                elif steady_done(curve, request.settings, end):
                    break
            peak, curve = curve[-1], tuple(curve)
        if peak > self.total_bytes:
            return (Trial(b, "oom", purpose=purpose, error="CUDA out of memory. Tried to allocate 2.00 GiB",
                          wall_s=0.0),)
        trial = Trial(b, "ok", peak, rss_peak_bytes=peak, step_s=0.001 * b, samples_per_s=1000.0, purpose=purpose,
                      wall_s=0.0, step_peaks=curve, epoch_end_step=end)
        if not request.verifies:
            return (trial,)
        first = Trial(b, "ok", short, rss_peak_bytes=short, step_s=0.001 * b, samples_per_s=1000.0,
                      purpose="verify-conservative", wall_s=0.0)
        return first, trial


def fake_calibration(memory: Callable[[int, int], float], total_bytes: int, *, max_trials: int = 16,
                     seq_lens: tuple[int, ...] = (), creep: float = 0.0, noise: int = 0, kind: str = "host",
                     spec=None, curve: Callable[[int], float] = lambda n: 1.0, epoch_rise: float = 0.0):
    """The profile :func:`vramcal.service.calibrator.run_trials` writes for ``memory`` (bytes at (batch_size,
    seq_len)) on
    a device of ``total_bytes``, cut short at ``max_trials`` (the real search, fit, limits and assembly)."""
    from pathlib import Path

    from vramcal.calibration.limits import LimitSettings
    from vramcal.models.regressor.spec import RegressorSpec
    from vramcal.records import Device, TrialSettings
    from vramcal.service.calibrator import CalibrationPlan, run_trials

    device = (Device("host", "Fake CPU (2 cores)", total_bytes, "--capacity") if kind == "host" else
              Device("cuda", "NVIDIA Fake GPU", total_bytes, "NVML v2 total", uuid="GPU-00000000-0000-0000-0000-0000000"
                     "00001", nvml_total_bytes=total_bytes))
    spec = spec or RegressorSpec(chunk_size=64, seq_len=128)
    plan = CalibrationPlan(device, spec.ref("transformers"), LimitSettings(), {}, Path("profile.json"),
                           seq_lens=seq_lens, trials=TrialSettings(max_trials=max_trials))
    return run_trials(plan, FakeTrialRunner(memory, total_bytes, creep, noise, curve, epoch_rise))


# ------------------------------------------------------------------------------ the NVIDIA driver
#
# The fake is the driver, not the Python binding: a stand-in for libnvidia-ml.so (``pynvml.nvmlLib``) under
# the real pynvml and the real nvitop, and a stand-in for the CUDA driver's device enumeration (the
# throw-away process nvitop asks). Handles are opaque pointers, as the real library's are: a lookup by
# index where a UUID was meant finds nothing.

SUCCESS, INVALID_ARGUMENT, NOT_SUPPORTED, NOT_FOUND, INSUFFICIENT_SIZE = 0, 2, 3, 6, 7
DRIVER_NOT_LOADED, NOT_AVAILABLE = 9, 2**64 - 1


class FakeNvmlLib:
    """What ``libnvidia-ml.so.1`` exports, for ``gpus`` (dicts: name, uuid, bus, total, used, and optionally
    reserved, cc=(major, minor), speed (CUDA's fastest-first rank), mig=[slice dicts: uuid, name, total, used]).

    ``processes`` maps a GPU's index or a UUID to objects with ``pid`` and ``usedGpuMemory`` (None: NVML gives
    no figure, as in containers). ``v2=False``: an old driver without ``nvmlDeviceGetMemoryInfo_v2``;
    ``v2_refused``: the v2 symbol exists but the call fails (vGPU); ``missing``: more symbols the driver
    lacks; ``init_error``: nvmlInit's return code. ``calls`` counts each exported call.
    """

    def __init__(self, gpus, processes=None, v2=True, v2_refused=False, init_error=None, missing=()):
        self.gpus, self.processes, self.init_error = gpus, processes or {}, init_error
        self.calls: dict[str, int] = {}
        self._by_address: dict[int, tuple[int, int | None]] = {}
        for i, gpu in enumerate(gpus):
            self._by_address[0x7F3A_0000_0000 + 0x1000 * i + 0x40] = (i, None)
            for m in range(len(gpu.get("mig", []))):
                self._by_address[0x7F3B_0000_0000 + 0x1000 * i + 0x80 * (m + 1)] = (i, m)
        self._address = {key: address for address, key in self._by_address.items()}
        self._missing = {*missing, *([] if v2 else ["nvmlDeviceGetMemoryInfo_v2"])}
        self._refuse_v2 = v2_refused
        for name in dir(self):
            if name.startswith("nvml") and name not in self._missing:
                setattr(self, name, self._counted(name, getattr(self, name)))

    def __getattribute__(self, name):
        if name.startswith("nvml") and name in object.__getattribute__(self, "_missing"):
            raise AttributeError(name)  # the driver does not export it: pynvml says FunctionNotFound
        return object.__getattribute__(self, name)

    def _counted(self, name, func):
        def call(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return func(*args)
        call.restype = None
        return call

    # -- helpers: C out-parameters and handles
    @staticmethod
    def _set(ref, value):
        target = getattr(ref, "_obj", ref)
        if isinstance(target, ctypes._Pointer):
            pointer = ctypes.c_void_p(value)
            ctypes.memmove(ctypes.addressof(target), ctypes.byref(pointer), ctypes.sizeof(pointer))
        else:
            target.value = value

    def _device(self, handle):
        address = ctypes.cast(handle, ctypes.c_void_p).value
        if address not in self._by_address:
            raise LookupError
        i, m = self._by_address[address]
        return self.gpus[i] if m is None else self.gpus[i]["mig"][m], i, m

    def _lookup(self, handle, out, *fields):
        try:
            device, i, m = self._device(handle)
        except LookupError:
            return INVALID_ARGUMENT
        for ref, field in zip(out, fields):
            self._set(ref, field(device, i, m))
        return SUCCESS

    def _handle_out(self, key, out):
        self._set(out, self._address[key])
        return SUCCESS

    # -- system
    def nvmlInitWithFlags(self, flags):
        return self.init_error or SUCCESS

    def nvmlShutdown(self):
        return SUCCESS

    def nvmlErrorString(self, code):
        return b"Fake NVML error %d" % code

    def nvmlSystemGetDriverVersion(self, buffer, size):
        buffer.value = b"580.65.06"
        return SUCCESS

    def nvmlSystemGetCudaDriverVersion_v2(self, out):
        self._set(out, 13000)
        return SUCCESS

    # -- handles
    def nvmlDeviceGetCount_v2(self, out):
        self._set(out, len(self.gpus))
        return SUCCESS

    def nvmlDeviceGetHandleByIndex_v2(self, index, out):
        return self._handle_out((index.value, None), out) if index.value < len(self.gpus) else INVALID_ARGUMENT

    def nvmlDeviceGetHandleByUUID(self, uuid, out):
        for (i, m) in self._address:
            device = self.gpus[i] if m is None else self.gpus[i]["mig"][m]
            if device["uuid"].encode() == uuid.value:
                return self._handle_out((i, m), out)
        return NOT_FOUND

    def nvmlDeviceGetHandleByPciBusId_v2(self, bus, out):
        for i, gpu in enumerate(self.gpus):
            if gpu["bus"].encode() == bus.value:
                return self._handle_out((i, None), out)
        return NOT_FOUND

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle, index, out):
        device, i, m = self._device(handle)
        if m is not None or index.value >= len(device.get("mig", [])):
            return NOT_FOUND
        return self._handle_out((i, index.value), out)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle, out):
        _, i, m = self._device(handle)
        return INVALID_ARGUMENT if m is None else self._handle_out((i, None), out)

    # -- identity
    def nvmlDeviceGetName(self, handle, buffer, size):
        device, _, _ = self._device(handle)
        buffer.value = device["name"].encode()
        return SUCCESS

    def nvmlDeviceGetUUID(self, handle, buffer, size):
        device, _, _ = self._device(handle)
        buffer.value = device["uuid"].encode()
        return SUCCESS

    def nvmlDeviceGetIndex(self, handle, out):
        _, i, m = self._device(handle)
        return NOT_SUPPORTED if m is not None else self._lookup(handle, [out], lambda d, i, m: i)

    def nvmlDeviceGetPciInfo_v3(self, handle, out):
        device, _, m = self._device(handle)
        if m is not None:
            return NOT_SUPPORTED
        out._obj.busId = device["bus"].encode()
        return SUCCESS

    def nvmlDeviceGetCudaComputeCapability(self, handle, major, minor):
        return self._lookup(handle, [major, minor], lambda d, i, m: d.get("cc", (9, 0))[0],
                            lambda d, i, m: d.get("cc", (9, 0))[1])

    def nvmlDeviceGetMigMode(self, handle, current, pending):
        device, _, m = self._device(handle)
        if m is not None or "mig" not in device:
            return NOT_SUPPORTED
        self._set(current, 1), self._set(pending, 1)
        return SUCCESS

    def nvmlDeviceIsMigDeviceHandle(self, handle, out):
        return self._lookup(handle, [out], lambda d, i, m: int(m is not None))

    def nvmlDeviceGetMaxMigDeviceCount(self, handle, out):
        return self._lookup(handle, [out], lambda d, i, m: 7 if "mig" in d and m is None else 0)

    def nvmlDeviceGetGpuInstanceId(self, handle, out):
        return self._lookup(handle, [out], lambda d, i, m: 1 + (m or 0))

    def nvmlDeviceGetComputeInstanceId(self, handle, out):
        return self._lookup(handle, [out], lambda d, i, m: 0)

    # -- memory and processes
    def _memory(self, handle, out, version):
        device, _, _ = self._device(handle)
        reserved = device.get("reserved", 0)
        memory = out._obj
        memory.total, memory.used = device["total"], device.get("used", 0)
        memory.free = device["total"] - reserved - device.get("used", 0)
        if version == 2:
            memory.reserved = reserved
        return SUCCESS

    def nvmlDeviceGetMemoryInfo(self, handle, out):
        return self._memory(handle, out, 1)

    def nvmlDeviceGetMemoryInfo_v2(self, handle, out):
        if self._refuse_v2:
            return NOT_SUPPORTED
        return self._memory(handle, out, 2)

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle, count, array):
        device, i, m = self._device(handle)
        listed = self.processes.get(device["uuid"], self.processes.get(i, []) if m is None else [])
        if array is None or count._obj.value < len(listed):
            self._set(count, len(listed))
            return INSUFFICIENT_SIZE if listed else SUCCESS
        for slot, process in zip(array, listed):
            used = process.usedGpuMemory
            slot.pid, slot.usedGpuMemory = process.pid, NOT_AVAILABLE if used is None else used
        self._set(count, len(listed))
        return SUCCESS

    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, handle, count, array):
        self._set(count, 0)
        return SUCCESS

    # -- the CUDA driver's enumeration (what nvitop's throw-away process reports)
    def cuda_uuids(self, cuda_visible_devices, device_order):
        """CUDA's visible devices: PCI bus order under PCI_BUS_ID, else fastest first; a MIG-enabled
        GPU shows its first slice; the list stops at the first entry naming no device (CUDA's rule)."""
        def rank(gpu):
            return gpu["bus"] if device_order == "PCI_BUS_ID" else (-gpu.get("speed", 0), gpu["bus"])

        ordered = sorted(self.gpus, key=rank)
        shown = [gpu["mig"][0] if gpu.get("mig") else gpu for gpu in ordered]
        if cuda_visible_devices is None:
            return [d["uuid"] for d in shown]
        chosen = []
        for token in (t.strip() for t in cuda_visible_devices.split(",")):
            if token.isdigit() and int(token) < len(shown):
                found = shown[int(token)]
            else:
                every = [d for g in ordered for d in [g, *g.get("mig", [])]]
                found = next((d for d in every if token and d["uuid"].startswith(token)), None)
            if found is None:
                break
            chosen.append(found["uuid"])
        return chosen


class _CudaQuery:
    """Stands in for the ``subprocess`` module nvitop uses to ask the CUDA driver (``cuda=False``: no driver)."""

    SubprocessError, DEVNULL = subprocess.SubprocessError, subprocess.DEVNULL

    def __init__(self, lib: FakeNvmlLib, cuda: bool):
        self.lib, self.cuda, self.asked = lib, cuda, 0

    def check_output(self, argv, **kwargs):
        self.asked += 1
        if not self.cuda:
            raise subprocess.CalledProcessError(1, argv)
        value = ast.literal_eval(re.search(r"_to_uuids\(\s*(.*?),\s*verbose", argv[-1], re.S).group(1))
        uuids = self.lib.cuda_uuids(value, os.environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST"))
        return ",".join(uuid.split("-", 1)[1] for uuid in uuids) + "\n"


def _reset_nvml_state(lib, query) -> None:
    import nvitop.api.device as nvitop_device
    import nvitop.api.libnvml as libnvml
    import pynvml

    pynvml.nvmlLib = lib
    pynvml._nvmlGetFunctionPointer_cache.clear()
    pynvml._nvmlLib_refcount = 0
    for name, value in (("__initialized", False), ("__flags", []), ("__get_memory_info_version_suffix", None),
                        ("__get_running_processes_version_suffix", None)):
        setattr(libnvml, name, value)
    nvitop_device._PHYSICAL_DEVICE_ATTRS = None
    nvitop_device._parse_cuda_visible_devices.cache_clear()
    nvitop_device.subprocess = query


_REAL = {}


def install_fake_nvml(gpus, processes=None, v2=True, v2_refused=False, init_error=None, cuda=True,
                      missing=()) -> FakeNvmlLib:
    """Put a :class:`FakeNvmlLib` under the real pynvml and nvitop, until :func:`restore_nvml` (conftest does)."""
    import nvitop.api.device as nvitop_device
    import pynvml

    _REAL.setdefault("lib", pynvml.nvmlLib)
    _REAL.setdefault("subprocess", nvitop_device.subprocess)
    lib = FakeNvmlLib(gpus, processes, v2, v2_refused, init_error, missing)
    lib.cuda_query = _CudaQuery(lib, cuda)
    _reset_nvml_state(lib, lib.cuda_query)
    return lib


def restore_nvml() -> None:
    """Undo :func:`install_fake_nvml`: the real driver library (or none, as on a CPU machine) again."""
    if _REAL:
        _reset_nvml_state(_REAL.pop("lib"), _REAL.pop("subprocess"))


def fake_nvml(gpus: list[dict], processes: dict | None = None, v2: bool = True, **options) -> types.ModuleType:
    """Install a fake driver for ``gpus`` (see :class:`FakeNvmlLib`) and return what ``load_nvml`` returns."""
    from vramcal.measure.nvml import load_nvml

    install_fake_nvml(gpus, processes, v2, **options)
    return load_nvml()


class Process:
    def __init__(self, pid, used):
        self.pid, self.usedGpuMemory = pid, used


H200 = {"name": "NVIDIA H200", "uuid": "GPU-5d2c1f7e-aaaa-bbbb-cccc-000000000001", "bus": "00000000:19:00.0",
        "total": 150754820096, "reserved": 527958016, "used": 600 * 2**20, "cc": (9, 0), "speed": 2}
L4 = {"name": "NVIDIA L4", "uuid": "GPU-77aa0000-aaaa-bbbb-cccc-000000000002", "bus": "00000000:3B:00.0",
      "total": 24152899584, "used": 0, "cc": (8, 9), "speed": 1}
T4 = {"name": "Tesla T4", "uuid": "GPU-1e4e0000-aaaa-bbbb-cccc-000000000003", "bus": "00000000:5E:00.0",
      "total": 16106127360, "used": 0, "cc": (7, 5), "speed": 0}
