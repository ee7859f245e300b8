"""How the GPU check (scripts/gpu_check.py) runs its steps and keeps their results.

* **Results written as soon as a step ends.** ``<out>/gpu_check.json`` (every figure) and ``<out>/GPU_CHECK.md``
  (the summary) are rewritten atomically (:mod:`vramcal.files`: temporary file, fsync, rename) after every
  step, whatever it ended with, and so is ``<out>/gpu_check_files.tar.gz`` (the work folder's ``profiles/``
  and ``reports/``). Nothing else goes under ``<out>``: the device tool brings back at most 8 files from its
  output folder (``/work/.library/device/README.md``, Limits), so the bulky work (profiles, reports, run
  folders, Triton's cache, bars) lives in the work folder.
* **A guard per step.** A step ends ``ok`` (its result), ``error`` (the error's one line and the traceback's
  last lines), ``stopped`` (it ran past the time it was given, or the check was told to stop; what it had
  measured by then is kept as ``partial``) or ``skipped`` (with the reason: a step it needs did not end
  ``ok``, no hardware for it, or too little time). A failure in one step never stops the next.
* **A time plan.** Each step has an estimate (the least time it is started with, seconds) and a weight. A step
  starts only when the time left covers its estimate; it is then given its weighted share of the time left
  against the later steps that can still run (counting as its own the weights of those that need it: they
  cannot run without it), never less than its estimate, and a timer (``SIGALRM``) stops it when that is
  spent; what it leaves unused goes to the steps after it. The check's own deadline is ``--budget-s`` less
  :data:`FINISH_S` for the last writes. ``SIGTERM`` (the outer ``timeout``) and Ctrl-C stop the step in
  progress the same way and skip the rest, with everything written.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import signal
import sys
import tarfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramcal.files import atomic_write, atomic_write_json, atomic_write_text

FINISH_S = 5.0  # kept back from --budget-s for the last writes (they take well under a second)
RESULTS, SUMMARY, BUNDLE = "gpu_check.json", "GPU_CHECK.md", "gpu_check_files.tar.gz"
TRACEBACK_LINES = 12


class OutOfTime(BaseException):
    """Raised in the main thread when a step's time is spent (``SIGALRM``) or the check must stop (``SIGTERM``,
    Ctrl-C). A BaseException, so that no ``except Exception`` inside vramcal swallows it; a worker's caller
    kills its process on the way out (:meth:`vramcal.measure.worker.Workers.run`).

    Attributes:
        stops_the_check: the later steps are skipped too (SIGTERM, Ctrl-C), not only this one.
    """

    def __init__(self, message: str, stops_the_check: bool = False) -> None:
        super().__init__(message)
        self.stops_the_check = stops_the_check


class InjectedError(RuntimeError):
    """The failure ``--inject-error STEP`` raises inside that step's guard (a rehearsal of a failing step)."""


@dataclass(frozen=True)
class Step:
    """One step of the check.

    Attributes:
        name: its key in the results.
        times: device kind (``cuda``, ``host``) -> (estimate seconds, weight); a kind missing: not for it.
        body: ``body(given_s, partial) -> result``; it may fill ``partial`` as it goes (kept if it fails or is
            stopped); the result may hold ``summary``, its one line for GPU_CHECK.md.
        needs: steps that must have ended ``ok`` first.
        unavailable: why it cannot run here (no hardware, no kernels), or None.
    """

    name: str
    times: dict[str, tuple[float, float]]
    body: Callable[[float, dict[str, Any]], dict[str, Any]]
    needs: tuple[str, ...] = ()
    unavailable: Callable[[], str | None] = lambda: None


