"""The calibration loop: the search policy (:mod:`vramcal.calibration`) against real trials, decided in one
:class:`CalibrationPlan` before the first trial, and the profile assembled from the trials (:func:`assemble`, pure).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from vramcal import __version__
from vramcal.calibration import evaluation, lengths, surface
from vramcal.calibration.creep import LATE_CREEP, STEADY
from vramcal.calibration.fit2d import LENGTH_RATIO, wide_gaps
from vramcal.calibration.limits import LimitSettings
from vramcal.calibration.search import Aim, SearchSettings, Step, next_batch_size, settle, unmeasured_ceiling
from vramcal.calibration.search import unmeasured as lost
from vramcal.environment import software_versions
from vramcal.measure.evidence import KILLED
from vramcal.measure.trial import TrialRequest
from vramcal.models.registry import family_of
from vramcal.profile import Profile, Verification, utc_now
from vramcal.records import Device, Trial, TrialSettings, World
from vramcal.service.journal import Journal
from vramcal.units import format_bytes
from vramcal.words import word
from vramcal.workload import ModelRef


class CalibrationError(RuntimeError):
    """A calibration that cannot produce limits (e.g. one sample does not fit); the message says why."""


class JournalError(CalibrationError):
    """The trial journal could not be written (a full disk): the calibration stopped, the trials so far kept."""


class Runner(Protocol):
    """What runs trials: :class:`vramcal.measure.trial.TrialRunner`, or a fake at the hardware boundary."""

    context: dict[str, Any]

    def run(self, request: TrialRequest, purpose: str = "") -> tuple[Trial, ...]:
        """The trial's record; two for a steady trial that verifies (``verify-conservative``, then ``steady``)."""


@dataclass(frozen=True)
class CalibrationPlan:
    """A calibration, fully decided before its first trial.

    Attributes:
        device: where to measure (its ``total_bytes`` is the budget); model: what (the profile's key).
        settings: reserve, margin and conservative fraction; path: where the profile will be written.
        options: factory arguments that do not change the model (the regressor's data file).
        seq_lens: two or more sequence lengths calibrated at once, else ().
        trials: how each trial runs and how many (:class:`~vramcal.records.TrialSettings`).
        world: a DDP world each trial runs in (limits per rank), or None; rank_devices: the ranks' devices
            (one GPU each; () = every rank on ``device``).
        aim: the slope the search's growth aims with (:class:`~vramcal.calibration.search.Aim`), or None.
        notices: lines for people about the plan (why it is not aimed).
        evaluation: also calibrate the evaluation pass (:mod:`vramcal.calibration.evaluation`).
        keep_previous: where the file at ``path`` goes when replaced (:func:`vramcal.files.atomic_write`), or None.
    """

    device: Device
    model: ModelRef
    settings: LimitSettings
    options: dict[str, Any]
    path: Path
    seq_lens: tuple[int, ...] = ()
    trials: TrialSettings = TrialSettings()
    world: World | None = None
    rank_devices: tuple[Device, ...] = ()
    aim: Aim | None = None
    notices: tuple[str, ...] = ()
    evaluation: bool = False
    keep_previous: Path | None = None

    @property
    def usable_bytes(self) -> int:
        return self.settings.usable_bytes(self.device.total_bytes)

    def search(self) -> SearchSettings:
        """The search policy's settings (4 more trials per length beyond the first)."""
        trials = self.trials
        return SearchSettings(total_bytes=self.device.total_bytes, limits=self.settings,
                              max_trials=trials.max_trials + 4 * max(0, len(self.seq_lens) - 1),
                              boundary_fraction=SearchSettings.boundary_fraction if trials.boundary else 0.0,
                              steady_steps=trials.steady_steps,
                              steady_verifies=trials.steady_steps > trials.measured_steps, aim=self.aim)

    def request(self, step: Step, seq_len: int | None = None) -> TrialRequest:
        """The trial of ``step`` (at ``seq_len`` over several lengths; an evaluation trial for an ``EvalStep``)."""
        model = self.model if seq_len is None else self.model.replace(seq_len=seq_len)
        train = step.train_batch_size if isinstance(step, evaluation.EvalStep) else None
        return TrialRequest(model, step.batch_size, self.device, json.dumps(self.options, sort_keys=True),
                            self.trials, steady=step.purpose == STEADY, verifies=step.verifies, world=self.world,
                            rank_devices=self.rank_devices,
                            peak_only=step.purpose.removeprefix(evaluation.PREFIX) == "boundary",
                            train_batch_size=train, usable_bytes=self.usable_bytes)


