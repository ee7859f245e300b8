"""The step creep: how much more a long training run peaks than a trial of a few steps, measured once.

A trial measures two steps; a training run takes thousands, and a process's peak can rise with the number of
steps as its allocator's pools fragment, before it levels off. The caching allocator of a GPU can creep so; on
the host glibc's heap did: with the workers' earlier 4 MiB mmap threshold the activations below it stayed on the
heap, and over 1,000 steps at the four benchmark specs' safe sizes the peak rose 1.3-6.9 % above the second
step's (``bench/results/creep/STUDY.md``). The workers now map every block of 256 KiB or more for itself
(:data:`vramcal.environment.HOST_MALLOC`), and the creep is 0.04-0.25 % over 300-500 steps, all of it in the first
few steps but for single rises of at most 0.08 % (``bench/results/creep-256k/STUDY.md``). Whatever remains is
measured: once the limits are verified, the search runs one **steady trial** at the conservative size, the one a
run takes by default (search rule 6). After its first ``measured_steps`` steps it runs an **epoch's end**
(:func:`epoch_end_due`): one step at a partial batch and validation passes at the full and the partial size, as a
run's epoch ends; then it measures until its peak has not risen for ``plateau_steps`` steps (:func:`plateau_step`,
:func:`steady_done`), at most ``steady_steps`` steps in all, keeping its curve (``Trial.step_peaks``,
``Trial.epoch_end_step``). The epoch's end is there because the first full step after one peaks higher than any
step before it: on the host's small spec +1.5 to +2.4 MiB in a trial's process and +2.3 MiB in the trainer's
(0.2-0.3 %, ``bench/results/epoch-end/STUDY.md``; the shapes of a partial batch are new to the allocator's pools),
which 1,000 training steps met (+0.5 % above the prediction, above its upper bound) and a steady trial of full
steps never did. A curve that had not levelled off by the end is reported (:attr:`Creep.levelled`), and the
trainer says so while it runs if its peak passes the prediction. For the late single rises, on the host the
steady trial's peak gets an allowance of :data:`HOST_LATE_CREEP` (``Trial.late_creep_bytes``). Every other trial's
peak is read as the peak a long run at its size would reach:

    creep_per_sample = (max(0, steady peak − mean peak of the short trials at that batch size)
                        + the steady trial's late allowance) / batch_size
    steady-equivalent peak(b) = peak(b) + creep_per_sample × b × (seq_len / steady trial's seq_len)

Where two steady trials ran, the larger ``creep_per_sample`` counts (:func:`measure_creep`): the limits never
rise on a second measurement that found less.

The creep is taken as proportional to the activations (batch_size, and tokens over several lengths):
a batch of zero samples has none. The fit, the limits and the verifications are computed from these
steady-equivalent peaks (so the profile's predictions are the long run's), while the trials keep their
raw figures in the profile; the predicted out-of-memory boundary stays a trial's (it is compared with
bisection by the same trials). A steady trial that runs out of memory is a failure at its size: the
limits come down below it, and one more steady trial is allowed at the new conservative size.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from vramcal.records import Trial, TrialSettings

STEADY = "steady"  # the purpose of a steady trial
CreepRule = Literal["largest", "last"]  # which steady trial's creep counts where two ran (measure_creep)
PLATEAU_TOLERANCE = 0.001  # a step's peak must pass the level by more than 0.1 % to count as a rise
# The host's creep after a steady trial, as a share of its peak: with the workers' 256 KiB mmap threshold, single
# rises of 0.05 % (small, step 189 of 500) and 0.08 % (wide, step 251 of 300) after the curves had levelled off,
# none on the long and default specs (bench/results/creep-256k/STUDY.md); 0.5 % covers them with room for what
# 1,000 steps may add. (With the earlier 4 MiB threshold it was 0.2-2.8 % and the allowance 1.5 %.) GPUs: not
# measured, no allowance (0).
HOST_LATE_CREEP = 0.005


def plateau_step(peaks: Sequence[int], plateau_steps: int, tolerance: float = PLATEAU_TOLERANCE) -> int | None:
    """The measured step (1-based) of the last rise of ``peaks`` (a peak so far after each step) when none
    followed it for ``plateau_steps`` steps; None while the curve is still rising (or ``plateau_steps`` is
    0, or there are fewer steps). A rise is a peak more than ``tolerance`` above the level of the last rise
    (the first step sets the level)."""
    if plateau_steps <= 0 or len(peaks) < plateau_steps + 1:
        return None
    last, level = 1, peaks[0]
    for step, peak in enumerate(peaks[1:], start=2):
        if peak > level * (1 + tolerance):
            last, level = step, peak
    return last if len(peaks) - last >= plateau_steps else None


def partial_batch_size(batch_size: int) -> int:
    """The batch size of the steady trial's epoch's end (:func:`epoch_end_due`): half the batch, rounded up, standing
    for an epoch's last, partial batch (and the validation set's last chunk) of any size below the full one."""
    return (batch_size + 1) // 2


def epoch_end_due(peaks: Sequence[int], settings: TrialSettings) -> bool:
    """Whether the steady trial runs its epoch's end after the last of ``peaks`` (its curve so far): after its first
    ``measured_steps`` steps, where a short trial ends (a steady trial that verifies its size has read the short
    trial's figures there), so that the plateau rule after it sees the early creep and what the epoch's end did
    together. (Run after the curve had levelled off instead, it measured the same rise or less and cost 4-6 more
    steps: ``bench/results/epoch-end/STUDY.md``.) Never without a plateau rule (``plateau_steps`` 0: the trial
    runs every step, a bare curve)."""
    return settings.plateau_steps > 0 and len(peaks) >= settings.measured_steps


def steady_done(peaks: Sequence[int], settings: TrialSettings, epoch_end_step: int | None) -> bool:
    """Whether the steady trial may stop after the last of ``peaks``: its epoch's end has run (after measured step
    ``epoch_end_step``), at least ``plateau_steps`` steps followed it, and the curve has levelled off again."""
    return (epoch_end_step is not None and len(peaks) - epoch_end_step >= settings.plateau_steps
            and plateau_step(peaks, settings.plateau_steps) is not None)


@dataclass(frozen=True)
class Creep:
    """The measured step creep (module docstring). Bytes are integers.

    Attributes:
        batch_size: where the steady trial ran (samples).
        seq_len: its sequence length in a calibration over several lengths (None: the model's one).
        steady_peak_bytes: the steady trial's peak.
        short_peak_bytes: the mean peak of the short trials at that batch size.
        per_sample_bytes: ``max(0, steady − short) / batch_size``.
        steps: the steady trial's measured steps (None: a profile made before its curve was recorded).
        levelled_at: the step of the curve's last rise, where it levelled off (:func:`plateau_step`), or
            None: still rising when the trial ended (or no curve recorded).
        late_rise_bytes: how much the peak rose over the curve's last ``plateau_steps`` steps (the rise still
            going on; 0 when it levelled off).
        epoch_end_step: the measured step after which the trial ran its epoch's end (None: it ran none).
        epoch_end_rise_bytes: how much the peak rose from that step to the trial's end (0 without one).
        late_bytes: the allowance for the creep after the steady trial (``Trial.late_creep_bytes``), in
            ``per_sample_bytes``.
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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def measure_creep(trials: Sequence[Trial], plateau_steps: int = TrialSettings.plateau_steps,
                  rule: CreepRule = "largest") -> Creep | None:
    """The creep of the finished steady trials, each against the short trials at its size; None without one.

    Args:
        plateau_steps: the steps without a rise that count as levelled off (the trials' setting).
        rule: which steady trial's creep counts where two ran: ``largest``, the largest per sample (the
            calibration's: with the workers' earlier 4 MiB mmap threshold the creep differed across it, and a
            second steady trial on the other side of it could measure less per sample than the first did at a
            size the limits still cover: small spec at 1.5 GiB, steady at 135 then 118, the second's creep raised the
            safe size back to 150, where the first's said it did not fit); ``last``, profiles made before.
    """
    creeps = [creep for trial in trials if trial.purpose == STEADY and trial.ok
              if (creep := _creep_of(trial, trials, plateau_steps)) is not None]
    if not creeps:
        return None
    return creeps[-1] if rule == "last" else max(reversed(creeps), key=lambda creep: creep.per_sample_bytes)


def _creep_of(steady: Trial, trials: Sequence[Trial], plateau_steps: int) -> Creep | None:
    """The creep ``steady`` measured against the mean peak of the short trials at its size (None: there is none)."""
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
    """The trials as the search and the fit read them: finished short trials with the creep added to
    their peaks (``rule``: :func:`measure_creep`'s), failed ones as they are, finished steady trials left
    out (their figure is the creep), failed steady trials kept (a failure at that size). Idempotent."""
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
