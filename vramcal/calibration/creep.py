"""The step creep: how much more a long training run peaks than a trial of a few steps, measured once.

A trial measures two steps; a training run takes thousands. On the host a worker's peak keeps rising
with the number of steps (malloc's heap fragments as activations of many sizes come and go), and
levels off after a few dozen: on the benchmark's small spec at batch 144, 2 / 10 / 40 measured steps
peaked at 809.0 / 827.4 / 836.5 MiB and 200 training steps at 840.0 MiB (``bench/results``). The
caching allocator of a GPU can creep the same way. So once the safe size is verified, the search runs
one **steady trial** there, ``steady_steps`` measured steps long (search rule 6), and every other
trial's peak is read as the peak a long run at its size would reach:

    creep_per_sample = max(0, steady peak − mean peak of the short trials at that batch size) / batch_size
    steady-equivalent peak(b) = peak(b) + creep_per_sample × b × (seq_len / steady trial's seq_len)

The creep is taken as proportional to the activations (batch_size, and tokens over several lengths):
a batch of zero samples has none. The fit, the limits and the verifications are computed from these
steady-equivalent peaks (so the profile's predictions are the long run's), while the trials keep their
raw figures in the profile; the predicted out-of-memory boundary stays a trial's (it is compared with
bisection by the same trials). A steady trial that runs out of memory is a failure at its size: the
limits come down below it, and one more steady trial is allowed at the new safe size.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from vramcal.records import Trial

STEADY = "steady"  # the purpose of a steady trial


@dataclass(frozen=True)
class Creep:
    """The measured step creep (module docstring). Bytes are integers.

    Attributes:
        batch_size: where the steady trial ran (samples).
        seq_len: its sequence length in a calibration over several lengths (None: the model's one).
        steady_peak_bytes: the steady trial's peak.
        short_peak_bytes: the mean peak of the short trials at that batch size.
        per_sample_bytes: ``max(0, steady − short) / batch_size``.
    """

    batch_size: int
    seq_len: int | None
    steady_peak_bytes: int
    short_peak_bytes: int
    per_sample_bytes: float

    @property
    def bytes_at_steady(self) -> int:
        return round(self.per_sample_bytes * self.batch_size)

    def bytes_at(self, batch_size: int, seq_len: int | None = None) -> int:
        """The creep of a run at ``batch_size`` (and ``seq_len``, scaled per token), bytes."""
        scale = seq_len / self.seq_len if seq_len and self.seq_len else 1.0
        return round(self.per_sample_bytes * batch_size * scale)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def measure_creep(trials: Sequence[Trial]) -> Creep | None:
    """The creep from the last finished steady trial and the short trials at its size; None without one."""
    steady = [t for t in trials if t.purpose == STEADY and t.ok]
    if not steady:
        return None
    last = steady[-1]
    short = [t.peak_bytes for t in trials if t.purpose != STEADY and t.ok and t.batch_size == last.batch_size
             and t.seq_len == last.seq_len]
    if not short:
        return None
    mean = round(statistics.fmean(short))  # type: ignore[arg-type]
    return Creep(last.batch_size, last.seq_len, last.peak_bytes, mean,  # type: ignore[arg-type]
                 max(0, last.peak_bytes - mean) / last.batch_size)  # type: ignore[operator]


def read_peak(trial: Trial, creep: Creep | None) -> int | None:
    """A short trial's peak as the fit reads it: plus the creep at its size (None: it has no peak)."""
    if creep is None or not trial.ok:
        return trial.peak_bytes
    return trial.peak_bytes + creep.bytes_at(trial.batch_size, trial.seq_len)  # type: ignore[operator]


def steady_equivalent(trials: Sequence[Trial]) -> list[Trial]:
    """The trials as the search and the fit read them: finished short trials with the creep added to
    their peaks, failed ones as they are, finished steady trials left out (their figure is the creep),
    failed steady trials kept (a failure at that size). Idempotent."""
    creep = measure_creep(trials)
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
