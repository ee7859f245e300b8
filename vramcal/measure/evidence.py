"""Why a worker that sent no result ended: out of memory only on evidence (DESIGN.md, "Failure").

A worker killed by a signal is ``oom`` only if the kernel's out-of-memory kill counter rose while it lived
(:func:`oom_kill_counter`: its memory cgroup's, else the machine's, which also counts a neighbour's kill), or its
meter's last reading was at or above its caller's usable memory (:func:`near_usable`). Otherwise the kill came
from outside: an ``error`` of type :data:`KILLED`, run again once. CUDA never kills for device memory, so a GPU
worker killed with the counter risen is a host fault (:data:`HOST_FAULT`), never a limit of the card.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import Any

from vramcal.units import format_bytes

KILLED = "Killed"  # the error_type of a worker killed by a signal without out-of-memory evidence
HOST_FAULT = "HostOutOfMemory"  # the error_type of a GPU worker the kernel's out-of-memory killer ended
CGROUP_ROOT = Path("/sys/fs/cgroup")
VMSTAT = Path("/proc/vmstat")


def oom_kill_counter(cgroups: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT,
                     vmstat: Path = VMSTAT) -> tuple[str, int] | None:
    """The kernel's out-of-memory kill counter that speaks for this process, ``(its file, its count)``, or None:
    its memory cgroup's ``oom_kill`` (v2 ``memory.events``, v1 ``memory.oom_control``; under ``root``, or the
    mount's root in a container), else ``vmstat``'s (Linux 4.13+). ``cgroups``: ``/proc/self/cgroup``'s lines."""
    files = []
    with contextlib.suppress(OSError):
        for line in cgroups.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":  # cgroup v2
                mount, name = root, "memory.events"
            elif "memory" in controllers.split(","):  # cgroup v1's memory controller
                mount, name = root / "memory", "memory.oom_control"
            else:
                continue
            files += [folder / name for folder in (mount / path.lstrip("/"), mount) if (folder / name).is_file()][:1]
    for file in [*files, vmstat]:
        with contextlib.suppress(OSError):
            count = _counter(file.read_text())
            if count is not None:
                return str(file), count
    return None


def _counter(text: str) -> int | None:
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def near_usable(reading_bytes: int | None, usable_bytes: int | None) -> bool:
    """Whether the meter's last reading (bytes) is at or above usable memory, where no size within the limits
    reads; either None: no evidence."""
    return reading_bytes is not None and usable_bytes is not None and reading_bytes >= usable_bytes


def oom_evidence(before: tuple[str, int] | None, after: tuple[str, int] | None, reading_bytes: int | None = None,
                 usable_bytes: int | None = None) -> str | None:
    """What says a kill was an out-of-memory one, as words for its message, or None (module docstring).
    ``before``/``after``: :func:`oom_kill_counter` at the worker's start and end (compared if the same file)."""
    if before is not None and after is not None and before[0] == after[0] and after[1] > before[1]:
        return f"by the kernel's out-of-memory killer ({after[0]}'s oom_kill counted it)"
    if near_usable(reading_bytes, usable_bytes):
        return (f"with {format_bytes(reading_bytes)} held, at or above usable memory {format_bytes(usable_bytes)} "
                f"(the meter's last reading)")
    return None


def exit_status(exitcode: int | None, pid: int | None = None, counter_before: tuple[str, int] | None = None,
                reading_bytes: int | None = None, usable_bytes: int | None = None,
                killed_for_memory: bool = True) -> dict[str, Any]:
    """How a worker that sent no result ended, as :class:`vramcal.measure.worker.Outcome` fields (module
    docstring); ``killed_for_memory``: the meter's (False on a GPU: a rise is a host fault, the reading no evidence).
    """
    if exitcode is not None and exitcode < 0:
        name, after = signal_name(-exitcode), oom_kill_counter()
        evidence = oom_evidence(counter_before, after, reading_bytes if killed_for_memory else None, usable_bytes)
        if evidence is not None and killed_for_memory:
            return {"status": "oom", "message": f"killed by {name} (pid {pid}) {evidence}"}
        if evidence is not None:
            return {"status": "error", "error_type": HOST_FAULT,
                    "message": f"killed by {name} (pid {pid}) {evidence}: the host's memory ran out, not the GPU's "
                               f"(CUDA raises an out-of-memory error for device memory, and never kills): a host "
                               f"fault, no limit of the card; free host memory and run again"}
        what = (f"killed by {name} (pid {pid}), and the kernel counted no out-of-memory kill: something outside "
                f"vramcal ended it (a kill, a scheduler's preemption)")
        return {"status": "error", "error_type": KILLED, "message": what}
    return {"status": "error", "message": f"the process exited with code {exitcode} without a result"}


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
