"""vramcal: empirical GPU-memory profiler and batch-size calibrator for Mamba-2 training.

The public API (:mod:`vramcal.api`)::

    import vramcal

    profile = vramcal.calibrate("mytrain:make_step", gpu="auto")   # real trials, verified limits, saved
    batch_size = vramcal.batch_size(profile)                        # the conservative batch size

Importing this package imports no torch, triton, NVML or mamba_ssm: the names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

_API = {
    "calibrate": "vramcal.api", "plan_calibration": "vramcal.api", "run_calibration": "vramcal.api",
    "find_profile": "vramcal.api", "locate_profile": "vramcal.sizing.lookup", "batch_size": "vramcal.api",
    "model_ref": "vramcal.api", "size_for": "vramcal.api", "Answered": "vramcal.api",
    "select_devices": "vramcal.api", "probe_command": "vramcal.sizing.lookup", "CalibrationPlan": "vramcal.api",
    "size": "vramcal.sizing", "SizeRequest": "vramcal.sizing", "Sizing": "vramcal.sizing",
    "SizingError": "vramcal.sizing", "GradientsHeld": "vramcal.sizing", "Located": "vramcal.sizing.lookup",
    "load_profile": "vramcal.profile", "Profile": "vramcal.profile", "ProfileError": "vramcal.profile",
    "LimitSettings": "vramcal.calibration.limits", "CalibrationError": "vramcal.service.calibrator",
    "TrialSettings": "vramcal.records",
    "TrainingStep": "vramcal.workload", "ModelRef": "vramcal.workload", "WorkloadError": "vramcal.workload",
}
__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    if name in _API:
        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'vramcal' has no attribute {name!r}")
