"""``--json`` of probe, limits and report: stdout is one JSON document for programs; people's lines go to stderr."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from host_budget import capacity

from vramcal.cli import main
from vramcal.profile import load_profile, save_profile

from profiles_for_tests import gpu_profile

TESTS = Path(__file__).resolve().parent
VRAMCAL = Path(sys.executable).with_name("vramcal")  # the console script, as a user runs it


@pytest.mark.skipif(not VRAMCAL.exists(), reason="the vramcal console script is not installed in this environment")
def test_probe_json_from_a_shell_is_only_json_on_stdout_even_when_the_factory_prints(tmp_path):
    """A user's module in the current directory (not on PYTHONPATH, not installed) that prints to stdout in
    every trial; three trials, so the limits are unverified and the exit status is 3."""
    shutil.copy(TESTS / "user_models.py", tmp_path / "shop_models.py")
    result = subprocess.run([str(VRAMCAL), "probe", "--json", "--gpu", "none", "--capacity", capacity(2**30),
                             "--reserve", "0", "--model", "shop_models:chatty", "--model-arg", "width=4",
                             "--max-trials", "3", "--out", "p.json", "--no-report"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 3, result.stderr
    printed = json.loads(result.stdout)  # the whole of stdout
    assert printed == load_profile(tmp_path / "p.json").to_dict()
    assert printed["model"] == {"factory": "shop_models:chatty", "params": {"width": 4}}
    assert printed["verified"] is False and len(printed["trials"]) == 3
    assert [t["status"] for t in printed["trials"]] == ["ok"] * 3
    assert "calibrating shop_models:chatty width=4 on" in result.stderr
    assert result.stderr.count("chatty: building the model") == 3  # one per trial process, on stderr
    assert "not verified" in result.stderr and "Traceback" not in result.stderr


def test_probe_json_errors_stay_off_stdout(tmp_path):
    result = CliRunner().invoke(main, ["probe", "--json", "--gpu", "none", "--capacity", capacity(2**30), "--model",
                                       "user_models:nope", "--no-report"])
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.startswith("Error: user_models has no nope")


def test_limits_json(tmp_path):
    profile = gpu_profile()
    path = save_profile(profile, tmp_path / "gpu.json")
    result = CliRunner().invoke(main, ["limits", str(path), "--json", "--gpus", "Test card=20GiB"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert printed["profile"] == str(path) and printed["verified"] is True
    assert printed["formula"] == profile.fit.formula()
    measured = [row for row in printed["gpus"] if row["measured"]]
    assert len(measured) == 1 and measured[0]["safe_batch_size"] == profile.limits.safe_batch_size
    assert measured[0]["conservative_batch_size"] == profile.limits.conservative_batch_size
    test_card = [row for row in printed["gpus"] if row["gpu"].startswith("Test card")]
    assert len(test_card) == 1 and test_card[0]["total_bytes"] == 20 * 2**30
    assert test_card[0]["safe_batch_size"] > profile.limits.safe_batch_size  # 20 GiB holds more than 12


def test_report_json(tmp_path):
    profile = gpu_profile()
    path = save_profile(profile, tmp_path / "gpu.json")
    result = CliRunner().invoke(main, ["report", str(path), "--json", "--out", str(tmp_path / "reports")])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert Path(printed["png"]).is_file() and Path(printed["markdown"]).is_file()
    assert Path(printed["png"]).parent == tmp_path / "reports"
    assert printed["profiles"] == [{"profile": str(path), "verified": True, "limits": profile.limits.to_dict(),
                                    "observations": 0}]


def test_limits_json_of_a_broken_profile_is_one_line_on_stderr(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    result = CliRunner().invoke(main, ["limits", str(broken), "--json"])
    assert result.exit_code == 1 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and str(broken) in result.stderr
