"""Device selection against a fake NVIDIA driver under the real pynvml and nvitop (tests/fakes.py)."""

import os
import re

import pytest
from click.testing import CliRunner

from vramcal.cli import main
from vramcal.measure.device import DeviceError, host_device, select
from vramcal.measure.nvml import NvmlError, gpu_record, load_nvml, nvml_handle, nvml_query
from vramcal.models.mamba2 import check_dtype
from vramcal.records import Device, Kind
from vramcal.schema import SchemaError

from fakes import DRIVER_NOT_LOADED, GIB, H200, L4, T4, fake_nvml, install_fake_nvml


def choose(gpu, env=None, **kwargs):
    """select() with CUDA_VISIBLE_DEVICES from ``env`` (None: unset) and NVML loaded the real way."""
    environ = {} if env is None else {"CUDA_VISIBLE_DEVICES": env}
    return select(gpu, environ=environ, **kwargs)


A100 = {"name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-a1000000-aaaa-bbbb-cccc-000000000004",
        "bus": "00000000:07:00.0", "total": 85899345920, "reserved": 2**29, "cc": (8, 0), "speed": 3,
        "mig": [{"name": "NVIDIA A100-SXM4-80GB MIG 3g.40gb", "uuid": "MIG-11111111-2222-3333-4444-000000000001",
                 "total": 42949672960, "reserved": 0, "used": 2**20},
                {"name": "NVIDIA A100-SXM4-80GB MIG 2g.20gb", "uuid": "MIG-11111111-2222-3333-4444-000000000002",
                 "total": 21474836480, "reserved": 0, "used": 2**20}]}


def test_gpu_record_reads_identity_and_the_usable_total():
    nvml = fake_nvml([H200, L4])
    gpus = [gpu_record(nvml, nvml_query(nvml, "nvmlDeviceGetHandleByIndex", index)) for index in range(2)]
    h200, l4 = gpus
    assert [g.name for g in gpus] == ["NVIDIA H200", "NVIDIA L4"]
    assert h200.total_bytes == H200["total"] - H200["reserved"]  # what a process can allocate
    assert (h200.nvml_total_bytes, h200.nvml_reserved_bytes) == (H200["total"], H200["reserved"])
    assert h200.total_source == "NVML v2 total - reserved" and h200.slug() == "nvidia-h200-140gib"
    assert (l4.uuid, l4.pci_bus_id, l4.nvml_index, l4.compute_capability) == (L4["uuid"], L4["bus"], 1, "8.9")
    assert h200.driver_version == "580.65.06" and h200.cuda_driver_version == "13.0"


@pytest.mark.parametrize("options", [{"v2": False}, {"v2_refused": True}], ids=["old-driver", "vgpu-refuses-v2"])
def test_memory_falls_back_to_v1_when_v2_is_missing_or_refused(options):
    lib = install_fake_nvml([H200], **options)
    (gpu,), notice = choose("auto")
    assert notice is None and gpu.total_bytes == H200["total"] and gpu.total_source == "NVML v1 total"
    assert gpu.nvml_reserved_bytes is None and lib.calls["nvmlDeviceGetMemoryInfo"] >= 1


def test_nvml_failing_sends_auto_to_the_host_with_a_notice_and_explicit_choices_raise():
    install_fake_nvml([H200], init_error=DRIVER_NOT_LOADED)
    devices, notice = choose("auto")
    assert devices[0].kind == "host"
    # the cause alone: auto chose the host already, so no advice to give --gpu none (issue 59 item 8)
    assert notice == "no usable NVIDIA GPU (NVML could not start: Driver Not Loaded): using the host's memory instead"
    with pytest.raises(NvmlError, match="use gpu=none for the host's memory"):  # the API's words: gpu=
        choose("0")
    assert choose("none")[0][0].kind == "host"


HOST_IS_NONE = "the host's memory is {}none"


@pytest.mark.parametrize(("value", "says"), [("nonee", "not a device choice; give auto, none (the host), all"),
                                             ("cuda:0", "not a device choice"), ("cpu", HOST_IS_NONE),
                                             ("host", HOST_IS_NONE)])
def test_a_misspelt_choice_is_named_as_such_not_as_a_missing_driver(value, says):
    """Checked before NVML is asked: on a machine without a driver a typo read as NVML failing to start (exit 1,
    "the NVIDIA driver is not installed"); it is a bad option value (exit 2) that says what the choices are."""
    lib = install_fake_nvml([H200], init_error=DRIVER_NOT_LOADED)
    with pytest.raises(DeviceError, match=re.escape(f"gpu={value}: {says.format('gpu=')}")):  # the API's words
        choose(value)
    assert not lib.calls  # NVML was not asked
    result = CliRunner().invoke(main, ["train", "--gpu", value])
    said = f"Invalid value for '--gpu': {value}: {says.format('--gpu ')}"  # the command line's
    assert result.exit_code == 2 and said in result.output, result.output
    assert "Traceback" not in result.output and "NVML" not in result.output


