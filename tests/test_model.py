"""The model spec and factory: validation, the real module, and coping with an installed mamba_ssm."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import transformers_versions
from packaging.version import Version

from vramcal.models.mamba2 import kernel_path, resolve_implementation
from vramcal.models.regressor.spec import RegressorSpec
from vramcal.models.regressor.step import build_model

TINY = RegressorSpec(d_model=32, n_layers=2, d_state=16, headdim=16, seq_len=32, chunk_size=16)


@pytest.mark.parametrize("changes, message", [
    ({"headdim": 48}, "use headdim in [16, 32, 64, 128, 256]"),
    ({"seq_len": 100}, "use seq_len 64 or 128"),
    ({"chunk_size": 24, "seq_len": 48}, "not a power of two: use 16 or 32"),
    ({"n_layers": 0}, "n_layers must be a positive integer"),
    ({"dtype": "fp16"}, "dtype must be one of"),
])
def test_impossible_specs_are_refused_with_values_that_work(changes, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        RegressorSpec(**changes).validate()


def test_the_profile_key_is_stable_and_distinguishes_specs_and_implementations():
    key = RegressorSpec().ref("transformers").key()
    assert key == RegressorSpec().ref("transformers").key()
    assert key != RegressorSpec(seq_len=256).ref("transformers").key()
    assert key != RegressorSpec().ref("mamba_ssm").key()
    assert RegressorSpec.from_dict(TINY.to_dict()) == TINY
    assert RegressorSpec.from_ref(TINY.ref("transformers")) == (TINY, "transformers")


def test_the_built_model_maps_windows_to_one_prediction_per_position():
    import torch

    model = build_model(TINY, "transformers")
    x = torch.randn(3, TINY.seq_len, TINY.n_features)
    y = model(x)
    assert y.shape == (3, TINY.seq_len) and y.dtype == torch.float32
    y.sum().backward()
    trained = sum(p.numel() for p in model.parameters() if p.grad is not None)
    assert trained == TINY.n_params()  # the analytic count = every parameter that gets a gradient


def test_mamba_ssm_is_refused_on_the_host_and_auto_picks_transformers():
    assert resolve_implementation("auto", "host") == "transformers"
    with pytest.raises(ValueError, match="NVIDIA GPUs only"):
        resolve_implementation("mamba_ssm", "host")
    assert "torch_forward" in kernel_path("transformers")


FAKE_MAMBA_SSM = {
    "mamba_ssm/__init__.py": "",
    "mamba_ssm/ops/__init__.py": "",
    "mamba_ssm/ops/triton/__init__.py": "",
    "mamba_ssm/ops/triton/ssd_combined.py": textwrap.dedent("""
        def mamba_split_conv1d_scan_combined(*args, **kwargs):
            raise RuntimeError("Triton kernel called on CPU tensors")
        mamba_chunk_scan_combined = mamba_split_conv1d_scan_combined
    """),
    "mamba_ssm/ops/triton/selective_state_update.py":
        "def selective_state_update(*args, **kwargs):\n    raise RuntimeError('Triton kernel')\n",
}

RUN = """
import sys, torch
sys.path.insert(0, {path!r})
if {guarded}:
    from vramcal.models.regressor.spec import RegressorSpec
    from vramcal.models.regressor.step import build_model
    model = build_model(RegressorSpec(d_model=32, n_layers=1, d_state=16, headdim=16, seq_len=32, chunk_size=16),
                        "transformers")
    model(torch.randn(2, 32, 5)).sum().backward()
else:
    from transformers import Mamba2Config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Model
    config = Mamba2Config(hidden_size=32, num_hidden_layers=1, state_size=16, head_dim=16, num_heads=4,
                          n_groups=1, chunk_size=16, vocab_size=1)
    Mamba2Model(config)(inputs_embeds=torch.randn(2, 32, 32)).last_hidden_state.sum().backward()
