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


def test_the_gpu_path_is_the_projects_dependencies_less_optuna_and_tensorboard_plus_nvitop():
    names = {preflight.canonical(r.name) for r in requirements()}
    assert {"torch", "transformers", "nvidia-ml-py", "nvitop", "scipy", "pandas", "pyarrow", "click"} <= names
    assert "optuna" not in names and "tensorboard" not in names


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



# --- the carried wheels' pins (scripts/gpu_wheels.txt) and the versions found

PINS = preflight.read_pins()


def test_the_pins_are_exact_and_with_the_image_meet_every_requirement():
    assert PINS["transformers"] == "5.24.0"  # the version whose METADATA TRANSFORMERS_5_24 holds: they move together
    assert set(PINS) == {"transformers", "regex", "nvitop", "nvidia-ml-py", "psutil"}
    recorded = {name: version for name, version in preflight.H200_IMAGE.items() if version}
    image = {**IMAGE, **recorded}  # IMAGE's made-up versions only where the image's were not recorded
    assert preflight.check_versions(requirements(), image, {"transformers": []})[0] != []  # the bare image fails
    on_top = {**image, **PINS}
    assert preflight.check_versions(requirements(), on_top, {"transformers": TRANSFORMERS_5_24,
                                                             "nvitop": NVITOP}) == ([], [])
    assert preflight.check_versions(requirements(), {**on_top, "regex": "2025.9.18"},  # an older regex than 5.24 needs
                                    {"transformers": TRANSFORMERS_5_24})[0] == [
        "too old: regex 2025.9.18 (needs >=2025.10.22, for transformers): carry a newer wheel in wheels/ "
        "(make gpu-wheels)"]


def test_a_pin_must_be_exact(tmp_path):
    path = tmp_path / "pins.txt"
    path.write_text("# carried\ntransformers==5.24.0  # the one\n\nnvitop==1.7.2\n")
    assert preflight.read_pins(path) == {"transformers": "5.24.0", "nvitop": "1.7.2"}
    for line, why in [("transformers>=5.23", "is not an exact pin"), ("regex==2026.*", "is not an exact pin"),
                      ("psutil==7.2.2; sys_platform == 'linux'", "is not an exact pin"),
                      ("Nvitop==1.7.3", "nvitop is pinned twice")]:
        path.write_text(f"nvitop==1.7.2\n{line}\n")
        with pytest.raises(ValueError, match=f"^pins.txt:2: .*{why}"):
            preflight.read_pins(path)


def test_one_line_per_package_found_and_a_warning_when_a_carried_wheel_is_not_the_one_imported():
    installed = {"transformers": "5.24.0", "nvitop": None, "regex": "2025.11.3"}
    folders = {"transformers": "/repo/.gpu-site", "regex": "/usr/lib/python3/dist-packages"}
    assert preflight.found_lines(installed, folders) == [
        "found nvitop: not installed", "found regex 2025.11.3 (/usr/lib/python3/dist-packages)",
        "found transformers 5.24.0 (/repo/.gpu-site)"]
    assert preflight.pin_warnings(PINS, installed) == [
        f"warning: regex 2025.11.3 found, but wheels/ carries {PINS['regex']} (gpu_wheels.txt): is .gpu-site first "
        f"on PYTHONPATH?"]


def carried_wheels(**changes):
    """(name, version, Requires-Dist) of the pinned wheels, with ``name=(version or None, requires)`` changed."""
    wheels = {"transformers": ("5.24.0", TRANSFORMERS_5_24), "nvitop": ("1.7.2", NVITOP), "psutil": ("7.2.2", []),
              "regex": ("2026.11.19", []), "nvidia-ml-py": ("13.615.71", [])}
    wheels.update(changes)
    return [(name, version, requires) for name, (version, requires) in wheels.items() if version]


def test_the_carried_wheels_meet_their_pins_and_the_image():
    lines, problems = preflight.check_wheels(carried_wheels(), PINS)
    assert problems == []
    assert lines[:2] == ["wheel transformers 5.24.0", "  packaging>=20.0 (for transformers): in the image at a "
                         "version not recorded: the device's preflight checks it"]
    assert "wheel nvitop 1.7.2" in lines and not any("colorama" in line for line in lines)  # a Windows-only need


