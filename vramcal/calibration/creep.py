"""The step creep: how much more a long run peaks than a trial of a few steps, measured once (search rule 6).

Allocator pools can fragment over thousands of steps (on the host, with the workers' 256 KiB mmap threshold,
0.04-0.25 % over 300-500 steps: ``bench/results/creep-256k/STUDY.md``). Once the limits are verified, one
**steady trial** at the conservative size runs ``measured_steps`` steps, an **epoch's end** (:func:`epoch_end_due`:
the first full step after a partial batch peaks higher, ``bench/results/epoch-end/STUDY.md``), then steps until
its peak has not risen for ``plateau_steps`` (:func:`steady_done`), at most ``steady_steps``. Every other trial's
peak is then read as a long run's (the fit and limits use these; the boundary stays a trial's)::

    creep_per_sample = (max(0, steady peak − mean peak of the short trials at its batch size)
                        + the steady trial's late allowance) / batch_size
    steady-equivalent peak(b) = peak(b) + creep_per_sample × b × (seq_len / steady trial's seq_len)
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from vramcal.records import Kind, Trial, TrialSettings
from vramcal.schema import Record

STEADY = "steady"  # the purpose of a steady trial
CreepRule = Literal["largest", "last"]  # which steady trial's creep counts where two ran (measure_creep)
PLATEAU_TOLERANCE = 0.001  # a step's peak must pass the level by more than 0.1 % to count as a rise
# The host's allowance for rises after a steady trial, a share of its peak: single late rises measured 0.05-0.08 %
# (bench/results/creep-256k/STUDY.md), with room for 1,000 steps. GPUs: not measured, none.
HOST_LATE_CREEP = 0.005
LATE_CREEP = {Kind.HOST: HOST_LATE_CREEP, Kind.CUDA: 0.0}  # each kind's allowance, a share of a steady trial's peak


def plateau_step(peaks: Sequence[int], plateau_steps: int, tolerance: float = PLATEAU_TOLERANCE) -> int | None:
    """The measured step (1-based) of the last rise of ``peaks`` (bytes, the peak so far after each step) when
    ``plateau_steps`` steps followed it without one; else None. A rise: more than ``tolerance`` above the level
    of the last rise (the first step sets it)."""
    if plateau_steps <= 0 or len(peaks) < plateau_steps + 1:
        return None
    last, level = 1, peaks[0]
    for step, peak in enumerate(peaks[1:], start=2):
        if peak > level * (1 + tolerance):
            last, level = step, peak
    return last if len(peaks) - last >= plateau_steps else None


def partial_batch_size(batch_size: int) -> int:
    """The epoch's end's partial batch (:func:`epoch_end_due`): half the batch, rounded up."""
    return (batch_size + 1) // 2


def epoch_end_due(peaks: Sequence[int], settings: TrialSettings) -> bool:
    """Whether the steady trial runs its epoch's end now: after its first ``measured_steps`` steps (cheaper than
    after the plateau, ``bench/results/epoch-end/STUDY.md``); never with ``plateau_steps`` 0 (a bare curve)."""
    return settings.plateau_steps > 0 and len(peaks) >= settings.measured_steps


def steady_done(peaks: Sequence[int], settings: TrialSettings, epoch_end_step: int | None) -> bool:
    """Whether the steady trial may stop: its epoch's end ran, ``plateau_steps`` steps followed, and it levelled."""
    return (epoch_end_step is not None and len(peaks) - epoch_end_step >= settings.plateau_steps
            and plateau_step(peaks, settings.plateau_steps) is not None)