def run_trials(plan: CalibrationPlan, runner: Runner, on_trial: Callable[[Trial], None] | None = None,
               journal: Journal | None = None) -> Profile:
    """Calibrate as ``plan`` says and return the profile (not yet written).

    Args:
        runner: runs each trial in a fresh worker; on_trial: called with each trial (a replayed one included).
        journal: records each trial and replays an earlier run's (:mod:`vramcal.service.journal`); None: none.

    Raises:
        CalibrationError: the first trial failed; a size was killed from outside twice; the journal cannot be
            written (:class:`JournalError`: what it holds is kept for the next run).
    """
    search, started, trials = plan.search(), time.perf_counter(), []
    while (chosen := _next(trials, search, plan)) is not None:
        seq_len, step = chosen
        purposes = ("verify-conservative", step.purpose) if step.verifies else (step.purpose,)
        found = journal.replay(len(trials), step.batch_size, purposes, seq_len) if journal else None
        if found is None:
            found = [_recorded(plan, trial, seq_len)
                     for trial in runner.run(plan.request(step, seq_len), purpose=step.purpose)]
        trials.extend(found)
        if journal:
            _record(journal, trials, len(found))
        if on_trial:
            for trial in found:
                on_trial(trial)
        _stop_if_killed_twice(trials)
    first = trials[0]
    if not first.fits(search.usable_bytes):
        if journal:
            journal.discard()
        raise CalibrationError(first_trial_failure(first, plan))
    return assemble(plan, trials, runner.context, time.perf_counter() - started)


def _stop_if_killed_twice(trials: list[Trial]) -> None:
    """Raises: CalibrationError: the last trial's size was killed from outside twice with no out-of-memory kill
    counted (:mod:`vramcal.measure.evidence`): no memory limit, and a search below it would verify far too small."""
    size = trials[-1].batch_size
    killed = [t for t in trials if t.batch_size == size and (t.error or "").startswith(f"{KILLED}: ")]
    if len(killed) >= 2:
        how = "; ".join(t.error.splitlines()[0].removeprefix(f"{KILLED}: ").split(", and")[0] for t in killed)
        raise CalibrationError(f"the trial at batch_size {size} was killed from outside twice ({how}), with no "
                               f"out-of-memory kill counted by the kernel: that measures nothing about memory, so "
                               f"the calibration stopped without a profile; its measured trials are kept, and the "
                               f"same command continues from them once nothing kills its workers")


def _recorded(plan: CalibrationPlan, trial: Trial, seq_len: int | None) -> Trial:
    """The trial with its length and a steady trial's allowance (:data:`vramcal.calibration.creep.LATE_CREEP`)."""
    if seq_len is not None:
        trial = dataclasses.replace(trial, seq_len=seq_len)
    if trial.purpose == STEADY and trial.ok:
        share = LATE_CREEP[plan.device.kind]
        trial = dataclasses.replace(trial, late_creep_bytes=round(share * trial.peak_bytes))  # type: ignore[operator]
    return trial


def _record(journal: Journal, trials: list[Trial], new: int) -> None:
    """Raises: JournalError: the journal cannot be written (a full disk): stop rather than lose trials."""
    try:
        journal.record(trials)
    except OSError as error:
        kept = len(trials) - new
        raise JournalError(f"cannot write the trial journal {journal.path} ({error.strerror or error}): the "
                               f"calibration stopped after {len(trials)} trial(s), {kept} of them kept there; free "
                               f"space and run the same command again to continue from them") from None