print("trained on the PyTorch path")
"""


@pytest.mark.parametrize("folder", transformers_versions.params())
@pytest.mark.parametrize("guarded", [False, True])
def test_an_installed_mamba_ssm_does_not_hijack_the_cpu_path(tmp_path, guarded, folder):
    """transformers binds importable mamba_ssm kernels at import, and up to 5.24 calls them even for CPU tensors;
    vramcal's own import never binds them, under every transformers the project allows."""
    for name, text in FAKE_MAMBA_SSM.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    result = subprocess.run([sys.executable, "-c", RUN.format(path=str(tmp_path), guarded=guarded)],
                            capture_output=True, text=True, timeout=300, env=transformers_versions.environment(folder))
    if guarded or not transformers_versions.kernels_reach_cpu(folder):  # 5.25 on: CPU tensors take the PyTorch path
        assert result.returncode == 0, result.stderr[-2000:]
        assert "trained on the PyTorch path" in result.stdout
    else:  # the failure vramcal guards against, reproduced with the fake package
        assert result.returncode != 0 and "Triton kernel called on CPU tensors" in result.stderr


def test_the_lowest_allowed_transformers_is_exercised():
    """The kernel-binding tests run under the lowest transformers pyproject.toml allows (``make test`` installs
    it beside the newest), so a release the project admits is not one it never ran."""
    import re
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    lowest = next(re.fullmatch(r"transformers>=([\d.]+)", d).group(1) for d in project["dependencies"]
                  if d.startswith("transformers"))
    tested = {transformers_versions.installed(), *transformers_versions.also()}
    assert Version(lowest) in tested, f"transformers {lowest} is not installed beside this one: run make test"


def _dtypes(blocks, run, entering: bool = False) -> list:
    """The dtype of what each of ``blocks`` returns (``entering``: is given) while ``run()`` runs."""
    seen = []
    def given(module, args):
        seen.append(args[0].dtype)

    def returned(module, args, out):
        seen.append(out.dtype)

    hooks = [b.register_forward_pre_hook(given) if entering else b.register_forward_hook(returned) for b in blocks]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def test_the_residual_stream_is_fp32_under_bf16_autocast_on_both_paths():
    """Issue 18: under bf16 autocast the input projection's output is bf16; on both implementations the residual
    stream the blocks add to, and pass on, is fp32 (transformers: ``residual_in_fp32`` casts it in each block; the
    mamba_ssm backbone casts it up at its entry), so the two calibrate the same model. transformers runs for real;
    the mamba_ssm backbone's own residual code runs with its CUDA kernels (RMSNorm, the Mamba2 mixer) stood in for
    by bf16-returning modules."""
    import torch

    from vramcal.models.regressor import net

    spec = RegressorSpec(d_model=32, n_layers=2, d_state=16, headdim=16, chunk_size=16, seq_len=32)
    x = torch.randn(2, spec.seq_len, spec.n_features)
    model = build_model(spec, "transformers")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.input_proj(x).dtype == torch.bfloat16  # what both backbones are fed
        layers = model.backbone.model.layers
        assert _dtypes(layers, lambda: model(x)) == [torch.float32] * spec.n_layers  # residual + mixer, fp32

    class Kernel(torch.nn.Module):  # a CUDA kernel's stand-in: bf16 out, as under autocast
        def forward(self, hidden):
            return (hidden * 0.5).to(torch.bfloat16)

    backbone = net.MambaSsmBackbone.__new__(net.MambaSsmBackbone)
    torch.nn.Module.__init__(backbone)
    backbone.norms = torch.nn.ModuleList(Kernel() for _ in range(spec.n_layers))
    backbone.mixers = torch.nn.ModuleList(Kernel() for _ in range(spec.n_layers))
    backbone.norm_f = torch.nn.Identity()
    backbone.checkpoint_stride = 0  # no activation checkpointing, as the spec's default
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model.input_proj(x)
        assert _dtypes(backbone.norms, lambda: backbone(hidden), entering=True) == [torch.float32] * spec.n_layers
        assert backbone(hidden).dtype == torch.float32
