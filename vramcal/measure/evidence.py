"""Why a worker that sent no result ended: out of memory only on evidence (DESIGN.md, "Failure").

A worker killed by a signal measured nothing unless something says memory killed it. Two things do, besides
the allocator's own error (which a worker that raised reports itself, :func:`vramcal.oom.is_out_of_memory`):

1. the kernel's out-of-memory kill counter rose while the worker lived (:func:`oom_kill_counter`): the memory
   cgroup's own (``oom_kill`` in cgroup v2's ``memory.events``, v1's ``memory.oom_control``), which counts kills
   of its own processes by any out-of-memory killer, the machine's or the cgroup's; the machine-wide
   ``/proc/vmstat`` one only where no cgroup counter is readable, since it also counts a neighbour's kill;
2. the meter's last reading, which the worker sends as it goes (:meth:`vramcal.measure.worker.Channel.reading`),
   was at or above the usable memory its caller named (:func:`near_usable`): there the process was past what the
   limits let a run take, where an out-of-memory kill is what a kill most likely was.

Without either the kill came from outside (``kill -9``, a preemption) and the status is an ``error`` of type
:data:`KILLED`, which the calibration runs again once (a second one stops it).

Only the host's memory is the kernel's to guard: CUDA raises an out-of-memory error for a GPU's memory and never
kills a process for it, so a GPU worker killed with the counter risen ran out of the host's memory, an ``error`` of
type :data:`HOST_FAULT` (it measured nothing about the card, and never becomes its limit), and its meter's reading,
of the card's memory, is no evidence at all.
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
    """The kernel's out-of-memory kill counter that speaks for this process: ``(its file, its count)``.

    The process's memory cgroup's (v2: ``memory.events``, v1: ``memory.oom_control``, each's ``oom_kill``; the
    cgroup's folder under ``root``, or the mount's root where a container shows only its own cgroup as the
    root), else the machine's (``vmstat``'s ``oom_kill``, Linux 4.13+), else None.

    Args:
        cgroups: the process's cgroup list (``/proc/self/cgroup``: ``hierarchy:controllers:path`` lines).
        root: where cgroup file systems are mounted.
    """
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
    """Whether the meter's last reading is evidence of an out-of-memory kill: at or above usable memory (a size
    within the limits never reads there: their upper prediction bound fits in it). No reading or no usable
    memory named: no evidence."""
    return reading_bytes is not None and usable_bytes is not None and reading_bytes >= usable_bytes


def oom_evidence(before: tuple[str, int] | None, after: tuple[str, int] | None, reading_bytes: int | None = None,
                 usable_bytes: int | None = None) -> str | None:
    """What says a kill was an out-of-memory one, as words for its message, or None (module docstring).

    Args:
        before, after: :func:`oom_kill_counter` when the worker started and once it had ended (compared only when
            both read the same file).
        reading_bytes: the meter's last reading the worker sent (bytes); usable_bytes: its caller's usable memory.
    """
    if before is not None and after is not None and before[0] == after[0] and after[1] > before[1]:
        return f"by the kernel's out-of-memory killer ({after[0]}'s oom_kill counted it)"
    if near_usable(reading_bytes, usable_bytes):
        return (f"with {format_bytes(reading_bytes)} held, at or above usable memory {format_bytes(usable_bytes)} "
                f"(the meter's last reading)")
    return None


def exit_status(exitcode: int | None, pid: int | None = None, counter_before: tuple[str, int] | None = None,
                reading_bytes: int | None = None, usable_bytes: int | None = None,
                killed_for_memory: bool = True) -> dict[str, Any]:
    """How a worker that sent no result ended, as :class:`vramcal.measure.worker.Outcome` fields: killed by a signal
    (``exitcode`` -N) is ``oom`` only on evidence (:func:`oom_evidence`, the counter read again now); any other kill
    is an ``error`` of type :data:`KILLED`, which measured nothing.

    Args:
        killed_for_memory: whether the memory the worker measured is the kernel's to guard (the host's; a GPU's is
            not: the meter's ``killed_for_memory``): where it is not, the counter's rise is a host fault
            (:data:`HOST_FAULT`) and the reading no evidence (module docstring)."""
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
