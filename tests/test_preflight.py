"""The GPU check's preflight (scripts/preflight.py) on made-up version data."""

import importlib.util
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("preflight", ROOT / "scripts" / "preflight.py")
preflight = importlib.util.module_from_spec(spec)
spec.loader.exec_module(preflight)

IMAGE = {"torch": "2.11.0", "transformers": "5.17.0", "nvidia-ml-py": "13.580.65", "scipy": "1.16.3",
         "numpy": "2.3.5", "pandas": "2.3.3", "pyarrow": "21.0.0", "matplotlib": "3.10.7", "click": "8.3.0",
         "tqdm": "4.67.1", "huggingface-hub": "1.33.0", "tokenizers": "0.23.2", "safetensors": "0.8.0",
         "packaging": "25.0", "pyyaml": "6.0.3", "regex": "2025.11.3", "typer": "0.20.0", "nvitop": None,
         "psutil": None, "optuna": None}
TRANSFORMERS_5_24 = ["huggingface-hub<3.0,>=1.31.0", "numpy>=1.17", "packaging>=20.0", "pyyaml>=5.1",
                     "regex>=2025.10.22", "tokenizers<0.24.0,>=0.23.1", "typer", "safetensors>=0.8.0", "tqdm>=4.60",
                     'torch>=2.4; extra == "torch"']
NVITOP = ["nvidia-ml-py<13.616.0a0,>=11.450.51", "psutil>=5.6.6", 'colorama>=0.4.0; platform_system == "Windows"']


def requirements():
    return preflight.gpu_path_requirements(ROOT / "pyproject.toml")


def test_the_gpu_path_is_the_projects_dependencies_less_optuna_plus_nvitop():
    names = {preflight.canonical(r.name) for r in requirements()}
    assert {"torch", "transformers", "nvidia-ml-py", "nvitop", "scipy", "pandas", "pyarrow", "click"} <= names
    assert "optuna" not in names


def test_the_bare_image_lists_every_problem_in_one_go():
    problems, _ = preflight.check_versions(requirements(), IMAGE, {"transformers": []})
    assert problems == [
        "too old: transformers 5.17.0 (needs >=5.23): carry a newer wheel in wheels/ (make gpu-wheels)",
        "missing: nvitop (>=1.4): carry its wheel in wheels/ (make gpu-wheels)"]


def test_the_image_with_the_carried_wheels_passes_and_their_own_requirements_are_checked():
    carried = {**IMAGE, "transformers": "5.24.0", "nvitop": "1.7.2", "psutil": "7.1.3"}
    declared = {"transformers": TRANSFORMERS_5_24, "nvitop": NVITOP}
    assert preflight.check_versions(requirements(), carried, declared) == ([], [])
    problems, _ = preflight.check_versions(requirements(), {**carried, "tokenizers": "0.22.2", "psutil": None},
                                           declared)
    assert problems == [
        "too old: tokenizers 0.22.2 (needs <0.24.0,>=0.23.1, for transformers): carry a newer wheel in wheels/ "
        "(make gpu-wheels)",
        "missing: psutil (>=5.6.6, for nvitop): carry its wheel in wheels/ (make gpu-wheels)"]


def test_a_version_above_a_maximum_is_only_a_warning():
    problems, warnings = preflight.check_versions([Requirement("nvitop>=1.4")], {"nvitop": "1.7.2",
                                                  "nvidia-ml-py": "13.700.1", "psutil": "7.1.3"}, {"nvitop": NVITOP})
    assert problems == []
    assert warnings == ["warning: nvidia-ml-py 13.700.1 is above <13.616.0a0,>=11.450.51, for nvitop"]


def test_modules_that_fail_to_import_are_listed():
    def importer(name):
        if name == "pyarrow":
            raise ImportError("libarrow.so.2100: cannot open shared object file\nmore")

    assert preflight.check_imports(["numpy", "pyarrow"], importer) == [
        "cannot import pyarrow: ImportError: libarrow.so.2100: cannot open shared object file"]


@pytest.mark.parametrize("gpu", [False, True])
def test_the_gpu_line(gpu):
    from fakes import L4, install_fake_nvml

    if gpu:
        install_fake_nvml([L4])
        assert preflight.gpu_problem() is None
    else:
        install_fake_nvml([L4], init_error=9)
        assert preflight.gpu_problem() == ("no NVIDIA GPU visible (NVML: Driver Not Loaded): "
                                           "the GPU check needs one")


def test_the_fused_path_line_is_optional_and_says_why_it_cannot_run():
    absent = preflight.fused_path_line({"mamba-ssm": None, "causal-conv1d": None})
    assert absent.startswith("fused path (--impl mamba_ssm): absent (mamba-ssm, causal-conv1d not installed)")
    both = {"mamba-ssm": "2.3.2.post1", "causal-conv1d": "1.7.0"}
    assert preflight.fused_path_line(both, importer=lambda: None) == (
        "fused path (--impl mamba_ssm): present (mamba-ssm 2.3.2.post1, causal-conv1d 1.7.0)")

    def broken():
        raise ImportError("libcudart.so.13: cannot open shared object file")

    assert preflight.fused_path_line(both, importer=broken).endswith(
        "but not importable: ImportError: libcudart.so.13: cannot open shared object file")
