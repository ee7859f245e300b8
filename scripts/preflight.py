"""Preflight of the GPU check: is everything vramcal imports on the GPU path here, new enough, importable?

    python3 scripts/preflight.py          # packages: one line per problem, exit 3 if any
    python3 scripts/preflight.py --gpu    # and an NVIDIA GPU visible through NVML, else one line, exit 4
    python3 scripts/preflight.py --wheels wheels   # the carried wheels against their pins and the image (exit 3)

Every run prints, on stdout, one line per package it looked at: ``preflight: found NAME VERSION (FOLDER)``
(``.gpu-site`` is a carried wheel) or ``preflight: found NAME: not installed``; a carried package found at
another version than its pin (scripts/gpu_wheels.txt, the one place the carried versions are pinned) is a
warning: the carried wheel is not the one imported.

What is checked: the project's dependencies from pyproject.toml (less those the GPU check does not use),
nvitop, and the requirements those packages declare themselves (transformers needs huggingface-hub,
tokenizers, safetensors ...; nvitop needs psutil): the carried wheels are installed with ``--no-deps``,
so nothing else checks that the image's packages satisfy them. Only a missing package or a version
below a declared minimum is a problem; a version above a declared maximum is printed as a warning
(the image's own packages are what there is). Then every top-level module is imported once, which
catches a broken install that metadata cannot show. The fused Mamba-2 path (mamba-ssm + causal-conv1d,
carried only when built: make gpu-fused-wheels) is optional: one line says whether it is present and
importable, and its absence is no problem.

``--wheels DIR`` (run by ``make gpu-wheels`` after the download) reads each wheel's METADATA: every pin has
exactly one wheel at its version, and every requirement a wheel declares for the image's interpreter
(Python 3.12 on Linux x86-64) is met by a carried wheel or by the image's recorded version
(:data:`H200_IMAGE`); a requirement on a package the image has at an unrecorded version is printed, for the
device's own preflight to settle.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import re
import sys
import tomllib
import zipfile
from collections.abc import Callable, Iterable, Mapping
from email.parser import HeaderParser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

EXIT_PACKAGES, EXIT_NO_GPU = 3, 4
NOT_ON_THE_GPU_PATH = {"optuna", "tensorboard"}  # `vramcal tune` only; the check's run reports to no tracker
EXTRA = ["nvitop>=1.4"]  # the NVML layer (vramcal.measure.nvml); also in pyproject.toml
# Shown on a line of their own too, beside what vramcal and the carried wheels require: what runs the fused path.
SHOWN = ("triton", "mamba-ssm", "causal-conv1d", "einops")
# Distributions whose own declared requirements are checked too (the ones carried with --no-deps).
CHECK_THEIR_REQUIREMENTS = ("transformers", "nvitop")
MODULES = {"torch": "torch", "transformers": "transformers", "nvitop": "nvitop", "nvidia-ml-py": "pynvml",
           "scipy": "scipy", "numpy": "numpy", "pandas": "pandas", "pyarrow": "pyarrow", "matplotlib": "matplotlib",
           "click": "click", "tqdm": "tqdm", "huggingface-hub": "huggingface_hub", "tokenizers": "tokenizers",
           "safetensors": "safetensors", "psutil": "psutil"}


PINS = Path(__file__).resolve().parent / "gpu_wheels.txt"
# The H200 image's Python packages (KINDS.md, nvidia-h200, as sessions read them there in 2026-11): a version
# where its pip list gave one, None where the package list names the package without a version.
H200_IMAGE: dict[str, str | None] = {
    "torch": "2.11.0", "transformers": "5.17.0", "triton": "3.6.0", "huggingface-hub": "1.33.0",
    "tokenizers": "0.23.2", "safetensors": "0.8.0", "accelerate": "1.15.0", "numpy": "2.5.2",
    "pytorch-lightning": "2.6.6", "torchmetrics": "1.9.0", "jax": "0.11.2", "onnx": "1.23.1",
    **dict.fromkeys(["regex", "psutil", "nvidia-ml-py", "packaging", "pyyaml", "tqdm", "typer", "scipy", "pandas",
                     "pyarrow", "matplotlib", "click", "einops", "filelock", "fsspec", "jinja2", "sympy", "networkx",
                     "typing-extensions", "lightning", "colorama", "rich", "shellingham", "hf-xet", "httpx",
                     "pillow", "requests", "setuptools"]),
}
# The image's interpreter, for the markers of declared requirements (PEP 508 environment markers).
H200_ENVIRONMENT = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
                    "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
                    "platform_machine": "x86_64", "os_name": "posix", "extra": ""}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path = PINS) -> dict[str, str]:
    """The carried wheels' exact versions: canonical name -> version (scripts/gpu_wheels.txt).

    Raises:
        ValueError: a line that is not ``name==version`` (the file pins exact versions only), or a name twice.
    """
    pins: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        requirement = Requirement(text)
        specifiers = list(requirement.specifier)
        exact = (len(specifiers) == 1 and specifiers[0].operator == "==" and "*" not in specifiers[0].version
                 and not requirement.marker and not requirement.extras)
        if not exact:
            raise ValueError(f"{path.name}:{number}: {text!r} is not an exact pin: write name==version")
        name = canonical(requirement.name)
        if name in pins:
            raise ValueError(f"{path.name}:{number}: {name} is pinned twice: keep one line")
        pins[name] = specifiers[0].version
    return pins


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


def found_lines(installed: Mapping[str, str | None], folders: Mapping[str, str]) -> list[str]:
    """One line per package looked at, sorted by name: its version and the folder it was found in.

    Args:
        installed: canonical distribution name -> version, or None when not installed.
        folders: canonical distribution name -> the folder its metadata lies in (a carried wheel's is ``.gpu-site``).
    """
    return [f"found {name} {version} ({folders.get(name, '?')})" if version else f"found {name}: not installed"
            for name, version in sorted(installed.items())]


def pin_warnings(pins: Mapping[str, str], installed: Mapping[str, str | None]) -> list[str]:
    """A warning per carried package found at another version than its pin (the carried wheel is not the one
    imported: it did not install, or ``.gpu-site`` is not ahead of the image's packages on PYTHONPATH)."""
    return [f"warning: {name} {installed[name]} found, but wheels/ carries {version} ({PINS.name}): is .gpu-site "
            f"first on PYTHONPATH?" for name, version in sorted(pins.items())
            if installed.get(name) is not None and installed[name] != version]


def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """(canonical name, version, Requires-Dist lines) from a wheel's ``*.dist-info/METADATA``.

    Raises:
        ValueError: not a wheel, or no METADATA in it.
    """
    try:
        with zipfile.ZipFile(path) as wheel:
            member = next(n for n in wheel.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
            headers = HeaderParser().parsestr(wheel.read(member).decode())
    except (zipfile.BadZipFile, StopIteration, OSError) as error:
        raise ValueError(f"{path.name} is not a readable wheel ({error or 'no METADATA'}): download it again") from None
    return canonical(headers["Name"]), headers["Version"], headers.get_all("Requires-Dist") or []


def check_wheels(wheels: Iterable[tuple[str, str, list[str]]], pins: Mapping[str, str],
                 image: Mapping[str, str | None] = H200_IMAGE,
                 environment: Mapping[str, str] = H200_ENVIRONMENT) -> tuple[list[str], list[str]]:
    """The carried wheels against their pins and the image (``--wheels``, module docstring).

    Args:
        wheels: (canonical name, version, Requires-Dist lines) of each wheel carried.
        pins: :func:`read_pins`. image: canonical name -> the image's version, None when not recorded.
        environment: the image's interpreter, for requirement markers.

    Returns:
        Lines (one per wheel, one per requirement the image's record cannot settle) and problems (a pin without
        its wheel, two wheels of one package, a requirement that neither a carried wheel nor the image meets).
    """
    lines: list[str] = []
    problems: list[str] = []
    wheels = list(wheels)
    carried: dict[str, str] = {}
    for name, version, _ in wheels:
        if name in carried and name in pins:
            problems.append(f"two wheels of {name} ({carried[name]}, {version}): keep the pinned one")
        carried[name] = version
    for name, version in sorted(pins.items()):
        if carried.get(name) != version:
            found = f"found {carried[name]}" if name in carried else "none found"
            problems.append(f"{name}=={version} is pinned but not carried ({found}): run make gpu-wheels")
    for name, version, requires in wheels:
        if name not in pins:
            continue
        lines.append(f"wheel {name} {version}")
        for line in requires:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate(dict(environment)):
                continue
            needed = canonical(requirement.name)
            have = carried.get(needed) or image.get(needed)
            source = "carried" if needed in carried else "the image's"
            if needed not in carried and needed not in image:
                problems.append(f"{name} {version} needs {needed}{requirement.specifier or ''}, which neither the "
                                f"image nor wheels/ has: pin it in {PINS.name}")
            elif have is None:
                lines.append(f"  {needed}{requirement.specifier or ''} (for {name}): in the image at a version not "
                             f"recorded: the device's preflight checks it")
            elif not requirement.specifier.contains(Version(have), prereleases=True):
                problems.append(f"{name} {version} needs {needed}{requirement.specifier}, {source} is {have}: pin a "
                                f"{needed} that meets it (or another {name}) in {PINS.name}")
    return lines, problems


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


def installed_folders(names: Iterable[str]) -> dict[str, str]:
    """canonical distribution name -> the folder its metadata was found in (for :func:`found_lines`)."""
    folders = {}
    for name in names:
        try:
            folders[canonical(name)] = str(importlib.metadata.distribution(name).locate_file(""))
        except importlib.metadata.PackageNotFoundError:
            pass
    return folders


def wheels_main(folder: Path) -> int:
    """``--wheels``: one line per carried wheel and unsettled requirement, one per problem (stderr), exit 3."""
    try:
        lines, problems = check_wheels([wheel_metadata(path) for path in sorted(folder.glob("*.whl"))], read_pins())
    except ValueError as error:
        lines, problems = [], [str(error)]
    for line in lines:
        print(f"preflight: {line}")
    for line in problems:
        print(f"preflight: {line}", file=sys.stderr)
    return EXIT_PACKAGES if problems else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="also require an NVIDIA GPU visible through NVML (exit 4)")
    parser.add_argument("--wheels", type=Path, help="check the carried wheels in this folder instead")
    args = parser.parse_args(argv)
    if args.wheels is not None:
        return wheels_main(args.wheels)
    root = Path(__file__).resolve().parent.parent
    requirements = gpu_path_requirements(root / "pyproject.toml")
    declared = {name: importlib.metadata.requires(name) or [] for name in CHECK_THEIR_REQUIREMENTS
                if installed_versions([name])[name] is not None}
    pins = read_pins()
    theirs = map(Requirement, (line for lines in declared.values() for line in lines))
    names = {canonical(r.name) for r in requirements} | set(pins) | set(SHOWN) | {
        canonical(r.name) for r in theirs if r.marker is None or r.marker.evaluate({"extra": ""})}
    installed = installed_versions(names)
    for line in found_lines(installed, installed_folders(names)):
        print(f"preflight: {line}")
    problems, warnings = check_versions(requirements, installed, declared)
    warnings += pin_warnings(pins, installed)
    if not problems:
        problems = check_imports(MODULES[name] for name in MODULES if installed.get(name))
    for line in warnings:
        print(f"preflight: {line}", file=sys.stderr)
    if problems:
        for line in problems:
            print(f"preflight: {line}", file=sys.stderr)
        return EXIT_PACKAGES
    found = ", ".join(f"{name} {installed[name]}" for name in ("torch", "transformers", "nvitop")
                      if installed.get(name))
    origin = Path(importlib.import_module("transformers").__file__).parent.parent
    print(f"preflight: packages ok ({found}; transformers from {origin})")
    print(f"preflight: {fused_path_line(installed_versions(['mamba-ssm', 'causal-conv1d']))}")
    if args.gpu and (line := gpu_problem()) is not None:
        print(line, file=sys.stderr)
        return EXIT_NO_GPU
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
