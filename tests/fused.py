"""mamba_ssm's fused path for the estimate's tests: ``make setup-dev`` installs mamba-ssm, causal-conv1d (both without
their CUDA builds), triton and einops in ``$(VENV)/fused-kernels`` (``pip install --target``), apart from the venv, so
the rest of the suite, the host trials and the kernel-binding tests see no mamba_ssm; :func:`fused_path` puts the
folder first on the path for one test and takes every module imported from it away after.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

FOLDER = Path(sys.prefix) / "fused-kernels"
PACKAGES = ("mamba_ssm", "causal_conv1d", "causal_conv1d_cuda")  # triton and einops stay loaded: harmless


@pytest.fixture
def fused_path(monkeypatch):
    if not (FOLDER / "mamba_ssm").is_dir():
        pytest.skip(f"mamba_ssm is not installed in {FOLDER}: run make setup-dev")
    monkeypatch.syspath_prepend(str(FOLDER))
    yield FOLDER
    for key in [k for k in sys.modules if k.split(".")[0] in PACKAGES]:
        del sys.modules[key]
