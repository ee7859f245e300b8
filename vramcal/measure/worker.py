"""Worker processes: trials and training runs, each in a fresh process forked from one preloaded server.

Forked from a ``multiprocessing`` fork server that imported what the caller names (:mod:`vramcal.train.preload`), a
worker starts in milliseconds, inherits no allocator state or CUDA (the server runs with
``PYTORCH_NVML_BASED_CUDA_CHECK=1``; :func:`cuda_started`), and a training run has the make-up of the trials that
sized it. A worker talks over one pipe (:class:`Channel`) and sends one final result; whatever happens inside
(an out-of-memory error, a crash, a hang, a ``kill -9``) becomes an :class:`Outcome`. It ends with its caller.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import multiprocessing
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from vramcal.environment import alive
from vramcal.measure.evidence import exit_status, oom_kill_counter
from vramcal.measure.meters import METERS
from vramcal.measure.nvml import NvmlError, load_nvml
from vramcal.oom import is_out_of_memory
from vramcal.records import Kind

OutcomeStatus = Literal["ok", "oom", "timeout", "error"]
_END_AT_EXIT: list[bool] = []  # one entry once Workers.warm_up has registered _end_server with atexit
Handler = Callable[[str, Any], Any]


@dataclass(frozen=True)
class Outcome:
    """How a worker ended: ``status`` ``ok``, ``oom`` (an out-of-memory error, or a kill with evidence:
    :mod:`vramcal.measure.evidence`), ``timeout`` or ``error``; ``result`` (``ok`` only); the traceback's last lines
    (``error``), the exception's class name and first line (None: it died without one); ``startup_s`` (asking for
    the process to its function running) and ``wall_s`` (the whole run, seen by the caller)."""

    status: OutcomeStatus
    result: Any = None
    error: str | None = None
    error_type: str | None = None
    message: str | None = None
    startup_s: float | None = None
    wall_s: float | None = None


class Channel:
    """The worker's side of the pipe: :meth:`send` a message, or :meth:`ask` and wait for the reply."""

    def __init__(self, connection: Any) -> None:
        self._connection = connection

    def send(self, kind: str, payload: Any = None) -> None:
        self._connection.send(("message", kind, payload))

    def ask(self, kind: str, payload: Any = None) -> Any:
        self._connection.send(("ask", kind, payload))
        return self._connection.recv()

    def reading(self, peak_bytes: int) -> None:
        """Send the meter's peak so far (bytes): the last one is a kill's evidence (:mod:`vramcal.measure.evidence`)."""
        self._connection.send(("reading", int(peak_bytes)))

    def phase(self, text: str) -> None:
        """Say what the worker does now (``building the step``): named if it is killed at its time limit."""
        self._connection.send(("phase", text))


class Workers:
    """Runs functions in fresh worker processes (module docstring).

    The fork server starts with its device kind's environment (the meter's ``worker_environment``,
    :mod:`vramcal.environment`) unless the caller set it; a kind's own settings are in ``os.environ`` only while
    its server starts (:func:`_server_for`); a worker of the other kind restarts the server.

    Args:
        preload: the modules the fork server imports before it forks; only a process's first pool starts it.
    """

    def __init__(self, preload: tuple[str, ...]) -> None:
        # what every kind's workers share is set for good
        shared = METERS[Kind.CUDA].worker_environment().items() & METERS[Kind.HOST].worker_environment().items()
        for name, value in shared:
            os.environ.setdefault(name, value)
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(list(preload))

    def warm_up(self, device_kind: Kind | None = None) -> None:
        """Start the fork server now and return at once, so its imports overlap the caller's work; it takes the
        environment as it is now, and is ended when this process exits (:func:`_end_server`).

        Args:
            device_kind: its workers' kind; None: the one last served, else a GPU where NVML starts, else the host.
        """
        import atexit

        _server_for(device_kind or (_SERVED[0] if _SERVED else _likely_kind()))
        if not _END_AT_EXIT:
            _END_AT_EXIT.append(True)
            atexit.register(_end_server)

    def run(self, function: Callable[..., Any] | str, *args: Any, timeout_s: float | None = None,
            handler: Handler | None = None, usable_bytes: int | None = None,
            device_kind: Kind = Kind.HOST) -> Outcome:
        """Run ``function(*args, channel=Channel)`` in a worker and wait for it.

        Args:
            function: a module-level function (pickled by reference), or ``module:function`` (imported there only).
            timeout_s: kill the worker after this many seconds (None: no limit).
            handler: ``handler(kind, payload)`` for the worker's messages; its return value answers an ask.
            usable_bytes: a kill after a reading at or above it is out-of-memory (:mod:`vramcal.measure.evidence`).
            device_kind: the kind of device the worker measures: its environment, and what a kill means.

        Raises:
            KeyboardInterrupt: the caller was interrupted; the worker is killed first.
        """
        return self.run_all([(function, args)], timeout_s=timeout_s, handler=handler, usable_bytes=usable_bytes,
                            device_kind=device_kind)[0]

    def start(self, function: Callable[..., Any] | str, *args: Any, handler: Handler | None = None,
              usable_bytes: int | None = None, device_kind: Kind = Kind.HOST) -> Job:
        """Start ``function(*args, channel=Channel)`` in a worker and return at once (:class:`Job`)."""
        _server_for(device_kind)
        ours, theirs = self._context.Pipe(duplex=True)
        started = time.time()
        process = self._context.Process(target=_worker_main, args=(theirs, function, args, started, os.getpid()))
        with _main_left_alone():
            process.start()
        theirs.close()
        return Job(process, ours, started, handler, usable_bytes, METERS[device_kind].killed_for_memory)

    def run_all(self, calls: list[tuple[Callable[..., Any] | str, tuple]], *, timeout_s: float | None = None,
                handler: Handler | None = None, grace_s: float = 10.0,
                usable_bytes: int | None = None, device_kind: Kind = Kind.HOST) -> list[Outcome]:
        """Run several workers at once (the ranks of a world) and wait for all of them: when one fails, the others
        get ``grace_s`` seconds to agree on it, then are killed; after ``timeout_s`` all are killed (``timeout``).

        Returns:
            The outcomes in the order of ``calls``; one killed after another's failure is ``error``, naming it.

        Raises:
            KeyboardInterrupt: the caller was interrupted; every worker is killed first.
        """
        jobs = [self.start(function, *args, handler=handler, usable_bytes=usable_bytes, device_kind=device_kind)
                for function, args in calls]
        try:
            _serve(jobs, timeout_s, grace_s)
        finally:
            for job in jobs:
                job.close()
        return [job.outcome for job in jobs]


class Job:
    """A started worker: the caller's end of its pipe; :attr:`outcome` once it has ended."""

    outcome: Outcome | None

    def __init__(self, process: Any, connection: Any, started: float, handler: Handler | None,
                 usable_bytes: int | None = None, killed_for_memory: bool = True) -> None:
        self.process, self.connection, self.started, self.handler = process, connection, started, handler
        self.killed_for_memory = killed_for_memory
        self.outcome: Outcome | None = None
        self.counter_before = oom_kill_counter()  # the kernel's out-of-memory kills so far (evidence.exit_status)
        self.phase: str | None = None  # what the worker last said it does (Channel.phase)
        self.reading_bytes: int | None = None  # the meter's last reading it sent (Channel.reading)
        self.usable_bytes = usable_bytes

    def receive(self) -> None:
        """Serve one message from the worker (its final result ends the job)."""
        try:
            kind, *rest = self.connection.recv()
        except (EOFError, OSError):
            self.end(None)
            return
        if kind == "done":
            self.end(rest[0])
            return
        if kind == "phase":
            self.phase = rest[0]
            return
        if kind == "reading":
            self.reading_bytes = rest[0]
            return
        reply = self.handler(rest[0], rest[1]) if self.handler is not None else None
        if kind == "ask":
            try:
                self.connection.send(reply)
            except OSError:  # it died while its question was answered (BrokenPipeError): its exit status says how
                self.end(None)

    def end(self, final: dict[str, Any] | None, kill: bool = False) -> None:
        """Record how the worker ended (``final`` None: its exit status says how); ``kill`` one still running."""
        if self.outcome is not None:
            return
        if kill or final is None:
            self.process.kill()
        self.process.join()
        final = final or exit_status(self.process.exitcode, self.process.pid, self.counter_before, self.reading_bytes,
                                     self.usable_bytes, self.killed_for_memory)
        self.outcome = Outcome(wall_s=time.time() - self.started, **final)

    def close(self) -> None:
        """Kill the worker if it still runs, and release the pipe."""
        if self.outcome is None:
            stopped = "stopped by its caller"
            self.end({"status": "error", "error": stopped, "message": stopped}, kill=True)
        self.connection.close()


def _serve(jobs: list[Job], timeout_s: float | None, grace_s: float) -> None:
    """Serve every job's messages until all have ended (:meth:`Workers.run_all`); the time limit counts from now."""
    from multiprocessing.connection import wait

    stop_at = None if timeout_s is None else time.time() + timeout_s
    while running := [job for job in jobs if job.outcome is None]:
        left = None if stop_at is None else max(0.0, stop_at - time.time())
        ready = wait([job.connection for job in running], timeout=left)
        for job in running:
            if job.connection in ready:
                job.receive()
        failed = [i for i, job in enumerate(jobs) if job.outcome is not None and job.outcome.status != "ok"]
        if failed and (stop_at is None or stop_at > time.time() + grace_s):
            stop_at = time.time() + grace_s  # the others may agree on the failure; then they are stopped
        if not ready and stop_at is not None and time.time() >= stop_at:
            _stop(running, failed, timeout_s)
            return


