"""The meter against a fake NVIDIA driver (tests/fakes.py) and a fake torch.cuda: baselines, sources,
the sampler's cost, the pin check, and which errors are out-of-memory."""

import os
import re
import subprocess
import sys
import time
import types

import pytest
import torch
from host_budget import SIZE

from vramcal import oom
from vramcal.measure import meters
from vramcal.measure.device import select
from vramcal.measure.meters import MeterError, open_meter
from vramcal.measure.nvml import NVML_SAMPLE_INTERVAL_S, NvmlSampler, nvml_handle, settled
from vramcal.oom import is_out_of_memory

from fakes import GIB, H200, L4, Process, fake_nvml, install_fake_nvml

MIB = 2**20
PROCESSES = "nvmlDeviceGetComputeRunningProcesses_v3"
MEMORY = "nvmlDeviceGetMemoryInfo_v2"


def sampler_on(gpu, processes, **options):
    nvml = fake_nvml([gpu], processes=processes, **options)
    (device,), _ = select("0", environ={})
    return NvmlSampler(nvml, nvml_handle(nvml, device))


def test_per_process_figure_costs_one_nvml_call_per_sample():
    """One NVML API call: the process list (in C, NVML's list protocol: the count, then the entries)."""
    import pynvml

    gpu = dict(L4, used=1 * GIB)
    processes = {0: [Process(os.getpid(), 3 * GIB), Process(1, 9 * GIB)]}
    sampler = sampler_on(gpu, processes)
    lib = pynvml.nvmlLib
    before = dict(lib.calls)
    for _ in range(5):
        sampler.sample()
    made = {name: lib.calls.get(name, 0) - before.get(name, 0) for name in lib.calls}
    assert {name: n for name, n in made.items() if n} == {PROCESSES: 2 * 5}
    assert sampler.peak_bytes() == 3 * GIB and sampler.source == "process"


def test_without_a_per_process_figure_the_device_wide_change_counts():
    for processes in ({0: [Process(999999, None)]}, {0: [Process(os.getpid(), None)]}):
        gpu = dict(L4, used=1 * GIB)
        sampler = sampler_on(gpu, processes)  # baseline: 1 GiB used by others
        gpu["used"] = 5 * GIB
        sampler.sample()
        gpu["used"] = 2 * GIB
        sampler.sample()
        assert sampler.process_peak_bytes is None and sampler.source == "device-delta"
        assert sampler.peak_bytes() == 4 * GIB  # the peak change, not the last one
        assert sampler.current_bytes() == 1 * GIB


def test_a_refused_process_list_leaves_the_device_wide_figure_at_one_call_per_sample():
    import pynvml

    gpu = dict(L4, used=1 * GIB)
    sampler = sampler_on(gpu, {}, missing=[PROCESSES])
    gpu["used"] = 3 * GIB
    before = pynvml.nvmlLib.calls.get(MEMORY, 0)
    sampler.sample()
    assert sampler.peak_bytes() == 2 * GIB and sampler.source == "device-delta"
    assert pynvml.nvmlLib.calls[MEMORY] - before == 1


def test_other_processes_changes_are_subtracted_and_a_leaving_one_counts_as_freed():
    gpu = dict(L4, used=6 * GIB)
    other, leaving = Process(111, 2 * GIB), Process(222, 4 * GIB)  # e.g. the previous trial, tearing down
    processes = {0: [other, leaving]}
    sampler = sampler_on(gpu, processes)
    processes[0].remove(leaving)  # 4 GiB freed; we took 3 GiB; the other process grew by 1 GiB
    other.usedGpuMemory = 3 * GIB
    gpu["used"] = 6 * GIB - 4 * GIB + 3 * GIB + 1 * GIB
    sampler.sample()
    assert sampler.peak_bytes() == 3 * GIB and sampler.source == "device-delta-minus-others"
    newcomer = Process(333, 1 * GIB)  # appeared after the baseline: maybe us under a host PID, so it counts
    processes[0].append(newcomer)
    gpu["used"] += 1 * GIB
    sampler.sample()
    assert sampler.peak_bytes() == 4 * GIB