def _next(trials: list[Trial], search: SearchSettings, plan: CalibrationPlan) -> tuple[int | None, Step] | None:
    """The next (seq_len, step): the search (or the surface's), the token budget's checks, then the evaluation's."""
    core, checks, evaluated = _split(trials)
    if len(plan.seq_lens) > 1:
        chosen = surface.next_trial(core, plan.seq_lens, search)
        found = None if chosen else surface.settle_surface(core, plan.seq_lens, _chunk(plan), search)[0]
        chosen = chosen or (found and lengths.next_check(core, checks, found, search))
    else:
        step = next_batch_size(core, search)
        chosen = None if step is None else (None, step)
    if chosen or not plan.evaluation:
        return chosen or None
    seq_len, train = _evaluation_base(plan, core, search)
    step = evaluation.next_step(evaluated, search, train, plan.trials.max_trials) if train else None
    return None if step is None else (seq_len, step)


def _split(trials: list[Trial]) -> tuple[list[Trial], list[Trial], list[Trial]]:
    """(the search's trials, the token budget's checks, the evaluation trials as their search reads them)."""
    return ([t for t in trials if t.purpose not in lengths.PURPOSES and not evaluation.is_evaluation(t)],
            [t for t in trials if t.purpose in lengths.PURPOSES], evaluation.evaluation_trials(trials))


def _evaluation_base(plan: CalibrationPlan, core: list[Trial], search: SearchSettings) -> tuple[int | None, int]:
    """(the evaluation trials' seq_len, None for the model's; their training batch: the conservative size or 0)."""
    seq_len = surface.reference_length(plan.seq_lens) if len(plan.seq_lens) > 1 else None
    limits = settle(core if seq_len is None else surface.at_length(core, seq_len), search).limits
    return seq_len, limits.conservative_batch_size if limits else 0


def _chunk(plan: CalibrationPlan) -> int:
    return family_of(plan.model).chunk_size(plan.model)


def first_trial_failure(first: Trial, plan: CalibrationPlan) -> str:
    """Why a calibration could not start, in one line with the fix: an ``error``, a ``timeout``, a kill, or one
    sample that does not fit (the only one about memory)."""
    title, size = family_of(plan.model).title(plan.model), first.batch_size
    header = (first.error or "").strip().splitlines()[:1] or ["no error text recorded"]
    if first.status == "error" and header[0].startswith(f"{KILLED}: "):
        return (f"the first trial of {title} (batch_size {size}) was {header[0].removeprefix(f'{KILLED}: ')}: run "
                f"the same command again once nothing kills its workers")
    if first.status == "error":
        kind, _, message = header[0].partition(": ")
        what = message if kind == "WorkloadError" else header[0]  # vramcal's own message names the factory
        return (f"the training step of {title} failed in the first trial (batch_size {size}), before any memory "
                f"limit: {what[:300]}: fix the step (call the factory and one step by hand to see the traceback)")
    if first.status == "timeout":
        return (f"the first trial of {title} (batch_size {size}) timed out: it was killed after the "
                f"{plan.trials.timeout_s:g} s time limit, before any memory figure (building the model and "
                f"{plan.trials.warmup_steps + plan.trials.measured_steps} steps at batch_size {size} take longer, "
                f"or the step hangs): give a larger {word('timeout')}, or a smaller model")
    if not first.ok and first.status != "oom":
        return (f"the first trial of {title} (batch_size {size}) finished without a peak figure (the meter read "
                f"nothing): run it again, and report it if it repeats")
    why = f"its peak was {format_bytes(first.peak_bytes)}" if first.ok else f"it ran out of memory: {header[0]}"
    larger = f"a larger {word('capacity')}"
    if first.ok and plan.device.kind.budgeted:  # the host's budget is the user's to choose: say how much
        larger += (f" (batch_size {size} alone needs {format_bytes(plan.settings.total_for(first.peak_bytes))} "
                   f"with this reserve and margin; a calibration wants room for many more samples)")
    return (f"batch_size {size} does not fit in the usable {format_bytes(plan.usable_bytes)} of "
            f"{plan.device.name} ({why}); give {larger}, a smaller {word('reserve')} or {word('margin')}, "
            f"or a smaller model")