def test_a_failing_query_after_start_also_falls_back_instead_of_a_traceback():
    install_fake_nvml([H200], v2=False, missing=["nvmlDeviceGetMemoryInfo"])
    devices, notice = choose("auto")
    assert devices[0].kind == "host" and "NVML nvmlDeviceGetMemoryInfo" in notice


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="this machine has an NVIDIA driver")
def test_no_driver_at_all_is_the_host():
    devices, notice = choose("auto")
    assert devices[0].kind == "host" and "NVML Shared Library Not Found" in notice


def test_inherited_cuda_visible_devices_is_honoured(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    install_fake_nvml([H200, L4])
    (gpu,), _ = choose("auto", env="1")
    assert (gpu.name, gpu.cuda_index, gpu.nvml_index) == ("NVIDIA L4", 0, 1)
    assert [g.uuid for g in choose("all", env="1")[0]] == [L4["uuid"]]
    assert choose("0", env=L4["uuid"])[0][0].uuid == L4["uuid"]
    with pytest.raises(DeviceError, match=r"gpu=1: this machine has 1 GPU\(s\) \(indices: 0\) visible "
                                          r"\(CUDA_VISIBLE_DEVICES='1'\)"):
        choose("1", env="1")
    with pytest.raises(DeviceError, match="no GPU with that index or UUID is visible here.*GPU-77aa"):
        choose(H200["uuid"], env="1")
    devices, notice = choose("auto", env="")
    assert devices[0].kind == "host" and "no GPU is visible (CUDA_VISIBLE_DEVICES='')" in notice


def test_cuda_order_is_fastest_first_by_default_and_pci_bus_under_pci_bus_id(monkeypatch):
    slow_first = dict(L4, bus="00000000:05:00.0")  # lower bus id than the H200, but slower
    install_fake_nvml([slow_first, H200])
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    assert [(g.name, g.cuda_index, g.nvml_index) for g in choose("all")[0]] == [
        ("NVIDIA H200", 0, 1), ("NVIDIA L4", 1, 0)]
    assert choose("1")[0][0].name == "NVIDIA L4"
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    install_fake_nvml([slow_first, H200])
    assert choose("0")[0][0].name == "NVIDIA L4"


def test_without_the_cuda_driver_the_order_is_nvmls_pci_bus_order(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    lib = install_fake_nvml([dict(L4, bus="00000000:05:00.0"), H200], cuda=False)
    assert [g.name for g in choose("all")[0]] == ["NVIDIA L4", "NVIDIA H200"]
    assert choose("0", env="1")[0][0].name == "NVIDIA H200" and lib.cuda_query.asked >= 1


def test_handles_are_found_by_uuid_not_position():
    nvml = fake_nvml([H200, L4])
    l4_at_the_wrong_index = Device(kind="cuda", name="NVIDIA L4", total_bytes=1, total_source="test",
                                   uuid=L4["uuid"], pci_bus_id=H200["bus"], nvml_index=0)
    assert nvml_query(nvml, "nvmlDeviceGetName", nvml_handle(nvml, l4_at_the_wrong_index)) == "NVIDIA L4"
    with pytest.raises(NvmlError, match="nvmlDeviceGetHandleByIndex_v2|Invalid Argument"):
        nvml_query(nvml, "nvmlDeviceGetHandleByIndex", 2)


def test_a_mig_uuid_selects_that_slice_with_the_slices_memory():
    install_fake_nvml([H200, A100])
    second = A100["mig"][1]
    (gpu,), _ = choose("auto", env=second["uuid"])
    assert (gpu.name, gpu.uuid, gpu.cuda_index) == (second["name"], second["uuid"], 0)
    assert gpu.total_bytes == second["total"] and gpu.is_mig
    assert (gpu.parent_uuid, gpu.pci_bus_id, gpu.nvml_index) == (A100["uuid"], A100["bus"], 1)
    assert gpu.compute_capability == "8.0"
    assert choose(second["uuid"])[0][0].uuid == second["uuid"]  # unset: any slice NVML knows
    with pytest.raises(DeviceError, match="no GPU with that index or UUID is visible"):
        choose(second["uuid"], env=H200["uuid"])


def test_a_mig_enabled_gpu_shows_its_first_slice_as_cuda_does():
    install_fake_nvml([A100])
    (gpu,), _ = choose("auto")
    assert gpu.uuid == A100["mig"][0]["uuid"] and gpu.total_bytes == A100["mig"][0]["total"]


def test_identical_cards_get_distinct_unique_slugs():
    twin = dict(H200, uuid="GPU-9a9a9a9a-aaaa-bbbb-cccc-000000000009", bus="00000000:9A:00.0")
    install_fake_nvml([H200, twin])
    first, second = choose("all")[0]
    assert first.slug() == second.slug() == "nvidia-h200-140gib"
    assert (first.slug(unique=True), second.slug(unique=True)) == ("nvidia-h200-140gib-5d2c1f7e",
                                                                   "nvidia-h200-140gib-9a9a9a9a")
    assert Device.from_dict(first.to_dict()) == first


def test_select_refuses_a_missing_index_or_uuid_naming_what_exists():
    install_fake_nvml([L4])
    with pytest.raises(DeviceError, match=r"gpu=7: this machine has 1 GPU\(s\) \(indices: 0\)"):
        choose("7")
    with pytest.raises(DeviceError, match="no GPU with that index or UUID.*GPU-77aa"):
        choose("GPU-deadbeef-0000")
    with pytest.raises(DeviceError, match="more than NVIDIA L4"):
        choose("0", capacity_bytes=100 * GIB)
    narrowed = choose("0", capacity_bytes=4 * GIB)[0][0]
    assert narrowed.total_bytes == 4 * GIB and narrowed.total_source == "--capacity"


def test_select_takes_an_injected_loader():
    nvml = fake_nvml([L4])
    assert choose("auto", nvml_loader=lambda: nvml)[0][0].name == "NVIDIA L4"
    assert load_nvml() is nvml


def test_bf16_is_refused_below_compute_capability_8():
    install_fake_nvml([T4, H200])
    t4, h200 = sorted(choose("all")[0], key=lambda d: d.name)[::-1]
    assert t4.compute_capability == "7.5"
    with pytest.raises(ValueError, match=r"^dtype bf16-autocast needs compute capability 8.0 or newer, and "
                                         r"Tesla T4 has 7.5: use --dtype fp32$"):
        check_dtype(t4, "bf16-autocast")
    check_dtype(t4, "fp32")
    check_dtype(h200, "bf16-autocast")
    with pytest.raises(ValueError, match=r"^dtype bf16-autocast is for CUDA GPUs; use --dtype fp32 on the host$"):
        check_dtype(host_device(), "bf16-autocast")


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


# ------------------------------------------------------------------------------------ free memory: the gate

def test_free_memory_is_memavailable_or_the_cgroups_room_or_nvmls_free(tmp_path):
    """The gate's figure (issue 44): the host's MemAvailable, lowered to a cgroup's limit minus its use; a GPU's
    NVML free memory. Read from fake /proc and cgroup files and a fake NVML: the hardware boundary."""
    from vramcal.measure.device import free_bytes

    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir()
    cgroup.mkdir()
    (proc / "meminfo").write_text("MemTotal: 16777216 kB\nMemAvailable: 8388608 kB\n")
    host = Device(kind="host", name="test", total_bytes=4 * GIB, total_source="--capacity")
    assert free_bytes(host, str(proc), str(cgroup)) == (8 * GIB, "MemAvailable")
    (cgroup / "memory.max").write_text(str(6 * GIB))
    (cgroup / "memory.current").write_text(str(3 * GIB))
    assert free_bytes(host, str(proc), str(cgroup)) == (3 * GIB, "the cgroup's limit minus its use")
    assert free_bytes(host, str(tmp_path / "none"), str(cgroup))[0] is None
    install_fake_nvml([H200])
    (gpu,), _ = choose("auto")
    assert free_bytes(gpu) == (H200["total"] - H200["reserved"] - H200["used"], "NVML free memory")


def test_a_device_kind_carries_what_differs_between_kinds_and_reads_back_from_json():
    """Issue 58: code asks the kind (its budget, its data, its ranks' memory, its kernels), not which kind it is."""
    import json

    host = Device.from_dict(json.loads(json.dumps(host_device(2 * GIB).to_dict())))
    card = Device(kind="cuda", name="NVIDIA H200", total_bytes=140 * GIB, total_source="nvml", uuid="GPU-1234")
    assert host.kind is Kind.HOST and card.kind is Kind.CUDA and host.kind == "host"
    assert json.loads(json.dumps(card.to_dict()))["kind"] == "cuda"
    asked = ("budgeted", "holds_data", "shared", "cuda_kernels", "backend", "torch_type")
    assert [getattr(host.kind, name) for name in asked] == [True, True, True, False, "gloo", "cpu"]
    assert [getattr(card.kind, name) for name in asked] == [False, False, False, True, "nccl", "cuda"]
    assert (host.gpu, card.gpu, card.slug()) == ("none", "GPU-1234", "nvidia-h200-140gib")
    assert host.slug().startswith("host-") and not host.slug().endswith("gib")  # a budget is in the profile's name
    assert Kind.of("cuda") is Kind.CUDA and Kind.of("cpu") is Kind.HOST and Kind.of("mps") is Kind.HOST
    with pytest.raises(SchemaError, match=r"^device\.kind = 'tpu' is not one of 'cuda', 'host'$"):
        Device.from_dict({**host.to_dict(), "kind": "tpu"})
