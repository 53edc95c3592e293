"""kdlab.study.stats: each statistical function against an independent reference value (a published table, or
scipy/statsmodels computing the same thing another way), and the seed-level intervals' design (paired where the
seeds are shared, the samples' noise counted once, a t interval below five seeds, Monte Carlo error reported)."""

import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

from kdlab.study.stats import (
    FEW_SEEDS,
    bootstrap_contrast,
    hierarchical_bootstrap_contrast,
    is_paired,
    newcombe_difference,
    paired_difference,
    paired_difference_bounds,
    resample_counts,
    seed_contrast,
    t_cdf,
    t_contrast,
    t_quantile,
    welch_satterthwaite_df,
    wilson_interval,
)

PROBLEMS = 60


def table(solved: int, problems: int = PROBLEMS, samples: int = 4, prefix: str = "p") -> dict[str, list[float]]:
    """A seed's evaluation: the first ``solved`` problems solved by every sample, the rest by none."""
    return {f"{prefix}{i}": [float(i < solved)] * samples for i in range(problems)}


def noisy(rng, rates: np.ndarray, samples: int = 4) -> dict[str, list[float]]:
    """A seed's evaluation: problem i solved by each of its samples with probability ``rates[i]``."""
    return {f"p{i}": [float(x) for x in rng.random(samples) < rate] for i, rate in enumerate(rates)}


# ---- distributions and standard intervals: published values ------------------------------------
def test_t_quantile_and_cdf_match_the_published_table():
    assert t_quantile(0.975, 2) == pytest.approx(4.302653, abs=1e-6)  # tables of Student's t
    assert t_quantile(0.975, 16) == pytest.approx(2.119905, abs=1e-6)
    assert t_quantile(0.975, math.inf) == pytest.approx(1.959964, abs=1e-6)
    assert t_quantile(0.025, 3) == pytest.approx(-3.182446, abs=1e-6)
    assert t_quantile(0.95, 9) == pytest.approx(1.833113, abs=1e-6)
    assert t_cdf(2.228139, 10) == pytest.approx(0.975, abs=1e-6)
    assert t_quantile(0.975, 0) == math.inf
    with pytest.raises(ValueError, match="p must lie"):
        t_quantile(1.0, 3)


@pytest.mark.parametrize(("successes", "n", "low", "high"), [
    (81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718), (29, 29, 0.8830, 1.0),
])
def test_wilson_interval_matches_newcombes_table(successes, n, low, high):
    """Newcombe (1998), Statistics in Medicine 17:857, table I, method 3 (the score interval)."""
    found = wilson_interval(successes / n, n)
    assert found == pytest.approx((low, high), abs=5e-5)


def test_newcombe_difference_matches_his_worked_example():
    """Newcombe (1998), Statistics in Medicine 17:873, table II example (a): 56/70 against 48/80, method 10 gives
    0.0524 to 0.3339."""
    low, high = newcombe_difference(56 / 70, 70, 48 / 80, 80)
    assert abs(low - 0.0524) < 5e-5 and abs(high - 0.3339) < 5e-5


def test_paired_difference_is_newcombes_independent_interval_when_the_pairs_are_uncorrelated():
    """With phi = 0 (both x neither = after_only x before_only) the paired method 10 is the independent one, which
    statsmodels computes; positively correlated pairs (the same prompts twice) narrow it, negatively widen it."""
    from statsmodels.stats.proportion import confint_proportions_2indep

    value, low, high = paired_difference(4, 2, 6, 3)  # 4 x 3 = 2 x 6
    reference = confint_proportions_2indep(6, 15, 10, 15, method="newcomb", compare="diff")
    assert value == pytest.approx(-4 / 15) and (low, high) == pytest.approx(tuple(reference), abs=1e-7)  # z = 1.959964
    _, low_pos, high_pos = paired_difference(40, 10, 5, 45)  # phi > 0
    independent = newcombe_difference(0.5, 100, 0.45, 100)
    assert high_pos - low_pos < independent[1] - independent[0]
    _, low_neg, high_neg = paired_difference(0, 50, 45, 5)  # phi < 0
    assert high_neg - low_neg > independent[1] - independent[0]
    with pytest.raises(ValueError, match="paired 2 x 2 table"):
        paired_difference(1, -1, 0, 0)


