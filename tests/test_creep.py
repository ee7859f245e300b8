"""The steady trial's policy on synthetic creep curves (issue 19): it ends once its peak levels off, the creep it
measured enters the predictions, and a creep still rising when it ends is reported, never extrapolated in
silence. The curves are the trial runner's (tests/fakes.py, the hardware boundary); the search, the plateau
rule, the fit, the limits and the profile are the real code."""

from __future__ import annotations

import math

import pytest

from vramcal.calibration.creep import plateau_step
from vramcal.cli.console import summary
from vramcal.records import TrialSettings
from vramcal.units import format_bytes

from fakes import fake_calibration

MIB = 2**20
GIB = 2**30
CAP, PLATEAU = TrialSettings.steady_steps, TrialSettings.plateau_steps


@pytest.mark.parametrize("curve, expected", [
    ([100] * 11, 1),  # flat from the first step: levelled off at once, known after 10 more
    ([100] * 10, None),  # one step short of knowing
    ([100, 101, 102, 103, 104] + [104] * 10, 5),  # rises, then stays
    ([100 + i for i in range(40)], None),  # still rising at the end
    ([100_000, 100_050, 100_090] + [100_090] * 10, 1),  # rises below 0.1 %: noise, not creep
    ([100, 100, 120] + [120] * 9, None),  # a late rise restarts the count
])
def test_the_plateau_rule(curve, expected):
    assert plateau_step(curve, 10) == expected


def test_the_default_plateau_is_five_steps():
    """Every curve of the 256 KiB study levelled off by step 7 and rose by at most 0.08 % later
    (bench/results/creep-256k/STUDY.md): five steps without a rise end the steady trial."""
    assert PLATEAU == 5
    assert plateau_step([100] * 6, PLATEAU) == 1 and plateau_step([100] * 5, PLATEAU) is None


def test_plateau_steps_zero_never_levels_off():
    assert plateau_step([100] * 50, 0) is None


def memory(b: int, seq_len: int) -> float:
    return 600 * MIB + 2 * MIB * b


def calibrate(curve):
    """0.2 MiB of creep per sample (a tenth of the slope), reached as ``curve`` says."""
    return fake_calibration(memory, 4 * GIB, creep=0.2 * MIB / 128, curve=curve)


def steady(profile):
    """The steady trial the creep is read from: of the one or two that ran (a second one runs where the first's
    creep moved the conservative size), the one with the larger creep per sample."""
    trials = [t for t in profile.trials if t.purpose == "steady"]
    assert 1 <= len(trials) <= 2
    (trial,) = [t for t in trials if t.batch_size == profile.creep.batch_size][-1:]
    return trial


def test_a_creep_that_rises_and_levels_off_ends_the_steady_trial_early_and_enters_the_limits():
    rises = lambda n: 1 - math.exp(-n / 3)  # noqa: E731 - 99 % of the creep by step 14
    profile = calibrate(rises)
    trial, creep = steady(profile), profile.creep
    assert PLATEAU < len(trial.step_peaks) < CAP  # ended early, after its plateau
    assert creep.levelled and creep.levelled_at == len(trial.step_peaks) - PLATEAU
    assert trial.epoch_end_step == creep.epoch_end_step == TrialSettings.measured_steps  # where a short trial ends
    assert trial.peak_bytes == trial.step_peaks[-1] == max(trial.step_peaks)
    assert creep.bytes_at_steady > 0 and not any("levelled off" in w for w in profile.warnings)
    flat = fake_calibration(memory, 4 * GIB)  # the same device and line without a creep
    assert profile.fit.slope_bytes_per_sample > flat.fit.slope_bytes_per_sample  # the line is a long run's
    assert profile.limits.point_safe_batch_size < flat.limits.point_safe_batch_size  # the creep took room
    assert f", level from step {creep.levelled_at} on" in summary(profile)


