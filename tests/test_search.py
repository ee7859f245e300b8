"""The search policy against fake trial runners: exact sequences, OOM above N, noise, non-linearity."""

import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from bench.search_curves import LIMITS, Case, curve, largest_within, run_case, simulate
from vramcal.calibration.limits import LimitSettings
from vramcal.calibration.search import SearchSettings, Step, next_batch_size, settle
from vramcal.records import Trial

from fakes import GIB, run_policy

_curve = curve  # the synthetic curves' shapes (issue 9), where bench.search_curves keeps them


def linear(overhead, slope):
    return lambda b: overhead + slope * b


def test_exact_sequence_for_a_linear_card():
    # The seeds' line on a 24 GiB card: usable 21.1 GiB, total 24 GiB.
    settings = SearchSettings(total_bytes=24 * GIB)
    trials = run_policy(linear(0.529 * GIB, 0.088 * GIB), settings)
    assert [(t.batch_size, t.purpose) for t in trials] == [
        (1, "grow"), (8, "grow"), (116, "grow"), (258, "boundary"), (227, "verify-safe"),
        (227, "verify-safe-repeat"), (204, "verify-conservative"), (204, "steady")]
    # safe: the point formula gives 233; verified 2.5 % below it (floor(233 x 0.975) = 227), twice;
    # conservative = floor(0.9 x 227); the boundary trial (over usable, under total) measured the top
    state = settle(trials, settings)
    assert (state.limits.safe_batch_size, state.limits.conservative_batch_size) == (227, 204)
    assert state.safe_trial.batch_size == 227 and state.conservative_trial.batch_size == 204
    true_boundary = (24 - 0.529) * GIB / (0.088 * GIB)
    assert abs(state.limits.boundary_batch_size - true_boundary) / true_boundary < 0.005
    assert [t.batch_size for t in trials if not t.fits(settings.usable_bytes)] == [258]


def test_oom_above_n_brings_the_limit_down_and_verifies_below_it():
    # The card fails at 151 although the line says 233 would fit (e.g. fragmentation).
    settings = SearchSettings(total_bytes=24 * GIB)
    trials = run_policy(linear(0.529 * GIB, 0.088 * GIB), settings, oom_above=150)
    statuses = [(t.batch_size, t.status) for t in trials]
    assert statuses[:5] == [(1, "ok"), (8, "ok"), (116, "ok"), (258, "oom"), (187, "oom")]  # then bisection
    state = settle(trials, settings)
    assert 151 <= state.failed_batch_size <= 165
    assert 143 <= state.limits.safe_batch_size <= 150  # within snap_tolerance of the true boundary
    assert state.safe_trial.batch_size == state.limits.safe_batch_size and state.safe_trial.status == "ok"
    assert state.conservative_trial.batch_size == state.limits.conservative_batch_size
    assert state.limits.conservative_batch_size <= 0.9 * state.limits.safe_batch_size
    first_oom = min(t.batch_size for t in trials if t.status == "oom")
    assert state.limits.boundary_batch_size < first_oom  # never at or above a batch that ran out of memory
    assert len(trials) <= 10


def test_noisy_memory_settles_on_verified_sizes_within_usable():
    rng = np.random.default_rng(3)
    settings = SearchSettings(total_bytes=16 * GIB)
    trials = run_policy(lambda b: 0.4 * GIB + 0.02 * GIB * b + rng.normal(0, 0.03 * GIB), settings)
    state = settle(trials, settings)
    point = (settings.usable_bytes - 0.4 * GIB) / (0.02 * GIB)
    assert state.limits.safe_batch_size <= point  # noise only lowers the limit
    safe_trials = [t for t in trials if t.batch_size == state.limits.safe_batch_size and t.purpose != "steady"]
    assert len(safe_trials) == 2 and all(t.peak_bytes <= settings.usable_bytes for t in safe_trials)
    assert state.conservative_trial.peak_bytes <= settings.usable_bytes
    assert len(trials) <= settings.max_trials


