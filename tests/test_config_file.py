"""Defaults from TOML files (vramcal.cli.defaults), through the real command line: the user's config.toml, the
project's vramcal.toml over it, a flag over both, a command's table over the top level, ``show --config`` naming
the sources, and a bad file as one line, exit 2.

Every test lives in its own home, XDG folder and project (a folder holding ``.git``, so the search for
vramcal.toml stops inside tmp_path); the commands observed are ``limits`` on a GPU profile written by the fake
calibration of tests/fakes.py, and one ``probe`` whose measurements are faked (tests/test_documented.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from host_budget import capacity
from test_documented import fake_measurement
from test_train import SPEC_ARGS
from test_train_data import synthetic_bars

from vramcal.cli import main
from vramcal.cli.defaults import project_file, user_file
from vramcal.profile import load_profile, save_profile

from fakes import GIB, fake_calibration

MIB = 2**20


@pytest.fixture
def places(tmp_path, monkeypatch):
    """A home, an XDG config folder, a project (``proj``, holding .git) and the current folder ``proj/sub``; the
    user's file and the project's file, not written yet."""
    (tmp_path / "home").mkdir()
    (tmp_path / "proj" / ".git").mkdir(parents=True)
    (tmp_path / "proj" / "sub").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("VRAMCAL_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path / "proj" / "sub")
    user = tmp_path / "xdg" / "vramcal" / "config.toml"
    user.parent.mkdir(parents=True)
    return {"tmp": tmp_path, "user": user, "project": tmp_path / "proj" / "vramcal.toml"}


@pytest.fixture(scope="module")
def gpu_profile(tmp_path_factory) -> Path:
    profile = fake_calibration(lambda b, n: 400 * MIB + 2.5 * MIB * b, 4 * GIB, kind="cuda")
    return save_profile(profile, tmp_path_factory.mktemp("defaults") / "gpu.json")


def invoke(*args, code: int = 0):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return result


def extra_cards(profile: Path, *flags: str) -> set[str]:
    """The cards ``limits --json`` lists beyond the catalogue (those named ``... card``)."""
    table = json.loads(invoke("limits", profile, "--json", *flags).output)
    return {row["gpu"] for row in table["gpus"] if row["gpu"].endswith("card")}


def test_the_users_file_reaches_a_command_through_the_options_own_types(places, monkeypatch):
    """A probe (faked measurements) writes its profile into the user file's profiles_dir, at the file's capacity
    read by --capacity's own type (a size with its unit)."""
    fake_measurement(monkeypatch)
    synthetic_bars(400).to_parquet(places["tmp"] / "bars.parquet")
    budget = int(capacity(3 * GIB // 2))
    places["user"].write_text(f'profiles_dir = "from-user"\ncapacity = "{budget // 1024}KiB"\n')
    invoke("probe", "--gpu", "none", *SPEC_ARGS, "--data", places["tmp"] / "bars.parquet", "--no-report")
    (written,) = (places["tmp"] / "proj" / "sub" / "from-user").rglob("*.json")
    assert load_profile(written).device.total_bytes == budget // 1024 * 1024


def test_project_over_user_flag_over_both_and_a_commands_table_over_the_top_level(places, gpu_profile):
    places["user"].write_text('gpus = "User card=10GiB"\n')
    assert extra_cards(gpu_profile) == {"User card"}
    places["project"].write_text('gpus = "Project card=12GiB"\n')
    assert extra_cards(gpu_profile) == {"Project card"}
    assert extra_cards(gpu_profile, "--gpus", "Flag card=14GiB") == {"Flag card"}
    places["project"].write_text('gpus = "Project card=12GiB"\n[limits]\ngpus = "Limits card=16GiB"\n')
    assert extra_cards(gpu_profile) == {"Limits card"}
    places["user"].write_text('[limits]\ngpus = "User card=10GiB"\n')  # the project file wins, from any table
    assert extra_cards(gpu_profile) == {"Limits card"}


def test_vramcal_config_names_one_file_instead_of_the_search(places, gpu_profile, monkeypatch):
    places["user"].write_text('gpus = "User card=10GiB"\n')
    places["project"].write_text('gpus = "Project card=12GiB"\n')
    named = places["tmp"] / "elsewhere.toml"
    named.write_text('[limits]\ngpus = "Named card=8GiB"\n')
    monkeypatch.setenv("VRAMCAL_CONFIG", str(named))
    assert extra_cards(gpu_profile) == {"Named card"}
    monkeypatch.setenv("VRAMCAL_CONFIG", str(places["tmp"] / "missing.toml"))
    (line,) = invoke("limits", gpu_profile, code=2).stderr.strip().splitlines()
    assert "VRAMCAL_CONFIG=" in line and "missing.toml names no file" in line


def test_the_search_stops_at_the_folder_holding_git(places):
    above = places["tmp"] / "vramcal.toml"  # above the project: never read
    above.write_text("no_such_option = 1\n")
    assert project_file(Path.cwd()) is None
    places["project"].write_text("")
    assert project_file(Path.cwd()) == places["project"]
    assert user_file({"HOME": "/h", "XDG_CONFIG_HOME": ""}) == Path("/h/.config/vramcal/config.toml")
    assert user_file({"HOME": "/h", "XDG_CONFIG_HOME": "relative"}) == Path("/h/.config/vramcal/config.toml")


def test_show_config_names_each_values_source(places, gpu_profile):
    places["user"].write_text('margin = 0.2\n[probe]\nprofiles_dir = "user-profiles"\n')
    places["project"].write_text('profiles-dir = "proj-profiles"\n[limits]\ngpus = "Limits card=16GiB"\n')
    text = invoke("show", "--config").output
    assert f"{places['user']}, {places['project']}" in text.splitlines()[0]
    (limits,) = [line for line in text.splitlines() if line.startswith("limits gpus ")]
    assert limits.split() == ["limits", "gpus", "=", '"Limits', 'card=16GiB"', str(places["project"]), "[limits]"]
    rows = {(row["command"], row["key"]): (row["value"], row["source"])
            for row in json.loads(invoke("show", "--config", "--json").output)["options"]}
    assert rows["probe", "profiles_dir"] == ("proj-profiles", str(places["project"]))  # the project file wins
    assert rows["limits", "gpus"] == ("Limits card=16GiB", f"{places['project']} [limits]")
    assert rows["report", "gpus"] == ([], "default")  # the table applies to limits only
    assert rows["probe", "margin"] == (0.2, str(places["user"]))
    assert rows["train", "profiles_dir"] == ("proj-profiles", str(places["project"]))
    assert "model: " in invoke("show", gpu_profile).output  # show PROFILE as before
    invoke("show", code=2)  # neither a profile nor --config


def test_no_file_is_said(places):
    assert invoke("show", "--config").output.startswith("no defaults file: none at ")


@pytest.mark.parametrize("text, named", [
    ('profile_dir = "p"\n', ['profile_dir = "p"', "did you mean profiles_dir?"]),
    ('[probe]\ncapacity = "12 parsecs"\n', ['[probe] capacity = "12 parsecs"', "--capacity refuses it"]),
    ('margin = 0.1\ncapacity 12GiB\n', ["not valid TOML", "line 2", "capacity 12GiB"]),
    ('[prbe]\nmargin = 0.1\n', ["[prbe] names no vramcal command"]),
    ('margin = [0.1]\n', ["margin = [0.1]", "--margin takes one"]),
])
def test_a_bad_file_is_one_line_naming_file_key_and_value_exit_2(places, gpu_profile, text, named):
    places["project"].write_text(text)
    result = invoke("limits", gpu_profile, code=2)
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"Error: {places['project']}: ") and all(part in line for part in named), line
