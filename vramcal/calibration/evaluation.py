"""The evaluation limit: the largest verified batch of the evaluation pass alone (no gradients, no saved
activations: it fits more than training; transformers #32215, Lightning #18985).

An **evaluation trial** (:class:`vramcal.measure.trial.TrialRequest` with ``train_batch_size``) trains
``warmup_steps`` steps at the training batch (the conservative size), resets the meter and measures evaluation
passes alone (:func:`vramcal.workload.validation_step`). The limit is the one-length search of
:mod:`vramcal.calibration.search` over these trials, with its own fit ``eval_peak = overhead + slope ×
batch_size``, from the training batch up, with no steady trial. Their purposes carry :data:`PREFIX`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from vramcal.calibration.fit import Fit
from vramcal.calibration.limits import Limits
from vramcal.calibration.search import SearchSettings, Step, next_batch_size, settle
from vramcal.records import Trial
from vramcal.schema import AT_LEAST_ONE, POSITIVE, Record, read_list

PREFIX = "eval:"  # an evaluation trial's purpose in the calibration's list: eval:grow, eval:verify-safe, ...


@dataclass(frozen=True)
class EvalStep(Step):
    """An evaluation trial at ``batch_size`` after warm-up training steps at ``train_batch_size``."""

    train_batch_size: int = 1


def is_evaluation(trial: Trial) -> bool:
    return trial.purpose.startswith(PREFIX)


def evaluation_trials(trials: Sequence[Trial]) -> list[Trial]:
    """The evaluation trials of a calibration's list, with their purposes as the search reads them (no prefix)."""
    return [dataclasses.replace(t, purpose=t.purpose.removeprefix(PREFIX)) for t in trials if is_evaluation(t)]


def search_settings(search: SearchSettings, train_batch_size: int, max_trials: int) -> SearchSettings:
    """The training search's settings, growing from the training batch, with no steady trial and no aim."""
    return dataclasses.replace(search, start_batch_size=max(1, train_batch_size), steady_steps=0,
                               steady_verifies=False, aim=None, max_trials=max_trials)


def next_step(trials: Sequence[Trial], search: SearchSettings, train_batch_size: int,
              max_trials: int) -> EvalStep | None:
    """The next evaluation trial after ``trials`` (:func:`evaluation_trials`), or None when verified (or cannot be)."""
    step = next_batch_size(trials, search_settings(search, train_batch_size, max_trials))
    if step is None:
        return None
    return EvalStep(step.batch_size, PREFIX + step.purpose, False, train_batch_size)


@dataclass(frozen=True)
class EvalLimits(Record):
    """The evaluation limit of a profile (module docstring).

    Attributes:
        train_batch_size: the warm-up steps' batch; seq_len: the trials' length (None: the model's).
        fit, limits: the evaluation fit and limits (None: too few trials).
        safe_peak_bytes, conservative_peak_bytes: the verification trials' peaks (None: not verified).
        trials: the evaluation trials, their purposes without :data:`PREFIX`.
    """

    train_batch_size: int
    seq_len: int | None
    fit: Fit | None
    limits: Limits | None
    safe_peak_bytes: int | None
    conservative_peak_bytes: int | None
    trials: tuple[Trial, ...] = ()

    @property
    def verified(self) -> bool:
        return (self.limits is not None and self.limits.safe_batch_size > 0 and self.safe_peak_bytes is not None
                and self.conservative_peak_bytes is not None)

    WHERE = "evaluation"
    RANGES = {"train_batch_size": AT_LEAST_ONE, "seq_len": AT_LEAST_ONE, "safe_peak_bytes": POSITIVE,
              "conservative_peak_bytes": POSITIVE}
    READERS = {"fit": lambda value, path: None if value is None else Fit.from_dict(value, path),
               "limits": lambda value, path: None if value is None else Limits.from_dict(value, path),
               "trials": lambda value, path: read_list(value, path, Trial.from_dict)}


def settle_evaluation(trials: Sequence[Trial], search: SearchSettings, train_batch_size: int,
                      seq_len: int | None, max_trials: int) -> EvalLimits:
    """The evaluation fit, limits and verification of the evaluation trials (:func:`evaluation_trials`)."""
    state = settle(trials, search_settings(search, train_batch_size, max_trials))
    return EvalLimits(train_batch_size, seq_len, state.fit, state.limits,
                      state.safe_trial and state.safe_trial.peak_bytes,
                      state.conservative_trial and state.conservative_trial.peak_bytes, tuple(trials))