@dataclass
class Check:
    """The results so far, and where they go; the time left.

    Args:
        out: the results folder (three files, module docstring). work: everything else.
        budget_s: seconds from now to the end of the check's last write.
        clock: seconds, monotonic (tests pass their own).
    """

    out: Path
    work: Path
    budget_s: float
    command: str
    clock: Callable[[], float] = time.monotonic
    results: dict[str, Any] = field(default_factory=dict)
    stop_reason: str | None = None

    def __post_init__(self) -> None:
        self.started = self.clock()
        self.deadline = self.started + self.budget_s - FINISH_S
        self.results = {"command": self.command, "started_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                        "budget_s": self.budget_s, "out": str(self.out), "work": str(self.work), "notes": {},
                        "steps": {}, "finished": False, **self.results}

    def left_s(self) -> float:
        return self.deadline - self.clock()

    def status(self, name: str) -> str | None:
        return self.results["steps"].get(name, {}).get("status")

    def record(self, name: str, entry: dict[str, Any]) -> None:
        self.results["steps"][name] = entry
        self.write()
        print(f"== {name}: {entry['status']}: {line_of(entry)}", flush=True)

    def write(self) -> None:
        """gpu_check.json, GPU_CHECK.md and the bundle, each atomically; a file that cannot be written is one line
        on stderr (the previous copy stays), and the check goes on: the next write tries again."""
        self.results["elapsed_s"] = round(self.clock() - self.started, 1)
        self.results["order"] = list(self.results["steps"])  # the JSON's keys are sorted: the steps' run order
        folders = [self.work / name for name in ("profiles", "reports") if (self.work / name).is_dir()]
        writes = [(RESULTS, lambda: atomic_write_json(self.out / RESULTS, self.results)),
                  (SUMMARY, lambda: atomic_write_text(self.out / SUMMARY, summary(self.results)))]
        if folders:
            writes.append((BUNDLE, lambda: atomic_write(self.out / BUNDLE, lambda handle: _pack(handle, folders))))
        for name, write in writes:
            try:
                self.out.mkdir(parents=True, exist_ok=True)
                write()
            except OSError as error:
                print(f"could not write {self.out / name} ({error.strerror or error}); the next step's end "
                      f"tries again", file=sys.stderr, flush=True)


def _pack(handle: Any, folders: list[Path]) -> None:
    with tarfile.open(fileobj=handle, mode="w:gz") as bundle:
        for folder in folders:
            bundle.add(folder, arcname=folder.name, filter=lambda info: None if info.name.endswith(".lock") else info)


def run_steps(check: Check, steps: list[Step], kind: Callable[[], str], inject: str | None = None) -> None:
    """Run ``steps`` in order, each in its guard (module docstring), recording each as it ends.

    Args:
        kind: the device kind the times are read for (known once the device step has run).
        inject: the name of a step whose body is replaced by an :class:`InjectedError`.

    Raises:
        KeyboardInterrupt: Ctrl-C between two steps (inside one it stops that step and skips the rest); the
            results are written first.
    """
    _terminated.clear()
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        for index, step in enumerate(steps):
            check.stop_reason = check.stop_reason or (_terminated[-1] if _terminated else None)
            reason = check.stop_reason and f"the check was stopped ({check.stop_reason})"
            reason = reason or blocked(check, step, kind())
            estimate_s, weight = step.times.get(kind(), (0.0, 0.0))
            if reason is None and check.left_s() < estimate_s:
                reason = f"needs ~{estimate_s:.0f} s, {max(check.left_s(), 0):.0f} s left"
            if reason is not None:
                check.record(step.name, {"status": "skipped", "reason": reason})
                continue
            later = [s for s in steps[index + 1:] if blocked(check, s, kind()) is None]
            weights = weight + sum(s.times[kind()][1] for s in later)
            # the later steps that need this one cannot run without it: their share is this one's to use if it must
            # (a step of no weight, as the device's, takes its estimate only)
            own = weight + sum(s.times[kind()][1] for s in later if step.name in s.needs) if weight else 0.0
            share = check.left_s() * own / weights if weights else 0.0
            given_s = min(check.left_s(), max(estimate_s, share))
            check.record(step.name, guard(check, step, given_s, inject == step.name))
    finally:
        signal.signal(signal.SIGTERM, previous)
        check.results["finished"] = True
        check.write()


def blocked(check: Check, step: Step, kind: str) -> str | None:
    """Why ``step`` cannot run (a needed step that ended otherwise than ``ok``, no time entry for this kind of
    device, its own reason), or None; a needed step that has not run yet does not block (it may still end ok)."""
    for name in step.needs:
        if check.status(name) not in (None, "ok"):
            return f"needs the {name} step, which ended {check.status(name)}"
    if kind not in step.times:
        return f"not for the {kind}"
    return step.unavailable()


