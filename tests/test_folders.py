"""Commands over a folder of profiles use what they can (issue 59 item 1): after ``make run-lm`` the README's own
``vramcal cost profiles/ --epochs 50 --price ...`` exited 1 on the language model's profile over seq_len 64-1024
("give the run's seq_len"), though the folder's other profiles could be forecast. A folder's profile that the command
cannot use is left out, in one line naming it and why; a file named on its own is still refused.

The profiles are the project's committed host calibrations (examples/measured/, bench/results/), as a user's
profiles/ folder holds them after ``make run``, ``make run-lm`` and a DDP and an FSDP probe.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_train_data import synthetic_bars

from vramcal.cli import main
from vramcal.profile import profiles_under

ROOT = Path(__file__).resolve().parent.parent
MEASURED = ROOT / "examples/measured/profiles/host-amd-epyc-2-cores"
REGRESSOR = MEASURED / "regressor-transformers-6e644469-2.5gib.json"  # one length, seq_len 128
LENGTHS = ROOT / "bench/results/lm-train/profiles/host-amd-epyc-2-cores/lm-transformers-9f5b73fd-640mib.json"
FSDP = ROOT / "bench/results/fsdp/profiles/host-amd-epyc-2-cores/regressor-transformers-38e8f3eb-fsdp2-2gib.json"


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    """``profiles/``: a regressor at seq_len 128, a language model over 64-1024, an FSDP world at seq_len 32, and a
    file cut short by a full disk."""
    profiles = tmp_path / "profiles" / "host-amd-epyc-2-cores"
    profiles.mkdir(parents=True)
    for path in (REGRESSOR, LENGTHS, FSDP):
        shutil.copy(path, profiles / path.name)
    (profiles / "regressor-transformers-0badf11e.json").write_text('{"schema_version": 2, "dev')
    return tmp_path / "profiles"


def invoke(*args) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in result.output
    return result.exit_code, result.stdout, result.stderr


def left_out(stderr: str) -> dict[str, str]:
    """The command's left-out lines, by file name."""
    lines = [line.removeprefix("left out ") for line in stderr.splitlines() if line.startswith("left out ")]
    return {Path(line.split(": ", 1)[0]).name: line.split(": ", 1)[1] for line in lines}


def test_the_readmes_cost_over_a_folder_forecasts_what_it_can_and_names_what_it_left_out(folder, tmp_path):
    code, out, err = invoke("cost", folder, "--epochs", "50", "--price", "RTX 4090=0.59,host=0.05",
                            "--out", tmp_path / "reports")
    assert code == 0, err
    assert left_out(err) == {
        LENGTHS.name: "the profile covers seq_len 64-1024: give the run's --seq-len (its memory depends on it)",
        "regressor-transformers-0badf11e.json": "is not valid JSON (line 1): it is corrupt or truncated; re-run "
                                                "`vramcal probe` to replace it"}
    assert "seq_len=128" in out and "seq_len=32" in out and "RTX 4090" in out  # the forecastable rows, and the card
    code, out, err = invoke("cost", folder, "--seq-len", "128", "--out", tmp_path / "reports", "--json")
    assert code == 0, err
    found = json.loads(out)
    assert [Path(p).name for p in found["profiles"]] == [LENGTHS.name, REGRESSOR.name]  # 128 is inside 64-1024
    assert set(left_out(err)) == {FSDP.name, "regressor-transformers-0badf11e.json"}
    assert left_out(err)[FSDP.name].startswith("the profile was calibrated at seq_len 32, not 128")
    assert found["left_out"] == [line for line in err.splitlines() if line.startswith("left out ")]


def test_cost_for_a_world_size_leaves_out_the_single_process_profiles(folder, tmp_path):
    code, out, err = invoke("cost", folder, "--world-size", "4", "--out", tmp_path / "reports")
    assert code == 0, err
    assert left_out(err)[REGRESSOR.name].startswith("a single-process profile has no world to carry")
    assert "4 cards under FSDP" in " ".join(out.split())


def test_a_file_named_alone_is_still_refused_and_a_folder_with_nothing_usable_says_why(folder, tmp_path):
    code, _, err = invoke("cost", LENGTHS, "--out", tmp_path / "reports")
    assert code == 1 and err.startswith(f"Error: {LENGTHS}: the profile covers seq_len 64-1024"), err
    only = tmp_path / "only"
    only.mkdir()
    shutil.copy(LENGTHS, only)
    code, _, err = invoke("cost", only, "--out", tmp_path / "reports")
    assert code == 1
    assert err.splitlines()[-1] == (f"Error: no profile here can be used (1 left out; the first: "
                                    f"{only / LENGTHS.name}: the profile covers seq_len 64-1024: give the run's "
                                    f"--seq-len (its memory depends on it))")


def test_the_report_of_a_folder_leaves_out_what_is_no_profile_and_what_its_data_cannot_forecast(folder, tmp_path):
    (folder / "run.json").write_text(json.dumps({"config": {}, "sizing": None}))  # a run folder's record
    synthetic_bars(400).to_parquet(tmp_path / "bars.parquet")  # windows of 32 bars, not of 128
    code, out, err = invoke("report", folder, "--data", tmp_path / "bars.parquet", "--out", tmp_path / "reports",
                            "--json")
    assert set(left_out(err)) == {"run.json", "regressor-transformers-0badf11e.json", LENGTHS.name, REGRESSOR.name}
    assert left_out(err)[LENGTHS.name] == "its model has no seq_len to cut windows with: give --samples"
    assert "400 bars give 3 training and 0 validation windows of 128 bars" in left_out(err)[REGRESSOR.name]
    assert left_out(err)["run.json"].startswith("it is not a vramcal profile")
    assert code == 0 and [Path(p["profile"]).name for p in json.loads(out)["profiles"]] == [FSDP.name]


def test_one_scan_of_a_folder_serves_sizing_the_estimate_and_the_commands(folder):
    found, unreadable = profiles_under(folder)
    assert sorted(p.path.name for p in found) == sorted(p.name for p in (REGRESSOR, LENGTHS, FSDP))
    assert [path.name for path, _ in unreadable] == ["regressor-transformers-0badf11e.json"]
    assert profiles_under(folder / "missing") == ([], [])
