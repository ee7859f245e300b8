"""Shared fixtures: every test leaves NVML as it found it (the fake driver of tests/fakes.py removed), and reads
no defaults file of the developer's; the bad-input corpus prints its tally at the end of a run that holds it."""

import sys

import pytest

from vramcal.staleness import STRICT_ENV

from fakes import restore_nvml


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
