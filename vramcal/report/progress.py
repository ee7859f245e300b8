"""Progress for people while a calibration runs: a line per finished trial and the steady trial's steps, above a
bar (probe) or as plain ``vramcal:`` lines (:func:`vramcal.calibrate`). Without a terminal, no bar: a line at most
once a minute (:class:`Heartbeat`, also used by :mod:`vramcal.train.loop`)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from tqdm import tqdm

from vramcal.records import Trial
from vramcal.report.markdown import trial_reason
from vramcal.units import format_bytes

LOG_EVERY_S = 60.0  # seconds between progress lines where no bar is drawn (Heartbeat)


class Heartbeat:
    """When a progress line is due without a terminal: at most one every ``every_s`` seconds (default
    :data:`LOG_EVERY_S`), the first ``every_s`` after it was made; ``clock``: monotonic seconds."""

    def __init__(self, every_s: float | None = None, clock: Callable[[], float] | None = None) -> None:
        self.every_s, self._clock = LOG_EVERY_S if every_s is None else every_s, clock or time.monotonic
        self._last = self._clock()

    def due(self) -> bool:
        """Whether a line is due now; if so, the next one is due ``every_s`` from now."""
        if self._clock() - self._last < self.every_s:
            return False
        self.mark()
        return True

    def mark(self) -> None:
        """A line was written now (another's: a trial's): the next is due ``every_s`` from now."""
        self._last = self._clock()


class TrialPrinter:
    """One line per finished trial (:func:`trial_line`), and the steady trial's steps (:meth:`step`).

    Args:
        max_trials: the bar's total. usable_bytes: a finished trial above it is ``over``.
        file: where the lines go (the bar goes to stderr).
        level: -1 nothing, 0 the trial lines, 1 each step as a line too (``vramcal -q`` / ``-v``).
        bar: draw a tqdm bar; without one (or a terminal), a step is a line when a :class:`Heartbeat` is due.
        prefix: put before every line (``"vramcal:"`` for a library's output).
    """

    def __init__(self, max_trials: int, usable_bytes: int, *, file: TextIO | None = None, level: int = 0,
                 bar: bool = True, prefix: str = "") -> None:
        self._usable_bytes, self._file, self._level = usable_bytes, file or sys.stderr, level
        self._prefix, self._beat = prefix, Heartbeat()
        self._bar = tqdm(total=max_trials, desc="trials", unit="trial", leave=False, file=sys.stderr,
                         disable=True if level < 0 or not bar else None)

    def __call__(self, trial: Trial) -> None:
        if self._level >= 0:
            speed = f"{trial.step_s:.3f} s/step, {trial.samples_per_s:.1f} samples/s  " if trial.step_s else ""
            self._write(trial_line(trial, self._usable_bytes, f"{speed}[{trial.purpose}, {trial.wall_s or 0:.1f} s]"))
        self._bar.set_postfix_str("")
        self._bar.update(1)

    def step(self, payload: dict[str, Any]) -> None:
        """A steady trial's step (``TrialRunner``'s ``on_step``: ``step``, ``of``, ``peak_bytes``, ``step_s``)."""
        text = (f"steady trial step {payload['step']} (of at most {payload['of']}: it stops once the peak is level), "
                f"peak {format_bytes(payload['peak_bytes'])}, {payload['step_s']:.2f} s/step")
        self._bar.set_postfix_str(text)
        if self._level > 0 or (self._level == 0 and self._bar.disable and self._beat.due()):
            self._write(f"    {text}")

    def note(self, text: str) -> None:
        """A line about the calibration as a whole (the device chosen, where the profile went)."""
        self._write(f" {text}" if self._prefix else text)

    def close(self) -> None:
        self._bar.close()

    def _write(self, line: str) -> None:
        self._beat.mark()
        self._bar.write(f"{self._prefix}{line}", file=self._file)
        self._file.flush()


def trial_line(trial: Trial, usable_bytes: int, middle: str) -> str:
    """One trial for people: length, batch size, status, peak, ``middle``, and why an unfinished one ended."""
    peak = format_bytes(trial.peak_bytes) if trial.peak_bytes is not None else "-"
    length = f"seq_len {trial.seq_len:>5}  " if trial.seq_len is not None else ""
    reason = trial_reason(trial)
    return (f"  {length}batch_size {trial.batch_size:>6}  {trial_status(trial, usable_bytes):<7}  peak {peak:>10}  "
            f"{middle}" + (f"  {reason}" if reason else ""))


def trial_status(trial: Trial, usable_bytes: int) -> str:
    """``over`` for a trial that finished above usable memory, else its status."""
    return "over" if trial.ok and not trial.fits(usable_bytes) else trial.status
