"""Fakes at the hardware boundary: trial runners with known memory, and a fake pynvml module."""

from __future__ import annotations

import types
from collections.abc import Callable

from vramcal.records import Trial

GIB = 2**30


def run_policy(memory: Callable[[int], float], settings, oom_above: int | None = None) -> list[Trial]:
    """Drive the real search policy with a fake trial runner: peak = memory(batch_size).

    A batch above ``oom_above`` (or whose peak exceeds the device's total) is recorded as ``oom``.
    """
    from vramcal.calibrate.search import next_batch_size

    trials: list[Trial] = []
    while (step := next_batch_size(trials, settings)) is not None:
        peak = int(memory(step.batch_size))
        if (oom_above is not None and step.batch_size > oom_above) or peak > settings.total_bytes:
            trials.append(Trial(step.batch_size, "oom", purpose=step.purpose, error="CUDA out of memory"))
        else:
            trials.append(Trial(step.batch_size, "ok", peak, purpose=step.purpose))
        assert len(trials) <= settings.max_trials
    return trials


class NVMLError(Exception):
    pass


def fake_nvml(gpus: list[dict], processes: dict[int, list] | None = None, v2: bool = True) -> types.ModuleType:
    """A module with pynvml's names, backed by ``gpus`` (dicts: name, uuid, bus, total, used).

    ``processes`` maps a GPU index to objects with ``pid`` and ``usedGpuMemory`` (None = not
    available, as in containers). ``v2=False`` fakes an old binding without ``nvmlMemory_v2``.
    """
    processes = processes or {}
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = NVMLError
    nvml.inits = 0

    def init():
        nvml.inits += 1

    def handle_by_index(i):
        if i >= len(gpus):
            raise NVMLError("Invalid Argument")
        return i

    def handle_by_uuid(uuid):
        for i, gpu in enumerate(gpus):
            if gpu["uuid"] == uuid:
                return i
        raise NVMLError("Not Found")

    def memory_info(handle, version=None):
        gpu = gpus[handle]
        if v2 and version is None:
            raise AssertionError("vramcal must ask for the v2 memory API")
        return types.SimpleNamespace(total=gpu["total"], used=gpu.get("used", 0),
                                     free=gpu["total"] - gpu.get("used", 0), reserved=0)

    def compute_processes(handle):
        return processes.get(handle, [])

    nvml.nvmlInit = init
    nvml.nvmlDeviceGetCount = lambda: len(gpus)
    nvml.nvmlSystemGetDriverVersion = lambda: b"580.65.06"
    nvml.nvmlSystemGetCudaDriverVersion_v2 = lambda: 13000
    nvml.nvmlDeviceGetHandleByIndex = handle_by_index
    nvml.nvmlDeviceGetHandleByUUID = handle_by_uuid
    nvml.nvmlDeviceGetHandleByPciBusId = lambda bus: [g["bus"] for g in gpus].index(bus)
    nvml.nvmlDeviceGetName = lambda h: gpus[h]["name"].encode()
    nvml.nvmlDeviceGetUUID = lambda h: gpus[h]["uuid"]
    nvml.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=gpus[h]["bus"].encode())
    nvml.nvmlDeviceGetMemoryInfo = memory_info
    nvml.nvmlDeviceGetComputeRunningProcesses = compute_processes
    nvml.nvmlDeviceGetGraphicsRunningProcesses = lambda h: []
    if v2:
        nvml.nvmlMemory_v2 = 0x02000028
    return nvml


H200 = {"name": "NVIDIA H200", "uuid": "GPU-5d2c1f7e-aaaa-bbbb-cccc-000000000001", "bus": "00000000:19:00.0",
        "total": 150754820096, "used": 600 * 2**20}
L4 = {"name": "NVIDIA L4", "uuid": "GPU-77aa0000-aaaa-bbbb-cccc-000000000002", "bus": "00000000:3B:00.0",
      "total": 24152899584, "used": 0}
