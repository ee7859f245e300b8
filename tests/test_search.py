"""The search policy against fake trial runners: exact sequences, OOM above N, noise, non-linearity."""

import numpy as np

from vramcal.calibrate.limits import LimitSettings
from vramcal.calibrate.search import SearchSettings, Step, next_batch_size, settle
from vramcal.records import Trial

from fakes import GIB, run_policy


def linear(overhead, slope):
    return lambda b: overhead + slope * b


def test_exact_sequence_for_a_linear_card():
    # The seeds' line on a 24 GiB card: usable 21.1 GiB.
    settings = SearchSettings(total_bytes=24 * GIB)
    trials = run_policy(linear(0.529 * GIB, 0.088 * GIB), settings)
    assert [(t.batch_size, t.purpose) for t in trials] == [
        (1, "grow"), (8, "grow"), (116, "grow"), (227, "verify-safe"), (204, "verify-conservative")]
    # safe: the point formula gives 233; verified 2.5 % below it (floor(233 x 0.975) = 227) so a refit
    # cannot leave it above the moved limit; conservative = floor(0.9 x 227)
    state = settle(trials, settings)
    assert (state.limits.safe_batch_size, state.limits.conservative_batch_size) == (227, 204)
    assert state.safe_trial.batch_size == 227 and state.conservative_trial.batch_size == 204
    assert all(t.fits(settings.usable_bytes) for t in trials)


def test_oom_above_n_brings_the_limit_down_and_verifies_below_it():
    # The card fails at 150 although the line says 233 would fit (e.g. fragmentation).
    settings = SearchSettings(total_bytes=24 * GIB)
    trials = run_policy(linear(0.529 * GIB, 0.088 * GIB), settings, oom_above=150)
    statuses = [(t.batch_size, t.status) for t in trials]
    assert statuses[:5] == [(1, "ok"), (8, "ok"), (116, "ok"), (227, "oom"), (166, "oom")]  # then bisection
    state = settle(trials, settings)
    assert 151 <= state.failed_batch_size <= 159
    assert 145 <= state.limits.safe_batch_size <= 150  # within snap_tolerance of the true boundary
    assert state.safe_trial.batch_size == state.limits.safe_batch_size and state.safe_trial.status == "ok"
    assert state.conservative_trial.batch_size == state.limits.conservative_batch_size
    assert state.limits.conservative_batch_size <= 0.9 * state.limits.safe_batch_size
    assert len(trials) <= 10


def test_noisy_memory_settles_on_verified_sizes_within_usable():
    rng = np.random.default_rng(3)
    settings = SearchSettings(total_bytes=16 * GIB)
    trials = run_policy(lambda b: 0.4 * GIB + 0.02 * GIB * b + rng.normal(0, 0.03 * GIB), settings)
    state = settle(trials, settings)
    point = (settings.usable_bytes - 0.4 * GIB) / (0.02 * GIB)
    assert state.limits.safe_batch_size <= point  # noise only lowers the limit
    assert state.safe_trial.peak_bytes <= settings.usable_bytes
    assert state.conservative_trial.peak_bytes <= settings.usable_bytes
    assert len(trials) <= settings.max_trials


def test_super_linear_memory_is_caught_by_verification():
    # Memory grows faster than the early points suggest: the first safe guess is over budget.
    settings = SearchSettings(total_bytes=24 * GIB, max_trials=24)
    trials = run_policy(lambda b: 0.5 * GIB + 0.05 * GIB * b + 0.0004 * GIB * b * b, settings)
    state = settle(trials, settings)
    over = [t for t in trials if t.ok and not t.fits(settings.usable_bytes)]
    assert over or any(t.status == "oom" for t in trials)  # a verification did fail
    assert state.safe_trial is not None and state.safe_trial.fits(settings.usable_bytes)
    assert state.limits.safe_batch_size < state.failed_batch_size


def test_nothing_fits_stops_after_the_first_trial():
    settings = SearchSettings(total_bytes=1 * GIB)
    trials = run_policy(linear(2 * GIB, 0.1 * GIB), settings)
    assert [(t.batch_size, t.status) for t in trials] == [(1, "oom")]


def test_growth_never_jumps_at_or_past_a_failure():
    settings = SearchSettings(total_bytes=24 * GIB, limits=LimitSettings())
    trials = [Trial(1, "ok", GIB), Trial(2, "oom")]
    assert next_batch_size(trials, settings) is None  # no size left between 1 and 2: cannot fit a line
    trials = [Trial(1, "ok", GIB), Trial(2, "ok", int(1.1 * GIB)), Trial(64, "timeout")]
    step = next_batch_size(trials, settings)
    assert step.purpose == "grow" and 2 < step.batch_size < 64


def test_max_trials_bounds_the_calibration():
    settings = SearchSettings(total_bytes=24 * GIB, max_trials=3)
    trials = run_policy(linear(0.529 * GIB, 0.088 * GIB), settings)
    assert len(trials) == 3
    state = settle(trials, settings)
    assert state.safe_trial is None  # not verified: the profile must say so


def test_recorded_host_trials_settle_instead_of_creeping_upward():
    """Trials recorded on the 2-core host (4 GiB budget): after 114 passed, a refit that moves the safe
    size a few samples up must not start another verify-safe round (it crept 114, 118, 122, 126 before)."""
    mib = 2**20
    recorded = [Trial(1, "ok", int(465.87 * mib)), Trial(2, "ok", int(486.89 * mib)),
                Trial(64, "ok", int(1.64 * GIB)), Trial(139, "ok", int(3.28 * GIB)),
                Trial(114, "ok", int(2.60 * GIB))]
    settings = SearchSettings(total_bytes=4 * GIB)
    state = settle(recorded, settings)
    assert state.safe_trial.batch_size == 114 and state.limits.safe_batch_size == 114
    assert next_batch_size(recorded, settings) == Step(102, "verify-conservative")


def test_calibration_names_the_first_trials_failure_in_plain_words():
    import pytest

    from vramcal.calibrate.probe import CalibrationError, calibrate_trials
    from vramcal.models.regressor import ModelSpec
    from vramcal.records import Device

    class OomRunner:  # fake at the hardware boundary: every trial runs out of memory
        context: dict = {}

        def run(self, request, purpose=""):
            return Trial(request.batch_size, "oom", error="Traceback ...\nRuntimeError: can't allocate memory\n")

    host = Device(kind="host", name="test host", total_bytes=8 * GIB, total_source="--capacity")
    with pytest.raises(CalibrationError) as caught:
        calibrate_trials(host, ModelSpec().ref("transformers"), runner=OomRunner())
    assert "(it ended with oom: RuntimeError: can't allocate memory);" in str(caught.value)
