"""Intervals for the report and the verdicts: the bootstrap over problems (and samples) of evaluation records with
the trained models held fixed (:func:`bootstrap_contrast`); seed-level intervals of a contrast (:func:`seed_contrast`:
a paired two-way bootstrap over (seed, problem) where configurations share their seeds, an unpaired one where they do
not, a t interval below :data:`FEW_SEEDS` seeds), with their 90% ends, p-values and Monte Carlo error
(:class:`SeedInterval`); t intervals over seeds with Welch-Satterthwaite degrees of freedom (:func:`t_contrast`); and
the standard intervals of fractions: Wilson's, Newcombe's for independent samples and his paired method
(:func:`paired_difference`). The distributions and standard intervals are scipy's and statsmodels' (the ``report``
extra); tests/test_stats.py checks every function against published values or those libraries."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from math import comb
from typing import Any

import numpy as np


# ---- uncertainty -------------------------------------------------------------------------------
def bootstrap_interval(tables: list[dict[str, list[float]]], k: int | None = None, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval (2.5th, 97.5th percentiles) of the mean over ``tables`` (one per seed:
    ``example id -> scores of its samples``) of the mean accuracy (``k`` None) or of the unbiased pass@k:
    :func:`bootstrap_contrast` of one configuration."""
    return bootstrap_contrast([(1.0, tables)], k, draws, seed)[1:]


def shared_problem_draws(terms: list, draws: int, rng) -> tuple[bool, object]:
    """``(shared, draws)``: whether every table of every term holds the same problem ids, and then one
    ``(draws, P)`` resampling of the problems for all of them (a paired comparison), else ``None``."""
    ids = [sorted(table) for _, tables in terms for table in tables]
    shared = all(i == ids[0] for i in ids)
    return shared, rng.integers(len(ids[0]), size=(draws, len(ids[0]))) if shared else None


