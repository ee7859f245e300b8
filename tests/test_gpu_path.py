"""The GPU path at its hardware boundary (issue 61): what the first card would have met, read against torch's and
nvitop's sources, each shown here with a fake torch.cuda, a fake NVML (tests/fakes.py), a fake NCCL, the kernel's
out-of-memory counter faked, or a real process where the process is the boundary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from host_budget import capacity
from test_meters import fake_cuda  # noqa: F401 - the fixture: torch.cuda as a GPU process sees it
from test_train import training_folder

from vramcal.environment import HOST_MALLOC
from vramcal.integrations import run as framework
from vramcal.measure import evidence
from vramcal.measure.device import select
from vramcal.measure.meters import attach_meter, open_meter
from vramcal.models.mamba2 import autocast
from vramcal.profile import load_profile

from fakes import GIB, L4, Process, install_fake_nvml

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20


# ------------------------------------------------------------------ 1. a GPU world's rank joins on its card

def test_a_gpu_rank_sets_its_pinned_card_and_binds_it_when_it_joins(monkeypatch):
    """torch.cuda.set_device takes no index-less device (torch's _get_device_index(optional=False) raises), and the
    worker sees one card, its index 0; init_process_group's device_id binds NCCL to it (and FSDP2's default mesh then
    keeps it rather than set LOCAL_RANK). The driver's set-device call and NCCL's init are the fakes."""
    import torch.distributed as dist

    from vramcal.measure.distributed import join
    from vramcal.measure.trial import torch_device
    from vramcal.records import World

    from profiles_for_tests import gpu_device

    set_to, init = [], {}
    monkeypatch.setattr(torch._C, "_cuda_setDevice", set_to.append, raising=False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: init.update(kwargs, backend=backend))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the rank's threads: not this test process's
    group = join(World(2, "nccl"), 1, "file:///nowhere", 30.0, torch_device(gpu_device()))
    assert set_to == [0] and init["device_id"] == torch.device("cuda", 0)
    assert (init["backend"], init["rank"], init["world_size"], group.device.type) == ("nccl", 1, 2, "cuda")
    join(World(2, "gloo"), 0, "file:///nowhere", 30.0, torch.device("cpu"))
    assert init["device_id"] is None and set_to == [0]  # the host binds nothing


# ------------------------------------------------------------------ 2. the device run's one deadline

@pytest.mark.slow
def test_the_device_run_takes_one_deadline_and_a_signal_to_it_keeps_the_step_in_flight(tmp_path):
    """scripts/gpu_check.sh on the host (``--gpu none``: no GPU asked of the preflight) under a 200 s deadline: the
    setup's seconds recorded, the check's budget derived from the deadline, and a SIGTERM to the script alone (a
    device limit ends the command) passed on to the check, which stops its calibration, keeps it, skips the rest
    and writes its finished mark before the script exits."""
    out, tree = tmp_path / "out", tmp_path / "tree"  # the source tree without its wheels/ (make gpu-rehearsal's)
    tree.mkdir()
    for name in ("scripts", "vramcal", "bench", "pyproject.toml"):
        (tree / name).symlink_to(ROOT / name)
    env = {**os.environ, "GPU_CHECK_DEADLINE_S": "200", "PYTHON": sys.executable, "OUT": str(out)}
    script = subprocess.Popen([str(tree / "scripts" / "gpu_check.sh"), "--gpu", "none", "--spec", "tiny",
                               "--capacity", capacity(600 * MIB), "--reserve", "0",
                               "--data", str(tmp_path / "no-bars.parquet")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tree)
    results, waited = out / "gpu_check.json", time.monotonic() + 150
    while not (results.is_file() and "estimate" in json.loads(results.read_text())["steps"]):
        assert script.poll() is None and time.monotonic() < waited, script.communicate()
        time.sleep(0.5)
    time.sleep(2)  # into the calibration
    script.terminate()
    stdout, stderr = script.communicate(timeout=90)
    assert script.returncode == 1, stdout[-2000:] + stderr[-2000:]  # a step was stopped
    found = json.loads(results.read_text())
    assert found["finished"] is True and found["setup_s"] > 0
    assert found["budget_s"] == 200 - found["setup_s"] - 30  # the timeout's 10 s to SIGKILL and 20 s to stop first
    steps = found["steps"]
    assert steps["default"]["status"] == "stopped" and "SIGTERM" in steps["default"]["reason"], steps["default"]
    assert all(steps[name]["status"] == "skipped" for name in ("boundary", "train", "chunk_size"))
    first = "gpu_check.sh: one deadline, 200 s from now: the setup, then the check, end within it"
    assert stdout.splitlines()[0] == first
    assert "== default: stopped" in (out / "gpu_check.log").read_text()
    assert f"after gpu_check.sh's setup of {found['setup_s']:.0f} s" in (out / "GPU_CHECK.md").read_text()


# ------------------------------------------------------------------ 3. a framework's run in a container

def test_a_meter_attached_after_cuda_started_counts_torchs_memory_and_says_what_it_cannot_see(fake_cuda):  # noqa: F811
    """A container (NVML lists no figure for this process): the baseline is the device's use when the meter is
    attached. After the framework put the model on the card, that baseline already holds it: torch's reserved
    memory then is counted back in, the context is named as unseen and the peak is a lower bound. Attached before
    CUDA started, nothing is missed."""
    gpu = dict(L4, used=512 * MIB)  # another process's
    install_fake_nvml([gpu], processes={0: [Process(999999, None)]})
    (device,), _ = select("0", environ={})
    fake_cuda.initialized = True  # the model, its optimizer state and the CUDA context are on the card already
    gpu["used"] += 400 * MIB + 4 * GIB
    fake_cuda.reserved = fake_cuda.max_reserved = 4 * GIB
    late = attach_meter(device, warn=print)
    assert late.unseen and "CUDA context" in late.unseen and "a lower bound" in late.definition
    assert late.held_bytes() == 4 * GIB
    late.reset()
    gpu["used"] += 2 * GIB  # the steps
    fake_cuda.reserved = fake_cuda.max_reserved = 6 * GIB
    assert late.read() == 6 * GIB  # 2 GiB before: the change since the model was on the card
    late.close()

    gpu["used"], fake_cuda.initialized, fake_cuda.reserved, fake_cuda.max_reserved = 512 * MIB, False, 0, 0
    early = attach_meter(device, warn=print)  # made with the run, before the model reaches the card
    fake_cuda.initialized = True
    gpu["used"] += 400 * MIB + 4 * GIB
    fake_cuda.reserved = fake_cuda.max_reserved = 4 * GIB
    assert early.unseen is None and early.held_bytes() == 4 * GIB + 400 * MIB
    early.reset()
    gpu["used"] += 2 * GIB
    fake_cuda.reserved = fake_cuda.max_reserved = 6 * GIB
    assert early.read() == 6 * GIB + 400 * MIB
    early.close()


class UnseenMeter:
    """The process meter at the hardware boundary, attached where part of the process was not seen."""

    unseen = "NVML gives no per-process figure here (a container?) and CUDA had started before vramcal attached"
    definition = f"GPU peak: ..., a lower bound: {unseen}"

    def held_bytes(self) -> int:
        return 300 * MIB

    def reset(self) -> None:
        """Nothing to reset."""

    def read(self) -> int:
        return 900 * MIB

    def close(self) -> None:
        """Nothing to stop."""


def test_a_run_whose_meter_could_not_see_everything_measures_no_process_term_and_records_a_lower_bound(
        tmp_path, monkeypatch):
    from vramcal.cli.console import observations_lines

    path, seen = training_folder(tmp_path), []
    made = []
    monkeypatch.setattr(framework, "attach_meter", lambda device, warn: made.append(device) or UnseenMeter())
    run = framework.FrameworkRun(path, device="cpu", warn=seen.append)
    assert len(made) == 1  # attached when the run is made: before the model reaches the card
    run.start()
    assert run.held_bytes is None and len(made) == 1
    assert any("no process term is measured, and the peak will be a lower bound" in line for line in seen), seen
    line, _ = run.finish(steps=3)
    assert "a lower bound" in line
    profile = load_profile(path)
    assert profile.observations[-1].peak_unseen == UnseenMeter.unseen
    assert any(">= 900.00 MiB" in each for each in observations_lines(profile))


# ------------------------------------------------------------------ 4 and 6. what a GPU worker runs with

WORKERS = """
import json, os
from vramcal.measure.worker import Workers
workers = Workers(("user_models",))
gpu = workers.run("user_models:worker_environment", device_kind="cuda", timeout_s=120).result
killed = workers.run("user_models:kill_myself", 2**30, usable_bytes=2**30 - 2**20, device_kind="cuda", timeout_s=120)
host = workers.run("user_models:worker_environment", timeout_s=120).result
print(json.dumps({"gpu": gpu, "host": host, "killed": [killed.status, killed.error_type],
                  "caller": {k: os.environ.get(k) for k in ("GLIBC_TUNABLES", "TRITON_CACHE_AUTOTUNING")}}))
