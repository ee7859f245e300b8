"""The NVML layer against a fake pynvml: selection, v2 memory, missing per-process figures."""

import os

import pytest

from vramcal.measure.device import DeviceError, NvmlError, host_device, list_gpus, select
from vramcal.measure.meters import NvmlSampler

from fakes import GIB, H200, L4, fake_nvml


def loader(nvml):
    return lambda: nvml


def test_list_gpus_reads_identity_and_v2_total():
    gpus = list_gpus(fake_nvml([H200, L4]))
    assert [g.name for g in gpus] == ["NVIDIA H200", "NVIDIA L4"]
    assert gpus[0].total_bytes == H200["total"] and gpus[0].total_source == "NVML v2 total"
    assert gpus[1].uuid == L4["uuid"] and gpus[1].pci_bus_id == L4["bus"]
    assert gpus[0].driver_version == "580.65.06" and gpus[0].cuda_driver_version == "13.0"


def test_old_binding_without_v2_falls_back_to_v1():
    assert list_gpus(fake_nvml([L4], v2=False))[0].total_bytes == L4["total"]


def test_select_by_index_uuid_all_and_auto():
    nvml = fake_nvml([H200, L4])
    assert select("auto", nvml_loader=loader(nvml))[0][0].name == "NVIDIA H200"
    assert [d.name for d in select("all", nvml_loader=loader(nvml))[0]] == ["NVIDIA H200", "NVIDIA L4"]
    assert select("1", nvml_loader=loader(nvml))[0][0].uuid == L4["uuid"]
    assert select(L4["uuid"], nvml_loader=loader(nvml))[0][0].name == "NVIDIA L4"
    narrowed = select("0", capacity_bytes=40 * GIB, nvml_loader=loader(nvml))[0][0]
    assert narrowed.total_bytes == 40 * GIB and narrowed.total_source == "--capacity"


def test_select_refuses_a_missing_index_or_uuid_naming_what_exists():
    nvml = fake_nvml([L4])
    with pytest.raises(DeviceError, match=r"--gpu 7: this machine has 1 GPU\(s\) \(indices: 0\)"):
        select("7", nvml_loader=loader(nvml))
    with pytest.raises(DeviceError, match="no GPU with that index or UUID.*GPU-77aa"):
        select("GPU-deadbeef-0000", nvml_loader=loader(nvml))
    with pytest.raises(DeviceError, match="more than NVIDIA L4"):
        select("0", capacity_bytes=100 * GIB, nvml_loader=loader(nvml))


def test_auto_falls_back_to_the_host_without_nvml_but_explicit_gpus_fail():
    def broken():
        raise NvmlError("NVML could not start (NVML Shared Library Not Found)")

    devices, notice = select("auto", nvml_loader=broken)
    assert devices[0].kind == "host" and "using the host's memory instead" in notice
    with pytest.raises(NvmlError):
        select("0", nvml_loader=broken)
    assert select("none", nvml_loader=broken)[0][0].kind == "host"


def test_host_total_prefers_cgroup_limit_then_memavailable(tmp_path):
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir(), cgroup.mkdir()
    (proc / "meminfo").write_text("MemTotal: 16000000 kB\nMemAvailable: 12000000 kB\n")
    (proc / "cpuinfo").write_text("model name\t: AMD EPYC 7763 64-Core Processor\n")
    assert host_device(proc=str(proc), cgroup=str(cgroup)).total_bytes == 12000000 * 1024
    (cgroup / "memory.max").write_text("max\n")
    assert host_device(proc=str(proc), cgroup=str(cgroup)).total_source == "MemAvailable"
    (cgroup / "memory.max").write_text(f"{8 * GIB}\n")
    device = host_device(proc=str(proc), cgroup=str(cgroup))
    assert (device.total_bytes, device.total_source) == (8 * GIB, "cgroup memory limit")
    assert device.name == f"AMD EPYC 7763 ({os.cpu_count()} cores)"
    assert host_device(2 * GIB, proc=str(proc), cgroup=str(cgroup)).total_bytes == 2 * GIB
    with pytest.raises(DeviceError, match="more than this host"):
        host_device(64 * GIB, proc=str(proc), cgroup=str(cgroup))


class Process:
    def __init__(self, pid, used):
        self.pid, self.usedGpuMemory = pid, used


def test_sampler_uses_the_per_process_figure_when_present():
    gpu = dict(L4, used=1 * GIB)
    nvml = fake_nvml([gpu], processes={0: [Process(os.getpid(), 3 * GIB), Process(1, 9 * GIB)]})
    sampler = NvmlSampler(nvml, 0)
    sampler.sample()
    assert sampler.peak_bytes() == 3 * GIB and sampler.process_peak_bytes == 3 * GIB


def test_sampler_falls_back_to_device_delta_when_the_pid_is_missing_or_figure_unavailable():
    gpu = dict(L4, used=1 * GIB)
    for processes in ({0: [Process(999999, 2 * GIB)]}, {0: [Process(os.getpid(), None)]}):
        nvml = fake_nvml([gpu], processes=processes)
        sampler = NvmlSampler(nvml, 0)  # baseline: 1 GiB used by others
        gpu["used"] = 5 * GIB
        sampler.sample()
        gpu["used"] = 2 * GIB
        sampler.sample()
        assert sampler.process_peak_bytes is None
        assert sampler.peak_bytes() == 4 * GIB  # the peak change, not the last one
        assert sampler.current_bytes() == 1 * GIB
        gpu["used"] = 1 * GIB