def bootstrap_contrast(
    terms: list[tuple[float, list[dict[str, list[float]]]]], k: int | None = None, draws: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """``(estimate, low, high)`` of ``sum_i w_i * mean_i`` over ``terms`` ``(w_i, tables_i)``, where
    ``mean_i`` is configuration i's mean over its tables (one per seed: ``example id -> scores of its
    samples``) of the mean accuracy (``k`` None) or of the unbiased pass@k; ``low``/``high`` are the 2.5th
    and 97.5th percentiles of its bootstrap distribution. One configuration with weight 1 is its mean's
    interval; ``[(1, OnPD), (-1, OffPD)]`` their difference's.

    Each draw resamples the problems with replacement and, for the accuracy, within each problem its
    samples with replacement: the interval covers both which problems were drawn and which completions
    were sampled. For pass@k each drawn problem keeps its unbiased estimate (resampling its samples with
    replacement would repeat completions and bias pass@k down); that estimate's own sampling noise is in
    the spread between problems.
    When every table holds the same problem ids, every table of every term uses the same problem draw
    (a paired comparison: the problems' difficulty cancels in a difference); otherwise each table draws
    its own. A problem's samples are cut to the smallest count of its table. Deterministic (``seed``)."""
    from math import comb

    import numpy as np

    rng = np.random.default_rng(seed)
    shared, problem_draws = shared_problem_draws(terms, draws, rng)
    total, estimate = np.zeros(draws), 0.0
    for weight, tables in terms:
        for table in tables:
            keys = sorted(table)
            n = min(len(table[key]) for key in keys)
            scores = np.array([table[key][:n] for key in keys], dtype=np.float64)  # (P, n)
            problems = problem_draws if shared else rng.integers(len(keys), size=(draws, len(keys)))  # (B, P)
            share = weight / len(tables)
            if k is None:
                samples = rng.integers(n, size=(*problems.shape, n))  # (B, P, n)
                total += share * scores[problems[..., None], samples].mean(axis=(1, 2))
                estimate += share * float(scores.mean())
            else:  # each problem's unbiased estimate as it is: resampling its samples would bias pass@k down
                pass_k = np.array([1.0 - comb(n - c, k) / comb(n, k) for c in range(n + 1)])
                per_problem = pass_k[(scores >= 1.0).sum(axis=1)]  # (P,)
                total += share * per_problem[problems].mean(axis=1)
                estimate += share * float(per_problem.mean())
    low, high = np.percentile(total, [2.5, 97.5])
    return estimate, float(low), float(high)


def wilson_interval(fraction: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval (95% at the default ``z``) of a fraction of ``n`` Bernoulli draws
    (``statsmodels.stats.proportion.proportion_confint``, method ``wilson``)."""
    from scipy.stats import norm
    from statsmodels.stats.proportion import proportion_confint

    low, high = proportion_confint(fraction * n, n, alpha=2.0 * float(norm.sf(z)), method="wilson")
    return max(0.0, float(low)), min(1.0, float(high))


def newcombe_difference(after: float, n_after: int, before: float, n_before: int) -> tuple[float, float]:
    """The 95% interval of ``after - before``, two fractions of ``n_after`` and ``n_before`` independent draws, by
    Newcombe's hybrid score method (his method 10: the two Wilson intervals combined;
    ``statsmodels.stats.proportion.confint_proportions_2indep``, method ``newcomb``). For the same prompts measured
    twice use :func:`paired_difference`."""
    from statsmodels.stats.proportion import confint_proportions_2indep

    low, high = confint_proportions_2indep(round(after * n_after), n_after, round(before * n_before), n_before,
                                           method="newcomb", compare="diff", alpha=0.05)
    return float(low), float(high)


def paired_difference(both: int, after_only: int, before_only: int, neither: int) -> tuple[float, float, float]:
    """``(after - before, low, high)``: the 95% interval of the difference of two fractions measured on the same ``n``
    prompts, from their 2 x 2 table (``both`` right, right ``after_only``, right ``before_only``, ``neither``), by
    Newcombe's method 10 for paired data (Statistics in Medicine 17:2635, 1998): the two Wilson intervals
    (:func:`wilson_interval`) combined with the correlation ``phi`` of the pairs, ``d - sqrt(l_a^2 - 2 phi l_a u_b +
    u_b^2)`` to ``d + sqrt(u_a^2 - 2 phi u_a l_b + l_b^2)`` (``l``/``u`` each fraction's distances to its Wilson ends).
    ``phi`` is 0 when a margin is empty; with ``phi`` 0 it is the independent-samples :func:`newcombe_difference`."""
    n = both + after_only + before_only + neither
    if n <= 0 or min(both, after_only, before_only, neither) < 0:
        raise ValueError(f"a paired 2 x 2 table needs counts >= 0 and n > 0, got {(both, after_only, before_only, neither)}")
    after, before = (both + after_only) / n, (both + before_only) / n
    (low_a, high_a), (low_b, high_b) = wilson_interval(after, n), wilson_interval(before, n)
    margins = (both + after_only) * (before_only + neither) * (both + before_only) * (after_only + neither)
    phi = (both * neither - after_only * before_only) / math.sqrt(margins) if margins else 0.0
    down = math.sqrt(max(0.0, (after - low_a) ** 2 - 2 * phi * (after - low_a) * (high_b - before) + (high_b - before) ** 2))
    up = math.sqrt(max(0.0, (high_a - after) ** 2 - 2 * phi * (high_a - after) * (before - low_b) + (before - low_b) ** 2))
    return after - before, after - before - down, after - before + up


def paired_difference_bounds(after: float, before: float, n: int) -> tuple[float, float, float]:
    """``(after - before, low, high)`` for two fractions of the same ``n`` prompts when only the fractions are known:
    the union of :func:`paired_difference` over every 2 x 2 table those margins allow (the prompts right in both runs
    range from ``max(0, a + b - n)`` to ``min(a, b)``). A fraction of 0 or 1 fixes the table, and the interval is
    exactly the paired one."""
    right_after, right_before = round(after * n), round(before * n)
    ends = [paired_difference(both, right_after - both, right_before - both, n - right_after - right_before + both)
            for both in range(max(0, right_after + right_before - n), min(right_after, right_before) + 1)]
    return (right_after - right_before) / n, min(e[1] for e in ends), max(e[2] for e in ends)


SEED_DRAWS = 20000  # seed-level bootstrap draws: interval ends whose Monte Carlo error is far below the labels' resolution
FEW_SEEDS = 5  # below this many seeds a configuration's seed-level interval is a t interval, not a bootstrap


@dataclass(frozen=True)
class SeedInterval:
    """A contrast's seed-level uncertainty: the ``estimate``, its two-sided 95% (``low``, ``high``) and 90% (``low90``,
    ``high90``) intervals and ``how`` they were made; a t interval keeps its standard error ``se`` and degrees of freedom
    ``df``, a bootstrap its ``draws`` (for p-values) and ``mc_error``, the Monte Carlo standard errors of the 95% ends."""

    estimate: float
    low: float
    high: float
    low90: float
    high90: float
    how: str
    se: float | None = None
    df: float | None = None
    draws: Any = field(default=None, compare=False, repr=False)
    mc_error: tuple[float, float] | None = None

    def p_greater(self, null: float) -> float:
        """One-sided p-value of "the contrast > ``null``": the t distribution's tail, or the share of bootstrap draws at
        or below ``null`` (the percentile interval's inversion); 1 - :meth:`p_greater` is not the other side's p-value."""
        if self.draws is not None:
            return float(np.mean(self.draws <= null))
        if not self.se:
            return 0.0 if self.estimate > null else 1.0
        return float(_student().sf((self.estimate - null) / self.se, self.df))

    def p_less(self, null: float) -> float:
        """One-sided p-value of "the contrast < ``null``" (as :meth:`p_greater`, mirrored)."""
        if self.draws is not None:
            return float(np.mean(self.draws >= null))
        if not self.se:
            return 0.0 if self.estimate < null else 1.0
        return float(_student().cdf((self.estimate - null) / self.se, self.df))


def _student():
    from scipy.stats import t

    return t


def seed_cells(tables: list[dict[str, list[float]]], k: int | None, ids: list[str] | None = None) -> np.ndarray:
    """``(S, P)`` per-(seed, problem) scores of one configuration: each problem's mean over its samples (``k`` None) or
    its unbiased pass@k, the samples cut to the problem's smallest count over the seeds; ``ids`` (default: the sorted
    ids of the first table) orders the problems."""
    ids = sorted(tables[0]) if ids is None else ids
    n = min(len(table[key]) for table in tables for key in ids)
    scores = np.array([[table[key][:n] for key in ids] for table in tables], dtype=np.float64)  # (S, P, n)
    if k is None:
        return scores.mean(axis=2)
    pass_k = np.array([1.0 - comb(n - c, k) / comb(n, k) for c in range(n + 1)])
    return pass_k[(scores >= 1.0).sum(axis=2)]


def percentile_interval(values: np.ndarray, estimate: float, how: str) -> SeedInterval:
    """:class:`SeedInterval` of bootstrap ``values`` (B,): percentile ends at 95% and 90%; the Monte Carlo standard
    error of each 95% end from the order statistics around it (the ranks ``B q +- 1.96 sqrt(B q (1 - q))`` bound
    the sample quantile's Monte Carlo spread; their distance over 2 x 1.96 is its standard error)."""
    ordered = np.sort(values)
    count = ordered.size
    low, high, low90, high90 = np.percentile(ordered, [2.5, 97.5, 5.0, 95.0])

    def error(q: float) -> float:
        spread = 1.959964 * math.sqrt(count * q * (1.0 - q))
        lower, upper = max(0, int(math.floor(count * q - spread))), min(count - 1, int(math.ceil(count * q + spread)))
        return float(ordered[upper] - ordered[lower]) / (2 * 1.959964)

    return SeedInterval(estimate, float(low), float(high), float(low90), float(high90), how, draws=ordered,
                        mc_error=(error(0.025), error(0.975)))


def t_interval(estimate: float, se: float, df: float, how: str) -> SeedInterval:
    """:class:`SeedInterval` ``estimate +- t(df) se`` at 95% and 90%."""
    h95, h90 = t_quantile(0.975, df) * se, t_quantile(0.95, df) * se
    return SeedInterval(estimate, estimate - h95, estimate + h95, estimate - h90, estimate + h90, how, se=se, df=df)


def resample_counts(rng, units: int, draws: int) -> np.ndarray:
    """``(draws, units)`` counts: how often each of ``units`` units is picked in each of ``draws`` resamples of
    ``units`` picks with replacement (a bootstrap draw of a mean is the counts-weighted mean)."""
    picks = rng.integers(units, size=(draws, units)) + units * np.arange(draws)[:, None]
    return np.bincount(picks.ravel(), minlength=draws * units).reshape(draws, units).astype(np.float64)


def is_paired(terms: list[tuple[float, dict[Any, dict[str, list[float]]]]]) -> bool:
    """Whether every configuration has the same seeds (the seed fixes the data order and the evaluation's sampling
    streams, so same-seed runs share random numbers) and every table the same problem ids: a paired design."""
    seeds = [sorted(map(str, by_seed)) for _, by_seed in terms]
    ids = [sorted(table) for _, by_seed in terms for table in by_seed.values()]
    return all(s == seeds[0] for s in seeds) and all(i == ids[0] for i in ids)


def seed_contrast(terms: list[tuple[float, dict[Any, dict[str, list[float]]]]], k: int | None = None,
                  draws: int = SEED_DRAWS, seed: int = 0) -> SeedInterval:
    """Seed-level interval of ``sum_i w_i * mean_i`` over ``terms`` ``(w_i, {seed: table})`` (a table: ``example id ->
    scores of its samples``; ``mean_i`` the configuration's mean over its seeds of the mean accuracy, ``k`` None, or of
    the unbiased pass@k). Each (seed, problem) cell enters with its own samples' mean, never resampled: the spread
    between seeds and problems already holds the samples' noise, so it is counted once.

    A paired design (:func:`is_paired`: the same seeds and problems in every configuration): the contrast of each
    (seed, problem) cell, ``D = sum_i w_i Y_i`` ``(S, P)``; with ``S >=`` :data:`FEW_SEEDS` seeds a paired two-way
    bootstrap, each draw resampling the seeds and the problems (the same picks for every configuration) and taking
    the mean of ``D`` over them, percentile ends; with fewer seeds a t interval over the seeds' contrasts
    ``D.mean(axis=1)`` (``S - 1`` df): a bootstrap over fewer seeds has a handful of distinct resamples and no t tails.
    Otherwise (unpaired): with at least :data:`FEW_SEEDS` seeds in every configuration a two-way bootstrap that
    resamples each configuration's seeds on its own and the problems (shared when every table has the same ids);
    with fewer, Welch's t over the seeds' means (:func:`t_contrast`). Deterministic (``seed``)."""
    if any(len(by_seed) < 2 for _, by_seed in terms):
        raise ValueError("a seed-level interval needs at least two seeds in every configuration")
    rng = np.random.default_rng(seed)
    if is_paired(terms):
        keys = sorted(terms[0][1], key=str)
        ids = sorted(next(iter(terms[0][1].values())))
        cells = sum(w * seed_cells([by_seed[s] for s in keys], k, ids) for w, by_seed in terms)  # (S, P)
        seeds, problems = cells.shape
        estimate = float(cells.mean())
        if seeds < FEW_SEEDS:
            per_seed = cells.mean(axis=1)
            return t_interval(estimate, float(per_seed.std(ddof=1)) / math.sqrt(seeds), seeds - 1,
                              f"paired t over {seeds} seeds (df {seeds - 1})")
        seed_counts = resample_counts(rng, seeds, draws)  # (B, S)
        problem_counts = resample_counts(rng, problems, draws)  # (B, P)
        values = ((seed_counts @ cells) * problem_counts).sum(axis=1) / (seeds * problems)
        return percentile_interval(values, estimate, f"paired bootstrap over {seeds} seeds x {problems} problems")
    prepared = [(w, seed_cells(list(by_seed.values()), k)) for w, by_seed in terms]
    estimate = float(sum(w * cells.mean() for w, cells in prepared))
    fewest = min(cells.shape[0] for _, cells in prepared)
    if fewest < FEW_SEEDS:
        value, low, high, df = t_contrast([(w, list(cells.mean(axis=1))) for w, cells in prepared])
        se = (high - value) / t_quantile(0.975, df) if high > value else 0.0
        return t_interval(estimate, se, df, f"unpaired Welch t over >= {fewest} seeds (df {df:.1f})")
    ids = [sorted(table) for _, by_seed in terms for table in by_seed.values()]
    shared = all(i == ids[0] for i in ids)
    problem_counts = resample_counts(rng, len(ids[0]), draws) if shared else None
    values = np.zeros(draws)
    for w, cells in prepared:
        seeds, problems = cells.shape
        counts = problem_counts if shared else resample_counts(rng, problems, draws)
        seed_counts = resample_counts(rng, seeds, draws)
        values += w * ((seed_counts @ cells) * counts).sum(axis=1) / (seeds * problems)
    return percentile_interval(values, estimate, f"unpaired bootstrap over >= {fewest} seeds per configuration and the problems")


def hierarchical_bootstrap_contrast(
    terms: list[tuple[float, list[dict[str, list[float]]]]], k: int | None = None, draws: int = SEED_DRAWS, seed: int = 0
) -> tuple[float, float, float]:
    """``(estimate, low, high)``: :func:`seed_contrast` of configurations whose seeds are not paired (each list's
    tables its seeds; resampled on their own), whatever their count (kdlab 0.1's two-way bootstrap, without its
    resampling of the samples, which counted their noise twice)."""
    if any(len(tables) < 2 for _, tables in terms):
        return bootstrap_contrast(terms, k, draws=2000, seed=seed)  # no seed variance to resample
    result = seed_contrast([(w, {(i, j): t for j, t in enumerate(tables)}) for i, (w, tables) in enumerate(terms)], k, draws, seed)
    return result.estimate, result.low, result.high


# ---- t intervals over seeds ----------------------------------------------------------------------
def t_cdf(t: float, df: float) -> float:
    """Student's t distribution function with ``df`` (any real > 0; ``math.inf`` for the normal) degrees of
    freedom (``scipy.stats.t``)."""
    from scipy.stats import norm, t as student

    return float(norm.cdf(t) if math.isinf(df) else student.cdf(t, df))


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` (any real > 0; ``math.inf`` for the normal) degrees
    of freedom (``scipy.stats.t``); ``df`` of 0 or less: infinite."""
    from scipy.stats import norm, t as student

    if not 0.0 < p < 1.0:
        raise ValueError(f"p must lie in (0, 1), got {p}")
    if not df > 0:
        return math.inf if p > 0.5 else -math.inf
    return float(norm.ppf(p) if math.isinf(df) else student.ppf(p, df))


def welch_satterthwaite_df(parts: list[tuple[float, float]]) -> float:
    """Degrees of freedom of ``sum_i c_i * s_i^2``, a sum of independent variance estimates, where ``parts``
    holds ``(c_i * s_i^2, df_i)``: ``(sum_i c_i s_i^2)^2 / sum_i (c_i s_i^2)^2 / df_i`` (Satterthwaite
    1946; with two groups and ``c_i = 1 / n_i`` it is Welch's df). All variances zero: ``sum_i df_i``."""
    total = sum(part for part, _ in parts)
    if total <= 0.0:
        return float(sum(df for _, df in parts))
    return total * total / sum(part * part / df for part, df in parts if part > 0.0)


def t_contrast(terms: list[tuple[float, list[float]]], level: float = 0.95) -> tuple[float, float, float, float]:
    """``(estimate, low, high, df)`` of ``sum_i w_i * mean(values_i)`` over ``terms`` ``(w_i, values_i)``:
    each configuration's per-seed values, configurations independent, each with its own variance. The
    standard error is ``sqrt(sum_i w_i^2 s_i^2 / n_i)`` and the t quantile's degrees of freedom are
    Welch-Satterthwaite's (:func:`welch_satterthwaite_df`): ``n - 1`` for one configuration, Welch's for a
    difference of two, between ``min(n_i) - 1`` and ``sum_i (n_i - 1)`` for a pooled contrast of many
    (the latter when their variances and weights agree). Needs two values in each configuration."""
    if any(len(values) < 2 for _, values in terms):
        raise ValueError("a t interval over seeds needs at least two seeds in every configuration")
    estimate, parts = 0.0, []
    for weight, values in terms:
        mean = sum(values) / len(values)
        variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
        estimate += weight * mean
        parts.append((weight * weight * variance / len(values), len(values) - 1))
    df = welch_satterthwaite_df(parts)
    half = t_quantile(0.5 + level / 2.0, df) * math.sqrt(sum(part for part, _ in parts))
    return estimate, estimate - half, estimate + half, df