def test_the_baseline_waits_for_the_previous_trial_to_release():
    readings = iter([9 * GIB, 6 * GIB, 3 * GIB, 1 * GIB, 1 * GIB + MIB, 1 * GIB, 1 * GIB, 5 * GIB])
    now = [0.0]

    def sleep(seconds):
        now[0] += seconds

    assert settled(lambda: next(readings), settle_s=3.0, clock=lambda: now[0], sleep=sleep) == 1 * GIB
    assert now[0] == pytest.approx(0.25)
    falling, seen = iter(range(100 * GIB, 0, -GIB)), []
    now[0] = 0.0
    baseline = settled(lambda: seen.append(next(falling)) or seen[-1], settle_s=0.5, clock=lambda: now[0], sleep=sleep)
    assert baseline == seen[-1] == min(seen) and now[0] == pytest.approx(0.5, abs=0.06)  # gave up: the lowest


def test_the_sampler_thread_samples_at_the_shared_interval_and_stops_with_a_last_sample():
    assert NVML_SAMPLE_INTERVAL_S == 0.010
    sampler = sampler_on(dict(L4), {0: [Process(os.getpid(), 1 * GIB)]})
    with sampler:
        time.sleep(0.2)
    assert 5 <= sampler.samples <= 25 and sampler.peak_bytes() == 1 * GIB and sampler.error is None


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda as a GPU process would see it: the other hardware boundary."""
    state = types.SimpleNamespace(reserved=0, max_reserved=0, max_allocated=0, initialized=False,
                                  uuid=L4["uuid"][4:], resets=0)
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_initialized", lambda: state.initialized)
    monkeypatch.setattr(cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda *a: setattr(state, "resets", state.resets + 1))
    monkeypatch.setattr(cuda, "memory_reserved", lambda *a: state.reserved)
    monkeypatch.setattr(cuda, "max_memory_reserved", lambda *a: state.max_reserved)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda *a: state.max_allocated)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "get_device_capability", lambda *a: (8, 9))
    monkeypatch.setattr(cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(name="NVIDIA L4", uuid=state.uuid))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91300)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # monkeypatch restores what the meter pins
    return state


def test_the_cuda_meter_pins_measures_from_before_cuda_and_reads_every_source(fake_cuda, monkeypatch):
    gpu = dict(L4, used=512 * MIB)  # someone else's, before this process started CUDA
    install_fake_nvml([gpu], processes={0: [Process(999999, None)]})  # a container: no figure for us
    (device,), _ = select("0", environ={})
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    meter = open_meter(device, settle_s=0)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == L4["uuid"]
    gpu["used"] += 300 * MIB + 2 * GIB  # context + weights and data, then warm-up
    fake_cuda.reserved = fake_cuda.max_reserved = 2 * GIB
    meter.check_pinned()
    meter.reset()
    gpu["used"] += 1 * GIB  # the measured steps
    fake_cuda.max_reserved, fake_cuda.max_allocated = 3 * GIB, 2 * GIB + 1
    figures = meter.read()
    meter.close()
    assert figures == {"peak_bytes": 3 * GIB + 300 * MIB, "nvml_peak_bytes": 3 * GIB + 300 * MIB,
                       "nvml_source": "device-delta", "nvml_overhead_bytes": 300 * MIB,
                       "torch_max_reserved_bytes": 3 * GIB, "torch_max_allocated_bytes": 2 * GIB + 1}
    environment = meter.environment()
    assert environment["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert (environment["torch_cuda_version"], environment["cudnn_version"], environment["compute_capability"]) == (
        "13.0", 91300, "8.9")
    assert {"triton_version", "CUDA_MODULE_LOADING", "torch_version"} <= set(environment)


def test_the_pin_check_catches_cuda_started_elsewhere(fake_cuda):
    install_fake_nvml([H200, L4])
    (device,), _ = select("1", environ={})
    meter = open_meter(device, settle_s=0)
    fake_cuda.uuid = H200["uuid"][4:]  # torch ended up on the H200
    with pytest.raises(MeterError, match=r"^torch runs on NVIDIA L4 .* but the meter measures NVIDIA L4 "):
        meter.check_pinned()
    meter.close()
    fake_cuda.initialized = True
    with pytest.raises(MeterError, match="CUDA was initialised before the meter opened"):
        open_meter(device, settle_s=0)


def test_a_mig_slice_is_pinned_by_its_own_uuid(fake_cuda):
    from test_device import A100

    install_fake_nvml([A100])
    (device,), _ = select("auto", environ={})
    fake_cuda.uuid = A100["uuid"]  # CUDA may name the slice by its parent GPU
    meter = open_meter(device, settle_s=0)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == A100["mig"][0]["uuid"]
    meter.check_pinned()
    meter.close()


def test_nvml_failing_during_the_span_is_an_error_not_a_small_peak(fake_cuda):
    import pynvml

    install_fake_nvml([L4], processes={0: [Process(os.getpid(), None)]})
    (device,), _ = select("0", environ={})
    meter = open_meter(device, settle_s=0)
    pynvml.nvmlLib._missing.update({MEMORY, "nvmlDeviceGetMemoryInfo"})  # the GPU fell off the bus
    pynvml._nvmlGetFunctionPointer_cache.clear()
    time.sleep(0.05)
    with pytest.raises(MeterError, match="NVML stopped answering while measuring"):
        meter.read()
    meter.close()


def test_the_host_meter_sets_the_data_limit_and_reads_the_host_peaks():
    code = ("import resource; from vramcal.measure.device import host_device; "
            "from vramcal.measure.meters import open_meter; m = open_meter(host_device(), 8 * 2**30); "
            "m.check_pinned(); m.reset(); f = m.read(); "
            "print(resource.getrlimit(resource.RLIMIT_DATA)[0], sorted(f), f['peak_bytes'] > 0, m.kind)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(8 * GIB), "['data_peak_bytes',", "'peak_bytes',", "'rss_peak_bytes']", "True", "host"]
    assert "torch_num_threads" in meters.HostMeter().environment()


def test_the_host_peak_leaves_out_the_page_cache_of_mapped_files_and_counts_what_the_process_writes(tmp_path):
    """Issue 60: how many file-backed pages a process maps depends on the page cache (a library just installed
    maps more), not on its step. Reading 256 MiB of a mapped file raises VmHWM by that much and the host peak by
    nothing; writing 256 MiB of its own raises both."""
    mapped = tmp_path / "mapped.bin"
    mapped.write_bytes(b"\1" * 256 * 2**20)
    script = tmp_path / "measure.py"
    script.write_text(f"""import mmap
