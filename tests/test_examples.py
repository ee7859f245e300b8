"""examples/: each framework's script runs as a user runs it, ``python examples/<name>.py`` from the repository's
root in a fresh process, and ends with its integration's line, the measured peak against the prediction.

The Lightning and Hugging Face scripts add only the callback: each one's first run calibrates its own model (a
profile saved), its second finds it (no trial), and each run's peak lands within 3 % of the prediction, under the
warning line. The Accelerate and plain-PyTorch scripts share one calibration of the tiny model's factory: the
plain-PyTorch script makes it in an empty folder (its first run), and both then find it there. Minutes on 2 shared
cores: three calibrations (1-3 min each), each script 5-10 s (its imports, two steps).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from host_budget import capacity

from vramcal.profile import load_profile

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
PEAK_LINE = re.compile(r"^vramcal: peak \d+\.\d+ [KMG]iB at batch_size \d+: predicted \d+\.\d+ [KMG]iB "
                       r"\(([+-]\d+\.\d)%", re.M)

pytestmark = pytest.mark.slow  # a real calibration and five training processes


def run(script: str, profiles_dir: Path, *args: str, budget: float = 1.6) -> str:
    """What ``python examples/<script> --profiles-dir <profiles_dir> --capacity <budget GiB> ...`` says (stdout and
    stderr), its exit status 0 asserted. The budget grows by what this torch build's workers hold beyond the CPU
    build's (tests/host_budget.py), as the scripts' default does."""
    # As a user's shell starts it: without the GLIBC_TUNABLES a worker pool of this test process may have set.
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "ARROW_DEFAULT_MEMORY_POOL")}
    command = [sys.executable, f"examples/{script}", "--profiles-dir", str(profiles_dir),
               "--capacity", capacity(int(budget * GIB)), *args]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def profiles_dir(tmp_path_factory) -> Path:
    """A folder holding the tiny model's profile, calibrated by a script's first run there (which then trains)."""
    folder = tmp_path_factory.mktemp("profiles")
    said = run("plain_pytorch_train.py", folder, "--steps", "1")
    assert "vramcal: profile saved to" in said and "from the matching profile" not in said, said[-2000:]
    assert PEAK_LINE.search(said), said[-2000:]
    # the promise, in the process that calibrated (its trials' workers set GLIBC_TUNABLES in its environment)
    assert "above usable memory" not in said and "above the warning line" not in said, said[-2000:]
    return folder


def runs_recorded(profiles_dir: Path, framework: str) -> list[int]:
    """The steps of each run of ``framework`` the profile recorded."""
    (path,) = profiles_dir.glob("*/lm-*.json")
    return [o.steps for o in load_profile(path).observations if o.framework == framework]


@pytest.mark.parametrize("script, framework", [
    ("lightning_train.py", "lightning"),
    ("hf_trainer_train.py", "transformers.Trainer"),
])
def test_the_callback_alone_calibrates_the_model_then_reuses_its_profile(script, framework, tmp_path):
    """Issue 60: the callback is the script's only vramcal line (1.3 GiB: smaller batches, a quicker calibration)."""
    first = run(script, tmp_path, "--steps", "2", budget=1.3)
    assert "vramcal: profile saved to" in first and "batch_size      1  ok" in first, first[-2000:]
    second = run(script, tmp_path, "--steps", "2", budget=1.3)
    assert "vramcal: from the matching profile" in second and "  ok  " not in second, second[-2000:]
    for said in (first, second):
        error = PEAK_LINE.search(said)
        assert error and abs(float(error.group(1))) <= 3.0, said[-2000:]  # within 3 % of the prediction
        assert "above the warning line" not in said and "above usable" not in said, said[-2000:]
    (path,) = tmp_path.glob("*/*.json")
    profile = load_profile(path)
    assert profile.verified and [o.framework for o in profile.observations] == [framework, framework]


@pytest.mark.parametrize("script, framework", [
    ("accelerate_train.py", "accelerate"),
    ("plain_pytorch_train.py", "plain"),
])
def test_the_example_trains_sized_by_the_shared_profile_and_reports_its_peak(script, framework, profiles_dir):
    before = runs_recorded(profiles_dir, framework)
    said = run(script, profiles_dir, "--steps", "2")
    assert "vramcal: from the matching profile" in said and "profile saved to" not in said, said[-2000:]
    assert PEAK_LINE.search(said), said[-2000:]
    assert runs_recorded(profiles_dir, framework) == [*before, 2]  # this run, appended to the profile
