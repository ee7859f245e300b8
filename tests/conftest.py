"""Shared fixtures: every test leaves NVML as it found it (the fake driver of tests/fakes.py removed), and reads
no defaults file of the developer's; the bad-input corpus prints its tally at the end of a run that holds it.

``make test`` runs the suite in two pytest processes (pytest-xdist; ``PYTEST_WORKERS=0``: one), each with its own
worker fork server, so two trials or training runs can run at once on two cores. OpenMP's threads then sleep when idle
(``OMP_WAIT_POLICY=PASSIVE``, read once as torch loads, so set here, before any test module imports it, and
inherited by every worker and command the tests start): libgomp's default spins a waiting thread, and two
processes' spinning threads took half the CPU of the other's work (tests/test_lm.py, test_probe_real.py and
test_surface.py in two processes: 299 CPU-seconds with the default, 152 with PASSIVE; 120 s of wall serially, 84 s
in two). It changes how threads wait, not how many there are or what they hold, so trials measure the same
memory. In one process it is left as it is (there it cost time: those files took 131 s against 120 s).
"""

import os
import sys

import pytest

from vramcal.sizing.staleness import STRICT_ENV

from fakes import restore_nvml

if os.environ.get("PYTEST_XDIST_WORKER"):  # set by pytest-xdist in each of its processes before conftests load
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# the estimate's traces are kept on disk (vramcal.estimate.cache): the tests' in a folder of their own, new each run
if "VRAMCAL_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["VRAMCAL_CACHE_DIR"] = tempfile.mkdtemp(prefix="vramcal-traces-")


def pytest_terminal_summary(terminalreporter):
    """The bad-input corpus's tally by kind, where it ran (tests/test_corpus.py's docstring)."""
    corpus = sys.modules.get("test_corpus")
    if corpus is not None and corpus.TALLY:
        for line in corpus.summary_lines():
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _restore_nvml():
    yield
    restore_nvml()


@pytest.fixture(autouse=True)
def _strictness_ends_with_its_test(monkeypatch):
    """``--strict-profile`` sets VRAMCAL_STRICT_PROFILE for the rest of its process (its workers inherit it); a
    command run in-process by a test must not make the next test's commands strict."""

    monkeypatch.delenv(STRICT_ENV, raising=False)


@pytest.fixture(autouse=True, scope="session")
def _no_user_defaults(tmp_path_factory):
    """No test reads the developer's own defaults file (vramcal.cli.defaults): an empty XDG config folder and no
    VRAMCAL_CONFIG, for the whole session (module-scoped fixtures run commands before function-scoped ones)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("xdg-config")))
        patch.delenv("VRAMCAL_CONFIG", raising=False)
        yield
