"""The evaluation limit (issue 41): the largest verified batch of the evaluation pass alone.

Evaluation holds no gradients and no activations saved for a backward pass, so it fits a larger batch than
training; evaluating at the training batch wastes the card, at a guessed larger one it dies (transformers #32215,
Lightning #18985). An **evaluation trial** (:class:`vramcal.measure.trial.TrialRequest` with ``train_batch_size``)
builds the step, makes ``warmup_steps`` real training steps at the training batch (AdamW allocates its state; the
optimizer step frees the gradients, ``zero_grad(set_to_none=True)``, as the trainer leaves them before it
validates; the allocator keeps what training left), resets the meter, then measures evaluation passes alone at
its batch size (:func:`vramcal.workload.validation_step`: eval mode, ``torch.no_grad()``). Its peak is the peak of a
training run's validation, by the trials' definition.

The evaluation limit is the one-length search of :mod:`vramcal.calibration.search` run over evaluation trials, as
it runs over training trials, with its own fit ``eval_peak = overhead + slope × batch_size`` and its own limits
and verification (two trials at the safe size, one at the conservative), starting at the training batch (the
evaluation's peak there is below the training step's) and with no steady trial (the creep is a training
step's). The training batch is the calibration's conservative size: the one a run trains at by default.

Evaluation trials are kept apart from the training trials: their purposes carry :data:`PREFIX` in the
calibration's list (and its journal), and the profile keeps them in its ``evaluation`` record only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from vramcal.calibration.fit import Fit
from vramcal.calibration.limits import Limits
from vramcal.calibration.search import SearchSettings, Step, next_batch_size, settle
from vramcal.records import Trial
from vramcal.schema import AT_LEAST_ONE, POSITIVE, read_list, read_record

PREFIX = "eval:"  # an evaluation trial's purpose in the calibration's list: eval:grow, eval:verify-safe, ...


@dataclass(frozen=True)
class EvalStep(Step):
    """A step of the evaluation search: an evaluation trial at ``batch_size`` after warm-up training steps at
    ``train_batch_size``."""

    train_batch_size: int = 1


def is_evaluation(trial: Trial) -> bool:
    return trial.purpose.startswith(PREFIX)


def evaluation_trials(trials: Sequence[Trial]) -> list[Trial]:
    """The evaluation trials of a calibration's list, with their purposes as the search reads them (no prefix)."""
    return [dataclasses.replace(t, purpose=t.purpose.removeprefix(PREFIX)) for t in trials if is_evaluation(t)]


def search_settings(search: SearchSettings, train_batch_size: int, max_trials: int) -> SearchSettings:
    """The training search's settings for the evaluation search (module docstring): the same budget and limits,
    growth from the training batch, no steady trial, no aim (an estimate's slope is a training step's)."""
    return dataclasses.replace(search, start_batch_size=max(1, train_batch_size), steady_steps=0,
                               steady_verifies=False, aim=None, max_trials=max_trials)


def next_step(trials: Sequence[Trial], search: SearchSettings, train_batch_size: int,
              max_trials: int) -> EvalStep | None:
    """The next evaluation trial, or None when the evaluation limits are verified (or cannot be).

    Args:
        trials: the evaluation trials so far (:func:`evaluation_trials`).
        search: the training search's settings; ``train_batch_size``: the batch its warm-up steps train at.
    """
    step = next_batch_size(trials, search_settings(search, train_batch_size, max_trials))
    if step is None:
        return None
    return EvalStep(step.batch_size, PREFIX + step.purpose, False, train_batch_size)


@dataclass(frozen=True)
class EvalLimits:
    """The evaluation limit of a profile (module docstring).

    Attributes:
        train_batch_size: the training batch of the trials' warm-up steps (the profile's conservative size).
        seq_len: the length the trials ran at (over several lengths, the reference one); None: the model's.
        fit: ``eval_peak = overhead + slope × batch_size`` through the evaluation trials (None: too few).
        limits: safe and conservative evaluation batch sizes (None without a fit).
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

    def to_dict(self) -> dict:
        return {"train_batch_size": self.train_batch_size, "seq_len": self.seq_len,
                "fit": self.fit and self.fit.to_dict(), "limits": self.limits and self.limits.to_dict(),
                "safe_peak_bytes": self.safe_peak_bytes, "conservative_peak_bytes": self.conservative_peak_bytes,
                "trials": [t.to_dict() for t in self.trials]}

    @classmethod
    def from_dict(cls, data: dict, where: str = "evaluation") -> EvalLimits:
        """Raises: SchemaError: a field missing, unknown, of the wrong type or out of range (named)."""
        return read_record(cls, data, where, {"train_batch_size": AT_LEAST_ONE, "seq_len": AT_LEAST_ONE,
                                              "safe_peak_bytes": POSITIVE, "conservative_peak_bytes": POSITIVE},
                           readers={"fit": lambda value, path: None if value is None else Fit.from_dict(value, path),
                                    "limits": lambda value, path: None if value is None else Limits.from_dict(value,
                                                                                                             path),
                                    "trials": lambda value, path: read_list(value, path, Trial.from_dict)})


def settle_evaluation(trials: Sequence[Trial], search: SearchSettings, train_batch_size: int,
                      seq_len: int | None, max_trials: int) -> EvalLimits:
    """The evaluation fit, limits and verification of the evaluation trials (:func:`evaluation_trials`)."""
    state = settle(trials, search_settings(search, train_batch_size, max_trials))
    return EvalLimits(train_batch_size, seq_len, state.fit, state.limits,
                      state.safe_trial and state.safe_trial.peak_bytes,
                      state.conservative_trial and state.conservative_trial.peak_bytes, tuple(trials))
