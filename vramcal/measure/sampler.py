"""NVML sampling of one GPU (or MIG slice) in a background thread: the NVML half of DESIGN.md's peak_bytes.

This process's memory (``source``), by preference: ``process``, NVML's per-process figure for this PID;
``device-delta-minus-others`` where NVML lists none for it (a container's PID namespace), the device-wide change
since the baseline minus the change of each other process listed at the baseline; ``device-delta`` with no such
process (or where NVML refuses to list them). The baseline is taken once, before this process starts CUDA, after
the device-wide figure settles; a process appearing later is never subtracted (it may be this one: errs high).
"""

from __future__ import annotations

import os
import threading
import time
import types
from collections.abc import Callable
from typing import Any

from vramcal.measure.nvml import NvmlError, memory_figures, process_figures

# NVML need only catch what torch's peaks cannot see (context, workspaces, kernels), which stays once it appears:
# 10 ms sees it several times a step at one NVML call (tens of microseconds) a sample.
NVML_SAMPLE_INTERVAL_S = 0.010
BASELINE_SETTLE_S = 3.0  # longest wait for the device-wide figure to stop changing before the baseline
_SETTLE_POLL_S = 0.05
_SETTLE_TOLERANCE_BYTES = 4 * 2**20  # NVML reports in whole pages; a few MiB of jitter is not a release


def settled(read: Callable[[], int], settle_s: float, poll_s: float = _SETTLE_POLL_S,
            tolerance_bytes: int = _SETTLE_TOLERANCE_BYTES, clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], None] = time.sleep) -> int:
    """``read()`` (bytes) once three readings ``poll_s`` apart agree within ``tolerance_bytes``, else at
    ``settle_s``."""
    deadline, readings = clock() + settle_s, [read()]
    while clock() < deadline:
        sleep(poll_s)
        readings.append(read())
        if len(readings) >= 3 and max(readings[-3:]) - min(readings[-3:]) <= tolerance_bytes:
            break
    return readings[-1]


class NvmlSampler:
    """Samples one GPU's NVML memory in a background thread (module docstring).

    Args:
        nvml: the NVML namespace (:func:`vramcal.measure.nvml.load_nvml`); handle: the device's (a slice's own).
        pid: the process measured (default: this one). interval_s: seconds between samples.
        settle_s: longest wait for device-wide used memory to settle before the baseline (0: none).

    Attributes (bytes): ``baseline_bytes`` (device-wide used at the baseline), ``process_peak_bytes`` (None while
    NVML gave no per-process figure), ``device_delta_peak_bytes``; ``samples``; ``error``: why the thread stopped.
    """

    def __init__(self, nvml: types.ModuleType, handle: Any, pid: int | None = None,
                 interval_s: float = NVML_SAMPLE_INTERVAL_S, settle_s: float = 0.0) -> None:
        self._nvml, self._handle, self._pid = nvml, handle, pid or os.getpid()
        self._interval_s = interval_s
        self._lists_processes = True
        self.baseline_bytes = settled(self.device_used_bytes, settle_s) if settle_s > 0 else self.device_used_bytes()
        self._others_baseline = {pid: used for pid, used in self._processes().items()
                                 if pid != self._pid and used is not None}
        self.process_peak_bytes: int | None = None
        self.device_delta_peak_bytes = 0
        self.samples = 0
        self.error: str | None = None
        self._lock = threading.Lock()  # a sample and a reset never interleave (the thread and the caller)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vramcal-nvml", daemon=True)

    @property
    def source(self) -> str:
        """Which figure :meth:`peak_bytes` is: ``process``, ``device-delta-minus-others`` or ``device-delta``."""
        if self.process_peak_bytes is not None:
            return "process"
        return "device-delta-minus-others" if self._others_baseline else "device-delta"

    def _processes(self) -> dict[int, int | None]:
        """PID -> used bytes; {} from the first refusal on (no permission on a MIG slice in a container)."""
        if self._lists_processes:
            try:
                return process_figures(self._nvml, self._handle)
            except NvmlError:
                self._lists_processes = False
        return {}

    def device_used_bytes(self) -> int:
        """Device-wide (or MIG-slice-wide) used memory now, bytes."""
        return memory_figures(self._nvml, self._handle).used_bytes

    def _device_delta(self, processes: dict[int, int | None]) -> int:
        others_change = sum((processes.get(pid) or 0) - used for pid, used in self._others_baseline.items())
        return self.device_used_bytes() - self.baseline_bytes - others_change

    def current_bytes(self) -> int:
        """This process's GPU memory now, bytes: the per-process figure, else the device-wide change."""
        processes = self._processes()
        mine = processes.get(self._pid)
        return mine if mine is not None else self._device_delta(processes)

    def sample(self) -> None:
        """One sample: one NVML call where NVML lists this PID with a figure, else two."""
        with self._lock:
            processes = self._processes()
            mine = processes.get(self._pid)
            if mine is not None:
                self.process_peak_bytes = max(self.process_peak_bytes or 0, mine)
            else:
                self.device_delta_peak_bytes = max(self.device_delta_peak_bytes, self._device_delta(processes))
            self.samples += 1

    def checked_sample(self) -> str | None:
        """:meth:`sample` unless NVML failed before; a failure is kept in ``error``, which is returned."""
        if self.error is None:
            try:
                self.sample()
            except NvmlError as error:
                self.error = str(error)
        return self.error

    def reset_peaks(self) -> None:
        """Forget the peaks (not the baseline): the next samples start the measured span."""
        with self._lock:
            self.process_peak_bytes = None
            self.device_delta_peak_bytes = 0

    def peak_bytes(self) -> int:
        """The NVML figure for this process: per-process peak, else the device-wide peak change."""
        return self.process_peak_bytes if self.process_peak_bytes is not None else self.device_delta_peak_bytes

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except NvmlError as error:
                self.error = str(error)
                return
            self._stop.wait(self._interval_s)

    def start(self) -> NvmlSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and take a last sample."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.error is None:
            self.sample()

    def __enter__(self) -> NvmlSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