# -------------------------------------------------------------------------------------- the profile

def assemble(plan: CalibrationPlan, trials: list[Trial], context: dict[str, Any], wall_s: float) -> Profile:
    """The profile of recorded trials (pure); ``context``: :attr:`vramcal.measure.trial.TrialRunner.context`."""
    settings = {k: v for k, v in plan.trials.to_dict().items() if k != "boundary"}
    run = {"wall_s": wall_s, **settings, "boundary_trials": plan.trials.boundary, "creep_rule": "largest",
           "host_memory_limit": "RLIMIT_DATA = total_bytes" if plan.device.kind.budgeted else None,
           **({"aim": dataclasses.asdict(plan.aim)} if plan.aim else {})}
    core, checks, evaluated = _split(trials)
    if len(plan.seq_lens) > 1:
        profile = _assemble_surface(plan, [*core, *checks], context, {**run, "seq_lens": list(plan.seq_lens)})
    else:
        profile = _assemble_one(plan, plan.model, core, context, run)
    if not plan.evaluation:
        return profile
    seq_len, train = _evaluation_base(plan, core, plan.search())
    found = evaluation.settle_evaluation(evaluated, plan.search(), max(1, train), seq_len, plan.trials.max_trials)
    warnings = [] if found.verified else ["the evaluation limit is not verified by real trials: validate at the "
                                          "training batch size"]
    return dataclasses.replace(profile, evaluation=found, warnings=profile.warnings + tuple(warnings))


def _assemble_one(plan: CalibrationPlan, model: ModelRef, trials: list[Trial], context: dict[str, Any],
                  run: dict[str, Any]) -> Profile:
    search = plan.search()
    state = settle(trials, search)
    verification = {}
    for name, trial in (("safe", state.safe_trial), ("conservative", state.conservative_trial)):
        if trial is not None:
            verification[name] = Verification(trial.batch_size, trial.fits(search.usable_bytes), trial.peak_bytes)
    pool = max((t.data_bytes or 0 for t in trials if t.ok), default=0)
    data = {"source": family_of(model).data_source(plan.options), "options": plan.options, "pool_bytes": pool,
            **context.get("data", {})}
    profile = Profile(
        device=plan.device, model=model, implementation=family_of(model).implementation(model),
        kernel_path=context.get("kernel_path", "unknown (no trial finished)"), settings=plan.settings,
        trials=tuple(trials), fit=state.fit, limits=state.limits, verification=verification, data=data,
        model_info=model_info(context), environment=context.get("environment", {}), world=plan.world,
        software=software_versions(), run=run, created_utc=utc_now(), vramcal_version=__version__)
    return dataclasses.replace(profile, warnings=tuple(_warnings(profile, len(trials)) + _off_aim(profile, plan.aim)))


def _off_aim(profile: Profile, aim: Aim | None) -> list[str]:
    """A warning when the measured slope lies outside twice the aim's error bound (at least ±10 %)."""
    fit = profile.fit
    if aim is None or fit is None or fit.slope_bytes_per_sample <= 0:
        return []
    error = aim.slope_bytes_per_sample / fit.slope_bytes_per_sample - 1
    if 2 * min(aim.low, -0.05) <= error <= 2 * max(aim.high, 0.05):
        return []
    measured = fit.slope_bytes_per_sample / aim.slope_bytes_per_sample - 1
    why = ("fragmentation, a leak, or a step that holds more than the model" if measured > 0 else
           "memory the step reuses or frees early that the trace kept, or batches smaller than asked")
    return [f"the measured slope {format_bytes(fit.slope_bytes_per_sample)} per sample is {abs(measured):.0%} "
            f"{'above' if measured > 0 else 'below'} the estimate's {format_bytes(aim.slope_bytes_per_sample)} "
            f"({aim.source}): {why}"]


COUNTED = ("gradient_bytes", "model_state_bytes", "rank_model_state_bytes")


