"""README's "Python API" example runs as written: its factory module and its five lines, in a fresh process.

The one change: ``gpu="auto"`` becomes the host with a 1 GiB budget (no reserve), since test machines have
no GPU (and a whole host's memory would take minutes). The README says so beside the example. The budget
grows by what this torch build's workers hold beyond the CPU build's (tests/host_budget.py).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from host_budget import budget

from vramcal.profile import load_profile

README = Path(__file__).resolve().parents[1] / "README.md"
DEVICE = 'gpu="auto"'
HOST = 'gpu="none", capacity_bytes={}, settings=vramcal.LimitSettings(reserve_bytes=0)'  # 1 GiB (budget())


def python_api_blocks() -> list[str]:
    """The ```python blocks of the README's "## Python API" section, in order."""
    text = README.read_text()
    section = text.split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_python_api_example_runs_as_written(tmp_path):
    """``python use.py`` in a folder holding ``mytrain.py``, as a user runs it: no ``__main__`` guard, so trial
    processes must not re-run the script (multiprocessing's forkserver would, by default)."""
    factory, use = python_api_blocks()[:2]
    assert factory.startswith("# mytrain.py") and "def make_step(device" in factory
    assert len([line for line in use.splitlines() if line.strip()]) == 5  # the five lines
    assert use.count(DEVICE) == 1 and "__main__" not in use
    (tmp_path / "mytrain.py").write_text(factory)
    (tmp_path / "use.py").write_text(use.replace(DEVICE, HOST.format(budget(2**30))))
    result = subprocess.run([sys.executable, "use.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = list((tmp_path / "profiles").glob("*/make_step-factory-*.json"))
    assert len(saved) == 1  # where the README says
    profile = load_profile(saved[0])
    assert profile.verified and profile.device.kind == "host" and profile.model.factory == "mytrain:make_step"
    assert profile.limits.conservative_batch_size > 1 and all(t.status == "ok" for t in profile.trials)
    assert profile.pool_data_bytes == 2048 * 256 * 16 * 4 + 2048 * 4  # the dataset's data_bytes, held by each trial


def test_the_readme_is_short_its_command_sheet_early_and_its_links_land():
    """Under 500 lines, the command cheat sheet within its first 100, and every link to DESIGN.md or bench/README.md
    names a heading that exists there (GitHub's anchors: lower case, punctuation dropped, spaces as hyphens)."""
    lines = README.read_text().splitlines()
    assert len(lines) < 500
    assert "## Commands" in lines[:100]
    for target, anchor in re.findall(r"\]\(((?:DESIGN|bench/README)\.md)#([^)]+)\)", "\n".join(lines)):
        headings = re.findall(r"^#+ (.+)$", (README.parent / target).read_text(), flags=re.M)
        anchors = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
        assert anchor in anchors, f"{target}#{anchor}"
