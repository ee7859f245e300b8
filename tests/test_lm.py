"""The language-model family (``--model lm``): configs, one-line refusals, and a real probe of a tiny one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers_versions
from click.testing import CliRunner
from host_budget import MIB, capacity

from vramcal.cli import main
from vramcal.models.lm import from_mamba_ssm, mamba2_config, read_config
from vramcal.models.registry import family_of
from vramcal.profile import load_profile

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "mamba2-lm-tiny.json"
# state-spaces/mamba2-130m's config.json as published (mamba_ssm's MambaConfig; the Mamba2 block's
# d_state 128, headdim 64, expand 2, ngroups 1, chunk_size 256 are mamba_ssm's defaults).
MAMBA2_130M = {"d_model": 768, "d_intermediate": 0, "n_layer": 24, "vocab_size": 50277,
               "ssm_cfg": {"layer": "Mamba2"}, "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True,
               "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 16,
               "tie_embeddings": True}


def test_the_130m_config_is_the_published_model():
    ours = read_config(str(REPO / "configs" / "mamba2-130m.json"))
    assert ours == read_config(MAMBA2_130M)
    assert ours["vocab_size"] == 50288  # 50277 padded to a multiple of 16, as mamba_ssm pads it
    import torch
    from transformers import Mamba2ForCausalLM

    with torch.device("meta"):  # shapes only, no memory
        model = Mamba2ForCausalLM(mamba2_config(ours))
    assert 128_000_000 < sum(p.numel() for p in model.parameters()) < 131_000_000  # tied embeddings


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.json")))
def test_every_shipped_config_reads(name):
    settings = read_config(str(REPO / "configs" / name))
    assert {"hidden_size", "num_hidden_layers", "vocab_size"} <= set(settings)


def test_a_config_without_chunk_size_has_transformers_default_for_its_lengths(tmp_path):
    """Lengths are multiples of chunk_size; a config file without one has Mamba2Config's (256), not 1 (which
    made --seq-len 256:2048's middle length 724, a length the family then refused)."""
    from vramcal.api import model_ref
    from vramcal.measure.device import host_device

    config = {k: v for k, v in json.loads(TINY.read_text()).items() if k != "chunk_size"}
    (tmp_path / "c.json").write_text(json.dumps(config))
    ref = model_ref("lm", {"config": str(tmp_path / "c.json"), "seq_len": 256}, device=host_device(2**30))
    assert family_of(ref).chunk_size(ref) == 256 == mamba2_config(config).chunk_size


def test_mamba_ssm_configs_that_transformers_cannot_build_are_refused():
    with pytest.raises(ValueError, match="has Mamba1 layers"):
        from_mamba_ssm({**MAMBA2_130M, "ssm_cfg": {}})
    with pytest.raises(ValueError, match="attention layers .* your own factory"):
        from_mamba_ssm({**MAMBA2_130M, "attn_layer_idx": [3]})


KERNELS = """
import sys, torch
sys.path.insert(0, {fake!r})
from vramcal.models.mamba2 import import_transformers_mamba2
from vramcal.models.lm import read_config, training_step
from vramcal.workload import KernelWitness, detect_kernel_path, train_step
import_transformers_mamba2()  # what the worker fork server preloads
step = training_step(torch.device("cpu"), config=read_config({tiny!r}), seq_len=32, implementation={impl!r})
print(detect_kernel_path(step.model), flush=True)
try:
    with KernelWitness() as witness:
        train_step(step, step.batch(2))
    print("trained")
finally:
    print(detect_kernel_path(step.model, witness.called), flush=True)
"""


@pytest.mark.parametrize("folder", transformers_versions.params())
@pytest.mark.parametrize("implementation", ["transformers", "mamba_ssm"])
def test_the_kernel_path_recorded_is_the_one_that_ran(tmp_path, implementation, folder):
    """With a fake mamba_ssm whose kernels refuse CPU tensors: ``transformers`` never reaches them; ``mamba_ssm``
    (transformers' Mamba2 reloaded with the kernels bound, after the worker's torch-only preload) reaches them
    where transformers calls them for CPU tensors (up to 5.24), and takes the PyTorch path where it does not
    (5.25 on). Either way the kernel path recorded after the step is the one that ran."""
    from test_model import FAKE_MAMBA_SSM

    for name, text in FAKE_MAMBA_SSM.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    code = KERNELS.format(fake=str(tmp_path), tiny=str(TINY), impl=implementation)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env=transformers_versions.environment(folder))
    before, after = result.stdout.splitlines()[0], result.stdout.splitlines()[-1]
    if implementation == "transformers":
        assert result.returncode == 0, result.stderr[-2000:]
        assert before == after and "mamba_ssm kernels not bound" in after
    elif transformers_versions.kernels_reach_cpu(folder):
        assert "kernels bound (no step witnessed" in before
        assert result.returncode != 0 and "Triton kernel called on CPU tensors" in result.stderr
        assert "kernels bound and run (mamba_split_conv1d_scan_combined)" in after
    else:
        assert result.returncode == 0, result.stderr[-2000:]
        assert "torch_forward" in after and "bound, not run" in after


@pytest.mark.skipif(transformers_versions.kernels_reach_cpu(None), reason="transformers <= 5.24 calls the fake "
                    "kernels for CPU tensors (test_the_kernel_path_recorded_is_the_one_that_ran covers it)")