"""


@pytest.mark.slow
def test_a_gpu_worker_runs_without_the_hosts_settings_and_with_triton_caches(tmp_path):
    """Real workers of each kind, from one caller: a GPU worker gets glibc's and oneDNN's defaults (as a framework's
    process on the card does) and Triton's caches; the host's gets the host's settings; the caller keeps neither
    (no other child of it takes them for the caller's); a killed GPU worker's reading near usable memory (of the
    card) is no out-of-memory evidence."""
    hidden = ("GLIBC_TUNABLES", "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING")
    env = {**{k: v for k, v in os.environ.items() if k not in hidden}, "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", WORKERS], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["gpu"] == {"GLIBC_TUNABLES": None, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": None,
                           "TRITON_CACHE_DIR": str(tmp_path / "cache" / "vramcal" / "triton"),
                           "TRITON_CACHE_AUTOTUNING": "1", "ARROW_DEFAULT_MEMORY_POOL": "system",
                           "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    assert seen["host"] == {"GLIBC_TUNABLES": HOST_MALLOC, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0",
                            "TRITON_CACHE_DIR": None, "TRITON_CACHE_AUTOTUNING": None,
                            "ARROW_DEFAULT_MEMORY_POOL": "system", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    assert seen["caller"] == {"GLIBC_TUNABLES": None, "TRITON_CACHE_AUTOTUNING": None}
    assert seen["killed"] == ["error", evidence.KILLED]


def test_a_gpu_workers_profile_records_its_triton_caches_and_the_host_settings_it_ran_with(fake_cuda,  # noqa: F811
                                                                                           monkeypatch):
    install_fake_nvml([L4], processes={0: [Process(os.getpid(), 0)]})
    (device,), _ = select("0", environ={})
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "1")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    meter = open_meter(device, settle_s=0)
    environment = meter.environment()
    meter.close()
    assert environment["TRITON_CACHE_AUTOTUNING"] == "1" and "TRITON_CACHE_DIR" in environment
    assert environment["GLIBC_TUNABLES"] is None and "ONEDNN_PRIMITIVE_CACHE_CAPACITY" in environment


# ------------------------------------------------------------------ 5. a GPU worker killed by the host's OOM killer

def test_a_gpu_worker_killed_by_the_hosts_out_of_memory_killer_is_a_host_fault_never_a_boundary(monkeypatch):
    """CUDA raises for device memory and never kills: a GPU worker's kill with the kernel's counter risen is the
    host's memory (an error that never becomes the card's limit), and its reading of the card is no evidence."""
    counter = "/sys/fs/cgroup/job/memory.events"
    monkeypatch.setattr(evidence, "oom_kill_counter", lambda: (counter, 5))  # the kernel's counter, now at 5
    gpu = evidence.exit_status(-9, 123, (counter, 4), killed_for_memory=False)
    assert gpu["status"] == "error" and gpu["error_type"] == evidence.HOST_FAULT
    assert gpu["message"].startswith(f"killed by SIGKILL (pid 123) by the kernel's out-of-memory killer ({counter}'s "
                                     f"oom_kill counted it): the host's memory ran out, not the GPU's")
    near = evidence.exit_status(-9, 123, (counter, 5), 2**30, 2**30 - 1, killed_for_memory=False)
    assert near["status"] == "error" and near["error_type"] == evidence.KILLED
    assert evidence.exit_status(-9, 123, (counter, 4))["status"] == "oom"  # the host's own memory: its boundary


# ------------------------------------------------------------------ 7. the calling process leaves CUDA alone

@pytest.fixture
def cuda_asked(monkeypatch):
    """A machine with a GPU, whose torch.cuda records every question that would start CUDA (the hardware boundary)."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("is_bf16_supported", "current_device", "_lazy_init", "get_device_properties", "init"):
        monkeypatch.setattr(torch.cuda, name, lambda *args, _name=name, **kwargs: asked.append(_name))
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *args, **kwargs: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda *args: asked.append("current_stream"))
    return asked


def test_bf16_autocast_never_asks_cuda_about_the_card(cuda_asked):
    """torch.autocast("cuda", bfloat16) asks torch.cuda.is_bf16_supported(), which starts CUDA: in a process beside
    running trials (an estimate, an aim) that context would hold memory on the card through every trial."""
    with autocast("cuda", "bf16-autocast"):
        assert torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16
        with autocast("cuda", "fp32"):
            assert not torch.is_autocast_enabled("cuda")
        assert torch.is_autocast_enabled("cuda")
    assert not torch.is_autocast_enabled("cuda") and cuda_asked == []


def test_an_aims_trace_of_a_bf16_spec_leaves_cuda_alone(cuda_asked):
    from vramcal.estimate.step import estimate_step
    from vramcal.models.regressor.spec import RegressorSpec

    spec = RegressorSpec(d_model=32, n_layers=1, d_state=16, headdim=16, chunk_size=16, seq_len=32,
                         dtype="bf16-autocast")
    estimate = estimate_step(spec.ref("transformers"), (8, 512), device_kind="cuda")  # as the card runs it
    assert estimate.choices and estimate.slope_bytes_per_sample > 0 and cuda_asked == []
