"""NVML sampling of one GPU (or MIG slice) in a background thread: the NVML half of DESIGN.md's peak_bytes.

Which figure counts as "this process's memory", in order of preference (``source``):

- ``process``: NVML's per-process used memory for this PID (``nvmlDeviceGetComputeRunningProcesses``).
  One NVML call per sample.
- ``device-delta-minus-others``: where NVML lists no figure for this PID (containers: the PID namespace
  hides it), the change of device-wide used memory since the baseline, minus the change of every
  *other* process NVML listed with a figure at the baseline (a process that has gone since counts as
  having freed all it held). Two calls per sample.
- ``device-delta``: the same with no such process to subtract (also where NVML refuses to list
  processes at all, e.g. without permission on a MIG slice: then one call per sample).

The baseline is taken once, before this process initialises CUDA (the caller's promise), after the
device-wide figure has settled: the previous trial's process may still be releasing its memory. So
the CUDA context, the weights and the data are part of every figure. A process that appears after the
baseline is never subtracted: in a container it may be this one under its host PID, so counting it
errs on the safe side (a larger peak).
"""

from __future__ import annotations

import os
import threading
import time
import types
from collections.abc import Callable
from typing import Any

from vramcal.measure.nvml import NvmlError, memory_figures, process_figures

# A training step lasts milliseconds to seconds. The caching allocator's peaks come from torch exactly
# (max_memory_reserved), so NVML only has to catch what torch cannot see (the CUDA context, cuBLAS and
# cuDNN workspaces, lazily loaded kernels), which appears at a step's start and stays. 10 ms sees
# anything that lives that long, several times per step even for millisecond steps, and costs one
# NVML call (tens of microseconds, with the GIL released inside ctypes) per sample: well under 1 % of
# one core, so the training thread is not held up. Trials and the trainer share it.
NVML_SAMPLE_INTERVAL_S = 0.010
BASELINE_SETTLE_S = 3.0  # longest wait for the device-wide figure to stop changing before the baseline
_SETTLE_POLL_S = 0.05
_SETTLE_TOLERANCE_BYTES = 4 * 2**20  # NVML reports in whole pages; a few MiB of jitter is not a release


def settled(read: Callable[[], int], settle_s: float, poll_s: float = _SETTLE_POLL_S,
            tolerance_bytes: int = _SETTLE_TOLERANCE_BYTES, clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], None] = time.sleep) -> int:
    """``read()`` once three readings ``poll_s`` apart agree within ``tolerance_bytes``, else at ``settle_s``.

    Returns the last reading, in bytes.
    """
    deadline, readings = clock() + settle_s, [read()]
    while clock() < deadline:
        sleep(poll_s)
        readings.append(read())
        if len(readings) >= 3 and max(readings[-3:]) - min(readings[-3:]) <= tolerance_bytes:
            break
    return readings[-1]


class NvmlSampler:
    """Samples one GPU's NVML memory in a background thread (see the module doc for the figures).

    Args:
        nvml: the NVML namespace (:func:`vramcal.measure.nvml.load_nvml`).
        handle: the device's NVML handle (a MIG slice's own handle for a slice).
        pid: the process measured (default: this one).
        interval_s: seconds between samples.
        settle_s: longest wait for device-wide used memory to settle before the baseline (0: none).

    Attributes:
        baseline_bytes: device-wide used memory at the baseline.
        process_peak_bytes: peak of the per-process figure, None while NVML never gave one.
        device_delta_peak_bytes: peak of the device-wide change (minus other processes' changes).
        samples: samples taken; ``error``: why the thread stopped early, else None.
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
        """PID -> used bytes; {} from the first refusal on (e.g. no permission on a MIG slice in a container)."""
        if self._lists_processes:
            try:
                return process_figures(self._nvml, self._handle)
            except NvmlError:
                self._lists_processes = False  # the device-wide figure is then the only one: one call a sample
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
