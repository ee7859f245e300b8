"""Shared fixtures: every test leaves NVML as it found it (the fake driver of tests/fakes.py removed)."""

import pytest

from fakes import restore_nvml


@pytest.fixture(autouse=True)
def _restore_nvml():
    yield
    restore_nvml()