def test_an_epochs_end_that_raises_the_peak_enters_the_limits():
    """The rise after an epoch's end (a partial batch, validation: +0.2-0.3 % on the host's small spec, which 1,000
    training steps met and the steady trial's full steps did not) is in the creep, and the run's limits make room."""
    flat = calibrate(lambda n: 1.0)
    profile = fake_calibration(memory, 4 * GIB, creep=0.2 * MIB / 128, curve=lambda n: 1.0, epoch_rise=0.1 * MIB / 128)
    trial, creep = steady(profile), profile.creep
    end = trial.epoch_end_step
    assert end == TrialSettings.measured_steps  # after the steps a short trial measures
    assert len(trial.step_peaks) == end + 1 + PLATEAU and creep.levelled  # the rise, then PLATEAU flat steps
    assert creep.epoch_end_rise_bytes == trial.step_peaks[-1] - trial.step_peaks[end - 1] > 0
    assert creep.levelled_at == end + 1
    assert creep.per_sample_bytes > flat.creep.per_sample_bytes
    assert profile.limits.point_safe_batch_size < flat.limits.point_safe_batch_size
    assert (f"; a validation pass after step {end}, as at an epoch's end, added "
            f"{format_bytes(creep.epoch_end_rise_bytes)};" in summary(profile))
    assert f"after step {steady(flat).epoch_end_step}, as at an epoch's end, added nothing" in summary(flat)


def test_an_epochs_end_rise_under_the_plateau_tolerance_says_why_the_curve_counts_as_level():
    """A rise after the epoch's end smaller than the plateau rule's 0.1 % leaves the curve level from before it
    (``level from step 1 on``); the summary says the rise was under the rule, not only that it happened."""
    profile = fake_calibration(memory, 4 * GIB, creep=0.2 * MIB / 128, curve=lambda n: 1.0, epoch_rise=1024 / 128)
    trial, creep = steady(profile), profile.creep
    assert 0 < creep.epoch_end_rise_bytes < 0.001 * trial.step_peaks[-1]
    assert creep.levelled_at is not None and creep.levelled_at < trial.epoch_end_step
    assert (f"; a validation pass after step {trial.epoch_end_step}, as at an epoch's end, added "
            f"{format_bytes(creep.epoch_end_rise_bytes)}, under the 0.1% counted as a rise") in summary(profile)


def test_a_creep_still_rising_at_the_cap_is_reported():
    profile = calibrate(lambda n: n / CAP)  # grows every step, to the last
    trial, creep = steady(profile), profile.creep
    assert len(trial.step_peaks) == CAP and not creep.levelled and creep.late_rise_bytes > 0
    (warning,) = [w for w in profile.warnings if "had not levelled off" in w]
    assert f"after the steady trial's {CAP} steps at batch_size {trial.batch_size}" in warning
    assert "a longer run may peak above the prediction (vramcal train says so as it runs)" in warning
    assert "still rising" in summary(profile)


def test_the_host_steady_trial_gets_an_allowance_for_later_steps_and_a_gpu_none():
    from vramcal.calibration.creep import HOST_LATE_CREEP

    host = fake_calibration(memory, 4 * GIB)
    trial = steady(host)
    assert trial.late_creep_bytes == round(HOST_LATE_CREEP * trial.peak_bytes) == host.creep.late_bytes
    assert host.creep.bytes_at_steady >= trial.late_creep_bytes  # no creep measured: the allowance alone
    gpu = fake_calibration(memory, 4 * GIB, kind="cuda")
    assert steady(gpu).late_creep_bytes == 0 and gpu.creep.late_bytes == 0
    assert host.creep.bytes_at_steady == host.creep.late_bytes  # no rise measured: the allowance is all of it
    assert (f"steps, flat; a validation pass after step {trial.epoch_end_step}, as at an epoch's end, added nothing; "
            f"all of the creep is the allowance for later steps") in summary(host)
    rising = calibrate(lambda n: 1 - math.exp(-n / 3))
    measured = rising.creep.bytes_at_steady - rising.creep.late_bytes
    assert (f"; of the creep, {format_bytes(measured)} measured and {format_bytes(rising.creep.late_bytes)} allowed "
            f"for later steps") in summary(rising) and measured > 0
