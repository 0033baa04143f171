"""The compare's statistics on hand-made inputs: a known difference is found, identical runs are
"no difference", and the interval covers the truth about as often as it claims."""

from __future__ import annotations

import numpy as np
import pytest

from mutualrl.report.stats import (
    NO_DIFFERENCE,
    bootstrap_means,
    cost_to_target,
    curve_area,
    paired_difference,
    verdict,
)


def test_identical_runs_are_no_difference():
    rng = np.random.default_rng(0)
    scores = (rng.random((3, 64)) < 0.6).astype(float)
    d = paired_difference(scores, scores.copy())
    assert (d.mean, d.lo, d.hi) == (0.0, 0.0, 0.0)
    assert d.verdict == NO_DIFFERENCE and (d.n_seeds, d.n_prompts) == (3, 64)


def test_a_known_difference_is_detected_both_ways():
    rng = np.random.default_rng(1)
    control = (rng.random((3, 128)) < 0.3).astype(float)
    treat = (rng.random((3, 128)) < 0.7).astype(float)  # +0.4 on every seed
    up = paired_difference(treat, control)
    assert up.verdict == "better" and up.lo > 0.2 and up.hi < 0.6 and up.lo < up.mean < up.hi
    assert paired_difference(control, treat).verdict == "worse"
    # Lower is better (e.g. tokens spent): the same interval reads the other way.
    assert paired_difference(treat, control, higher_is_better=False).verdict == "worse"


def test_noise_of_the_size_of_the_effect_is_no_difference():
    # Two seeds disagree in sign: resampling seeds must show it.
    treat = np.array([[1.0] * 32, [0.0] * 32, [1.0] * 32])
    control = np.array([[0.0] * 32, [1.0] * 32, [0.5] * 32])
    assert paired_difference(treat, control).verdict == NO_DIFFERENCE


def test_per_seed_values_are_one_prompt_per_seed():
    d = paired_difference(np.array([3.0, 4.0, 5.0]), np.array([1.0, 2.0, 3.0]))
    assert d.mean == 2.0 and d.lo == d.hi == 2.0 and d.verdict == "better" and d.n_prompts == 1


def test_the_bootstrap_is_seeded_and_resamples_both_levels():
    d = np.arange(12.0).reshape(3, 4)
    a, b = bootstrap_means(d, n_boot=500, seed=7), bootstrap_means(d, n_boot=500, seed=7)
    assert np.array_equal(a, b) and a.shape == (500,)
    # Seeds alone (one prompt each) or prompts alone (one seed) both give spread.
    assert np.ptp(bootstrap_means(d[:, :1], n_boot=200)) > 0
    assert np.ptp(bootstrap_means(d[:1], n_boot=200)) > 0
    with pytest.raises(ValueError, match="seeds, prompts"):
        bootstrap_means(np.zeros(0))
    with pytest.raises(ValueError, match="paired"):
        paired_difference(np.zeros((2, 3)), np.zeros((3, 2)))


def test_interval_coverage_is_sane():
    """No true difference, seed-level noise plus prompt noise: the 95% interval should contain 0
    most of the time (the percentile bootstrap with few seeds is a bit narrow, so not 95%
    exactly)."""
    rng = np.random.default_rng(2)
    covered, trials = 0, 200
    for i in range(trials):
        seed_effect = rng.normal(0, 0.05, size=(6, 1))
        base = rng.random((6, 48))
        treat = (base < 0.5 + seed_effect).astype(float)
        control = (rng.random((6, 48)) < 0.5).astype(float)
        d = paired_difference(treat, control, n_boot=400, seed=i)
        covered += d.lo <= 0 <= d.hi
    assert 0.8 <= covered / trials <= 1.0


def test_verdict_reads_the_interval():
    assert verdict(0.01, 0.2) == "better" and verdict(-0.3, -0.1) == "worse"
    assert verdict(-0.1, 0.1) == NO_DIFFERENCE and verdict(0.0, 0.0) == NO_DIFFERENCE


def test_curve_area_and_cost_to_target():
    steps = np.array([0, 10, 20, 40])
    assert curve_area(steps, np.array([0.0, 1.0, 1.0, 1.0])) == pytest.approx(0.875)
    per_prompt = curve_area(steps, np.array([[0, 1], [0, 1], [1, 1], [1, 1]], float))
    assert per_prompt.tolist() == pytest.approx([0.625, 1.0])
    assert curve_area(np.array([5]), np.array([0.4])) == pytest.approx(0.4)
    tokens = np.array([0, 100, 200, 400])
    assert cost_to_target(tokens, np.array([0.1, 0.5, 0.8, 0.9]), 0.75) == 200
    assert cost_to_target(tokens, np.array([0.1, 0.5, 0.6, 0.7]), 0.75) is None


def test_wilson_interval_matches_its_formula_and_stays_inside_0_1():
    from mutualrl.report.stats import wilson_interval

    # 20 of 100 at 95%: the textbook values (Newcombe 1998): [0.1333, 0.2888]
    lo, hi = wilson_interval(20, 100)
    assert abs(lo - 0.1333) < 5e-4 and abs(hi - 0.2888) < 5e-4
    assert wilson_interval(0, 64)[0] == 0.0 and 0.0 < wilson_interval(0, 64)[1] < 0.06
    assert wilson_interval(64, 64)[1] == 1.0 and wilson_interval(64, 64)[0] > 0.94
    import pytest

    with pytest.raises(ValueError):
        wilson_interval(0, 0)