def test_carried_wheels_that_miss_their_pins_or_the_image_are_problems():
    old_hub = {**preflight.H200_IMAGE, "huggingface-hub": "1.30.0"}
    lines, problems = preflight.check_wheels(carried_wheels(regex=(None, []), psutil=("7.1.0", [])), PINS, old_hub)
    assert problems == [
        "psutil==7.2.2 is pinned but not carried (found 7.1.0): run make gpu-wheels",
        "regex==2026.11.19 is pinned but not carried (none found): run make gpu-wheels",
        "transformers 5.24.0 needs huggingface-hub<3.0,>=1.31.0, the image's is 1.30.0: pin a huggingface-hub that "
        "meets it (or another transformers) in gpu_wheels.txt"]
    # without the carried regex, the image's (no recorded version) is left to the device's preflight
    assert ("  regex>=2025.10.22 (for transformers): in the image at a version not recorded: the device's preflight "
            "checks it") in lines
    _, problems = preflight.check_wheels(carried_wheels(psutil=("7.2.2", ["no-such-package>=1"]),
                                                        nvitop=("1.7.2", ["psutil>=8"])), PINS)
    assert problems == ["nvitop 1.7.2 needs psutil>=8, carried is 7.2.2: pin a psutil that meets it (or another "
                        "nvitop) in gpu_wheels.txt",
                        "psutil 7.2.2 needs no-such-package>=1, which neither the image nor wheels/ has: pin it in "
                        "gpu_wheels.txt"]


def test_the_wheel_check_reads_real_wheels(tmp_path):
    import zipfile

    path = tmp_path / "psutil-7.2.2-cp36-abi3-manylinux2010_x86_64.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("psutil-7.2.2.dist-info/METADATA", "Metadata-Version: 2.1\nName: psutil\nVersion: 7.2.2\n"
                       "Requires-Dist: pytest; extra == 'test'\n\nA description.\n")
    assert preflight.wheel_metadata(path) == ("psutil", "7.2.2", ["pytest; extra == 'test'"])
    (tmp_path / "broken.whl").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="^broken.whl is not a readable wheel"):
        preflight.wheel_metadata(tmp_path / "broken.whl")


def write_wheel(folder, name, version, requires=()):
    import zipfile

    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", "Metadata-Version: 2.1\n"
                       f"Name: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires))
    return path


def test_the_wheels_option_checks_a_folder_of_wheels(tmp_path, capsys):
    for name, (version, requires) in {"transformers": ("5.24.0", TRANSFORMERS_5_24), "nvitop": ("1.7.2", NVITOP),
                                      "psutil": ("7.2.2", []), "regex": ("2026.11.19", []),
                                      "nvidia-ml-py": ("13.615.71", [])}.items():
        write_wheel(tmp_path, name, version, requires)
    assert preflight.main(["--wheels", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert "preflight: wheel transformers 5.24.0\n" in out.out and out.err == ""
    (tmp_path / "psutil-7.2.2-py3-none-any.whl").unlink()
    assert preflight.main(["--wheels", str(tmp_path)]) == preflight.EXIT_PACKAGES
    assert capsys.readouterr().err == ("preflight: psutil==7.2.2 is pinned but not carried (none found): run make "
                                       "gpu-wheels\n")


def test_the_gpu_option_needs_a_visible_gpu_and_every_package_gets_a_line(capsys):
    from fakes import L4, install_fake_nvml

    install_fake_nvml([L4], init_error=9)
    assert preflight.main(["--gpu"]) == preflight.EXIT_NO_GPU
    out = capsys.readouterr()
    assert out.err.splitlines()[-1] == "no NVIDIA GPU visible (NVML: Driver Not Loaded): the GPU check needs one"
    found = [line for line in out.out.splitlines() if line.startswith("preflight: found ")]
    names = {line.split()[2].rstrip(":") for line in found}
    assert names >= {"torch", "transformers", "nvitop", "psutil", "regex", "tokenizers", "huggingface-hub",
                     "nvidia-ml-py", "triton"}
    assert "preflight: packages ok (" in out.out
