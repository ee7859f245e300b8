"""The API's checks of the arguments its functions share, by name, at their door (:mod:`vramcal.arguments`;
DESIGN.md, "Failure"): a wrong type is one TypeError naming the argument, before any work."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vramcal.arguments import callback, flag, mapping, of_type, path_like
from vramcal.calibration.fit2d import SeqLens
from vramcal.calibration.limits import LimitSettings
from vramcal.profile import Profile
from vramcal.records import Device, TrialSettings, World
from vramcal.service.calibrator import CalibrationPlan

_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "settings": lambda n, v: of_type(n, v, LimitSettings, "a vramcal.LimitSettings (LimitSettings(reserve_bytes=0))"),
    "trials": lambda n, v: of_type(n, v, TrialSettings, "a vramcal.TrialSettings (TrialSettings(max_trials=8))"),
    "options": lambda n, v: mapping(n, v, "the data options as a dict ({'stride': 4})"),
    "profiles_dir": path_like, "out": lambda n, v: path_like(n, v, "a profile file's path", none=True),
    "path": lambda n, v: path_like(n, v, "a profile file's path", none=True),
    "save": flag, "progress": flag, "unique_device": flag, "aim": flag, "evaluation": flag,
    "on_trial": callback, "on_notice": callback, "on_step": callback,
    "device": lambda n, v: of_type(n, v, Device, "a vramcal.records.Device (select_devices(gpu)[0][0])"),
    "world": lambda n, v: of_type(n, v, World, "a vramcal.records.World, or None", none=True),
    "implementation": lambda n, v: of_type(n, v, str, "'auto', 'transformers' or 'mamba_ssm'"),
    "seq_lens": lambda n, v: of_type(n, v, (str, Sequence, SeqLens), "lengths: [128, 512], '128,512' or '128:2048'"),
    "plan": lambda n, v: of_type(n, v, CalibrationPlan, "a vramcal.CalibrationPlan (from plan_calibration)"),
    "profile": lambda n, v: of_type(n, v, Profile, "a vramcal.Profile (vramcal.load_profile(path))"),
    "rank_devices": lambda n, v: of_type(n, v, (list, tuple), "the ranks' Devices as a list"),
}


def door(**given: Any) -> None:
    """Check each of the ``given`` arguments by its name.

    Raises:
        TypeError: one of the wrong type, named (``trials= takes a vramcal.TrialSettings ..., not dict {}``).
    """
    for name, value in given.items():
        _CHECKS[name](name, value)
