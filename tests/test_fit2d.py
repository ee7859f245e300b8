"""The 2-D memory model (batch_size × seq_len) against synthetic data with known coefficients."""

import json
import math

import numpy as np
import pytest

from vramcal.calibration.fit2d import (
    LENGTH_RATIO,
    Fit2D,
    SeqLens,
    check_seq_lens,
    fit_2d,
    longest_seq_len,
    parse_seq_lens,
    safe_batch_size_2d,
    wide_gaps,
)

GIB = 2**30
OVERHEAD, PER_TOKEN, PER_SAMPLE = 0.51 * GIB, 12.3 * 2**10, 1.2 * 2**20
GRID = [(b, L) for b in (1, 8, 32) for L in (128, 512, 2048)]


def truth(b, length):
    return OVERHEAD + PER_TOKEN * b * length + PER_SAMPLE * b


def points(grid, peaks):
    batches, lengths = zip(*grid)
    return list(batches), list(lengths), [int(p) for p in peaks]


def noisy_fit(seed, noise=20e6, grid=GRID):
    rng = np.random.default_rng(seed)
    return fit_2d(*points(grid, [truth(b, L) + rng.normal(0, noise) for b, L in grid]))


def test_exact_points_recover_the_coefficients():
    fit = fit_2d(*points(GRID, [truth(b, L) for b, L in GRID]))
    assert fit.overhead_bytes == pytest.approx(OVERHEAD, rel=1e-6)
    assert fit.bytes_per_token == pytest.approx(PER_TOKEN, rel=1e-6)
    assert fit.bytes_per_sample == pytest.approx(PER_SAMPLE, rel=1e-6)
    assert fit.r_squared == pytest.approx(1.0, abs=1e-12)
    assert fit.extra_terms is None
    assert fit.formula() == "peak = 0.51 GiB + 12.30 KiB × batch_size·seq_len + 1.20 MiB × batch_size"
    assert fit.predict(16, 1024) == pytest.approx(truth(16, 1024), rel=1e-9)
    assert "n = 9 over 3 seq_len values" in fit.describe()


def test_noisy_points_coefficients_within_three_standard_errors():
    noise = 20e6
    fit = noisy_fit(7, noise, GRID * 2)
    assert abs(fit.overhead_bytes - OVERHEAD) < 3 * fit.overhead_stderr_bytes
    assert abs(fit.bytes_per_token - PER_TOKEN) < 3 * fit.stderr_bytes_per_token
    assert abs(fit.bytes_per_sample - PER_SAMPLE) < 3 * fit.stderr_bytes_per_sample
    assert fit.residual_stderr_bytes == pytest.approx(noise, rel=0.5)
    assert fit.lower(64, 4096) < fit.predict(64, 4096) < fit.upper(64, 4096)
    # the interval widens away from the points
    assert fit.half_width(64, 4096) > fit.half_width(8, 512)


def test_standard_errors_match_a_direct_computation():
    """sqrt(diag((XᵀX)⁻¹) s²) and the leverage x0ᵀ(XᵀX)⁻¹x0, computed here independently of the module."""
    fit = noisy_fit(3)
    design = np.array([[1.0, b * L, b] for b, L in GRID])
    inverse = np.linalg.inv(design.T @ design)
    s = fit.residual_stderr_bytes
    assert fit.stderr_bytes_per_token == pytest.approx(math.sqrt(inverse[1, 1]) * s, rel=1e-6)
    x0 = np.array([1.0, 20 * 1000, 20])
    expected = fit.t_critical * s * math.sqrt(1 + x0 @ inverse @ x0)
    assert fit.half_width(20, 1000) == pytest.approx(expected, rel=1e-6)
    assert fit.t_critical == pytest.approx(2.447, abs=1e-3)  # t(0.975, 6)


def test_prediction_interval_covers_95_percent_of_new_trials():
    """Over 1000 simulated calibrations (11 points each), a fresh trial falls inside the interval ~95 %."""
    rng = np.random.default_rng(11)
    grid = GRID + [(4, 1024), (16, 256)]
    clean = np.array([truth(b, L) for b, L in grid])
    hits = []
    for _ in range(1000):
        fit = fit_2d(*points(grid, clean + rng.normal(0, 20e6, len(grid))))
        b, length = int(rng.integers(1, 33)), int(rng.integers(128, 2049))
        fresh = truth(b, length) + rng.normal(0, 20e6)
        hits.append(fit.lower(b, length) <= fresh <= fit.upper(b, length))
    assert 0.93 < np.mean(hits) < 0.97


