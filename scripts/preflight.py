"""Preflight of the GPU check: is everything vramcal imports on the GPU path here, new enough, importable?

    python3 scripts/preflight.py          # packages: one line per problem, exit 3 if any
    python3 scripts/preflight.py --gpu    # and an NVIDIA GPU visible through NVML, else one line, exit 4

What is checked: the project's dependencies from pyproject.toml (less those the GPU check does not use),
nvitop, and the requirements those packages declare themselves (transformers needs huggingface-hub,
tokenizers, safetensors ...; nvitop needs psutil): the carried wheels are installed with ``--no-deps``,
so nothing else checks that the image's packages satisfy them. Only a missing package or a version
below a declared minimum is a problem; a version above a declared maximum is printed as a warning
(the image's own packages are what there is). Then every top-level module is imported once, which
catches a broken install that metadata cannot show. The fused Mamba-2 path (mamba-ssm + causal-conv1d,
carried only when built: make gpu-fused-wheels) is optional: one line says whether it is present and
importable, and its absence is no problem.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys
import tomllib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

EXIT_PACKAGES, EXIT_NO_GPU = 3, 4
NOT_ON_THE_GPU_PATH = {"optuna"}  # `vramcal tune` only
EXTRA = ["nvitop>=1.4"]  # the NVML layer (vramcal.measure.nvml); also in pyproject.toml
# Distributions whose own declared requirements are checked too (the ones carried with --no-deps).
CHECK_THEIR_REQUIREMENTS = ("transformers", "nvitop")
MODULES = {"torch": "torch", "transformers": "transformers", "nvitop": "nvitop", "nvidia-ml-py": "pynvml",
           "scipy": "scipy", "numpy": "numpy", "pandas": "pandas", "pyarrow": "pyarrow", "matplotlib": "matplotlib",
           "click": "click", "tqdm": "tqdm", "huggingface-hub": "huggingface_hub", "tokenizers": "tokenizers",
           "safetensors": "safetensors", "psutil": "psutil"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def gpu_path_requirements(pyproject: Path) -> list[Requirement]:
    """The project's dependencies (pyproject.toml) that the GPU check imports, plus :data:`EXTRA`."""
    listed = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    requirements = {canonical(r.name): r for r in map(Requirement, [*listed, *EXTRA])}
    return [r for name, r in requirements.items() if name not in NOT_ON_THE_GPU_PATH]


def _minimum_problem(requirement: Requirement, version: str | None, why: str) -> str | None:
    name = canonical(requirement.name)
    if version is None:
        wanted = requirement.specifier or "any version"
        return f"missing: {name} ({wanted}{why}): carry its wheel in wheels/ (make gpu-wheels)"
    lower = [s for s in requirement.specifier if s.operator in (">=", ">", "==", "~=")]
    try:
        if not all(s.contains(Version(version), prereleases=True) for s in lower):
            return (f"too old: {name} {version} (needs {requirement.specifier}{why}): "
                    f"carry a newer wheel in wheels/ (make gpu-wheels)")
    except InvalidVersion:
        return f"unreadable version: {name} {version!r}{why}: reinstall it"
    return None


def _maximum_warning(requirement: Requirement, version: str | None, why: str) -> str | None:
    if version is None:
        return None
    upper = [s for s in requirement.specifier if s.operator in ("<", "<=", "!=")]
    try:
        if not all(s.contains(Version(version), prereleases=True) for s in upper):
            return f"warning: {canonical(requirement.name)} {version} is above {requirement.specifier}{why}"
    except InvalidVersion:
        return None
    return None


def check_versions(requirements: Iterable[Requirement], installed: Mapping[str, str | None],
                   declared: Mapping[str, list[str]]) -> tuple[list[str], list[str]]:
    """Problems (missing, below a minimum) and warnings (above a maximum), one line each.

    Args:
        requirements: what vramcal needs directly.
        installed: canonical distribution name -> version, or None when not installed.
        declared: canonical distribution name -> its own ``Requires-Dist`` lines (for
            :data:`CHECK_THEIR_REQUIREMENTS`); extras and false markers are skipped.
    """
    problems: list[str] = []
    warnings: list[str] = []
    checks = [(r, "") for r in requirements]
    for parent in CHECK_THEIR_REQUIREMENTS:
        for line in declared.get(parent, []):
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                checks.append((requirement, f", for {parent}"))
    seen: set[tuple[str, str]] = set()
    for requirement, why in checks:
        key = (canonical(requirement.name), str(requirement.specifier))
        if key in seen:
            continue
        seen.add(key)
        version = installed.get(canonical(requirement.name))
        problem = _minimum_problem(requirement, version, why)
        problems += [problem] if problem else []
        warning = _maximum_warning(requirement, version, why)
        warnings += [warning] if warning else []
    return problems, warnings