from vramcal.measure.meters import host_held_bytes, host_peaks, read_status_bytes, reset_peak_rss
reset_peak_rss()
start, hwm = host_peaks()["peak_bytes"], read_status_bytes("VmHWM")
handle = open({str(mapped)!r}, "rb")
data = mmap.mmap(handle.fileno(), 0, prot=mmap.PROT_READ)
total = sum(data[i] for i in range(0, len(data), 4096))
read_only = host_peaks()["peak_bytes"] - start, read_status_bytes("VmHWM") - hwm
held = bytearray(256 * 2**20)
for i in range(0, len(held), 4096):
    held[i] = 2
print(*(n // 2**20 for n in (*read_only, host_peaks()["peak_bytes"] - start, host_held_bytes())))
""")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True).stdout.split()
    peak_read, hwm_read, peak_written, held = map(int, out)
    assert hwm_read >= 250 and peak_read <= 6, out  # a MiB or two of the interpreter's own between readings
    assert peak_written >= 250 and held >= 250, out


def test_a_host_budget_below_what_the_process_holds_is_out_of_memory_before_any_limit_is_set():
    """Under such a budget every allocation fails, wherever the first one happens; the meter says why at once,
    as an out-of-memory error (the budget, not the step), and leaves the process's limit alone. In a process
    of its own: a meter that set the limit would leave this one unable to allocate."""
    code = ("import resource; from vramcal.measure.device import host_device; "
            "from vramcal.measure.meters import open_meter\nfrom vramcal.oom import is_out_of_memory\n"
            "before = resource.getrlimit(resource.RLIMIT_DATA)\n"
            "try:\n    open_meter(host_device(), 2**20)\n"
            "except MemoryError as error:\n"
            "    print(is_out_of_memory(error), resource.getrlimit(resource.RLIMIT_DATA) == before, error)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert re.fullmatch(rf"True True the host budget 1\.00 MiB is below the {SIZE} this process held before its "
                        r"step \(the interpreter, torch and the libraries it imported\)\n", out), out


class OutOfResources(Exception):  # triton.runtime.errors.OutOfResources, by name and message
    pass


@pytest.mark.parametrize("message", [fragment for fragment, _ in oom.OOM_MESSAGES])
def test_message_only_out_of_memory_kinds(message):
    assert is_out_of_memory(RuntimeError(f"prefix {message} when calling `cublasCreate(handle)`"))


def test_out_of_memory_by_type_and_what_is_not_out_of_memory(monkeypatch):
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)"))
    assert not is_out_of_memory(OutOfResources("out of resource: shared memory, Required: 262144, "
                                               "Hardware limit: 232448"))
    assert not is_out_of_memory(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE"))
    assert not is_out_of_memory(ValueError("CUDA error: out of memory"))  # not a runtime error from torch


def test_onednn_primitive_failure_is_out_of_memory_only_after_an_allocation_failure(monkeypatch):
    monkeypatch.setattr(oom, "_under_data_limit", lambda: False)
    primitive = RuntimeError("could not create a primitive")
    assert not is_out_of_memory(primitive)
    try:
        try:
            raise MemoryError
        except MemoryError:
            raise RuntimeError("could not create a primitive") from None
    except RuntimeError as chained:
        assert not is_out_of_memory(chained)  # `from None` cuts the chain: nothing to see
    try:
        try:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes")
        except RuntimeError:
            raise RuntimeError("could not create a primitive")  # noqa: B904 - the implicit chain is the point
    except RuntimeError as chained:
        assert is_out_of_memory(chained)
    monkeypatch.setattr(oom, "_under_data_limit", lambda: True)  # the host budget is in force
    assert is_out_of_memory(primitive)


def test_real_triton_out_of_resources_is_not_out_of_memory():
    errors = pytest.importorskip("triton.runtime.errors")
    assert not is_out_of_memory(errors.OutOfResources(262144, 232448, "shared memory"))


def test_the_host_peak_since_a_reset_never_falls(monkeypatch):
    """The data-segment peak is VmPeak less the mappings that are not data when it is read, so a mapping present
    at one reading and not at the peak lowered a steady trial's "peak so far" by 116 KiB (tests/test_bench.py saw
    it fall); the meter keeps its highest reading until the next reset."""
    readings = iter([500, 480, 510, 300])
    monkeypatch.setattr(meters, "host_peaks", lambda: {"peak_bytes": next(readings), "rss_peak_bytes": 0,
                                                       "data_peak_bytes": 0})
    monkeypatch.setattr(meters, "reset_peak_rss", lambda: True)
    meter = meters.HostMeter()
    assert [meter.read()["peak_bytes"] for _ in range(3)] == [500, 500, 510]
    meter.reset()
    assert meter.read()["peak_bytes"] == 300