def _stop(running: list[Job], failed: list[int], timeout_s: float | None) -> None:
    """End the jobs still running: at the time limit (``timeout``), or after another worker failed."""
    for job in running:
        if failed:
            what = f"stopped after worker {failed[0]} of the world failed"
            job.end({"status": "error", "error": what, "message": what}, kill=True)
        else:
            limit = f"killed after the {timeout_s:.0f} s time limit" + (f", in {job.phase}" if job.phase else "")
            job.end({"status": "timeout", "error": limit, "message": limit}, kill=True)


@contextlib.contextmanager
def _main_left_alone():
    """Start a worker without it re-running the caller's script: multiprocessing imports the parent's ``__main__``
    file in a forkserver child, and workers run only functions named by module, so the file is hidden."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or getattr(getattr(main, "__spec__", None), "name", None) is not None:
        yield  # run as a module (python -m ...): its import by name has no side effects beyond the module's own
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


_SERVED: list[str] = []  # the kind of device whose environment the running fork server started with


def _server_for(device_kind: str) -> None:
    """Make sure the fork server runs with ``device_kind``'s environment, its settings in ``os.environ`` only while
    it starts, ending one of the other kind first (the private ``_forkserver._stop``, CPython 3.8-3.13)."""
    from multiprocessing import forkserver

    if _SERVED and _SERVED[0] != device_kind:
        getattr(forkserver._forkserver, "_stop", lambda: None)()  # type: ignore[attr-defined]
    own = {name: value for name, value in METERS[device_kind].worker_environment().items() if name not in os.environ}
    os.environ.update(own)
    try:
        with _main_left_alone():
            forkserver.ensure_running()
    finally:
        for name in own:
            os.environ.pop(name, None)
    _SERVED[:] = [device_kind]


def _likely_kind() -> str:
    """A server's likely kind before the device is chosen: a GPU where NVML starts, else the host."""
    try:
        load_nvml()
    except NvmlError:
        return "host"
    return "cuda"


def _end_server() -> None:
    """End this process's fork server at exit, so an early-stopping command leaves nothing busy (the private
    ``_forkserver._forkserver_pid``, CPython 3.8-3.13; without it the server ends after its imports)."""
    import signal
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def _worker_main(connection: Any, function: Callable[..., Any], args: tuple, started: float,
                 caller_pid: int) -> None:
    """Entry point of a worker process: run, then send one final result (caller gone: exit 1 quietly)."""
    startup_s = time.time() - started
    threading.Thread(target=_exit_with_caller, args=(caller_pid,), daemon=True, name="vramcal-caller").start()
    try:
        started_cuda = cuda_started()
        if started_cuda:
            raise RuntimeError(f"this worker inherited CUDA from its fork server ({started_cuda}): a forked process "
                               f"cannot use it; something imported by the server started CUDA (a module that calls "
                               f"torch.cuda at import?): keep CUDA calls out of module level")
        if isinstance(function, str):
            module, _, name = function.partition(":")
            function = getattr(importlib.import_module(module), name)
        final = {"status": "ok", "result": function(*args, channel=Channel(connection))}
    except BaseException as error:  # noqa: BLE001 - everything becomes a recorded status
        final = failure(error)
    final["startup_s"] = startup_s
    try:
        connection.send(("done", final))
        connection.close()
    except OSError:  # the caller is gone: no one to tell
        os._exit(1)


def cuda_started() -> str | None:
    """Why this process holds torch's CUDA state already (here, or a parent's: torch's "bad fork"), or None: CUDA
    cannot be used after a fork."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if getattr(torch.cuda, "_is_in_bad_fork", lambda: False)():
        return "its parent initialised CUDA before forking it"
    if torch.cuda.is_initialized():
        return "torch.cuda is initialised"
    return None


def failure(error: BaseException) -> dict[str, Any]:
    """The final result of a worker that raised: ``oom`` or ``error``, the traceback's last lines, the exception's
    class name and first line (at most 4,000 characters). The frames (the step's tensors) are cleared first."""

    status = "oom" if is_out_of_memory(error) else "error"
    message = (str(error).strip().splitlines() or [type(error).__name__])[0][:4000]
    traceback.clear_frames(error.__traceback__)
    gc.collect()
    try:
        tail = "".join(traceback.format_exception(error)[-3:]).strip()[-1500:]
    except MemoryError:
        tail = f"{type(error).__name__} (no memory left to format its traceback)"
    return {"status": status, "error": tail, "error_type": type(error).__name__, "message": message}


def _exit_with_caller(caller_pid: int, interval_s: float = 0.5) -> None:
    """End this worker when its caller is gone (no such process, a zombie, or the fork server, its parent, ended)."""
    server = os.getppid()
    while alive(caller_pid) and os.getppid() == server:
        time.sleep(interval_s)
    os._exit(1)
