"""Real trials and the real meter on an NVIDIA GPU (skipped cleanly where there is none)."""

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA")]


def test_gpu_trial_peak_covers_allocator_and_nvml():
    from vramcal.api import worker_pool
    from vramcal.measure.device import select
    from vramcal.measure.trial import TrialRequest, TrialRunner
    from vramcal.models.regressor.spec import RegressorSpec

    (device,), _ = select("0")
    spec = RegressorSpec(d_model=64, n_layers=2, d_state=32, headdim=32, seq_len=128, chunk_size=64)
    runner = TrialRunner(worker_pool())
    small, large = (runner.run(TrialRequest(spec.ref("transformers"), b, device))[0] for b in (4, 64))
    assert small.ok and large.ok
    for trial in (small, large):
        assert trial.peak_bytes >= trial.torch_max_reserved_bytes >= trial.torch_max_allocated_bytes > 0
        assert trial.nvml_overhead_bytes > 0  # the CUDA context is outside the allocator
        assert trial.nvml_source in ("process", "device-delta", "device-delta-minus-others")
    assert large.torch_max_allocated_bytes > small.torch_max_allocated_bytes


METER = """
import json, sys
from vramcal.measure.device import select
from vramcal.measure.meters import open_meter
(device,), _ = select(sys.argv[1])
meter = open_meter(device)
import torch
x = torch.empty(2**28, dtype=torch.float32, device="cuda")  # 1 GiB, before the reset: weights and data
meter.check_pinned()
meter.reset()
y = torch.empty(2**28, dtype=torch.float32, device="cuda")  # 1 GiB in the measured span
figures = meter.read()
print(json.dumps({"device": device.to_dict(), "figures": figures, "environment": meter.environment(),
                  "visible": __import__("os").environ["CUDA_VISIBLE_DEVICES"]}))
meter.close()
"""


def run_meter(choice, env=None):
    out = subprocess.run([sys.executable, "-c", METER, choice], capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})}).stdout
    return json.loads(out.splitlines()[-1])


def test_the_meter_measures_from_before_cuda_and_pins_the_uuid():
    result = run_meter("auto")
    device, figures = result["device"], result["figures"]
    assert result["visible"] == device["uuid"]
    assert device["total_bytes"] <= device["nvml_total_bytes"] and device["compute_capability"]
    assert figures["torch_max_reserved_bytes"] >= 2 * 2**30
    assert figures["peak_bytes"] >= figures["nvml_overhead_bytes"] + 2 * 2**30 > 2 * 2**30  # context included
    assert figures["nvml_peak_bytes"] >= 2 * 2**30  # weights and data before the reset count too
    assert result["environment"]["torch_cuda_version"] == torch.version.cuda


def test_an_inherited_cuda_visible_devices_is_honoured():
    from vramcal.measure.device import select

    (first,), _ = select("0")
    result = run_meter("auto", env={"CUDA_VISIBLE_DEVICES": first.uuid})
    assert result["device"]["uuid"] == first.uuid and result["device"]["cuda_index"] == 0