def check_imports(modules: Iterable[str], importer: Callable[[str], object] = importlib.import_module) -> list[str]:
    """One line per module that fails to import."""
    problems = []
    for module in modules:
        try:
            importer(module)
        except Exception as error:  # noqa: BLE001 - any failure to import is the finding
            problems.append(f"cannot import {module}: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
    return problems


def installed_versions(names: Iterable[str]) -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[canonical(name)] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[canonical(name)] = None
    return versions


def fused_path_line(installed: Mapping[str, str | None], importer: Callable[[], object] | None = None) -> str:
    """The optional line on the fused Mamba-2 path (``--impl mamba_ssm``); never a problem.

    Its wheels (mamba-ssm without the Mamba-1 extension, causal-conv1d compiled for sm_90 against torch
    2.11 + CUDA 13) are carried only when ``make gpu-fused-wheels`` built them (scripts/FUSED_WHEELS.md).

    Args:
        installed: canonical distribution name -> version or None, for ``mamba-ssm`` and ``causal-conv1d``.
        importer: imports both when they are installed (by default ``causal_conv1d``, which loads its
            compiled ``causal_conv1d_cuda``, and vramcal's ``import_mamba_ssm_mamba2``); any exception is
            reported on the line.
    """
    versions = {name: installed.get(name) for name in ("mamba-ssm", "causal-conv1d")}
    found = ", ".join(f"{name} {version}" for name, version in versions.items() if version)
    if not all(versions.values()):
        missing = ", ".join(name for name, version in versions.items() if not version)
        return (f"fused path (--impl mamba_ssm): absent ({missing} not installed{'; ' + found if found else ''}); "
                f"optional: carry its wheels (make gpu-fused-wheels)")
    try:
        (importer or _import_fused)()
    except Exception as error:  # noqa: BLE001 - any failure to import is the finding
        return (f"fused path (--impl mamba_ssm): present ({found}) but not importable: "
                f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
    return f"fused path (--impl mamba_ssm): present ({found})"


def _import_fused() -> None:
    from vramcal.models.mamba2 import import_mamba_ssm_mamba2

    importlib.import_module("causal_conv1d")
    import_mamba_ssm_mamba2()


def gpu_problem() -> str | None:
    """None when NVML shows at least one GPU visible to this process, else the one line to print."""
    from vramcal.measure.nvml import NvmlError, load_nvml, visible_gpus

    try:
        gpus = visible_gpus(load_nvml())
    except NvmlError as error:
        return f"no NVIDIA GPU visible (NVML: {error.__cause__ or error}): the GPU check needs one"
    if not gpus:
        return ("no NVIDIA GPU visible (NVML: none visible to this process; CUDA_VISIBLE_DEVICES?): "
                "the GPU check needs one")
    return None


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parent.parent
    requirements = gpu_path_requirements(root / "pyproject.toml")
    declared = {name: importlib.metadata.requires(name) or [] for name in CHECK_THEIR_REQUIREMENTS
                if installed_versions([name])[name] is not None}
    names = {canonical(r.name) for r in requirements}
    names |= {canonical(Requirement(line).name) for lines in declared.values() for line in lines}
    installed = installed_versions(names)
    problems, warnings = check_versions(requirements, installed, declared)
    if not problems:
        problems = check_imports(MODULES[name] for name in MODULES if name in installed)
    for line in warnings:
        print(f"preflight: {line}", file=sys.stderr)
    if problems:
        for line in problems:
            print(f"preflight: {line}", file=sys.stderr)
        return EXIT_PACKAGES
    found = ", ".join(f"{name} {installed[name]}" for name in ("torch", "transformers", "nvitop") if name in installed)
    origin = Path(importlib.import_module("transformers").__file__).parent.parent
    print(f"preflight: packages ok ({found}; transformers from {origin})")
    print(f"preflight: {fused_path_line(installed_versions(['mamba-ssm', 'causal-conv1d']))}")
    if "--gpu" in argv and (line := gpu_problem()) is not None:
        print(line, file=sys.stderr)
        return EXIT_NO_GPU
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