def test_quadratic_in_tokens_is_flagged_and_a_plane_is_not():
    rng = np.random.default_rng(5)
    grid = GRID + [(4, 1024), (16, 256)]
    noise = rng.normal(0, 5e6, len(grid))
    linear = fit_2d(*points(grid, [truth(b, L) + e for (b, L), e in zip(grid, noise)]))
    assert linear.extra_terms is None
    curved = fit_2d(*points(grid, [truth(b, L) + 0.5 * (b * L) ** 2 + e for (b, L), e in zip(grid, noise)]))
    assert "tokens²" in curved.extra_terms and "trust only verified limits" in curved.extra_terms
    per_length = fit_2d(*points(grid, [truth(b, L) + 300e3 * L + e for (b, L), e in zip(grid, noise)]))
    assert "per-seq_len" in per_length.extra_terms


def test_extra_terms_need_enough_points():
    grid = GRID[:6]  # 6 points: the extended model (5 terms) leaves too few degrees of freedom
    fit = fit_2d(*points(grid, [truth(b, L) + 0.08 * (b * L) ** 2 for b, L in grid]))
    assert fit.extra_terms is None


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("seq_len", [128, 1000, 4096])
def test_safe_batch_size_agrees_with_brute_force(seed, seq_len):
    fit = noisy_fit(seed, noise=30e6)
    usable = 4 * GIB
    assert fit.bytes_per_token * seq_len + fit.bytes_per_sample > 0  # else the answer is 0 by design
    fits = [b for b in range(1, 5000) if fit.upper(b, seq_len) <= usable]
    assert fits and fits == list(range(fits[0], fits[-1] + 1))  # an interval, as the convexity argument says
    assert fits[-1] < 4999  # the scan reached past the end
    assert safe_batch_size_2d(fit, usable, seq_len) == fits[-1]


def test_safe_batch_size_when_the_interval_starts_above_one():
    """Points far from batch 1 make the bound wide there; the search must not give up at batch 1."""
    grid = [(b, L) for b in (200, 220, 240) for L in (128, 256)]
    rng = np.random.default_rng(1)
    fit = fit_2d(*points(grid, [truth(b, L) + rng.normal(0, 100e6) for b, L in grid]))
    usable = fit.upper(232, 192) + 1
    fits = [b for b in range(1, 1000) if fit.upper(b, 192) <= usable]
    assert fits[0] > 1 and fits[-1] == 232
    assert safe_batch_size_2d(fit, usable, 192) == 232


def test_safe_batch_size_is_zero_when_nothing_fits():
    fit = noisy_fit(1)
    assert safe_batch_size_2d(fit, int(0.4 * GIB), 512) == 0
    flat = fit_2d([1, 2, 1, 2], [128, 128, 256, 256], [5 * GIB] * 4)  # slopes are rounding noise
    assert safe_batch_size_2d(flat, 10 * GIB, 512) == 0
    assert longest_seq_len(flat, 10 * GIB, 1, 64, 64, 8192) == 0
    shrinking = fit_2d(*points(GRID, [2 * GIB - 1e6 * b for b, _ in GRID]))
    assert shrinking.bytes_per_sample < 0 and safe_batch_size_2d(shrinking, 10 * GIB, 512) == 0


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("batch_size", [1, 8, 30])
def test_longest_seq_len_agrees_with_brute_force(seed, batch_size):
    fit = noisy_fit(seed, noise=80e6)
    usable, chunk = 6 * GIB, 64
    brute = max([L for L in range(chunk, 100_000 + 1, chunk) if fit.upper(batch_size, L) <= usable], default=0)
    found = longest_seq_len(fit, usable, batch_size, chunk, 64, 100_000)
    assert found == brute and found % chunk == 0 and found > 0
    # a cap inside the fitting range is returned, rounded down to a multiple
    assert longest_seq_len(fit, usable, batch_size, chunk, 100, found - 1) == found - chunk


def test_longest_seq_len_is_zero_when_nothing_fits():
    fit = noisy_fit(1)
    assert longest_seq_len(fit, int(0.4 * GIB), 1, 64, 64, 8192) == 0
    assert longest_seq_len(fit, 80 * GIB, 1, 64, 65, 127) == 0  # no multiple of 64 in the range


def test_too_few_or_degenerate_points_are_refused():
    with pytest.raises(ValueError, match="at least 4 points .* got 3 points"):
        fit_2d([1, 2, 4], [128, 256, 128], [1, 2, 3])
    with pytest.raises(ValueError, match="got 4 points over 1 seq_len values"):
        fit_2d([1, 2, 4, 8], [128] * 4, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="and 1 batch sizes"):
        fit_2d([4] * 4, [128, 256, 512, 1024], [1, 2, 3, 4])
    with pytest.raises(ValueError, match="collinear"):  # batch_size·seq_len constant: tokens = intercept
        fit_2d([1, 2, 1, 2], [256, 128, 256, 128], [1, 2, 3, 4])
    with pytest.raises(ValueError, match="differ in length"):
        fit_2d([1, 2], [128], [1, 2])


