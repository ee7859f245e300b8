"""vramcal's public API, a facade over :mod:`vramcal.service`: calibrate a training step on a device, find its
profile, size a run::

    profile = vramcal.calibrate("mytrain:make_step", gpu="auto")   # real trials, verified limits, saved
    batch_size = vramcal.batch_size(profile)                        # the conservative batch size

where ``mytrain.make_step(device, **params)`` returns a :class:`vramcal.TrainingStep`; models are named by family
(``regressor``, ``lm``: :mod:`vramcal.models.registry`) or by ``module:function``. :func:`model_ref` makes the
profile's key, :func:`plan_calibration` the plan, :func:`run_calibration` runs it, :func:`vramcal.sizing.size`
turns a profile into a batch size: each returns a record that the next one takes.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vramcal.calibration.limits import LimitSettings
from vramcal.models.registry import model_ref
from vramcal.profile import DEFAULT_PROFILES_DIR, Profile, ProfileError, load_profile
from vramcal.records import Trial, TrialSettings
from vramcal.service.calibrate import plan_calibration, run_calibration, run_said
from vramcal.service.calibrator import CalibrationError, CalibrationPlan
from vramcal.service.door import door
from vramcal.service.pool import capacity_argument, one_device, select_devices, verify, worker_pool
from vramcal.service.size import Answered, size_for
from vramcal.sizing import Answer, Limit, SizeRequest, Sizing, SizingError, answer, size
from vramcal.sizing.lookup import Located, locate_profile, probe_command
from vramcal.words import is_info
from vramcal.workload import ModelRef, WorkloadError

__all__ = ["Answer", "Answered", "CalibrationError", "CalibrationPlan", "LimitSettings", "Located",
           "Profile", "ProfileError", "Sizing", "SizingError", "TrialSettings", "WorkloadError", "answer",
           "batch_size", "calibrate", "capacity_argument", "find_profile", "load_profile", "locate_profile",
           "model_ref", "plan_calibration", "probe_command", "run_calibration", "select_devices", "size", "size_for",
           "verify", "worker_pool"]


def calibrate(model: str | ModelRef = "regressor", params: dict[str, Any] | None = None, *, gpu: str = "auto",
              capacity_bytes: int | str | None = None, implementation: str = "auto",
              settings: LimitSettings = LimitSettings(), options: dict[str, Any] | None = None,
              profiles_dir: Path | str = DEFAULT_PROFILES_DIR, save: bool = True,
              on_trial: Callable[[Trial], None] | None = None, seq_lens: str | Sequence[int] = (),
              trials: TrialSettings = TrialSettings(), progress: bool = True, evaluation: bool = False) -> Profile:
    """Calibrate a training step on one device and (by default) save its profile under ``profiles_dir``.

    Args:
        model, params: see :func:`model_ref`.
        gpu: ``auto`` (the first visible GPU, else the host), ``none`` (the host), a CUDA index or a UUID.
        capacity_bytes: a budget below the device's memory: bytes, or a size string (``"1.5GiB"``); on the
            host, trials run under ``RLIMIT_DATA`` = the budget.
        settings: reserve (bytes), margin and conservative fraction.
        options, seq_lens, trials, evaluation: see :func:`plan_calibration`.
        on_trial: called with each finished trial; without it, and with ``progress``, each trial is a line on
            stderr (:class:`vramcal.report.progress.TrialPrinter`).

    Returns:
        The profile: ``limits.safe_batch_size`` and ``limits.conservative_batch_size`` (samples), the fit
        ``peak_bytes = overhead_bytes + slope_bytes_per_sample × batch_size``, ``verified``, and ``path`` (None
        with ``save=False``).

    Raises:
        DeviceError, NvmlError: no such device. ValueError, WorkloadError: bad model arguments.
        CalibrationError: not even one sample fits. OSError: the profile cannot be written.
    """
    door(save=save, on_trial=on_trial, progress=progress)
    device, notice = one_device(gpu, capacity_bytes)
    plan = plan_calibration(model, params, device=device, implementation=implementation, settings=settings,
                            options=options, profiles_dir=profiles_dir, seq_lens=seq_lens, trials=trials,
                            evaluation=evaluation)
    return run_said(plan, notice, capacity_bytes is None, save=save, on_trial=on_trial, progress=progress)


def find_profile(model: str | ModelRef = "regressor", params: dict[str, Any] | None = None, *, gpu: str = "auto",
                 capacity_bytes: int | str | None = None, implementation: str = "auto",
                 profiles_dir: Path | str = DEFAULT_PROFILES_DIR, path: Path | str | None = None) -> Profile:
    """The newest profile for a model on the device ``gpu`` names under ``profiles_dir`` at ``capacity_bytes``
    (None: whatever budget the matching files share), or ``path``. Files that fail their checks, or are stale
    (:mod:`vramcal.sizing.staleness`), are passed over with a :class:`UserWarning` each.

    Raises:
        SizingError, WorkloadError, ValueError: see :func:`locate_profile` (SeveralBudgetsError: no
            ``capacity_bytes`` and the matching files have several budgets). DeviceError, NvmlError: no such device.
    """
    door(implementation=implementation, profiles_dir=profiles_dir, path=path)
    (device, *_), notice = select_devices(gpu, capacity_bytes)
    located = locate_profile(model, params, device=device, profile=path, implementation=implementation,
                             profiles_dir=profiles_dir,
                             total_bytes=device.total_bytes if capacity_bytes is not None else None)
    for line in ([notice] if notice else []) + list(located.notices):
        tell(line)
    return located.profile


def tell(notice: str) -> None:
    """A notice to people: information (:class:`~vramcal.words.Info`) as a line on stderr, a warning through
    :func:`warnings.warn` (attributed to the caller of the public function)."""
    if is_info(notice):
        print(f"vramcal: {notice}", file=sys.stderr, flush=True)
    else:
        warnings.warn(f"vramcal: {notice}", stacklevel=3)


def batch_size(profile: Profile | Path | str, limit: Limit = "conservative", *, request: int | None = None,
               batch_size_min: int = 1, pool_data_bytes: int | None = None, seq_len: int | None = None) -> int:
    """The batch size to train with (samples): the profile's conservative (or safe) size, or ``request`` clamped to
    ``[batch_size_min, safe]`` (:func:`vramcal.sizing.size`, which also gives the predicted peak).

    Args:
        profile: a :class:`Profile`, or the path of a profile file.
        pool_data_bytes: the run's data bytes in the measured memory (None: as much as the calibration held).
        seq_len: the run's sequence length; required for a profile calibrated over several lengths.

    Raises:
        SizingError: no limits, empty bounds, ``seq_len`` missing or outside what was calibrated; an argument out
            of range. TypeError: an argument of the wrong type. ProfileError: a path that holds no profile.
    """
    if isinstance(profile, str | Path):
        profile = load_profile(profile)
    ask = SizeRequest(limit=limit, batch_size_min=batch_size_min, request=request, seq_len=seq_len)
    return size(profile, ask, pool_data_bytes=pool_data_bytes).batch_size
