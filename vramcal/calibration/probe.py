"""Calibration: run the search policy against real trials and assemble a :class:`~vramcal.profile.Profile`.

The loop is ``step = next_batch_size(trials)`` -> run the trial in a worker of its own -> repeat; the
fit, limits and verification come from :func:`vramcal.calibration.search.settle` over the recorded
trials, and :func:`assemble` is a pure function of them.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import platform
import time
from collections.abc import Callable
from typing import Any

from vramcal import __version__
from vramcal.calibration import surface
from vramcal.calibration.creep import STEADY, STEADY_STEPS
from vramcal.calibration.limits import LimitSettings
from vramcal.calibration.search import SearchSettings, Step, next_batch_size, settle
from vramcal.measure.trial import TrialRequest, TrialRunner
from vramcal.profile import Profile, Verification, utc_now
from vramcal.records import Device, Trial
from vramcal.units import format_bytes
from vramcal.workload import ModelRef


class CalibrationError(RuntimeError):
    """A calibration that cannot produce limits (e.g. one sample does not fit); the message says why."""


def check_budget(device: Device, settings: LimitSettings) -> None:
    """Raises: ValueError when reserve and margin leave no usable memory on ``device``."""
    if settings.usable_bytes(device.total_bytes) <= 0:
        raise ValueError(f"{format_bytes(device.total_bytes)} leaves no usable memory after the reserve of "
                         f"{format_bytes(settings.reserve_bytes)} and the {settings.margin:.0%} margin: "
                         f"give a larger --capacity or a smaller --reserve/--margin")


def calibrate_trials(device: Device, model: ModelRef, settings: LimitSettings = LimitSettings(), *,
              options: dict[str, Any] | None = None, warmup_steps: int = 1, measured_steps: int = 2,
              val_steps: int = 1, steady_steps: int = STEADY_STEPS, max_trials: int = 16, timeout_s: float = 900.0,
              runner: TrialRunner | None = None, on_trial: Callable[[Trial], None] | None = None,
              seq_lens: tuple[int, ...] = (), boundary: bool = True) -> Profile:
    """Calibrate ``model`` on ``device`` and return the profile (not yet written).

    Args:
        device: from :func:`vramcal.measure.device.select`.
        model: the factory and its arguments (a family's arguments name a concrete implementation).
        settings: reserve, margin and conservative fraction.
        options: factory arguments that do not change the model (the regressor's data file, ...).
        warmup_steps, measured_steps, val_steps: steps per trial (measured_steps >= 2).
        steady_steps: measured steps of the one steady trial at the verified safe size, which measures the
            step creep (:mod:`vramcal.calibration.creep`); 0 runs none, and the profile has no creep term.
        max_trials: the most trials to run.
        timeout_s: per-trial time limit; a slower trial is recorded as ``timeout``.
        runner: a :class:`TrialRunner` (made here by default).
        on_trial: called with each trial as it finishes (progress output).
        seq_lens: two or more sequence lengths to calibrate at once (:mod:`vramcal.calibration.surface`; the
            factory takes ``seq_len``): the profile then holds the model in batch_size × seq_len, and
            ``max_trials`` grows by 4 per length beyond the first.
        boundary: run the boundary trials (search rule 3); without them the predicted out-of-memory
            boundary is an extrapolation, and the calibration is faster (the largest trials are skipped).

    Raises:
        ValueError: no usable memory (:func:`check_budget`), measured_steps < 2, steady_steps < 0 or
            max_trials < 1.
        CalibrationError: the first trial failed (too little memory for one sample, or a crash).
    """
    if measured_steps < 2:
        raise ValueError(f"measured_steps must be >= 2, got {measured_steps}")
    if max_trials < 1:
        raise ValueError(f"max_trials must be >= 1, got {max_trials}")
    if steady_steps < 0:
        raise ValueError(f"steady_steps must be >= 0, got {steady_steps}")
    check_budget(device, settings)
    runner = runner or TrialRunner(timeout_s=timeout_s)
    search = SearchSettings(total_bytes=device.total_bytes, limits=settings, max_trials=max_trials,
                            boundary_fraction=SearchSettings.boundary_fraction if boundary else 0.0,
                            steady_steps=steady_steps)
    host_limit = device.total_bytes if device.kind == "host" else None
    template = TrialRequest(model, 1, device, json.dumps(options or {}, sort_keys=True), warmup_steps,
                            measured_steps, val_steps, host_limit)
    started = time.perf_counter()
    trials: list[Trial] = []
    if len(seq_lens) > 1:
        search = dataclasses.replace(search, max_trials=max_trials + 4 * (len(seq_lens) - 1))
    while (chosen := _next(trials, search, seq_lens)) is not None:
        seq_len, step = chosen
        request = template if seq_len is None else dataclasses.replace(template, model=model.replace(seq_len=seq_len))
        if step.purpose == STEADY:
            request = dataclasses.replace(request, measured_steps=steady_steps)
        trial = runner.run(request.with_batch_size(step.batch_size), purpose=step.purpose)
        trial = trial if seq_len is None else dataclasses.replace(trial, seq_len=seq_len)
        trials.append(trial)
        if on_trial:
            on_trial(trial)
    first = trials[0]
    if not first.fits(search.usable_bytes):
        raise CalibrationError(first_trial_failure(first, device, search.usable_bytes, model))
    run = {"wall_s": time.perf_counter() - started, "boundary_trials": boundary, "warmup_steps": warmup_steps,
           "measured_steps": measured_steps, "steady_steps": steady_steps,
           "val_steps": val_steps, "timeout_s": timeout_s, "max_trials": max_trials,
           "host_memory_limit": "RLIMIT_DATA = total_bytes" if host_limit else None}
    if len(seq_lens) > 1:
        run["seq_lens"] = list(seq_lens)
        return assemble_surface(device, model, settings, trials, search, run, runner.context, options or {},
                                seq_lens)
    return assemble(device, model, settings, trials, search, run, runner.context, options or {})


def _next(trials: list[Trial], search: SearchSettings, seq_lens: tuple[int, ...]) -> tuple[int | None, Step] | None:
    if len(seq_lens) > 1:
        return surface.next_trial(trials, seq_lens, search)
    step = next_batch_size(trials, search)
    return None if step is None else (None, step)


def assemble_surface(device: Device, model: ModelRef, settings: LimitSettings, trials: list[Trial],
                     search: SearchSettings, run: dict[str, Any], context: dict[str, Any], options: dict[str, Any],
                     seq_lens: tuple[int, ...]) -> Profile:
    """The profile of a calibration over several lengths: the reference length's one-length fields, the
    surface, and a warning for each length left unverified or for terms the 2-D model lacks."""
    reference = surface.reference_length(seq_lens)
    one = assemble(device, model.replace(seq_len=reference), settings, surface.at_length(trials, reference), search,
                   run, context, options)
    found, _, _ = surface.settle_surface(trials, seq_lens, chunk_size(model), search)
    warnings = list(one.warnings)
    if found is None:
        warnings.append("no model in batch_size x seq_len: too few points over the lengths")
    else:
        warnings += [f"seq_len {e.seq_len}: limits not verified by real trials" for e in found.lengths
                     if not e.verified]
        if found.fit.extra_terms:
            warnings.append(found.fit.extra_terms)
    return dataclasses.replace(one, model=model.without("seq_len"), trials=tuple(trials), surface=found,
                               warnings=tuple(warnings))


def chunk_size(model: ModelRef) -> int:
    """The model's chunk_size (lengths are multiples of it): the regressor's, the LM config's (transformers'
    ``Mamba2Config`` default where the file has none), else 1."""
    params = model.params
    if isinstance(params.get("config"), dict):
        from vramcal.models.lm import mamba2_config

        return mamba2_config(params["config"]).chunk_size
    return int(params.get("chunk_size") or 1)


def first_trial_failure(first: Trial, device: Device, usable_bytes: int, model: ModelRef) -> str:
    """Why a calibration could not start, in one line, with what to change: the training step itself
    failed (an ``error``: fix the step), or one sample does not fit (change the budget or the model)."""
    header = (first.error or "").strip().splitlines()[:1] or ["no error text recorded"]
    if first.status == "error":
        kind, sep, message = header[0].partition(": ")
        what = message if kind == "WorkloadError" else header[0]  # vramcal's own message names the factory
        return (f"the training step of {model.family or model.factory} failed in the first trial (batch_size "
                f"{first.batch_size}), before any memory limit: {what[:300]}: fix the step (call the factory "
                f"and one step by hand to see the traceback)")
    why = f"its peak was {format_bytes(first.peak_bytes)}" if first.ok else f"it ended with {first.status}: {header[0]}"
    return (f"batch_size {first.batch_size} does not fit in the usable {format_bytes(usable_bytes)} of "
            f"{device.name} ({why}); give a larger --capacity, a smaller --reserve or --margin, or a smaller model")


def assemble(device: Device, model: ModelRef, settings: LimitSettings, trials: list[Trial],
             search: SearchSettings, run: dict[str, Any], context: dict[str, Any],
             options: dict[str, Any]) -> Profile:
    """Build the profile from recorded trials (pure: fit, limits, verification and warnings).

    ``context`` is what the trial processes reported (:attr:`vramcal.measure.trial.TrialRunner.context`).
    """
    state = settle(trials, search)
    verification = {}
    for name, trial in (("safe", state.safe_trial), ("conservative", state.conservative_trial)):
        if trial is not None:
            verification[name] = Verification(trial.batch_size, trial.fits(search.usable_bytes), trial.peak_bytes)
    pool = max((t.data_bytes or 0 for t in trials if t.ok), default=0)
    data = {"source": options.get("data") or ("synthetic" if model.family == "regressor" else "the factory's"),
            "options": options, "pool_bytes": pool, **context.get("data", {})}
    profile = Profile(
        device=device, model=model, implementation=model.params.get("implementation", "factory"),
        kernel_path=context.get("kernel_path", "unknown (no trial finished)"), settings=settings,
        trials=tuple(trials), fit=state.fit, limits=state.limits, verification=verification, data=data,
        model_info=context.get("info", {}),
        environment=context.get("environment", {}), software=software_versions(), run=run,
        created_utc=utc_now(), vramcal_version=__version__)
    return _with_warnings(profile, state.fit, len(trials))


def _with_warnings(profile: Profile, fit, n_trials: int) -> Profile:
    """The profile with a warning for each way it falls short: why there are no limits, curvature, no
    verification."""
    warnings = []
    finished = [t for t in profile.trials if t.ok]
    if fit is None and len(finished) >= 3 and len({t.batch_size for t in finished}) >= 2:
        warnings.append(f"the peaks of {len(finished)} finished trials did not rise measurably with batch_size (a "
                        f"flat start, or failures before the slope showed): no slope to fit, no limits; give a "
                        f"larger budget, or --max-trials for more batch sizes")
    elif fit is None:
        warnings.append(f"only {len(finished)} trial(s) finished over {len({t.batch_size for t in finished})} "
                        f"batch size(s): no fit, no limits (a fit needs 3 over 2 batch sizes)")
    elif profile.limits is None:
        warnings.append(f"the fitted slope is not positive ({fit.formula()}): the peaks fall with batch_size over the "
                        f"fitted trials, so no limit can be extrapolated; re-run with a larger budget")
    elif fit.nonlinearity:
        warnings.append(fit.nonlinearity)
    if profile.limits is not None and not profile.verified:
        warnings.append(f"limits not verified by real trials within {n_trials} trials: treat them as "
                        f"estimates, or re-run with a larger --max-trials")
    return dataclasses.replace(profile, warnings=tuple(warnings))


def software_versions() -> dict[str, str | None]:
    """Versions of Python and the packages whose behaviour changes the measured memory."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for package in ("torch", "transformers", "mamba-ssm", "causal-conv1d", "triton", "nvidia-ml-py", "nvitop"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions
