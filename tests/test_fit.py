"""The fit against synthetic data with known coefficients (explicit tolerances)."""

import numpy as np
import pytest

from vramcal.calibration.fit import Fit, fit_linear

GIB = 2**30


def test_exact_line_recovers_the_coefficients():
    batches = [1, 2, 8, 64, 200]
    peaks = [int(0.529 * GIB + 0.088 * GIB * b) for b in batches]
    fit = fit_linear(batches, peaks)
    assert fit.overhead_bytes == pytest.approx(0.529 * GIB, rel=1e-6)
    assert fit.slope_bytes_per_sample == pytest.approx(0.088 * GIB, rel=1e-6)
    assert fit.r_squared == pytest.approx(1.0)
    assert fit.formula() == "peak = 0.529 GiB + 90.11 MiB × batch_size"
    small = fit_linear(batches, [int(0.49 * GIB + 263_000 * b) for b in batches])  # a tiny model's slope
    assert small.formula() == "peak = 0.49 GiB + 256.84 KiB × batch_size"  # not 0.000245 GiB
    assert fit.nonlinearity is None


def test_noisy_line_coefficients_within_three_standard_errors():
    rng = np.random.default_rng(7)
    overhead, slope, noise = 400e6, 25e6, 20e6
    batches = np.repeat([1, 4, 16, 64, 128, 256], 3)
    peaks = (overhead + slope * batches + rng.normal(0, noise, batches.size)).astype(int)
    fit = fit_linear(batches.tolist(), peaks.tolist())
    assert abs(fit.overhead_bytes - overhead) < 3 * fit.overhead_stderr_bytes
    assert abs(fit.slope_bytes_per_sample - slope) < 3 * fit.slope_stderr_bytes_per_sample
    assert fit.residual_stderr_bytes == pytest.approx(noise, rel=0.5)
    assert fit.upper(300) > fit.predict(300) > fit.lower(300)


def test_prediction_interval_covers_95_percent_of_new_trials():
    """Over many simulated calibrations (5 points each), a fresh trial falls inside the interval ~95 %."""
    rng = np.random.default_rng(11)
    batches = np.array([1, 2, 64, 128, 200])
    hits = []
    for _ in range(1000):
        peaks = 400e6 + 25e6 * batches + rng.normal(0, 20e6, batches.size)
        fit = fit_linear(batches.tolist(), peaks.astype(int).tolist())
        b = int(rng.integers(1, 250))
        fresh = 400e6 + 25e6 * b + rng.normal(0, 20e6)
        hits.append(fit.lower(b) <= fresh <= fit.upper(b))
    assert 0.93 < np.mean(hits) < 0.97


def test_quadratic_memory_is_flagged_as_non_linear():
    batches = [1, 8, 32, 64, 128, 256]
    peaks = [int(300e6 + 1e6 * b + 2e4 * b * b) for b in batches]
    assert "not linear" in fit_linear(batches, peaks).nonlinearity


def test_too_few_points_are_refused():
    with pytest.raises(ValueError, match="at least 3"):
        fit_linear([1, 2], [10, 20])
    with pytest.raises(ValueError, match="at least 3"):
        fit_linear([4, 4, 4], [10, 11, 12])


def test_round_trip_through_dict():
    fit = fit_linear([1, 2, 4, 9], [10, 21, 39, 92])
    assert Fit.from_dict(fit.to_dict()) == fit