def test_check_seq_lens():
    assert check_seq_lens([512, 128, 512, 2048], 64) == (128, 512, 2048)
    with pytest.raises(ValueError, match="seq_len 100 is not a multiple of chunk_size 64: use 64 or 128"):
        check_seq_lens([128, 100], 64)
    with pytest.raises(ValueError, match="seq_len 30 is not a multiple of chunk_size 64: use 64$"):
        check_seq_lens([30], 64)
    with pytest.raises(ValueError, match="seq_len 0 is not positive"):
        check_seq_lens([0, 128], 64)
    with pytest.raises(ValueError, match="at least one"):
        check_seq_lens([], 64)


def test_a_range_is_placed_with_no_gap_wider_than_the_widest_measured():
    """Issue 59 item 3: answers between calibrated lengths interpolate, and the interpolation error was measured
    over gaps of up to 16 times (bench/interpolation.py); a range places its lengths so that no gap is wider
    (16:8192 placed 16, 368, 8192 before: gaps of 23 and 22 times)."""
    assert LENGTH_RATIO == 16
    assert parse_seq_lens("64:1024").design(16) == (64, 256, 1024)  # the committed profiles' gaps of 4 times
    assert parse_seq_lens("16:8192").design(16) == (16, 128, 1024, 8192)
    for text in ("16:4096", "128:16384", "256:512", "16:65536", "64:256", "32:131072"):
        lengths = parse_seq_lens(text).design(16)
        assert len(lengths) >= 3 and all(b <= LENGTH_RATIO * a for a, b in zip(lengths, lengths[1:])), lengths
    assert parse_seq_lens("128,8192").design(16) == (128, 8192)  # a list as written: the probe warns of its gap
    assert wide_gaps((128, 512, 16384)) == [(512, 16384)] and wide_gaps((64, 1024, 16384)) == []


def test_parse_seq_lens():
    assert parse_seq_lens("2048, 128,512,128").lengths == (128, 512, 2048)
    assert parse_seq_lens(" 128:2048 ") == SeqLens((128, 2048), is_range=True)
    assert parse_seq_lens("128:2048").design(64) == (128, 512, 2048)
    assert parse_seq_lens("256") == SeqLens((256,))
    for text, message in [("", "no seq_len given"), ("  ", "no seq_len given"),
                          ("2048:128", "the range is reversed: write 128:2048"),
                          ("128,abc", "'abc' is not a whole number"), ("1.5", "not a whole number"),
                          ("128,,512", "not a whole number"), ("0,128", "must be positive"),
                          ("-128:128", "must be positive"), ("1:2:3", "cannot read")]:
        with pytest.raises(ValueError, match=message):
            parse_seq_lens(text)


def test_round_trip_through_dict_and_json():
    fit = noisy_fit(9, grid=GRID + [(4, 1024)])
    assert Fit2D.from_dict(fit.to_dict()) == fit
    assert Fit2D.from_dict(json.loads(json.dumps(fit.to_dict()))) == fit
    assert hash(fit) == hash(Fit2D.from_dict(fit.to_dict()))


def test_a_negative_term_is_explained_and_a_positive_plane_needs_no_word():
    """issue 42 item 7: ``- 1.18 KiB × batch_size`` was shown with no word on what it means: what each sample
    adds within the calibrated lengths, and whether the points can tell the term from none."""
    assert fit_2d(*points(GRID, [truth(b, L) for b, L in GRID])).negative_terms() is None
    per_sample = -1.18 * 2**10

    def peaks(noise: float, seed: int = 0) -> list[float]:
        rng = np.random.default_rng(seed)
        return [OVERHEAD + PER_TOKEN * b * L + per_sample * b + rng.normal(0, noise) for b, L in GRID]

    exact = fit_2d(*points(GRID, peaks(0.0)))
    assert exact.formula().endswith(" - 1.18 KiB × batch_size")
    assert exact.negative_terms() == (
        "the negative per-sample term gives no memory back: it corrects the per-token term, which alone would "
        "over-cover what each sample adds within the calibrated lengths; a sample adds 1.54 MiB at seq_len 128 and "
        "24.60 MiB at 2048 (the model is not used outside 128-2048)")
    noisy = fit_2d(*points(GRID, peaks(5e6, seed=3)))
    assert noisy.bytes_per_sample < 0 and abs(noisy.bytes_per_sample) <= 2 * noisy.stderr_bytes_per_sample
    assert noisy.negative_terms().endswith(": the points cannot tell it from none")
