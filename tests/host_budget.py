"""Host budgets for tests that run real trials or training runs: the figure a test was written with, plus what
this interpreter and torch build hold beyond the build the figures were written for.

Every trial and training run is a worker forked from a server that has imported torch, transformers, pandas
and pyarrow (``vramcal/train/preload.py``), so its data segment, which the host budget (``RLIMIT_DATA``)
binds and the host peak counts, starts at what those imports hold. The tests' budgets (``--capacity 1GiB``,
the in-memory profile's 1 GiB, ...) were written with the CPU build of torch 2.13 on Python 3.11, where that
is about 470 MiB (:data:`REFERENCE_BYTES`). The CUDA build (the only torch 2.13 PyPI offers for Python 3.12
and 3.13; it runs on the CPU) maps about 540 MiB more before a step runs, which left a 1 GiB budget almost
nothing and failed every real run under one.

:func:`extra_bytes` measures it once per test session, in a worker of vramcal's own (the fork server the
tests' trials and runs use: starting it is the first real run's cost anyway, and the worker is a fork), less
the reference. :func:`budget` grows a figure by it so that what the budget leaves above a worker's own
footprint is the same on every build: on the CPU build it returns the figure unchanged. :data:`SIZE` matches a
printed size in any unit. tests/test_host_budget.py finds, on any build, a test that runs under a literal budget or
matches a printed size in one unit (CI runs the CPU build only, where neither fails).
"""

from __future__ import annotations

import functools
import math
from typing import Any

from vramcal.calibration.limits import DEFAULT_MARGIN

MIB = 2**20
# A worker's data segment at its start with torch 2.13.0+cpu on Python 3.11 (this repository's .venv, 2-core
# host): 470.2 MiB; with the CUDA build (cu130) 1009-1021 MiB on Python 3.11-3.13.
REFERENCE_BYTES = 472 * MIB
# Closer than this to the reference is the reference's own build (other library versions move it by a few
# MiB): the tests' figures hold as written, with the room they already leave.
TOLERANCE_BYTES = 16 * MIB
# A size as vramcal prints it (vramcal.units.format_bytes), in whichever unit: a process's figure is MiB on the CPU
# build and GiB on the CUDA build (a worker at batch_size 1: 0.48 against 1.00 GiB), so a test matches any unit.
SIZE = r"-?[\d.]+ (?:B|KiB|MiB|GiB|TiB)"


def _data_bytes_here(channel: Any = None) -> int:
    """In a worker: its data-segment peak before it runs anything else (bytes)."""
    from vramcal.measure.meters import peak_data_bytes

    return peak_data_bytes()


@functools.cache
def worker_data_bytes() -> int:
    """What a worker (a trial's or a training run's process) holds at its start: its data-segment peak."""
    from vramcal.api import worker_pool

    outcome = worker_pool().run(_data_bytes_here, timeout_s=300)
    assert outcome.status == "ok", f"measuring a worker failed: {outcome.error}"
    return outcome.result


@functools.cache
def extra_bytes() -> int:
    """What a worker of this interpreter and torch build holds beyond :data:`REFERENCE_BYTES` (0 within
    :data:`TOLERANCE_BYTES` of it, or below it), rounded up to a whole MiB."""
    over = worker_data_bytes() - REFERENCE_BYTES
    return math.ceil(over / MIB) * MIB if over > TOLERANCE_BYTES else 0


def budget(nbytes: int, margin: float = DEFAULT_MARGIN) -> int:
    """A host budget of ``nbytes`` as written for the reference build, for this build.

    Usable memory is ``(1 - margin) × total − reserve``, so the total grows by ``extra / (1 − margin)``:
    usable memory then grows by exactly the extra, and what it leaves above the worker's footprint (the room
    the test's trials and limits were sized for) is the reference build's. The hard limit (``RLIMIT_DATA`` =
    the total) keeps at least that room too.
    """
    return nbytes + math.ceil(extra_bytes() / (1 - margin))


def capacity(nbytes: int, margin: float = DEFAULT_MARGIN) -> str:
    """:func:`budget` as a ``--capacity`` value (a byte count)."""
    return str(budget(nbytes, margin))
