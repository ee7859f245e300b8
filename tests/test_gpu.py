"""Real trials on an NVIDIA GPU (skipped cleanly where there is none)."""

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA")]


def test_gpu_trial_peak_covers_allocator_and_nvml():
    from vramcal.measure.device import select
    from vramcal.measure.trial import TrialRequest, TrialRunner
    from vramcal.model import ModelSpec

    (device,), _ = select("0")
    spec = ModelSpec(d_model=64, n_layers=2, d_state=32, headdim=32, seq_len=128, chunk_size=64)
    small, large = (TrialRunner(timeout_s=300).run(TrialRequest(spec, "transformers", b, device)) for b in (4, 64))
    assert small.ok and large.ok
    for trial in (small, large):
        assert trial.peak_bytes >= trial.torch_max_reserved_bytes >= trial.torch_max_allocated_bytes > 0
        assert trial.nvml_overhead_bytes > 0  # the CUDA context is outside the allocator
        assert trial.nvml_source in ("process", "device-delta")
    assert large.torch_max_allocated_bytes > small.torch_max_allocated_bytes