def test_paired_bounds_from_margins_are_exact_at_zero_and_cover_every_table():
    value, low, high = paired_difference_bounds(0.045, 0.0, 200)  # before 0: the table is fixed
    assert (value, low, high) == pytest.approx(paired_difference(0, 9, 0, 191))
    value, low, high = paired_difference_bounds(0.5, 0.3, 20)  # 10 and 6 right: 0-6 right in both
    tables = [paired_difference(b, 10 - b, 6 - b, 4 + b) for b in range(0, 7)]
    assert low == pytest.approx(min(t[1] for t in tables)) and high == pytest.approx(max(t[2] for t in tables))
    assert value == pytest.approx(0.2)


# ---- t intervals over seeds: scipy's t tests ----------------------------------------------------
def test_one_configuration_is_the_t_interval_with_n_minus_one_df():
    value, low, high, df = t_contrast([(1.0, [1.0, 2.0, 3.0])])
    assert (value, df) == (2.0, 2)
    assert high - value == pytest.approx(4.302653 / math.sqrt(3), rel=1e-6)  # t(0.975, 2) * s / sqrt(n), s = 1


def test_a_difference_of_two_configurations_is_welchs_t_test():
    a, b = [1.0, 2.0, 4.0], [3.0, 3.5, 9.0, 10.0]
    value, low, high, df = t_contrast([(1.0, a), (-1.0, b)])
    welch = scipy_stats.ttest_ind(a, b, equal_var=False)
    assert df == pytest.approx(welch.df) and value == pytest.approx(7 / 3 - 25.5 / 4)
    assert (low, high) == pytest.approx(tuple(welch.confidence_interval(0.95)))


def test_a_pooled_contrast_of_many_cells_has_their_summed_df_not_two():
    cells = [[10.0 + c, 11.0 + c, 12.0 + c] for c in range(8)]  # eight cells, three seeds each, equal variances
    terms = [(0.25, values) for values in cells[:4]] + [(-0.25, values) for values in cells[4:]]
    value, low, high, df = t_contrast(terms)
    assert df == pytest.approx(16.0) and value == pytest.approx(-4.0)
    assert high - value == pytest.approx(t_quantile(0.975, 16) * math.sqrt(8 * 0.25**2 * 1.0 / 3))
    va, vb, vc = 0.25 * 100 / 3, 0.25 * 0.01 / 3, 5 / 12 / 4  # by hand: w^2 s^2 / n of each cell
    uneven = t_contrast([(0.5, [0.0, 10.0, 20.0]), (0.5, [1.0, 1.1, 1.2]), (-1.0, [0.0, 0.5, 1.0, 1.5])])[3]
    assert uneven == pytest.approx((va + vb + vc) ** 2 / (va**2 / 2 + vb**2 / 2 + vc**2 / 3))
    assert uneven == pytest.approx(welch_satterthwaite_df([(va, 2), (vb, 2), (vc, 3)]))


def test_zero_variance_collapses_the_interval_and_one_seed_is_refused():
    assert t_contrast([(1.0, [2.0, 2.0]), (-1.0, [1.0, 1.0, 1.0])]) == (1.0, 1.0, 1.0, 3.0)
    with pytest.raises(ValueError, match="two seeds"):
        t_contrast([(1.0, [2.0])])


# ---- seed-level intervals ------------------------------------------------------------------------
def seeds_of(tables: list[dict], start: int = 42) -> dict[int, dict]:
    return {start + i: t for i, t in enumerate(tables)}


def test_few_paired_seeds_give_the_paired_t_test_and_its_one_sided_p_values():
    rng = np.random.default_rng(1)
    rates = rng.random(PROBLEMS)
    on = [noisy(rng, np.clip(rates + 0.05 * s, 0, 1)) for s in range(3)]
    off = [noisy(rng, np.clip(rates + 0.03 * s - 0.02, 0, 1)) for s in range(3)]
    terms = [(1.0, seeds_of(on)), (-1.0, seeds_of(off))]
    assert is_paired(terms)
    found = seed_contrast(terms)
    means = lambda tables: [np.mean([np.mean(v) for v in t.values()]) for t in tables]  # noqa: E731
    reference = scipy_stats.ttest_rel(means(on), means(off))
    assert (found.low, found.high) == pytest.approx(tuple(reference.confidence_interval(0.95)))
    assert (found.low90, found.high90) == pytest.approx(tuple(reference.confidence_interval(0.90)))
    assert found.df == 2 and found.draws is None and found.mc_error is None and "paired t over 3 seeds" in found.how
    greater = scipy_stats.ttest_rel(means(on), means(off), alternative="greater").pvalue
    assert found.p_greater(0.0) == pytest.approx(greater) and found.p_less(0.0) == pytest.approx(1 - greater)


def test_few_unpaired_seeds_give_welchs_t_test():
    on, off = [table(20), table(30), table(40)], [table(30), table(25), table(28), table(33)]
    found = seed_contrast([(1.0, seeds_of(on)), (-1.0, seeds_of(off, 60))])
    reference = scipy_stats.ttest_ind([20 / 60, 30 / 60, 40 / 60], [c / 60 for c in (30, 25, 28, 33)], equal_var=False)
    assert (found.low, found.high) == pytest.approx(tuple(reference.confidence_interval(0.95)))
    assert "Welch" in found.how


def paired_world(seeds: int, edge: float, seed: int = 0):
    """Configurations whose same-seed runs share their random numbers (the seed's data order and sampling stream):
    each seed shifts every problem's rate of both configurations alike; OnPD adds ``edge``."""
    rng = np.random.default_rng(seed)
    base = rng.random(200) * 0.8 + 0.1
    shifts = rng.normal(0.0, 0.08, seeds)
    on, off = {}, {}
    for s, shift in enumerate(shifts):
        draws = rng.random((200, 4))  # one sampling stream per seed, used by both configurations
        off[42 + s] = {f"p{i}": [float(x) for x in draws[i] < np.clip(base[i] + shift, 0, 1)] for i in range(200)}
        on[42 + s] = {f"p{i}": [float(x) for x in draws[i] < np.clip(base[i] + shift + edge, 0, 1)] for i in range(200)}
    return on, off


def test_pairing_the_seeds_removes_their_shared_variance():
    on, off = paired_world(10, 0.03)
    paired = seed_contrast([(1.0, on), (-1.0, off)], draws=4000)
    unpaired = seed_contrast([(1.0, on), (-1.0, {s + 100: t for s, t in off.items()})], draws=4000)
    assert "paired bootstrap over 10 seeds x 200 problems" in paired.how and "unpaired" in unpaired.how
    assert paired.estimate == pytest.approx(unpaired.estimate)
    assert paired.low > 0 and unpaired.low < 0  # the shared seed shifts cancel only in the paired contrast
    assert (paired.high - paired.low) < 0.5 * (unpaired.high - unpaired.low)


def test_the_samples_noise_is_counted_once_and_seeds_that_agree_add_nothing():
    """Seeds whose tables are identical: the paired seed-level interval is the two-way bootstrap's problems part only,
    no wider than the problems-and-samples interval (kdlab 0.1 redrew the samples in every seed slot on top)."""
    rng = np.random.default_rng(3)
    rates = rng.random(PROBLEMS)
    one_on, one_off = noisy(rng, rates), noisy(rng, np.clip(rates - 0.1, 0, 1))
    terms = [(1.0, seeds_of([one_on] * 6)), (-1.0, seeds_of([one_off] * 6))]
    seeds = seed_contrast(terms, draws=4000)
    value, low, high = bootstrap_contrast([(w, list(t.values())) for w, t in terms], draws=4000)
    assert seeds.estimate == pytest.approx(value)
    assert seeds.high - seeds.low <= high - low
    same = seeds_of([one_on] * 6)
    zero = seed_contrast([(1.0, same), (-1.0, same)], draws=500)
    assert (zero.low, zero.high) == (0.0, 0.0)


def test_monte_carlo_error_of_the_ends_matches_their_spread_over_rng_seeds():
    on, off = paired_world(FEW_SEEDS + 3, 0.02, seed=5)
    terms = [(1.0, on), (-1.0, off)]
    runs = [seed_contrast(terms, draws=2000, seed=rng_seed) for rng_seed in range(12)]
    spread = np.std([r.low for r in runs], ddof=1)
    reported = np.mean([r.mc_error[0] for r in runs])
    assert 0.4 * spread < reported < 2.5 * spread
    big = seed_contrast(terms, draws=20000)
    assert big.mc_error[0] < 0.5 * reported  # about 1 / sqrt(10) of it


def test_resample_counts_are_multinomial():
    counts = resample_counts(np.random.default_rng(0), 7, 5000)
    assert counts.shape == (5000, 7) and set(counts.sum(axis=1)) == {7.0}
    assert counts.mean(axis=0) == pytest.approx(np.ones(7), abs=0.05)
    assert counts[:, 0].var() == pytest.approx(7 * (1 / 7) * (6 / 7), rel=0.1)  # a binomial's variance


def test_hierarchical_bootstrap_is_the_unpaired_seed_contrast():
    on = [table(20), table(30), table(40)]
    off = [table(30, prefix="q"), table(25, prefix="q")]
    first = hierarchical_bootstrap_contrast([(1.0, on), (-1.0, off)], draws=500, seed=3)
    assert first == hierarchical_bootstrap_contrast([(1.0, on), (-1.0, off)], draws=500, seed=3)
    assert first[0] == pytest.approx(0.5 - 27.5 / 60)
    pass_2 = hierarchical_bootstrap_contrast([(1.0, on), (-1.0, [table(30)] * 3)], k=2, draws=500)
    accuracy = hierarchical_bootstrap_contrast([(1.0, on), (-1.0, [table(30)] * 3)], draws=500)
    assert pass_2 == pytest.approx(accuracy)  # every sample of a problem agrees here: pass@2 is the accuracy
    one = [(1.0, [table(40)]), (-1.0, [table(30)])]
    assert hierarchical_bootstrap_contrast(one, draws=500) == bootstrap_contrast(one, draws=2000)  # one seed: no seed variance


def test_a_seed_level_interval_needs_two_seeds():
    with pytest.raises(ValueError, match="two seeds"):
        seed_contrast([(1.0, {42: table(30)}), (-1.0, {42: table(20)})])


def test_the_paired_two_way_bootstrap_has_its_exact_variance():
    """The draws' variance against its closed form: a draw is ``a' D b / (S P)`` with ``a``, ``b`` independent
    multinomial counts (``E[a a'] = I + (1 - 1/S) 11'``), so ``Var = trace(M_a D M_b D') / (S P)^2 - mean(D)^2``."""
    on, off = paired_world(6, 0.02, seed=7)
    terms = [(1.0, on), (-1.0, off)]
    found = seed_contrast(terms, draws=20000, seed=1)
    from kdlab.study.stats import seed_cells

    ids = sorted(on[42])
    cells = seed_cells([on[s] for s in sorted(on)], None, ids) - seed_cells([off[s] for s in sorted(off)], None, ids)
    seeds, problems = cells.shape
    m_a = np.eye(seeds) + (1 - 1 / seeds) * np.ones((seeds, seeds))
    m_b = np.eye(problems) + (1 - 1 / problems) * np.ones((problems, problems))
    exact = np.trace(m_a @ cells @ m_b @ cells.T) / (seeds * problems) ** 2 - cells.mean() ** 2
    assert found.estimate == pytest.approx(cells.mean())
    assert np.std(found.draws) == pytest.approx(math.sqrt(exact), rel=0.03)


def test_the_problem_bootstrap_matches_the_binomial_it_samples():
    """Problems solved by all their samples or by none: resampling the problems makes the mean a Binomial(P, solved
    share) / P, whose 2.5% and 97.5% quantiles scipy gives (4 of 10 solved: 0.1 and 0.7)."""
    low, high = bootstrap_contrast([(1.0, [table(4, problems=10)])], draws=4000)[1:]
    reference = scipy_stats.binom(10, 0.4)
    assert (low, high) == (reference.ppf(0.025) / 10, reference.ppf(0.975) / 10) == (0.1, 0.7)


def test_scipy_and_statsmodels_are_in_the_report_and_dev_extras():
    """kdlab report's statistics need them (the report extra), and CI, which installs .[dev], runs these tests."""
    import tomllib

    extras = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    for extra in ("report", "dev"):
        names = {requirement.split(">")[0].split("[")[0] for requirement in extras[extra]}
        assert {"scipy", "statsmodels"} <= names, extra