def model_info(context: dict[str, Any]) -> dict[str, Any]:
    """The factory's report on its model and the bytes counted in the trial (:func:`vramcal.measure.trial.model_state`):
    a rank's ``gradient_bytes``, a whole copy's ``model_state_bytes``, a rank's ``rank_model_state_bytes``."""
    return {**context.get("info", {}), **{name: context[name] for name in COUNTED if name in context}}


def _assemble_surface(plan: CalibrationPlan, trials: list[Trial], context: dict[str, Any],
                      run: dict[str, Any]) -> Profile:
    """The reference length's one-length fields, the surface and the lengths' sizing, with their warnings."""
    reference, (trials, checks, _) = surface.reference_length(plan.seq_lens), _split(trials)
    one = _assemble_one(plan, plan.model.replace(seq_len=reference), surface.at_length(trials, reference),
                        context, run)
    found, _, _ = surface.settle_surface(trials, plan.seq_lens, _chunk(plan), plan.search())
    warnings, sized = list(one.warnings), None
    if found is None:
        warnings.append("no model in batch_size x seq_len: too few points over the lengths")
    else:
        warnings += [f"seq_len {e.seq_len}: limits not verified by real trials" for e in found.lengths
                     if not e.verified]
        warnings += [f"seq_len {a} and {b} are {b / a:.3g} times apart: answers between them interpolate over a "
                     f"wider gap than the {LENGTH_RATIO} times the interpolation error was measured over; add a "
                     f"length between them, or give a range ({a}:{b}) to have them placed" for a, b in
                     wide_gaps(plan.seq_lens)]
        if found.fit.extra_terms:
            warnings.append(found.fit.extra_terms)
        sized = lengths.settle_lengths(trials, checks, found, plan.search())
        if not sized.verified:
            warnings.append(sized.note or "the token budget is not verified by a real trial at its worst batch")
    return dataclasses.replace(one, model=plan.model.without("seq_len"), trials=tuple(trials), surface=found,
                               lengths=sized, warnings=tuple(warnings))


def _warnings(profile: Profile, n_trials: int) -> list[str]:
    """A warning for each way the profile falls short."""
    warnings, fit = [], profile.fit
    finished = [t for t in profile.trials if t.ok]
    if fit is None and len(finished) >= 3 and len({t.batch_size for t in finished}) >= 2:
        warnings.append(f"the peaks of {len(finished)} finished trials did not rise measurably with batch_size (a "
                        f"flat start, or failures before the slope showed): no slope to fit, no limits; give a "
                        f"larger budget, or --max-trials for more batch sizes")
    elif fit is None:
        unmeasured = sum(map(lost, profile.trials))
        why = f" ({unmeasured} ended in an error or a timeout: see their reasons)" if unmeasured else ""
        warnings.append(f"only {len(finished)} trial(s) finished over {len({t.batch_size for t in finished})} "
                        f"batch size(s){why}: no fit, no limits (a fit needs 3 over 2 batch sizes)")
    elif profile.limits is None:
        warnings.append(f"the fitted slope is not positive ({fit.formula()}): the peaks fall with batch_size over the "
                        f"fitted trials, so no limit can be extrapolated; re-run with a larger budget")
    elif fit.nonlinearity:
        warnings.append(fit.nonlinearity)
    creep = profile.creep
    if creep is not None and not creep.levelled:
        warnings.append(f"the step creep had not levelled off after the steady trial's {creep.steps} steps at "
                        f"batch_size {creep.batch_size} (+{format_bytes(creep.late_rise_bytes)} over its last "
                        f"steps): a longer run may peak above the prediction (vramcal train says so as it runs); "
                        f"more --steady-steps measure further")
    if profile.limits is not None and not profile.verified:
        warnings.append(f"limits not verified by real trials within {n_trials} trials: treat them as "
                        f"estimates, or re-run with a larger --max-trials")
    ceiling = unmeasured_ceiling(profile.trials)
    if ceiling is not None:
        ended = sorted({t.status for t in profile.trials if t.batch_size == ceiling})
        warnings.append(f"batch_size {ceiling} ended in {' and '.join(ended)} twice: it measured nothing about memory, "
                        f"so it is no limit, but no larger size was tried (see the trials' errors)")
    return warnings
