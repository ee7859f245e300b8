"""The transformers releases the kernel-binding tests run under: the one installed, and the earlier ones that
``make test`` installs beside it (``$(VENV)/transformers-also/<version>``, ``pip install --no-deps --target``),
each put first on a subprocess's ``PYTHONPATH``.

The releases differ where it matters to vramcal: up to 5.24 transformers calls mamba_ssm's kernels for tensors on
every device, from 5.25 on only for CUDA tensors (``transformers/integrations/hub_kernels.py``). The project
allows ``transformers>=5.23`` (pyproject.toml), so the lowest it allows is among them (checked by
``test_model.test_the_lowest_allowed_transformers_is_exercised``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from packaging.version import Version

ALSO = Path(sys.prefix) / "transformers-also"
FIRST_DEVICE_AWARE = Version("5.25")  # the first release that sends CPU tensors to the PyTorch path


def installed() -> Version:
    from importlib.metadata import version

    return Version(version("transformers"))


def also() -> dict[Version, Path]:
    """The earlier releases installed beside this one, by version."""
    return {Version(path.name): path for path in sorted(ALSO.glob("*")) if (path / "transformers").is_dir()}


def params() -> list:
    """``pytest.param`` per release: ``None`` (the installed one) and each of :func:`also`'s folders."""
    return [pytest.param(None, id=f"transformers-{installed()}")] + [
        pytest.param(path, id=f"transformers-{version}") for version, path in also().items()]


def version_of(folder: Path | None) -> Version:
    return installed() if folder is None else Version(folder.name)


def environment(folder: Path | None) -> dict[str, str]:
    """A subprocess's environment with ``folder``'s transformers first on its path (``None``: unchanged)."""
    env = dict(os.environ)
    if folder is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH")]))
    return env


def kernels_reach_cpu(folder: Path | None) -> bool:
    """Whether that release calls bound mamba_ssm kernels for CPU tensors."""
    return version_of(folder) < FIRST_DEVICE_AWARE