def test_a_repeated_size_puts_its_spread_into_the_fit():
    """Two trials at one batch size that differ (host noise): the residual error covers that spread, so the
    prediction interval is at least as wide as the repeatability of one size."""
    from vramcal.calibration.search import fit_trials

    mib = 2**20
    trials = [Trial(64, "ok", 1000 * mib), Trial(128, "ok", 1500 * mib), Trial(200, "ok", 2060 * mib),
              Trial(200, "ok", 2000 * mib)]  # the same size: 3 % apart
    fit = fit_trials(trials, SearchSettings(total_bytes=8 * GIB))
    assert fit.residual_stderr_bytes >= 30 * mib / 2**0.5 * 0.5
    assert fit.upper(200) - fit.predict(200) > 30 * mib


def test_super_linear_memory_is_caught_by_verification():
    # Memory grows faster than the early points suggest: the first safe guess is over budget.
    settings = SearchSettings(total_bytes=24 * GIB, max_trials=24)
    trials = run_policy(lambda b: 0.5 * GIB + 0.05 * GIB * b + 0.0004 * GIB * b * b, settings)
    state = settle(trials, settings)
    over = [t for t in trials if t.ok and not t.fits(settings.usable_bytes)]
    assert over or any(t.status == "oom" for t in trials)  # a trial did go past usable memory
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
    assert next_batch_size(trials, settings) == Step(64, "retry")  # rule 7: a timeout measured nothing
    step = next_batch_size([*trials, Trial(64, "timeout")], settings)
    assert step.purpose == "grow" and 2 < step.batch_size < 64  # twice: no proposal reaches it


def test_max_trials_bounds_the_calibration():
    settings = SearchSettings(total_bytes=24 * GIB, max_trials=3)
    trials = run_policy(linear(0.529 * GIB, 0.088 * GIB), settings)
    assert len(trials) == 3
    state = settle(trials, settings)
    assert state.safe_trial is None  # not verified: the profile must say so


def test_a_flat_start_is_left_out_of_the_fit():
    """Host peaks sit flat for the first samples (memory the process already holds); a line through them
    would pull the slope down. The fit uses the rising points only."""
    from vramcal.calibration.search import fit_points

    mib = 2**20
    trials = [Trial(1, "ok", 556 * mib), Trial(8, "ok", 556 * mib), Trial(64, "ok", 557 * mib),
              Trial(512, "ok", 708 * mib), Trial(841, "ok", 855 * mib), Trial(900, "ok", 880 * mib)]
    assert [t.batch_size for t in fit_points(trials, SearchSettings(total_bytes=2 * GIB))] == [512, 841, 900]
    # growth past a flat start is x8, not an extrapolation of a flat line (which once jumped 64 -> 4096)
    assert next_batch_size(trials[:3], SearchSettings(total_bytes=2 * GIB)) == Step(512, "grow")


def test_without_a_failure_a_missing_fit_point_is_added_below_the_estimate_not_halfway_to_the_cap():
    """Recorded on Python 3.11 with the CUDA build of torch (2 GiB budget): a flat start (1 and 8 within 2 %
    of a 1.02 GiB process) and two rising points, 64 and 98, right under the estimated limit (~104). With no
    failure, "halfway between what fitted and what failed" took the batch-size cap for the failure and
    proposed 524,337, then bisected down through eleven out-of-memory trials and ended unverified."""
    trials = [Trial(1, "ok", 1099984896), Trial(8, "ok", 1120956416), Trial(64, "ok", 1282473984),
              Trial(98, "ok", 1379581952)]
    step = next_batch_size(trials, SearchSettings(total_bytes=2 * GIB))
    assert step == Step(81, "fill")  # between the rising points: the third point of the fit


def test_verifications_near_the_limit_at_one_peak_are_fitted_not_dropped_as_a_flat_start():
    """A length calibrated by its verifications only (vramcal.calibration.surface) has sizes about 10 % apart
    whose peaks differ by less than the noise threshold; they are points near the limit, not a flat start
    (with the CUDA build of torch, whose process holds 540 MiB more, the threshold grew past their difference
    and the whole length was dropped: no surface)."""
    from vramcal.calibration.search import fit_points

    mib = 2**20
    trials = [Trial(121, "ok", 1126 * mib), Trial(135, "ok", 1136 * mib), Trial(135, "ok", 1136 * mib)]
    assert [t.batch_size for t in fit_points(trials, SearchSettings(total_bytes=2 * GIB))] == [121, 135, 135]


def test_a_small_limit_after_a_flat_start_still_ends_verified():
    """The issue's reproducer on an 80 GiB card: 1 and 8 at one peak, 64 out of memory, 36 higher. The
    policy adds points where the fit is too thin instead of giving up, and ends verified."""
    settings = SearchSettings(total_bytes=80 * GIB)
    usable = settings.usable_bytes

    def memory(b):
        return 0.8 * usable + 0.006 * usable * max(0, b - 10)

    trials = run_policy(memory, settings, oom_above=60)
    assert [t.batch_size for t in trials[:4]] == [1, 8, 64, 36]
    state = settle(trials, settings)
    assert state.safe_trial is not None and state.conservative_trial is not None, trials
    assert memory(state.limits.safe_batch_size) <= usable and state.limits.safe_batch_size >= 36
    assert len(trials) <= 12


def test_a_size_whose_trials_fitted_is_evidence_only_with_room_for_their_noise():
    """Rule 5 (issue 42 item 8): few points and a wide interval put the fit's safe size low, and a batch size whose
    two trials fitted with room for the noise they were measured with lifts it; a pair whose spread (2 % of usable,
    one degree of freedom near the limit: t = 12.7) leaves no such room does not, where it used to."""
    from vramcal.calibration.noise import measure_noise
    from vramcal.calibration.search import evidence_batch_size, largest_fitting

    settings = SearchSettings(total_bytes=80 * GIB)
    usable = settings.usable_bytes

    def trials(repeat):
        return [Trial(8, "ok", int(0.50 * usable)), Trial(36, "ok", int(0.70 * usable)),
                Trial(50, "ok", int(0.95 * usable)), Trial(50, "ok", int(repeat * usable)), Trial(64, "oom")]

    close, apart = trials(0.951), trials(0.97)
    for recorded in (close, apart):
        assert largest_fitting(recorded, usable) == 50
    state = settle(close, settings)
    assert state.limits.safe_batch_size == 50 and state.safe_trial.batch_size == 50
    assert evidence_batch_size(close, usable, measure_noise(close, state.fit)) == 50
    state = settle(apart, settings)
    assert evidence_batch_size(apart, usable, measure_noise(apart, state.fit)) == 36  # the next size down
    assert state.limits.safe_batch_size < 50 and state.safe_trial is None


def test_the_creeps_error_widens_the_bound_the_safe_size_is_held_to():
    """Issue 42 item 8: the creep is one steady trial's peak minus a short trial's, so it carries the noise of both;
    the bound the safe size is held to adds that error to the fit's (in quadrature, scaled to the batch size as the
    creep is), and a noise-free calibration keeps its limits."""
    from vramcal.calibration.fit import fit_linear
    from vramcal.calibration.noise import Noise, measure_noise

    fit = fit_linear([100, 150, 200, 200], [1000, 1510, 1990, 2005])
    plain, creep = Noise(10.0, 4), Noise(10.0, 4, creep_batch_size=180, creep_short_trials=1)
    assert plain.upper(fit, 200) == pytest.approx(fit.upper(200))
    widened = creep.upper(fit, 200) - fit.predict(200)
    assert widened == pytest.approx(math.hypot(fit.half_width(200), plain.t * 10.0 * math.sqrt(2) * 200 / 180))
    assert creep.holds([1900, 1900], 200, 1940) is False and plain.holds([1900, 1900], 200, 1940) is True
    settings = SearchSettings(total_bytes=24 * GIB)
    trials = run_policy(linear(0.529 * GIB, 0.088 * GIB), settings)
    state = settle(trials, settings)
    assert measure_noise(trials, state.fit).creep_batch_size == 204
    assert (state.limits.safe_batch_size, state.limits.conservative_batch_size) == (227, 204)


