"""Calibration: run the search policy against real trials and assemble a :class:`Profile`.

The loop is ``step = next_batch_size(trials)`` -> run the trial in its own process -> repeat; the
fit, limits and verification come from :func:`vramcal.calibrate.search.settle` over the recorded trials.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import platform
import time
from collections.abc import Callable

from vramcal import __version__
from vramcal.calibrate.limits import LimitSettings
from vramcal.calibrate.search import SearchSettings, next_batch_size, settle
from vramcal.measure.trial import TrialRequest, TrialRunner
from vramcal.model import ModelSpec, kernel_path, resolve_implementation
from vramcal.profile import Profile, Verification
from vramcal.records import Device, Trial
from vramcal.units import format_bytes


class CalibrationError(RuntimeError):
    """A calibration that cannot produce limits (e.g. one sample does not fit); the message says why."""


def check_request(device: Device, spec: ModelSpec, implementation: str, settings: LimitSettings) -> str:
    """Validate everything knowable before the first trial; returns the concrete implementation.

    Raises:
        ValueError: an impossible spec, a dtype policy the device cannot run, an unusable
            implementation, or a budget with no usable memory after reserve and margin.
    """
    spec.validate()
    if spec.dtype == "bf16-autocast" and device.kind != "cuda":
        raise ValueError("dtype bf16-autocast is for CUDA GPUs; use --dtype fp32 on the host")
    concrete = resolve_implementation(implementation, device.kind)
    usable = settings.usable_bytes(device.total_bytes)
    if usable <= 0:
        raise ValueError(f"{format_bytes(device.total_bytes)} leaves no usable memory after the reserve of "
                         f"{format_bytes(settings.reserve_bytes)} and the {settings.margin:.0%} margin: "
                         f"give a larger --capacity or a smaller --reserve/--margin")
    return concrete


def calibrate(device: Device, spec: ModelSpec, implementation: str = "auto",
              settings: LimitSettings = LimitSettings(), *, warmup_steps: int = 1, measured_steps: int = 2,
              max_trials: int = 16, timeout_s: float = 900.0, runner: TrialRunner | None = None,
              on_trial: Callable[[Trial], None] | None = None) -> Profile:
    """Calibrate ``spec`` on ``device`` and return the profile (not yet written).

    Args:
        device: from :func:`vramcal.measure.device.select`.
        spec: the model spec.
        implementation: ``auto``, ``transformers`` or ``mamba_ssm``.
        settings: reserve, margin and conservative fraction.
        warmup_steps, measured_steps: steps per trial (measured_steps >= 2).
        max_trials: the most trials to run.
        timeout_s: per-trial time limit; a slower trial is recorded as ``timeout``.
        runner: a :class:`TrialRunner` (made here by default); tests of the policy use the policy directly.
        on_trial: called with each trial as it finishes (progress output).

    Raises:
        ValueError: see :func:`check_request`.
        CalibrationError: the first trial failed (too little memory for one sample, or a crash).
    """
    if measured_steps < 2:
        raise ValueError(f"measured_steps must be >= 2, got {measured_steps}")
    concrete = check_request(device, spec, implementation, settings)
    runner = runner or TrialRunner(timeout_s=timeout_s)
    search = SearchSettings(total_bytes=device.total_bytes, limits=settings, max_trials=max_trials)
    host_limit = device.total_bytes if device.kind == "host" else None
    started = time.perf_counter()
    trials: list[Trial] = []
    while (step := next_batch_size(trials, search)) is not None:
        request = TrialRequest(spec=spec, implementation=concrete, batch_size=step.batch_size, device=device,
                               warmup_steps=warmup_steps, measured_steps=measured_steps,
                               host_memory_limit_bytes=host_limit)
        trial = runner.run(request, purpose=step.purpose)
        trials.append(trial)
        if on_trial:
            on_trial(trial)
    wall_s = time.perf_counter() - started
    first = trials[0]
    if not first.fits(search.usable_bytes):
        last_line = (first.error or "").strip().splitlines()[-1:] or [""]
        why = (f"its peak was {format_bytes(first.peak_bytes)}" if first.ok
               else f"it ended with {first.status}: {last_line[0]}")
        raise CalibrationError(
            f"batch_size {first.batch_size} does not fit in the usable {format_bytes(search.usable_bytes)} "
            f"of {device.name} ({why}); give a larger --capacity, a smaller --reserve or --margin, "
            f"or a smaller model")
    return assemble(device, spec, concrete, settings, trials, search,
                    run={"wall_s": wall_s, "warmup_steps": warmup_steps, "measured_steps": measured_steps,
                         "timeout_s": timeout_s, "max_trials": max_trials,
                         "host_memory_limit": "RLIMIT_DATA = total_bytes" if host_limit else None})


def assemble(device: Device, spec: ModelSpec, implementation: str, settings: LimitSettings,
             trials: list[Trial], search: SearchSettings, run: dict) -> Profile:
    """Build the profile from recorded trials (pure: fit, limits, verification and warnings)."""
    state = settle(trials, search)
    verification = {}
    for name, trial in (("safe", state.safe_trial), ("conservative", state.conservative_trial)):
        if trial is not None:
            verification[name] = Verification(trial.batch_size, trial.fits(search.usable_bytes), trial.peak_bytes)
    warnings = []
    if state.fit is None:
        warnings.append(f"only {sum(t.ok for t in trials)} trial(s) finished: no fit, no limits")
    elif state.fit.nonlinearity:
        warnings.append(state.fit.nonlinearity)
    if state.limits is not None and not all(name in verification for name in ("safe", "conservative")):
        warnings.append(f"limits not verified by real trials within {len(trials)} trials: treat them as "
                        f"estimates, or re-run with a larger --max-trials")
    return Profile(device=device, spec=spec, implementation=implementation,
                   kernel_path=kernel_path(implementation), settings=settings, trials=tuple(trials),
                   fit=state.fit, limits=state.limits, verification=verification, warnings=tuple(warnings),
                   software=software_versions(), run=run,
                   created_utc=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                   vramcal_version=__version__)


def software_versions() -> dict[str, str | None]:
    """Versions of Python and the packages whose behaviour changes the measured memory."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for package in ("torch", "transformers", "mamba-ssm", "causal-conv1d", "triton", "nvidia-ml-py"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions
