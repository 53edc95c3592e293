"""kdlab.study.stats: the seed-level (hierarchical) bootstrap of a contrast, and t intervals over seeds
with Welch-Satterthwaite degrees of freedom (checked against scipy where it is installed, and by hand)."""

import math

import pytest

from kdlab.study.stats import (
    bootstrap_contrast,
    hierarchical_bootstrap_contrast,
    t_contrast,
    t_quantile,
    welch_satterthwaite_df,
)

PROBLEMS = 60


def table(solved: int, problems: int = PROBLEMS, samples: int = 4, prefix: str = "p") -> dict[str, list[float]]:
    """A seed's evaluation: the first ``solved`` problems solved by every sample, the rest by none."""
    return {f"{prefix}{i}": [float(i < solved)] * samples for i in range(problems)}


# ---- hierarchical bootstrap ----------------------------------------------------------------------
def test_seeds_that_disagree_widen_the_seed_level_interval_only():
    on = [table(20), table(30), table(40)]  # three training seeds: 33%, 50%, 67%
    off = [table(30)] * 3
    terms = [(1.0, on), (-1.0, off)]
    value, p_low, p_high = bootstrap_contrast(terms)
    s_value, s_low, s_high = hierarchical_bootstrap_contrast(terms)
    assert s_value == value == pytest.approx(0.0, abs=1e-12)  # the same estimate
    assert -0.07 < p_low < 0 < p_high < 0.07  # the models held fixed: the seeds' mean is 50% on every problem draw
    # a seed draw of the 33% seed three times has probability 1/27 > 2.5%: the seed-level interval reaches about -1/6
    assert s_low < -0.15 and s_high > 0.15
    assert (s_high - s_low) > 3 * (p_high - p_low)


def test_seeds_that_agree_give_the_problem_interval():
    terms = [(1.0, [table(45)] * 3), (-1.0, [table(30)] * 3)]
    assert hierarchical_bootstrap_contrast(terms) == pytest.approx(bootstrap_contrast(terms))
    same = [table(30)] * 3
    assert hierarchical_bootstrap_contrast([(1.0, same), (-1.0, same)])[1:] == pytest.approx((0.0, 0.0), abs=1e-12)  # paired


def test_hierarchical_bootstrap_is_deterministic_and_handles_pass_at_k_and_unpaired_problems():
    on = [table(20), table(30), table(40)]
    off = [table(30, prefix="q"), table(25, prefix="q")]
    first = hierarchical_bootstrap_contrast([(1.0, on), (-1.0, off)], draws=500, seed=3)
    assert first == hierarchical_bootstrap_contrast([(1.0, on), (-1.0, off)], draws=500, seed=3)
    assert first[0] == pytest.approx(0.5 - 27.5 / 60)
    # pass@k: every sample of a problem agrees here, so pass@2 equals the accuracy
    pass_2 = hierarchical_bootstrap_contrast([(1.0, on), (-1.0, [table(30)] * 3)], k=2, draws=500)
    accuracy = hierarchical_bootstrap_contrast([(1.0, on), (-1.0, [table(30)] * 3)], draws=500)
    assert pass_2[0] == pytest.approx(accuracy[0]) and pass_2[1] < -0.15 and pass_2[2] > 0.15


def test_one_table_per_configuration_has_no_seed_variance():
    terms = [(1.0, [table(40)]), (-1.0, [table(30)])]
    assert hierarchical_bootstrap_contrast(terms, draws=500) == pytest.approx(bootstrap_contrast(terms, draws=500), abs=0.02)


# ---- t intervals over seeds ------------------------------------------------------------------------
def test_t_quantile_by_hand_and_against_scipy():
    assert t_quantile(0.975, 2) == pytest.approx(4.302653, abs=1e-6)  # tables of Student's t
    assert t_quantile(0.975, 16) == pytest.approx(2.119905, abs=1e-6)
    assert t_quantile(0.975, math.inf) == pytest.approx(1.959964, abs=1e-6)
    assert t_quantile(0.025, 3) == pytest.approx(-3.182446, abs=1e-6)
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 4.23, 7.5, 16, 120):
        for p in (0.6, 0.9, 0.975, 0.995):
            assert t_quantile(p, df) == pytest.approx(scipy_stats.t.ppf(p, df), rel=1e-9)


def test_one_configuration_is_the_t_interval_with_n_minus_one_df():
    value, low, high, df = t_contrast([(1.0, [1.0, 2.0, 3.0])])
    assert (value, df) == (2.0, 2)
    assert high - value == pytest.approx(4.302653 / math.sqrt(3), rel=1e-6)  # t(0.975, 2) * s / sqrt(n), s = 1


def test_a_difference_of_two_configurations_has_welch_df():
    a, b = [1.0, 2.0, 4.0], [3.0, 3.5, 9.0, 10.0]
    value, low, high, df = t_contrast([(1.0, a), (-1.0, b)])
    # by hand: s_a^2 = 7/3 (mean 7/3), s_b^2 = 635/48 (mean 6.375)
    va, vb = (7 / 3) / 3, (635 / 48) / 4
    assert df == pytest.approx((va + vb) ** 2 / (va**2 / 2 + vb**2 / 3))
    assert value == pytest.approx(7 / 3 - 25.5 / 4)
    scipy_stats = pytest.importorskip("scipy.stats")
    welch = scipy_stats.ttest_ind(a, b, equal_var=False)
    assert df == pytest.approx(welch.df)
    assert (low, high) == pytest.approx(tuple(welch.confidence_interval(0.95)))


def test_a_pooled_contrast_of_many_cells_has_their_summed_df_not_two():
    cells = [[10.0 + c, 11.0 + c, 12.0 + c] for c in range(8)]  # eight cells, three seeds each, equal variances
    terms = [(0.25, values) for values in cells[:4]] + [(-0.25, values) for values in cells[4:]]
    value, low, high, df = t_contrast(terms)
    assert df == pytest.approx(16.0)  # sum of (n_i - 1): 8 x 2, where the old code used min(n) - 1 = 2
    assert value == pytest.approx(-4.0)
    assert high - value == pytest.approx(t_quantile(0.975, 16) * math.sqrt(8 * 0.25**2 * 1.0 / 3))
    # unequal variances: Satterthwaite's df lies between the smallest cell's and the sum
    uneven = t_contrast([(0.5, [0.0, 10.0, 20.0]), (0.5, [1.0, 1.1, 1.2]), (-1.0, [0.0, 0.5, 1.0, 1.5])])[3]
    assert 2.0 < uneven < 7.0
    # by hand: w^2 s^2 / n is 0.25 * 100 / 3, 0.25 * 0.01 / 3 and 1 * (5 / 12) / 4 (the variance of 0, 0.5, 1, 1.5 is 5/12)
    va, vb, vc = 0.25 * 100 / 3, 0.25 * 0.01 / 3, 5 / 12 / 4
    assert uneven == pytest.approx((va + vb + vc) ** 2 / (va**2 / 2 + vb**2 / 2 + vc**2 / 3))
    assert uneven == pytest.approx(welch_satterthwaite_df([(va, 2), (vb, 2), (vc, 3)]))


def test_zero_variance_collapses_the_interval_and_one_seed_is_refused():
    assert t_contrast([(1.0, [2.0, 2.0]), (-1.0, [1.0, 1.0, 1.0])]) == (1.0, 1.0, 1.0, 3.0)
    with pytest.raises(ValueError, match="two seeds"):
        t_contrast([(1.0, [2.0])])


def test_newcombe_difference_matches_his_worked_example():
    """Newcombe (1998), Statistics in Medicine 17:873, table II example (a): 56/70 against 48/80, method 10 gives
    0.0524 to 0.3339."""
    from kdlab.study.stats import newcombe_difference

    low, high = newcombe_difference(56 / 70, 70, 48 / 80, 80)
    assert abs(low - 0.0524) < 5e-4 and abs(high - 0.3339) < 5e-4