def test_recorded_host_trials_settle_instead_of_creeping_upward():
    """Trials recorded on the 2-core host (4 GiB budget): after 114 passed, a refit that moves the safe
    size a few samples up must not start another verify-safe round (it crept 114, 118, 122, 126 before)."""
    mib = 2**20
    recorded = [Trial(1, "ok", int(465.87 * mib)), Trial(2, "ok", int(486.89 * mib)),
                Trial(64, "ok", int(1.64 * GIB)), Trial(139, "ok", int(3.28 * GIB)),
                Trial(114, "ok", int(2.60 * GIB), purpose="verify-safe"),
                Trial(114, "ok", int(2.62 * GIB), purpose="verify-safe-repeat")]
    settings = SearchSettings(total_bytes=4 * GIB, boundary_fraction=0)
    state = settle(recorded, settings)
    assert state.safe_trial.batch_size == 114 and state.limits.safe_batch_size == 114
    assert next_batch_size(recorded, settings) == Step(102, "steady", verifies=True)  # its first steps verify 102


@pytest.mark.parametrize("kind", ["linear", "allocator-steps", "flat-start", "bend-up", "bend-down"])
@pytest.mark.parametrize("creep", [0.0, 0.06])
def test_synthetic_curves_end_verified_and_safe(kind, creep):
    """Issue 42 item 8, the exact criterion over a deterministic set: the 80 GiB half of ``bench.search_curves``'s
    600 curves (limits 8 to 60,000 samples, ±1 % noise drawn for every record, 5 seeds; the 24 GiB half differs
    only in the reserve's share of the card; it had the issue's unsafe curves at both) and the same shapes
    noise-free at 4 and 80 GiB, with and without a step creep (a long run peaks 6 % of the activations higher
    than a short trial): every calibration ends with both limits verified within ``max_trials``, and the safe
    size's true long-run peak (the curve without noise, plus the creep) within usable memory — no allowance for
    the noise. The card is not wasted: noise-free the safe size is at least a quarter (and a sample) below the
    true limit; with noise at least 0.55 of it (bench/results/search-curves: 0.69 the lowest, 0.92 the mean).
    Noise-free, the predicted boundary (a short trial's) is within 5 % of the true one (a sample is 4 % at the
    smallest limits), the steady trials are one (two where the creep moved the conservative size)."""
    for limit, seed in itertools.product(LIMITS, range(5)):
        outcome = run_case(Case(kind, creep, 80 * GIB, limit, seed), "uniform")
        assert outcome.over is not None and outcome.over <= 0, outcome
        assert limit == 8 or outcome.ratio >= 0.55, outcome
    for total, limit in itertools.product((4 * GIB, 80 * GIB), (8, 60, 2000, 60_000)):
        settings = SearchSettings(total_bytes=total)
        usable, memory = settings.usable_bytes, curve(kind, total, limit)

        def long_run(b, memory=memory):
            return memory(b) + creep * (memory(b) - memory(0))
        trials = simulate(memory, settings, lambda b, memory=memory: creep * (memory(b) - memory(0)))
        state = settle(trials, settings)
        case = (kind, creep, total // GIB, limit, [(t.batch_size, t.purpose, t.status) for t in trials])
        assert state.safe_trial is not None and state.conservative_trial is not None, case
        safe, conservative = state.limits.safe_batch_size, state.limits.conservative_batch_size
        assert long_run(safe) <= usable and long_run(conservative) <= usable and conservative <= safe, case
        assert safe >= 0.75 * largest_within(long_run, usable) - 1, case
        steady = [t.batch_size for t in trials if t.purpose == "steady"]
        assert len(steady) == 1 or (len(steady) == 2 and abs(steady[0] - steady[1]) > 0.05 * steady[1]), case
        truth = largest_within(memory, total)
        assert abs(state.limits.boundary_batch_size - truth) <= max(1.5, 0.05 * truth), case
        at = state.safe_trial.batch_size  # its verification is read as the long run's peak
        assert state.safe_trial.peak_bytes == pytest.approx(long_run(at), rel=0.01), case
        if kind == "linear":  # and the fit predicts the long run
            assert state.fit.predict(at) == pytest.approx(long_run(at), rel=1e-3), case


def test_a_creep_past_usable_memory_brings_the_limits_down_and_verifies_them_again():
    """The steady trial at the verified conservative size reads a creep that takes the safe size above usable
    memory: the limits come down, the new safe size is verified by short trials whose steady-equivalent peaks
    fit, and a second steady trial measures the creep at the new conservative size (more than 5 % below the
    first's); no third."""
    settings = SearchSettings(total_bytes=24 * GIB)
    memory = linear(0.529 * GIB, 0.088 * GIB)
    trials = run_policy(memory, settings, creep=lambda b: 0.01 * GIB * b)  # 11 % of the activations
    purposes = [(t.batch_size, t.purpose) for t in trials]
    assert purposes[:8] == [(1, "grow"), (8, "grow"), (116, "grow"), (258, "boundary"), (227, "verify-safe"),
                            (227, "verify-safe-repeat"), (204, "verify-conservative"), (204, "steady")]
    state = settle(trials, settings)
    safe = state.limits.safe_batch_size
    assert safe < 227 and state.safe_trial is not None and state.conservative_trial is not None
    assert memory(safe) + 0.01 * GIB * safe <= settings.usable_bytes
    assert [t for t in trials[8:] if t.purpose.startswith("verify-safe")], purposes
    steady = [t.batch_size for t in trials if t.purpose == "steady"]
    assert len(steady) == 2 and steady[0] == 204 and steady[1] == state.limits.conservative_batch_size < 0.95 * 204
    assert state.limits.boundary_batch_size == pytest.approx((24 - 0.529) / 0.088, abs=1.5)  # a short trial's


def test_the_steady_trials_first_steps_verify_the_conservative_size():
    """Rule 6 (issue 19): once the safe size is verified, the policy asks for one steady trial at the conservative
    size that verifies it too, instead of a short verification and then a steady trial there; the records are the
    same (a ``verify-conservative`` and a ``steady`` at 204), one process fewer. Switched off: two processes."""
    import dataclasses

    settings = SearchSettings(total_bytes=24 * GIB)
    trials = run_policy(linear(0.529 * GIB, 0.088 * GIB), settings)
    at = [(t.batch_size, t.purpose) for t in trials].index((204, "verify-conservative"))
    assert next_batch_size(trials[:at], settings) == Step(204, "steady", verifies=True)
    apart = dataclasses.replace(settings, steady_verifies=False)
    assert next_batch_size(trials[:at], apart) == Step(204, "verify-conservative")
    assert next_batch_size(trials[:at + 1], apart) == Step(204, "steady")
    assert [(t.batch_size, t.purpose) for t in run_policy(linear(0.529 * GIB, 0.088 * GIB), apart)] == [
        (t.batch_size, t.purpose) for t in trials]
    # no room for both records under max_trials: the verification runs on its own
    assert next_batch_size(trials[:at], dataclasses.replace(settings, max_trials=at + 1)) == Step(
        204, "verify-conservative")


def test_a_second_steady_trial_that_measures_less_per_sample_does_not_raise_the_limits():
    """Issue 19 (the small spec at 1.5 GiB, bench/results/fold): steady at 135 said 150 no longer fits; the limits
    came down, a second steady trial at 118 (the other side of glibc's mmap threshold) measured less per sample,
    and read last it took the safe size back to 150. The larger creep counts; profiles made before read the last."""
    from vramcal.calibration.creep import measure_creep, steady_equivalent

    mib = 2**20
    trials = [Trial(118, "ok", 760 * mib, purpose="grow"), Trial(135, "ok", 800 * mib, purpose="verify-conservative"),
              Trial(135, "ok", 840 * mib, purpose="steady"), Trial(118, "ok", 770 * mib, purpose="steady")]
    largest, last = measure_creep(trials), measure_creep(trials, rule="last")
    assert (largest.batch_size, last.batch_size) == (135, 118)
    assert largest.per_sample_bytes == 40 * mib / 135 > last.per_sample_bytes == 10 * mib / 118
    assert [t.peak_bytes for t in steady_equivalent(trials)] == [760 * mib + round(40 * mib / 135 * 118),
                                                                  800 * mib + 40 * mib]
    assert [t.peak_bytes for t in steady_equivalent(trials, "last")] == [770 * mib,
                                                                          800 * mib + round(10 * mib / 118 * 135)]


def test_a_steady_trial_that_runs_out_of_memory_is_a_failure_and_gets_one_more_try():
    settings = SearchSettings(total_bytes=24 * GIB)
    memory = linear(0.529 * GIB, 0.088 * GIB)
    trials = []
    while (step := next_batch_size(trials, settings)) is not None:
        if step.purpose == "steady":
            trials.append(Trial(step.batch_size, "oom", purpose="steady", error="CUDA out of memory"))
        else:
            trials.append(Trial(step.batch_size, "ok", int(memory(step.batch_size)), purpose=step.purpose))
    steady = [t for t in trials if t.purpose == "steady"]
    state = settle(trials, settings)
    assert len(steady) == 2 and steady[1].batch_size < steady[0].batch_size
    assert state.limits.safe_batch_size < steady[1].batch_size and state.safe_trial is not None


def test_no_steady_trial_when_steady_steps_is_zero():
    settings = SearchSettings(total_bytes=24 * GIB, steady_steps=0)
    trials = run_policy(linear(0.529 * GIB, 0.088 * GIB), settings, creep=lambda b: 0.01 * GIB * b)
    assert "steady" not in [t.purpose for t in trials]
    assert settle(trials, settings).limits.safe_batch_size == 227


def test_calibration_names_the_first_trials_failure_in_plain_words():
    import pytest

    from vramcal.models.regressor.spec import RegressorSpec
    from vramcal.records import Device
    from vramcal.service.calibrator import CalibrationError, CalibrationPlan, run_trials

    class OomRunner:  # fake at the hardware boundary: every trial runs out of memory
        context: dict = {}

        def run(self, request, purpose=""):
            return (Trial(request.batch_size, "oom", error="RuntimeError: can't allocate memory\nTraceback ...\n"),)

    host = Device(kind="host", name="test host", total_bytes=8 * GIB, total_source="--capacity")
    with pytest.raises(CalibrationError) as caught:
        run_trials(CalibrationPlan(host, RegressorSpec().ref("transformers"), LimitSettings(), {}, Path("p.json")),
                   OomRunner())
    assert "(it ran out of memory: RuntimeError: can't allocate memory);" in str(caught.value)


def test_the_creep_is_read_from_the_steady_trial_and_scaled_per_token():
    from vramcal.calibration.creep import measure_creep, steady_equivalent

    trials = [Trial(100, "ok", 1000 * 2**20, purpose="verify-safe", seq_len=64),
              Trial(100, "ok", 1010 * 2**20, purpose="verify-safe-repeat", seq_len=64),
              Trial(100, "ok", 1045 * 2**20, purpose="steady", seq_len=64),
              Trial(50, "ok", 900 * 2**20, purpose="verify-safe", seq_len=128),
              Trial(120, "oom", purpose="grow", seq_len=64)]
    creep = measure_creep(trials)
    assert (creep.short_peak_bytes, creep.bytes_at_steady) == (1005 * 2**20, 40 * 2**20)
    read = steady_equivalent(trials)
    assert [t.peak_bytes for t in read] == [1040 * 2**20, 1050 * 2**20, 940 * 2**20, None]  # 50 x 128 = 100 x 64
    assert steady_equivalent(read) == read  # idempotent: the search and the profile may both apply it
    lower = [*trials[:2], Trial(100, "ok", 990 * 2**20, purpose="steady", seq_len=64)]
    assert measure_creep(lower).per_sample_bytes == 0  # a steady trial below the short ones: no creep, never less
    failed = [*trials[:2], Trial(100, "oom", purpose="steady")]
    assert measure_creep(failed) is None and [t.status for t in steady_equivalent(failed)] == ["ok", "ok", "oom"]


def test_a_profile_with_a_steady_trial_records_the_creep_and_loads(tmp_path):
    from vramcal.models.regressor.spec import RegressorSpec
    from vramcal.profile import load_profile, save_profile
    from vramcal.service.calibrator import CalibrationPlan, assemble

    from profiles_for_tests import gpu_device

    device = gpu_device(total_bytes=24 * GIB)
    settings = SearchSettings(total_bytes=device.total_bytes)
    trials = run_policy(linear(0.529 * GIB, 0.088 * GIB), settings, creep=lambda b: 0.01 * GIB * b)
    plan = CalibrationPlan(device, RegressorSpec().ref("transformers"), settings.limits, {}, tmp_path / "p.json")
    profile = assemble(plan, trials, {}, 1.0)
    assert profile.verified and profile.creep.batch_size == profile.limits.conservative_batch_size < 204  # the
    # second steady trial's, at the conservative size the first one's creep brought the limits down to
    assert profile.verification["safe"].peak_bytes > max(t.peak_bytes for t in trials if t.batch_size ==
                                                          profile.limits.safe_batch_size and t.purpose != "steady")
    from vramcal.report.markdown import trials_table

    marked = [line for line in trials_table(profile).splitlines() if line.rstrip(" |").endswith("yes")]
    assert len(marked) == profile.fit.n_points  # the fit's points are the trials' peaks plus the creep
    loaded = load_profile(save_profile(profile, tmp_path / "p.json"))  # its checks accept the creep-read peaks
    assert loaded.creep == profile.creep and loaded.to_dict()["creep"]["per_sample_bytes"] == pytest.approx(0.01 * GIB)


def test_a_boundary_trial_bisected_down_from_a_failure_is_followed_by_one_near_the_boundary():
    """The benchmark's wide spec at 2 GiB (recorded peaks, MiB; bisection put the boundary at 55): the first
    boundary trial (71) ran out of memory, the second (43) landed far below; the line through 43 and the
    verifications extrapolated to 57.5 (+4.5 %). A third trial near the predicted boundary pins it to +1.6 %."""
    recorded = {1: 563.8, 2: 599.5, 4: 683.5, 8: 833.8, 16: 980.8, 21: 1133.6, 24: 1232.4, 32: 1393.3,
                43: 1695.1, 48: 1834.0, 52: 1940.2, 54: 1996.3, 55: 2023.3}
    sizes = sorted(recorded)
    settings = SearchSettings(total_bytes=2 * GIB)
    trials = run_policy(lambda b: np.interp(b, sizes, [recorded[s] * 2**20 for s in sizes]), settings, oom_above=55)
    boundary = [(t.batch_size, t.status) for t in trials if t.purpose == "boundary"]
    assert boundary[:2] == [(71, "oom"), (43, "ok")] and len(boundary) == 3 and boundary[2][0] > 43
    assert abs(settle(trials, settings).limits.boundary_batch_size - 55) <= 0.03 * 55


def test_the_step_creep_moves_the_limits_but_not_the_boundary():
    """The benchmark's small spec at 1.5 GiB (recorded, MiB; bisection put the boundary at 548): the steady
    trial at 152 peaked 30.9 MiB above the short ones there. The predictions carry the creep; the predicted
    boundary, a short trial's, is the same with or without it (it fell to 514, -6 %, when it did not)."""
    recorded = [(1, "grow", 498.8), (8, "grow", 520.8), (59, "grow", 670.8), (341, "boundary", 1145.6),
                (118, "grow", 816.3), (560, "boundary", None), (139, "verify-safe", 797.1),
                (152, "verify-safe", 837.6), (152, "verify-safe-repeat", 832.3), (136, "verify-conservative", 792.4)]
    trials = [Trial(b, "ok", int(mib * 2**20), purpose=p) if mib else Trial(b, "oom", purpose=p)
              for b, p, mib in recorded]
    steady = Trial(152, "ok", int(865.8 * 2**20), purpose="steady")
    settings = SearchSettings(total_bytes=int(1.5 * GIB))
    without, with_creep = settle(trials, settings), settle([*trials, steady], settings)
    assert with_creep.limits.boundary_batch_size == without.limits.boundary_batch_size
    assert abs(with_creep.limits.boundary_batch_size - 548) <= 0.03 * 548
    assert with_creep.fit.predict(152) - without.fit.predict(152) == pytest.approx(30.9 * 2**20, rel=0.02)


@pytest.mark.parametrize("status", ["error", "timeout"])
def test_an_error_or_timeout_near_the_limit_is_retried_and_never_becomes_a_limit(status):
    """Rule 7: the first trial at or above 200 samples ends in an error (or a timeout) once: it is run once
    more, and the calibration ends as if it had not happened (the same limits and boundary as a clean one)."""
    settings = SearchSettings(total_bytes=24 * GIB)
    memory = linear(0.529 * GIB, 0.088 * GIB)
    clean = settle(run_policy(memory, settings), settings)
    first = []

    def once(batch_size: int, n: int) -> str | None:
        if batch_size >= 200 and not first:
            first.append(batch_size)
            return status
        return None

    trials = run_policy(memory, settings, unmeasured=once)
    retried = [t for t in trials if t.batch_size == first[0]]
    assert [t.status for t in retried][:2] == [status, "ok"] and retried[1].purpose == "retry"
    state = settle(trials, settings)
    assert state.limits.safe_batch_size == clean.limits.safe_batch_size
    assert state.failed_batch_size == clean.failed_batch_size  # (the retried trial, measured, was over usable)
    assert state.limits.boundary_batch_size == pytest.approx(clean.limits.boundary_batch_size, rel=0.01)


def test_a_size_unmeasured_twice_is_never_reached_again_nor_a_limit():
    """Every trial at 230 samples or more times out: no proposal reaches them after the retry, no failure is
    recorded there, and the limits are what the trials below could verify."""
    settings = SearchSettings(total_bytes=24 * GIB)
    trials = run_policy(linear(0.529 * GIB, 0.088 * GIB), settings,
                        unmeasured=lambda b, n: "timeout" if b >= 230 else None)
    ceiling = min(t.batch_size for t in trials if t.status == "timeout")
    assert sum(t.batch_size == ceiling for t in trials) == 2  # the trial and its retry
    assert all(t.batch_size < ceiling for t in trials if t.status != "timeout")
    state = settle(trials, settings)
    assert state.failed_batch_size is None and state.limits.failed_batch_size is None
    assert state.safe_trial is not None and state.safe_trial.batch_size < ceiling


def test_an_aimed_search_jumps_to_half_the_estimated_limit_and_verifies_the_same_limits():
    """Issue 38: with an estimate's slope (vramcal.estimate.learned.aim_for) the search leaves batch size 1 for half the
    limit that slope gives (its worst under-prediction added) instead of climbing x8; the limits it verifies are
    the climbing search's, on a host-like curve (a flat start of arenas, then a line)."""
    from vramcal.calibration.search import Aim

    mib = 2**20
    memory = lambda b: 480 * mib + max(0, b - 8) * 0.25 * mib  # noqa: E731 - flat to 8 samples, then 256 KiB each
    climbing = SearchSettings(total_bytes=int(1.5 * GIB))
    aimed = SearchSettings(total_bytes=int(1.5 * GIB), aim=Aim(0.25 * mib, -0.04, 0.04, "a test"))
    first = [Trial(1, "ok", int(memory(1)))]
    assert next_batch_size(first, climbing) == Step(8, "grow")
    limit = 1 + (aimed.usable_bytes - memory(1)) / (0.25 * mib / 0.96)  # the aim's line from the trial at 1
    assert next_batch_size(first, aimed) == Step(int(limit // 2), "grow")  # no x64 cap on an aimed jump
    slow, fast = run_policy(memory, climbing), run_policy(memory, aimed)
    assert len(fast) < len(slow)
    truth = 8 + (aimed.usable_bytes - 480 * mib) / (0.25 * mib)  # where the line reaches usable memory
    safe, climbed = settle(fast, aimed).limits.safe_batch_size, settle(slow, climbing).limits.safe_batch_size
    assert 0.95 * truth <= safe <= truth and safe >= 0.99 * climbed
