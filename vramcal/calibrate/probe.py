"""Calibration: run the search policy against real trials and assemble a :class:`~vramcal.profile.Profile`.

The loop is ``step = next_batch_size(trials)`` -> run the trial in a worker of its own -> repeat; the
fit, limits and verification come from :func:`vramcal.calibrate.search.settle` over the recorded
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
from vramcal.calibrate.limits import LimitSettings
from vramcal.calibrate.search import SearchSettings, next_batch_size, settle
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
              val_steps: int = 1, max_trials: int = 16, timeout_s: float = 900.0,
              runner: TrialRunner | None = None, on_trial: Callable[[Trial], None] | None = None) -> Profile:
    """Calibrate ``model`` on ``device`` and return the profile (not yet written).

    Args:
        device: from :func:`vramcal.measure.device.select`.
        model: the factory and its arguments (a family's arguments name a concrete implementation).
        settings: reserve, margin and conservative fraction.
        options: factory arguments that do not change the model (the regressor's data file, ...).
        warmup_steps, measured_steps, val_steps: steps per trial (measured_steps >= 2).
        max_trials: the most trials to run.
        timeout_s: per-trial time limit; a slower trial is recorded as ``timeout``.
        runner: a :class:`TrialRunner` (made here by default).
        on_trial: called with each trial as it finishes (progress output).

    Raises:
        ValueError: no usable memory (:func:`check_budget`), or measured_steps < 2.
        CalibrationError: the first trial failed (too little memory for one sample, or a crash).
    """
    if measured_steps < 2:
        raise ValueError(f"measured_steps must be >= 2, got {measured_steps}")
    check_budget(device, settings)
    runner = runner or TrialRunner(timeout_s=timeout_s)
    search = SearchSettings(total_bytes=device.total_bytes, limits=settings, max_trials=max_trials)
    host_limit = device.total_bytes if device.kind == "host" else None
    template = TrialRequest(model, 1, device, json.dumps(options or {}, sort_keys=True), warmup_steps,
                            measured_steps, val_steps, host_limit)
    started = time.perf_counter()
    trials: list[Trial] = []
    while (step := next_batch_size(trials, search)) is not None:
        trial = runner.run(template.with_batch_size(step.batch_size), purpose=step.purpose)
        trials.append(trial)
        if on_trial:
            on_trial(trial)
    first = trials[0]
    if not first.fits(search.usable_bytes):
        raise CalibrationError(first_trial_failure(first, device, search.usable_bytes))
    run = {"wall_s": time.perf_counter() - started, "warmup_steps": warmup_steps, "measured_steps": measured_steps,
           "val_steps": val_steps, "timeout_s": timeout_s, "max_trials": max_trials,
           "host_memory_limit": "RLIMIT_DATA = total_bytes" if host_limit else None}
    return assemble(device, model, settings, trials, search, run, runner.context, options or {})


def first_trial_failure(first: Trial, device: Device, usable_bytes: int) -> str:
    """Why a calibration could not start, in one line, with what to change."""
    if first.ok:
        why = f"its peak was {format_bytes(first.peak_bytes)}"
    else:
        last = (first.error or "").strip().splitlines()[-1:] or [""]
        why = f"it ended with {first.status}: {last[0]}"
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
    warnings = []
    if fit is None:
        ok = sum(t.ok for t in profile.trials)
        warnings.append(f"only {ok} trial(s) finished over {len({t.batch_size for t in profile.trials if t.ok})} "
                        f"batch size(s): no fit, no limits (a fit needs 3 over 2 batch sizes)")
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
