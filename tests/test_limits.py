"""Limits arithmetic, worked by hand against DESIGN.md's definitions."""

import math

import pytest

from vramcal.calibration.fit import fit_linear
from vramcal.calibration.limits import LimitSettings, compute_limits, safe_batch_size

GIB = 2**30


def exact_fit(overhead, slope, batches=(1, 10, 100)):
    return fit_linear(list(batches), [int(overhead + slope * b) for b in batches])


def test_usable_is_total_minus_reserve_minus_margin():
    settings = LimitSettings()  # 0.5 GiB reserve, 10 % margin
    assert settings.usable_bytes(24 * GIB) == int(24 * GIB - 0.5 * GIB - 2.4 * GIB)


def test_exact_fit_gives_the_seed_point_formula():
    # the seeds' line: 0.529 GB + 0.088 GB x batch on a 24 GiB card: usable 21.1 GiB
    fit = exact_fit(0.529 * GIB, 0.088 * GIB)
    limits = compute_limits(fit, 24 * GIB, LimitSettings())
    expected = math.floor((21.1 * GIB - 0.529 * GIB) / (0.088 * GIB))  # 233
    assert limits.point_safe_batch_size == expected == 233
    assert limits.safe_batch_size in (expected, expected - 1)  # zero residuals: bound = point (up to rounding)
    assert limits.conservative_batch_size == math.floor(0.9 * limits.safe_batch_size)
    assert limits.boundary_batch_size == pytest.approx((24 - 0.529) / 0.088, rel=1e-6)


def test_noise_makes_safe_smaller_never_larger():
    batches = [1, 2, 50, 100, 150]
    noisy = [int(0.5 * GIB + 0.05 * GIB * b + (-1) ** i * 0.05 * GIB) for i, b in enumerate(batches)]
    fit = fit_linear(batches, noisy)
    limits = compute_limits(fit, 16 * GIB, LimitSettings())
    assert 0 < limits.safe_batch_size < limits.point_safe_batch_size
    assert fit.upper(limits.safe_batch_size) <= limits.usable_bytes < fit.upper(limits.safe_batch_size + 1)


def test_safe_stays_below_a_failed_batch_size():
    fit = exact_fit(0.5 * GIB, 0.01 * GIB)
    limits = compute_limits(fit, 16 * GIB, LimitSettings(), failed_batch_size=700)
    assert limits.safe_batch_size == 699
    assert limits.conservative_batch_size == 629


def test_nothing_fits_gives_zero():
    fit = exact_fit(10 * GIB, 0.1 * GIB)
    assert compute_limits(fit, 8 * GIB, LimitSettings()).safe_batch_size == 0
    flat = fit_linear([1, 2, 3], [5, 5, 5])
    assert safe_batch_size(flat, 100) == 0


@pytest.mark.parametrize("kwargs", [{"margin": 1.0}, {"margin": -0.1}, {"reserve_bytes": -1},
                                    {"conservative_fraction": 0}, {"conservative_fraction": 1.5}])
def test_settings_refuse_values_out_of_range(kwargs):
    with pytest.raises(ValueError, match="must be"):
        LimitSettings(**kwargs)
