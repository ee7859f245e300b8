"""Progress lines where there is no terminal (issue 59 items 6 and 7): at most one a minute, whatever the steps.

The policy is :class:`vramcal.report.progress.Heartbeat`, tested here on a fake clock; a training run's lines are tested
on a real run in tests/test_train.py (``test_without_a_terminal_a_run_says_...``).
"""

from __future__ import annotations

import io

from vramcal.report import progress
from vramcal.report.progress import Heartbeat, TrialPrinter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_heartbeat_is_due_once_a_minute_from_its_last_line():
    clock = Clock()
    beat = Heartbeat(clock=clock)
    due = []
    for second in range(0, 200, 5):
        clock.now = 1000.0 + second
        due.append(second) if beat.due() else None
    assert due == [60, 120, 180]
    clock.now += 30
    beat.mark()  # another line was written: the next is a minute after it
    clock.now += 59
    assert not beat.due()
    clock.now += 1
    assert beat.due()


def step(number: int, of: int = 40) -> dict:
    return {"step": number, "of": of, "peak_bytes": 512 * 2**20, "step_s": 4.0}


def test_a_log_gets_no_steady_step_line_from_a_short_steady_trial_and_one_a_minute_from_a_long_one(monkeypatch):
    """A steady trial of 8 steps of 4 s printed ``steady trial step 5/40`` in every calibration log (the trial
    stops long before 40: when the peak is level); without a bar a step is a line only once a minute has passed
    since the last line, and it says that 40 is a most."""
    clock = Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    out = io.StringIO()
    printer = TrialPrinter(10, 2**30, file=out, bar=False)
    for number in range(1, 9):  # 32 s
        clock.now += 4
        printer.step(step(number))
    assert out.getvalue() == ""
    for number in range(9, 40):  # the same trial, 31 more steps: 124 s more
        clock.now += 4
        printer.step(step(number))
    lines = out.getvalue().splitlines()
    assert lines == ["    steady trial step 15 (of at most 40: it stops once the peak is level), peak 512.00 MiB, "
                     "4.00 s/step", "    steady trial step 30 (of at most 40: it stops once the peak is level), "
                     "peak 512.00 MiB, 4.00 s/step"]
