"""Stale profiles (issue 18, item 6): a profile made under another torch, or another allocator setting, says so
wherever it is used (train, tune, show, limits, the API, the framework callbacks), and --strict-profile /
VRAMCAL_STRICT_PROFILE=1 refuse it in one line."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
from click.testing import CliRunner
from test_train import SPEC, SPEC_ARGS, make_profile, training_folder

from vramcal import api
from vramcal.cli import main
from vramcal.environment import software_versions, worker_setting
from vramcal.measure.device import host_device
from vramcal.sizing.staleness import STRICT_ENV, StaleProfileError, changes

OLD_TORCH = "2.5.1"


@pytest.fixture
def stale(tmp_path, monkeypatch):
    """A profile of the tiny spec for this host made under torch 2.5.1 and another GLIBC_TUNABLES; bars."""
    monkeypatch.delenv(STRICT_ENV, raising=False)
    profile = make_profile(host_device())
    profile = dataclasses.replace(profile, software={**software_versions(), "torch": OLD_TORCH},
                                  environment={**profile.environment, "GLIBC_TUNABLES": "glibc.malloc.arena_max=8"})
    path = training_folder(tmp_path, profile)
    return {"tmp": tmp_path, "path": path, "profile": profile}


def expected_changes() -> tuple[str, str]:
    # the running torch as a profile records it: its version with its build (2.13.0+cpu, 2.13.0+cu130)
    return (f"torch {OLD_TORCH} -> {software_versions()['torch']}",
            f"GLIBC_TUNABLES 'glibc.malloc.arena_max=8' -> '{worker_setting('GLIBC_TUNABLES')}'")


def test_the_changes_that_move_memory_are_named():
    profile = make_profile(host_device())
    assert changes(dataclasses.replace(profile, software=software_versions())) == []
    edited = dataclasses.replace(profile, software={**software_versions(), "torch": OLD_TORCH, "nvitop": "0.1"},
                                 environment={**profile.environment, "GLIBC_TUNABLES": "glibc.malloc.arena_max=8"})
    torch_change, malloc_change = expected_changes()
    assert changes(edited) == [torch_change, malloc_change]  # nvitop does not move memory: not named


def train_args(stale, run: str, *extra: str) -> list[str]:
    return ["train", "--data", str(stale["tmp"] / "bars.parquet"), "--profiles-dir", str(stale["tmp"] / "profiles"),
            "--gpu", "none", "--run-dir", str(stale["tmp"] / run), *SPEC_ARGS, "--max-steps", "1", *extra]


def notice_in(output: str, path) -> str:
    lines = [line for line in output.splitlines() if "was made with other software or settings" in line]
    assert len(lines) == 1, output
    assert str(path) in lines[0] and all(change in lines[0] for change in expected_changes()), lines[0]
    assert "recalibrate with `vramcal probe --gpu none --impl transformers --d-model 32" in lines[0]
    return lines[0]


def refused(result, path) -> str:
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith(f"Error: {path} was made with other software or settings that can move memory (")
    assert f"refused as strict (--strict-profile, strict=True or {STRICT_ENV}=1); recalibrate with `vramcal " \
           f"probe --gpu none --impl transformers --d-model 32" in line
    return line


def test_show_and_limits_warn_and_refuse_when_strict(stale):
    runner, path = CliRunner(), str(stale["path"])
    for command in (["show", path], ["limits", path]):
        result = runner.invoke(main, command)
        assert result.exit_code == 0, result.output
        assert notice_in(result.output, path).startswith("warning: ")
    refused(runner.invoke(main, ["show", path, "--strict-profile"]), path)
    refused(runner.invoke(main, ["limits", path, "--strict-profile"]), path)


def test_train_warns_trains_and_refuses_when_strict(stale, monkeypatch):
    runner = CliRunner()
    result = runner.invoke(main, train_args(stale, "run"))
    assert result.exit_code == 0, result.output
    assert notice_in(result.output, stale["path"]).startswith("warning: ")  # was printed as information
    refused(runner.invoke(main, train_args(stale, "strict", "--strict-profile")), stale["path"])
    assert not (stale["tmp"] / "strict").exists()
    monkeypatch.setenv(STRICT_ENV, "1")
    refused(runner.invoke(main, train_args(stale, "strict-env")), stale["path"])


def test_tune_refuses_a_stale_profile_when_strict(stale):
    result = CliRunner().invoke(main, ["tune", "--data", str(stale["tmp"] / "bars.parquet"), "--gpu", "none",
                                       "--profiles-dir", str(stale["tmp"] / "profiles"), *SPEC_ARGS, "--run-dir",
                                       str(stale["tmp"] / "tune"), "--trials", "1", "--strict-profile"])
    refused(result, stale["path"])


def test_the_api_and_the_callbacks_say_it_and_refuse_when_strict(stale, monkeypatch):
    from vramcal.integrations.run import FrameworkRun

    found = api.locate_profile(SPEC.ref("transformers"), device=host_device(),
                               profiles_dir=stale["tmp"] / "profiles")
    assert len(found.notices) == 1 and notice_in(found.notices[0], stale["path"])
    with pytest.raises(StaleProfileError):
        api.locate_profile(SPEC.ref("transformers"), device=host_device(), profiles_dir=stale["tmp"] / "profiles",
                           strict=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FrameworkRun(stale["path"], device="cpu")
    notice_in("\n".join(str(w.message) for w in caught), stale["path"])
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(StaleProfileError):
        FrameworkRun(stale["path"], device="cpu")


def test_a_world_profile_is_not_stale_for_the_threads_torchrun_sets(monkeypatch):
    """A DDP probe's ranks set their threads from the world (threads_per_rank); torchrun starts the trainer's ranks
    with OMP_NUM_THREADS=1. Seen: a profile made by `probe --nproc 2` was called stale by `train --nproc-per-node 2`
    on the same machine (OMP_NUM_THREADS unset -> '1'). One process still compares it."""
    from vramcal.records import World

    profile = make_profile(host_device())
    profile = dataclasses.replace(profile, software=software_versions(),
                                  environment={**profile.environment, "OMP_NUM_THREADS": None})
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert changes(dataclasses.replace(profile, world=World(2))) == []
    assert changes(profile) == ["OMP_NUM_THREADS unset -> '1'"]


def test_the_torch_build_is_recorded_and_compared_without_importing_torch():
    """Issue 62: PyPI's CUDA wheel is published as 2.13.0 (its torch.__version__ is 2.13.0+cu130), and a host worker
    of it holds about 540 MiB more than one of the CPU build (2.13.0+cpu): the version a profile records and the
    staleness check compares is torch's own, with its build, read without importing torch."""
    import subprocess
    import sys

    code = ("import sys; from vramcal.environment import software_versions; v = software_versions()['torch']; "
            "loaded = 'torch' in sys.modules; import torch; print(v == torch.__version__, loaded)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.split() == ["True", "False"]


def test_a_profile_of_the_other_torch_build_is_stale_and_one_recorded_without_the_build_is_read_with_it(
        monkeypatch):
    """A profile made under the CPU build used by a process of the CUDA build (and the reverse) names both builds;
    a profile written before the build was recorded (PyPI's ``2.13.0``, its trials' ``torch.__version__`` in its
    environment) is read with the build its trials ran."""
    from vramcal.sizing import staleness

    profile = make_profile(host_device())

    def running(build: str) -> None:
        monkeypatch.setattr(staleness, "software_versions", lambda: {**software_versions(), "torch": build})

    cpu = dataclasses.replace(profile, software={**software_versions(), "torch": "2.13.0+cpu"})
    earlier = dataclasses.replace(profile, software={**software_versions(), "torch": "2.13.0"},
                                  environment={**profile.environment, "torch_version": "2.13.0+cu130"})
    running("2.13.0+cu130")
    assert changes(cpu) == ["torch 2.13.0+cpu -> 2.13.0+cu130"] and changes(earlier) == []
    running("2.13.0+cpu")
    assert changes(cpu) == [] and changes(earlier) == ["torch 2.13.0+cu130 -> 2.13.0+cpu"]