def guard(check: Check, step: Step, given_s: float, inject: bool = False) -> dict[str, Any]:
    """Run one step under its time limit; its record, whatever happens (never raises but for SystemExit)."""
    started = check.clock()
    partial: dict[str, Any] = {}
    entry: dict[str, Any] = {"given_s": round(given_s, 1), "started_at_s": round(started - check.started, 1)}
    try:
        with time_limit(given_s) as limit:
            if inject:
                raise InjectedError(f"injected by --inject-error {step.name} (a rehearsal of a failing step)")
            result = step.body(given_s, partial)
            limit["active"] = False
        entry.update(status="ok", result=result)
    except OutOfTime as why:
        entry.update(status="stopped", reason=str(why))
        if why.stops_the_check:
            check.stop_reason = str(why)
    except Exception as error:  # noqa: BLE001 - the guard's purpose: any failure is this step's result
        entry.update(status="error", error=error_line(error),
                     traceback="".join(traceback.format_exception(error)).splitlines()[-TRACEBACK_LINES:])
    entry["wall_s"] = round(check.clock() - started, 1)
    if partial and entry["status"] != "ok":
        entry["partial"] = partial
    return entry


def error_line(error: BaseException) -> str:
    """``Type: first line of the message`` (at most 300 characters)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


_active: list[dict[str, bool]] = []


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[dict[str, bool]]:
    """Raise :class:`OutOfTime` in the main thread after ``seconds``, unless ``limit["active"]`` is cleared first
    (the body has returned: its result stands)."""
    limit = {"active": True}

    def expire(signum: int, frame: Any) -> None:
        if limit["active"]:
            raise OutOfTime(f"ran past the {seconds:.0f} s it was given")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    _active.append(limit)
    try:
        yield limit
    except KeyboardInterrupt:
        raise OutOfTime("interrupted (Ctrl-C)", stops_the_check=True) from None
    finally:
        _active.remove(limit)
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_terminated: list[str] = []


def _terminate(signum: int, frame: Any) -> None:
    """SIGTERM: stop the step in progress (if one is) and skip the rest; the results are written on the way out."""
    _terminated.append("SIGTERM: the check's outer time limit")
    if _active and _active[-1]["active"]:
        raise OutOfTime(_terminated[-1], stops_the_check=True)


# ----------------------------------------------------------------------------------------------- summary

def line_of(entry: dict[str, Any]) -> str:
    """A step's one line: its summary, error, or the reason it was skipped or stopped."""
    if entry["status"] == "ok":
        return str(entry.get("result", {}).get("summary", "done"))
    if entry["status"] == "error":
        return entry["error"]
    return entry.get("reason", "")


def summary(results: dict[str, Any]) -> str:
    """GPU_CHECK.md: one section per step, then the notes (data, Triton's cache) and the time used."""
    setup = f" after gpu_check.sh's setup of {results['setup_s']:.0f} s" if results.get("setup_s") is not None else ""
    lines = ["# GPU check", "", f"Command: `{results['command']}`  ", f"Started {results['started_utc']}{setup}, "
             f"budget {results['budget_s']:.0f} s, elapsed {results.get('elapsed_s', 0):.0f} s"
             f"{'' if results.get('finished') else ' (still running)'}.", ""]
    for name, entry in results["steps"].items():
        timing = f", {entry['wall_s']:.1f} s of {entry['given_s']:.0f} s given" if "wall_s" in entry else ""
        lines.append(f"- **{name}** ({entry['status']}{timing}): {line_of(entry)}")
        if entry["status"] == "error":
            lines += ["", "  ```", *(f"  {line}" for line in entry["traceback"]), "  ```", ""]
        if "partial" in entry:
            lines.append(f"  - kept: {json.dumps(entry['partial'], default=str)[:1500]}")
    for name, note in results.get("notes", {}).items():
        lines.append(f"- {name}: {note}")
    return "\n".join(lines) + "\n"
