"""Throughput from the trials' step times (issue 22): pooled rates with their intervals, steadiness, the knee,
interpolation without extrapolation, and the new Trial fields' round trip (old profiles still load)."""

from __future__ import annotations

import math

import pytest

from vramcal.calibration.throughput import (
    KNEE_FRACTION,
    NEAR_FRACTION,
    STEADY_MIN_STEPS,
    find_knee,
    measured_rates,
    overlap,
    rate_at,
    rate_for_run,
)
from vramcal.profile import Profile, load_profile, save_profile
from vramcal.records import Trial

from profiles_for_tests import gpu_profile, timed_profile

T_975_3 = 3.182446305284263  # Student's t, 0.975 quantile, 3 degrees of freedom (tables)


def trial(b: int, times: tuple[float, ...] | None, purpose: str = "grow", **more) -> Trial:
    median = sorted(times)[len(times) // 2] if times else more.pop("step_s", None)
    return Trial(b, "ok", 2**30, step_s=median, samples_per_s=b / median if median else None, step_times_s=times,
                 purpose=purpose, **more)


def test_a_rate_pools_every_timed_step_of_a_batch_size_and_gives_the_mean_with_a_t_interval():
    rates = measured_rates([trial(8, (0.10, 0.12)), trial(8, (0.11, 0.13), "verify-safe"), trial(16, (0.2, 0.2))])
    rate = rates[0]
    assert [r.batch_size for r in rates] == [8, 16]
    assert (rate.n_steps, rate.n_trials, rate.steady, rate.per_step) == (4, 2, False, True)
    assert rate.step_s == pytest.approx(0.115)  # the mean, not the median: an epoch is the sum of its steps
    assert rate.samples_per_s == pytest.approx(8 / 0.115)
    sd = math.sqrt(((0.015**2) * 2 + (0.005**2) * 2) / 3)
    half = T_975_3 * sd / 2
    assert rate.step_sd_s == pytest.approx(sd)
    assert rate.low_samples_per_s == pytest.approx(8 / (0.115 + half))
    assert rate.high_samples_per_s == pytest.approx(8 / (0.115 - half))
    assert rate.spread == pytest.approx(sd / 0.115)


def test_failed_trials_and_trials_without_times_give_no_rate():
    rates = measured_rates([Trial(4, "oom"), Trial(8, "ok", 2**30), trial(2, (0.5,))])
    assert [r.batch_size for r in rates] == [2]
    assert rates[0].low_samples_per_s is None and rates[0].high_samples_per_s is None  # one step: no interval


def test_an_old_profile_without_step_times_shows_each_trials_median():
    old = trial(8, None, step_s=0.2)
    (rate,) = measured_rates([old, trial(8, None, step_s=0.4)])
    assert (rate.samples_per_s, rate.n_steps, rate.per_step) == (pytest.approx(8 / 0.3), 2, False)


def test_a_rate_is_steady_with_a_steady_trial_or_enough_timed_steps():
    short = measured_rates([trial(8, (0.1,) * (STEADY_MIN_STEPS - 1))])[0]
    many = measured_rates([trial(8, (0.1,) * STEADY_MIN_STEPS)])[0]
    steady = measured_rates([trial(8, (0.1, 0.1), "steady")])[0]
    assert (short.steady, many.steady, steady.steady) == (False, True, True)


def test_the_first_step_and_the_validation_pass_are_averaged_over_the_trials():
    (rate,) = measured_rates([trial(8, (0.1, 0.1), warmup_times_s=(0.5, 0.1), val_times_s=(0.03,)),
                              trial(8, (0.1, 0.1), warmup_times_s=(0.3,), val_times_s=(0.05, 0.04))])
    assert rate.first_step_s == pytest.approx(0.4) and rate.val_s == pytest.approx(0.04)


def test_the_knee_is_the_smallest_batch_reaching_95_percent_of_the_best():
    # samples/s: 1 -> 10, 8 -> 47, 16 -> 48, 64 -> 50 (the best), 128 -> 49; two equal step times: a finite interval
    rates = measured_rates([trial(b, (b / r,) * 2) for b, r in ((1, 10), (8, 47), (16, 48), (64, 50), (128, 49))])
    knee = find_knee(rates)
    assert KNEE_FRACTION == 0.95 and knee.refused is None
    assert (knee.batch_size, knee.best.batch_size, knee.below) == (16, 64, 8)  # 47 < 47.5 <= 48
    assert knee.rate.samples_per_s == pytest.approx(48)
    assert find_knee(rates, high=32).batch_size == 8  # the best there is 48 (at 16): 47 >= 45.6
    assert find_knee(rates, low=100).batch_size == 128
    assert find_knee(rates, high=0) is None and find_knee([]) is None


def test_a_knee_is_not_called_from_a_rate_whose_interval_is_open_and_says_which_sizes_need_more_steps():
    """Two step times 30 % apart (a busy host's short trial, as the issue's "(15.6–∞)"): t(0.975, 1) = 12.7 leaves
    the rate's interval open above, so that size may be the best one; ten steps at each size close it."""
    noisy = [trial(8, (0.10, 0.13)), trial(45, (0.5, 0.65)), trial(76, (0.8, 0.81)), trial(85, (0.9, 0.91))]
    rates = measured_rates(noisy)
    assert rates[0].high_samples_per_s is None and rates[1].high_samples_per_s is None and rates[2].bounded
    knee = find_knee(rates)
    assert knee.refused is not None and "batch sizes 8, 45 (2 timed steps each) have no finite 95 % interval" in \
        knee.refused and f"{STEADY_MIN_STEPS} steps" in knee.refused
    assert find_knee(rates, low=76).refused is None  # among the sizes with finite intervals a knee is called
    steady = measured_rates([trial(b, (t, t * 1.3) * 5) for b, t in ((8, 0.1), (45, 0.5), (76, 0.8))])
    assert all(r.bounded for r in steady) and find_knee(steady).refused is None
    old = measured_rates([trial(8, None, step_s=0.2), trial(16, None, step_s=0.3)])  # medians only: no interval
    assert "predates per-step times" in find_knee(old).refused


def test_a_short_trial_times_steps_until_its_rate_has_a_finite_interval_at_most_four_more():
    """Issue 42 item 3: the knee was refused from two-step rates ("(15.6–∞)"); a short trial now goes on timing
    steps until its own give a finite 95 % interval (the same interval :func:`measured_rates` computes), at most
    EXTRA_TIMED_STEPS beyond its measured ones."""
    from vramcal.calibration.throughput import EXTRA_TIMED_STEPS, finite_interval, timing_done

    assert not timing_done([0.1], 2) and timing_done([0.10, 0.105], 2)  # 3.5 % apart: finite with two
    assert not timing_done([0.10, 0.13], 2) and timing_done([0.10, 0.13, 0.11], 2)  # 26 %: open; a third closes it
    spread = [0.05, 1.0, 0.05, 1.0, 0.05, 1.0]  # open at every count: the cap ends it
    assert [timing_done(spread[:n], 2) for n in range(2, 7)] == [False, False, False, False, True]  # the cap: 2 + 4
    assert EXTRA_TIMED_STEPS == 4 and not finite_interval(spread)
    for times in ([0.10, 0.105], [0.10, 0.13], [0.10, 0.13, 0.11], spread[:4]):  # the same rule as the rates'
        (rate,) = measured_rates([Trial(8, "ok", 1, step_times_s=tuple(times))])
        assert rate.bounded == finite_interval(times), times


def test_the_workers_t_quantile_is_scipys_at_every_count_and_the_rule_agrees_with_the_rates_past_eleven_steps():
    """timing_done (in the worker, no scipy) and the rates' intervals read one quantile: up to 60 timed steps it is
    scipy's within 1e-5, and a series whose interval closes only past 11 steps (where a normal quantile of 1.96
    stood in) is judged the same way by both."""
    from scipy import stats

    from vramcal.calibration.throughput import finite_interval, t_975

    for dof in range(1, 60):
        assert t_975(dof) == pytest.approx(float(stats.t.ppf(0.975, dof)), abs=1e-5), dof
    for n in range(2, 60):
        times = [0.1, 0.3] * (n // 2) + [0.2] * (n % 2)  # a wide spread: the interval closes at some n
        (rate,) = measured_rates([Trial(8, "ok", 1, step_times_s=tuple(times))])
        assert rate.bounded == finite_interval(times), n
    times = [0.01] * 11 + [0.12]  # mean / (sd / sqrt 12) = 2.09: above a normal's 1.96, below t(0.975, 11) = 2.201
    (rate,) = measured_rates([Trial(8, "ok", 1, step_times_s=tuple(times))])
    assert not finite_interval(times) and not rate.bounded  # open to both (the worker's 1.96 called it finite)


def test_two_intervals_differ_measurably_only_when_apart_and_an_open_end_reaches_everything():
    assert overlap((1.0, 2.0), (2.0, 3.0)) and overlap((2.0, 3.0), (1.0, 2.5))
    assert not overlap((1.0, 2.0), (2.1, 3.0)) and not overlap((5.0, 6.0), (1.0, 4.0))
    assert overlap((15.6, None), (26.9, 40.0)) and not overlap((15.6, 20.0), (26.9, 40.0))  # open above
    assert overlap((None, None), (1.0, 2.0)) and overlap((None, 3.0), (0.1, 0.2))  # no interval: no difference


def test_rates_are_interpolated_between_measured_sizes_and_never_extrapolated():
    rates = measured_rates([trial(10, (1.0,), val_times_s=(0.2,)), trial(30, (6.0,), val_times_s=(1.8,))])
    middle = rate_at(rates, 20)
    # time per sample 0.1 s at 10 and 0.2 s at 30: halfway 0.15 s
    assert middle.step_s == pytest.approx(20 * 0.15) and middle.interpolated_from == (10, 30)
    assert middle.val_s == pytest.approx(20 * (0.02 + 0.06) / 2)
    assert rate_at(rates, 10) is rates[0]
    assert rate_at(rates, 5) is None and rate_at(rates, 31) is None
    timed = measured_rates([trial(10, (1.0, 1.02)), trial(30, (6.0, 6.1))])
    between = rate_at(timed, 20)  # the interval's ends mixed per sample as the rate is: 1 / (0.5/a + 0.5/b)
    assert between.low_samples_per_s == pytest.approx(1 / (0.5 / timed[0].low_samples_per_s
                                                           + 0.5 / timed[1].low_samples_per_s))
    assert between.low_samples_per_s < between.samples_per_s < between.high_samples_per_s


def test_step_times_survive_the_profile_file_and_an_old_file_still_loads(tmp_path):
    profile = timed_profile()
    path = save_profile(profile, tmp_path / "p.json")
    loaded = load_profile(path)
    assert loaded.trials == profile.trials and isinstance(loaded.trials[0].step_times_s, tuple)
    old = gpu_profile()  # made before step times were recorded: no such fields at all in its JSON
    data = old.to_dict()
    for t in data["trials"]:
        for name in ("step_times_s", "warmup_times_s", "val_times_s"):
            del t[name]
    assert Profile.from_dict(data).trials == old.trials


def test_a_profile_with_a_non_finite_step_time_is_refused(tmp_path):
    from vramcal.profile import ProfileError

    data = timed_profile().to_dict()
    data["trials"][0]["step_times_s"] = [0.1, float("nan")]
    with pytest.raises(ProfileError, match="step_times_s"):
        Profile.from_dict(data)


def test_a_run_is_forecast_at_a_nearby_steady_rate_per_sample_else_at_the_short_one():
    rates = measured_rates([trial(90, (1.0, 1.2), val_times_s=(0.3,)), trial(100, (1.0,) * 40, "steady",
                                                                               val_times_s=(0.2,)),
                            trial(50, (0.4, 0.4))])
    assert NEAR_FRACTION == 0.25
    near = rate_for_run(rates, 90)
    assert near.per_sample_from == 100 and near.samples_per_s == pytest.approx(100.0)  # 1.0 s per 100 samples
    assert near.step_s == pytest.approx(0.9) and near.val_s == pytest.approx(0.18) and near.steady
    assert rate_for_run(rates, 100).per_sample_from is None  # its own steady rate
    short = rate_for_run(rates, 50)  # 50 % away: its own short rate
    assert short.per_sample_from is None and not short.steady and short.samples_per_s == pytest.approx(125.0)
    between = rate_for_run(rates, 70)  # 30 % away from the steady 100: interpolated between the short 50 and 90
    assert between.interpolated_from == (50, 90)
