"""The GPU check's rules (scripts/gpu_check.py), pure functions of recorded trials and times: how much a
calibration may run in the time it is given, the boundary bisection, the epoch cut, and the trial figures the
results keep. Tested without trials (tests/test_gpu_check.py).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.truth import memory_verdict
from vramcal.records import TrialSettings

MIN_TRIALS = 8  # the search needs about 7-12 to grow, fit, reach the boundary and verify (README)
BOUNDARY_TOLERANCE = 0.01  # the bisection ends when the bounds are within 1 % of the lower one


@dataclass(frozen=True)
class Caps:
    """The most a calibration may run, and what a trial is assumed to take.

    Attributes:
        max_trials, steady_steps: at most this many trials, and a steady trial of this many steps.
        trial_timeout_s: at most this long per trial (seconds).
        trial_s: seconds one trial is assumed to take, to turn the time given into a number of trials.
        start_s: seconds assumed for what comes before the first trial runs (the fork server's imports).
        given_s: at most this much time for the step (None: its share).
    """

    max_trials: int
    steady_steps: int
    trial_timeout_s: float
    trial_s: float
    start_s: float = 0.0
    given_s: float | None = None


# On a GPU the steady trial runs half the product's steps (TrialSettings.steady_steps): its 40 steps at the safe
# size measure the host heap's creep, and on a card that size a step may take seconds; 20 fit the check's minutes.
CUDA = Caps(max_trials=16, steady_steps=TrialSettings.steady_steps // 2, trial_timeout_s=180, trial_s=8, start_s=15)
HOST = Caps(max_trials=16, steady_steps=TrialSettings.steady_steps, trial_timeout_s=120, trial_s=3, start_s=10)
FUSED = Caps(max_trials=8, steady_steps=10, trial_timeout_s=120, trial_s=15, given_s=150)
STEADY_SHARE = 1 / 3  # of the time a calibration step has left, what its steady trial may take
STEPS_PER_TRIAL = 4  # a trial is about 4 steps' time: a warm-up, 2 measured steps and the validation pass


def trial_settings(caps: Caps, given_s: float) -> dict[str, Any]:
    """``max_trials``, ``steady_steps`` and ``timeout_s`` (seconds) for a calibration given ``given_s`` seconds.

    The time given, less ``caps.start_s``, holds ``room`` trials of ``caps.trial_s``. Trials come first (they make
    the profile): ``room`` of them, at least :data:`MIN_TRIALS` and at most the cap; what room is left goes to the
    steady trial, :data:`STEPS_PER_TRIAL` steps per trial's time, at most the cap (fewer than 2: none). Each trial
    may take a third of the time given, within [10 s, the cap].
    """
    room = int(max(0.0, given_s - caps.start_s) // caps.trial_s)
    max_trials = max(MIN_TRIALS, min(caps.max_trials, room))
    steady = min(caps.steady_steps, STEPS_PER_TRIAL * max(0, room - max_trials))
    return {"max_trials": max_trials, "steady_steps": steady if steady >= 2 else 0,
            "timeout_s": round(max(10.0, min(caps.trial_timeout_s, given_s / 3)), 1)}


def trial_row(trial: Any, measured_steps: int) -> dict[str, Any]:
    """A trial's figures for the results; ``rest_s``: wall − start − build − measured steps (module docstring)."""
    rest = None
    if None not in (trial.wall_s, trial.startup_s, trial.build_s, trial.step_s):
        rest = round(trial.wall_s - trial.startup_s - trial.build_s - measured_steps * trial.step_s, 2)
    return {"batch_size": trial.batch_size, "status": trial.status, "purpose": trial.purpose,
            "peak_bytes": trial.peak_bytes, "wall_s": trial.wall_s, "startup_s": trial.startup_s,
            "build_s": trial.build_s, "step_s": trial.step_s, "rest_s": rest,
            "error": trial.error.strip().splitlines()[-1][:300] if trial.error and trial.error.strip() else None}


def first_and_later(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first trial's wall time and rest against the later trials' (seconds; module docstring)."""
    if not rows:
        return None
    later = [r for r in rows[1:] if r["wall_s"] is not None]

    def median(key: str) -> float | None:
        values = [r[key] for r in later if r[key] is not None]
        return round(statistics.median(values), 2) if values else None

    return {"first_s": rows[0]["wall_s"], "first_rest_s": rows[0]["rest_s"], "first_batch_size": rows[0]["batch_size"],
            "later_median_s": median("wall_s"), "later_median_rest_s": median("rest_s"), "later": len(later)}


def cache_files(folder: Path) -> dict[str, int]:
    """Files in Triton's cache folder, and of them autotuning results (``*.autotune.json``)."""
    files = [p for p in folder.rglob("*") if p.is_file()] if folder.is_dir() else []
    return {"files": len(files), "autotune_files": sum(p.name.endswith(".autotune.json") for p in files)}


def bisect_boundary(trials: list[Any], total_bytes: int, predicted: float | None, run: Callable[[int], Any],
                    left_s: Callable[[], float], partial: dict[str, Any] | None = None,
                    on_trial: Callable[[Any], None] = lambda trial: None) -> dict[str, Any]:
    """The largest batch size whose real trial fits the whole device, by bisection to :data:`BOUNDARY_TOLERANCE`.

    Starts from the calibration's trials (only memory decides, :func:`bench.truth.memory_verdict`; their errors
    and timeouts are listed as ``ignored``). Above the largest fitting size with nothing over it, it probes 3 %
    past the predicted boundary, then doubles. An ``error`` or ``timeout`` is run once more; twice, and the
    bisection stops at its last real bounds. A trial starts only when ``left_s()`` covers the time the largest
    earlier trial took, scaled by batch size.

    Args:
        trials: the calibration's trials. total_bytes: the device's memory (bytes).
        predicted: the profile's predicted boundary (batch size), or None.
        run: ``run(batch_size) -> Trial``. left_s: ``() -> seconds left``.
        partial: filled with the bisection's trials as they come (kept if the step is stopped).
        on_trial: called with each trial as it ends (progress output).
    """
    verdicts = [(t, memory_verdict(t.status, t.peak_bytes, total_bytes)) for t in trials]
    fitting = [t.batch_size for t, v in verdicts if v == "fits"]
    low = max(fitting, default=0)
    high = min((t.batch_size for t, v in verdicts if v == "over" and t.batch_size > low), default=None)
    timed = [t for t in trials if t.wall_s and t.ok]
    rows = partial.setdefault("trials", []) if partial is not None else []
    stopped, probe = None, max(low + 1, math.ceil(predicted * 1.03)) if predicted else low * 2 or 1

    def estimate_s(size: int) -> float:
        largest = max(timed, key=lambda t: t.batch_size, default=None)
        return largest.wall_s * max(1.0, size / largest.batch_size) if largest else 0.0

    while high is None or high - low > max(1, math.ceil(BOUNDARY_TOLERANCE * low)):
        size = probe if high is None else (low + high) // 2
        if (left := left_s()) < estimate_s(size):
            stopped = f"no time for batch {size} (~{estimate_s(size):.0f} s, {max(left, 0):.0f} s left)"
            break
        for attempt in (1, 2):
            trial = run(size)
            on_trial(trial)
            rows.append({**trial_row(trial, 2), "attempt": attempt})
            verdict = memory_verdict(trial.status, trial.peak_bytes, total_bytes)
            if verdict != "unknown":
                break
        if verdict == "unknown":
            stopped = (f"batch {size} ended in {trial.status} twice ({rows[-1]['error'] or 'no message'}): not a "
                       f"memory outcome, so not the boundary; the bisection stops at its last real bounds")
            break
        if trial.ok:
            timed.append(trial)
        if verdict == "fits":
            low, probe = size, size * 2
        else:
            high = size
    complete = stopped is None
    return {"largest_fitting": low, "smallest_over": high, "predicted": predicted, "complete": complete,
            "stopped_because": stopped, "error_pct": 100 * (predicted - low) / low if predicted and low else None,
            "trials": rows, "ignored": [(t.batch_size, t.status) for t, v in verdicts if v == "unknown"]}


def boundary_line(found: dict[str, Any]) -> str:
    predicted = f"{found['predicted']:.1f}" if found["predicted"] else "none"
    error = f", error {found['error_pct']:+.2f} %" if found["error_pct"] is not None else ""
    state = "complete" if found["complete"] else f"incomplete: {found['stopped_because']}"
    return (f"predicted {predicted}, largest fitting {found['largest_fitting']}, smallest over "
            f"{found['smallest_over']} ({state}){error}, {len(found['trials'])} bisection trials")


def steady_steps_that_fit(trials: list[Any], batch_size: int, left_s: float, most: int) -> tuple[int, str | None]:
    """Measured steps of a steady trial at ``batch_size`` that fit :data:`STEADY_SHARE` of ``left_s`` (seconds; the
    rest is the later steps'), and why none when none do.

    Per step: 1.2 x the slowest step time of the finished trials at that size; before the steps: the trials'
    median start-and-build time and two steps' time (the warm-up and the validation pass). At most ``most``;
    fewer than 2: none.
    """
    if most < 2:
        return 0, "no time for it in the time given (trial_settings)"
    at_size = [t for t in trials if t.ok and t.step_s and t.batch_size == batch_size]
    timed = [t for t in trials if t.ok and t.startup_s is not None and t.build_s is not None]
    if not at_size or not timed:
        return 0, f"no finished trial at batch {batch_size} to time it by"
    step_s = 1.2 * max(t.step_s for t in at_size)
    before_s = statistics.median(t.startup_s + t.build_s for t in timed) + 2 * step_s
    steps = min(most, int((left_s * STEADY_SHARE - before_s) / step_s))
    if steps < 2:
        return 0, f"{left_s:.0f} s left: not 2 steps of {step_s:.1f} s in a third of it"
    return steps, None


def epoch_cut(trials: list[Any], batch_size: int, train_windows: int, given_s: float) -> int | None:
    """Steps to stop at when the calibration's trials say an epoch would not fit ``given_s`` (None: the epoch fits).

    An epoch's time is estimated as the trials' median start-and-build time plus ``ceil(train_windows /
    batch_size)`` steps at the step time of the trial nearest ``batch_size`` (scaled by batch size), with half
    again for the validation pass and the checkpoint.
    """
    timed = [t for t in trials if t.ok and t.step_s and t.startup_s is not None and t.build_s is not None]
    if not timed:
        return None
    nearest = min(timed, key=lambda t: abs(t.batch_size - batch_size))
    step_s = 1.5 * nearest.step_s * max(1.0, batch_size / nearest.batch_size)
    overhead_s = statistics.median(t.startup_s + t.build_s for t in timed)  # not the first's: it starts the server
    steps = math.ceil(train_windows / batch_size)
    if overhead_s + steps * step_s <= given_s:
        return None
    return max(1, int((given_s - overhead_s) / step_s) - 1)