def test_show_names_the_kernel_path_a_host_probe_ran_with_mamba_ssm_importable(tmp_path):
    """A host probe of a model with mamba_ssm's (fake) kernels bound, under a transformers that sends CPU tensors
    to the PyTorch path: the profile, and ``vramcal show``, name the PyTorch path, not the kernels."""
    from test_model import FAKE_MAMBA_SSM

    for name, text in FAKE_MAMBA_SSM.items():
        (tmp_path / "fake" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fake" / name).write_text(text)
    env = transformers_versions.environment(None)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "fake"), str(REPO / "tests"), env.get("PYTHONPATH", "")])
    out = tmp_path / "p.json"
    vramcal = [sys.executable, "-m", "vramcal"]
    probed = subprocess.run([*vramcal, "probe", "--gpu", "none", "--capacity", capacity(800 * MIB), "--model",
                             "user_models:lm_with_kernels", "--model-arg", f"config={TINY}", "--model-arg",
                             "seq_len=32", "--reserve", "0", "--no-boundary", "--out", str(out), "--no-report"],
                            capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert probed.returncode == 0, probed.stdout[-2000:] + probed.stderr[-2000:]
    assert "bound, not run" in load_profile(out).kernel_path
    shown = subprocess.run([*vramcal, "show", str(out)], capture_output=True, text=True, timeout=120, env=env)
    assert shown.returncode == 0 and "torch_forward (pure PyTorch chunked scan; mamba_ssm kernels bound, not run" \
        in shown.stdout, shown.stdout + shown.stderr


def probe(*args: str, capacity: str = "1GiB"):
    result = CliRunner().invoke(main, ["probe", "--gpu", "none", "--capacity", capacity, "--model", "lm", *args])
    assert "Traceback" not in result.output
    return result


def bad_config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.json"
    path.write_text(text)
    return f"config={path}"


@pytest.mark.parametrize("args, message", [
    (["--model-arg", "config=/nonexistent/lm.json"], "cannot read the config /nonexistent/lm.json (No such file"),
    (["--model-arg", lambda t: bad_config(t, '{"hidden_size": 64,')], "is not JSON (line 1"),
    (["--model-arg", lambda t: bad_config(t, '{"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 512, '
                                             '"num_heads": 3, "head_dim": 16}')],
     "num_heads x head_dim = 3 x 16 = 48 must equal expand x hidden_size = 2 x 64 = 128: fix num_heads or head_dim"),
    (["--model-arg", lambda t: bad_config(t, '{"hidden_size": "64", "num_hidden_layers": 2, "vocab_size": 512}')],
     "hidden_size = '64' is a string, not a whole number (write it without quotes): fix it in the config"),
    (["--model-arg", lambda t: bad_config(t, '{"hidden_sise": 64, "num_hidden_layers": 2, "vocab_size": 512}')],
     "hidden_sise is not a Mamba2Config setting: fix or remove it"),
    (["--model-arg", lambda t: bad_config(t, '{"num_hidden_layers": 2, "vocab_size": 512}')],
     "does not set hidden_size: give the model's shape"),
    (["--model-arg", f"config={TINY}", "--seq-len", "40"],
     "seq_len 40 is not a positive multiple of the config's chunk_size 16: use --seq-len 32 or 48"),
    (["--model-arg", f"config={TINY}", "--model-arg", "seq_len=0"], "seq_len 0 is not a positive multiple"),
    (["--model-arg", f"config={TINY}", "--dtype", "bf16-autocast"], "bf16-autocast is for CUDA GPUs"),
    (["--model-arg", "seq_len=32"], "--model lm needs --model-arg config=<Mamba2Config JSON file>"),
    (["--model-arg", f"config={TINY}", "--d-model", "64"], "--d-model apply to --model regressor"),
])
def test_bad_lm_input_is_one_line_before_any_trial(args, message, tmp_path):
    args = [a(tmp_path) if callable(a) else a for a in args]
    result = probe(*args, "--out", str(tmp_path / "p.json"), "--no-report")
    assert result.exit_code in (1, 2), result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and message in errors[0], result.output
    assert "calibrating" not in result.output and not (tmp_path / "p.json").exists()


def test_probe_of_a_tiny_lm_writes_a_verified_profile_of_the_torch_path(tmp_path):
    out = tmp_path / "lm.json"
    result = probe("--model-arg", f"config={TINY.relative_to(REPO) if Path.cwd() == REPO else TINY}",
                   "--seq-len", "32", "--reserve", "0", "--no-boundary", "--out", str(out), "--reports-dir",
                   str(tmp_path / "r"), capacity=capacity(800 * MIB))
    assert result.exit_code == 0, result.output  # verified
    assert "calibrating lm config=(hidden 64, layers 2, vocab 512, state 16, +7 more) seq_len=32 fp32 [transformers]" \
        in result.output
    profile = load_profile(out)
    assert profile.verified, profile.warnings
    assert family_of(profile.model).name == "lm" and profile.model.factory == "vramcal.models.lm:training_step"
    assert profile.model.params == {"config": json.loads(TINY.read_text()), "seq_len": 32, "dtype": "fp32",
                                    "implementation": "transformers"}
    assert profile.kernel_path.startswith("transformers Mamba2 torch_forward (pure PyTorch chunked scan")
    states = 16 * 89_136 + 20 * 4  # parameters, gradients, AdamW's two states; its step count per parameter tensor
    assert profile.model_info == {"n_params": 89_136, "vocab_size": 512, "tie_word_embeddings": True,
                                  "gradient_bytes": 4 * 89_136, "model_state_bytes": states,
                                  "rank_model_state_bytes": states}
    ok = sorted((t.batch_size, t.peak_bytes) for t in profile.trials if t.ok)
    assert ok[-1][1] > ok[0][1] and profile.fit.slope_bytes_per_sample > 0
    assert 0 < profile.limits.conservative_batch_size < profile.limits.safe_batch_size
    assert len(list((tmp_path / "r").glob("*-lm-transformers-*.md"))) == 1