@dataclass(frozen=True)
class Creep(Record):
    """The measured step creep (module docstring's formula). Bytes are integers.

    Attributes:
        batch_size, seq_len: where the steady trial ran (seq_len None: the model's one).
        steady_peak_bytes, short_peak_bytes: its peak; the mean peak of the short trials at its size.
        per_sample_bytes: the module docstring's ``creep_per_sample``.
        steps: its measured steps (None: a profile made before its curve was recorded).
        levelled_at: the step of the curve's last rise (:func:`plateau_step`); None: still rising.
        late_rise_bytes: the rise over the curve's last ``plateau_steps`` steps (0 when it levelled off).
        late_bytes: the allowance (``Trial.late_creep_bytes``), included in ``per_sample_bytes``.
        epoch_end_step, epoch_end_rise_bytes: the step after which its epoch's end ran, the rise from there.
    """

    batch_size: int
    seq_len: int | None
    steady_peak_bytes: int
    short_peak_bytes: int
    per_sample_bytes: float
    steps: int | None = None
    levelled_at: int | None = None
    late_rise_bytes: int = 0
    late_bytes: int = 0
    epoch_end_step: int | None = None
    epoch_end_rise_bytes: int = 0

    @property
    def levelled(self) -> bool:
        """The curve levelled off within the trial (a profile without a curve: taken as it was measured)."""
        return self.steps is None or self.levelled_at is not None

    @property
    def bytes_at_steady(self) -> int:
        return round(self.per_sample_bytes * self.batch_size)

    def bytes_at(self, batch_size: int, seq_len: int | None = None) -> int:
        """The creep of a run at ``batch_size`` (and ``seq_len``, scaled per token), bytes."""
        scale = seq_len / self.seq_len if seq_len and self.seq_len else 1.0
        return round(self.per_sample_bytes * batch_size * scale)


def measure_creep(trials: Sequence[Trial], plateau_steps: int = TrialSettings.plateau_steps,
                  rule: CreepRule = "largest") -> Creep | None:
    """The creep of the finished steady trials, each against the short trials at its size; None without one.

    Args:
        plateau_steps: the steps without a rise that count as levelled off (the trials' setting).
        rule: which counts where two ran: ``largest`` per sample (the limits never rise on a second measurement
            that found less); ``last``, older profiles'.
    """
    creeps = [creep for trial in trials if trial.purpose == STEADY and trial.ok
              if (creep := _creep_of(trial, trials, plateau_steps)) is not None]
    if not creeps:
        return None
    return creeps[-1] if rule == "last" else max(reversed(creeps), key=lambda creep: creep.per_sample_bytes)


def _creep_of(steady: Trial, trials: Sequence[Trial], plateau_steps: int) -> Creep | None:
    """``steady``'s creep against the short trials at its size, or None without one."""
    short = [t.peak_bytes for t in trials if t.purpose != STEADY and t.ok and t.batch_size == steady.batch_size
             and t.seq_len == steady.seq_len]
    if not short:
        return None
    mean = round(statistics.fmean(short))  # type: ignore[arg-type]
    curve = steady.step_peaks or ()
    levelled = plateau_step(curve, plateau_steps) if curve else None
    window = curve[-plateau_steps - 1:] if curve and plateau_steps else ()
    late = 0 if levelled is not None or len(window) < 2 else window[-1] - window[0]
    allowance, end = steady.late_creep_bytes or 0, steady.epoch_end_step
    end_rise = curve[-1] - curve[end - 1] if end and len(curve) >= end else 0
    return Creep(steady.batch_size, steady.seq_len, steady.peak_bytes, mean,  # type: ignore[arg-type]
                 (max(0, steady.peak_bytes - mean) + allowance) / steady.batch_size,  # type: ignore[operator]
                 len(curve) or None, levelled, late, allowance, end, end_rise)


def read_peak(trial: Trial, creep: Creep | None) -> int | None:
    """A short trial's peak as the fit reads it: plus the creep at its size (None: it has no peak)."""
    if creep is None or not trial.ok:
        return trial.peak_bytes
    return trial.peak_bytes + creep.bytes_at(trial.batch_size, trial.seq_len)  # type: ignore[operator]


def steady_equivalent(trials: Sequence[Trial], rule: CreepRule = "largest") -> list[Trial]:
    """The trials as the search and the fit read them: finished short trials plus the creep, failed ones as
    they are, finished steady trials left out (their figure is the creep), failed ones kept. Idempotent."""
    creep = measure_creep(trials, rule=rule)
    out = []
    for trial in trials:
        if trial.purpose == STEADY:
            if not trial.ok:
                out.append(trial)
        else:
            out.append(dataclasses.replace(trial, peak_bytes=read_peak(trial, creep)))
    return out


def short_trials(trials: Sequence[Trial]) -> list[Trial]:
    """The trials of a few measured steps, as measured (no steady trial, no creep)."""
    return [t for t in trials if t.purpose != STEADY]
