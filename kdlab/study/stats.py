"""Intervals for the report and the verdicts: the bootstrap over problems (and samples) of evaluation records with
the trained models held fixed (:func:`bootstrap_contrast`); seed-level intervals of a contrast (:func:`seed_contrast`:
seeds and problems as crossed random effects, paired where configurations share their seeds, a t interval with
Satterthwaite's degrees of freedom from two-way mean squares; :class:`SeedInterval`); t intervals over seeds with
Welch-Satterthwaite degrees of freedom (:func:`t_contrast`); and the standard intervals of fractions: Wilson's,
Newcombe's for independent samples and his paired method (:func:`paired_difference`). The distributions and standard
intervals are scipy's and statsmodels' (the ``report`` extra); tests/test_stats.py checks every function against
published values or those libraries (the seed-level variance against statsmodels' mixed model)."""

from __future__ import annotations

import dataclasses
import importlib
import math
from dataclasses import dataclass
from math import comb
from typing import Any

import numpy as np


def statistics_library(module: str) -> Any:
    """``module`` of scipy or statsmodels, imported when first needed (``kdlab report``'s statistics; the ``report`` extra,
    also in ``tiny``); without the package, an ImportError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        package = module.split(".")[0]
        raise ImportError(f"kdlab report's statistics need {package}, which is not installed: pip install 'kdlab[report]'") from error


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
                per_problem = pass_at_k_table(n, k)[(scores >= 1.0).sum(axis=1)]  # (P,)
                total += share * per_problem[problems].mean(axis=1)
                estimate += share * float(per_problem.mean())
    low, high = np.percentile(total, [2.5, 97.5])
    return estimate, float(low), float(high)


def wilson_interval(fraction: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval (95% at the default ``z``) of a fraction of ``n`` Bernoulli draws
    (``statsmodels.stats.proportion.proportion_confint``, method ``wilson``)."""
    norm = statistics_library("scipy.stats").norm
    proportion_confint = statistics_library("statsmodels.stats.proportion").proportion_confint

    low, high = proportion_confint(fraction * n, n, alpha=2.0 * float(norm.sf(z)), method="wilson")
    return max(0.0, float(low)), min(1.0, float(high))


def newcombe_difference(after: float, n_after: int, before: float, n_before: int) -> tuple[float, float]:
    """The 95% interval of ``after - before``, two fractions of ``n_after`` and ``n_before`` independent draws, by
    Newcombe's hybrid score method (his method 10: the two Wilson intervals combined;
    ``statsmodels.stats.proportion.confint_proportions_2indep``, method ``newcomb``). For the same prompts measured
    twice use :func:`paired_difference`."""
    confint_proportions_2indep = statistics_library("statsmodels.stats.proportion").confint_proportions_2indep

    low, high = confint_proportions_2indep(round(after * n_after), n_after, round(before * n_before), n_before,
                                           method="newcomb", compare="diff", alpha=0.05)
    return float(low), float(high)


def paired_difference(both: int, after_only: int, before_only: int, neither: int) -> tuple[float, float, float]:
    """``(after - before, low, high)``: the 95% interval of the difference of two fractions measured on the same ``n``
    prompts, from their 2 x 2 table (``both`` right, right ``after_only``, right ``before_only``, ``neither``), by
    Newcombe's method 10 for paired data (Statistics in Medicine 17:2635, 1998): the two Wilson intervals
    (:func:`wilson_interval`) combined with the correlation ``phi`` of the pairs, ``d - sqrt(l_a^2 - 2 phi l_a u_b +
    u_b^2)`` to ``d + sqrt(u_a^2 - 2 phi u_a l_b + l_b^2)`` (``l``/``u`` each fraction's distances to its Wilson ends).
    ``phi``'s numerator ``both * neither - after_only * before_only`` is, where positive, reduced by ``n / 2`` (not below
    0), as in Newcombe's method; ``phi`` is 0 when a margin is empty; with ``phi`` 0 it is the independent-samples
    :func:`newcombe_difference`."""
    n = both + after_only + before_only + neither
    if n <= 0 or min(both, after_only, before_only, neither) < 0:
        raise ValueError(f"a paired 2 x 2 table needs counts >= 0 and n > 0, got {(both, after_only, before_only, neither)}")
    after, before = (both + after_only) / n, (both + before_only) / n
    (low_a, high_a), (low_b, high_b) = wilson_interval(after, n), wilson_interval(before, n)
    margins = (both + after_only) * (before_only + neither) * (both + before_only) * (after_only + neither)
    cross = both * neither - after_only * before_only
    cross = max(cross - n / 2, 0.0) if cross > 0 else cross  # Newcombe's continuity correction of a positive phi
    phi = cross / math.sqrt(margins) if margins else 0.0
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


@dataclass(frozen=True)
class SeedInterval:
    """A contrast's seed-level uncertainty: the ``estimate``, its two-sided 95% (``low``, ``high``) and 90% (``low90``,
    ``high90``) t intervals, their standard error ``se`` and degrees of freedom ``df``, and ``how`` they were made."""

    estimate: float
    low: float
    high: float
    low90: float
    high90: float
    how: str
    se: float | None = None
    df: float | None = None

    def p_greater(self, null: float) -> float:
        """One-sided p-value of "the contrast > ``null``" (the t distribution's tail; with no spread at all, 0 when the
        estimate lies above ``null``, else 1)."""
        if not self.se:
            return 0.0 if self.estimate > null else 1.0
        return float(_student().sf((self.estimate - null) / self.se, self.df))

    def p_less(self, null: float) -> float:
        """One-sided p-value of "the contrast < ``null``" (as :meth:`p_greater`, mirrored)."""
        if not self.se:
            return 0.0 if self.estimate < null else 1.0
        return float(_student().cdf((self.estimate - null) / self.se, self.df))


def _student():
    return statistics_library("scipy.stats").t


def pass_at_k_table(n: int, k: int) -> np.ndarray:
    """``(n + 1,)``: the unbiased pass@k of a problem with ``c`` of its ``n`` samples right, for each ``c`` (Chen et al.
    2021, ``1 - C(n - c, k) / C(n, k)``); ``ValueError`` when a problem has fewer than ``k`` samples."""
    if n < k:
        raise ValueError(f"pass@{k} needs at least {k} samples of every problem; a problem here has {n}")
    return np.array([1.0 - comb(n - c, k) / comb(n, k) for c in range(n + 1)])


def seed_cells(tables: list[dict[str, list[float]]], k: int | None, ids: list[str] | None = None) -> np.ndarray:
    """``(S, P)`` per-(seed, problem) scores of one configuration: each problem's mean over its samples (``k`` None) or
    its unbiased pass@k, the samples cut to the problem's smallest count over the seeds; ``ids`` (default: the sorted
    ids of the first table) orders the problems."""
    ids = sorted(tables[0]) if ids is None else ids
    n = min(len(table[key]) for table in tables for key in ids)
    scores = np.array([[table[key][:n] for key in ids] for table in tables], dtype=np.float64)  # (S, P, n)
    if k is None:
        return scores.mean(axis=2)
    return pass_at_k_table(n, k)[(scores >= 1.0).sum(axis=2)]


def t_interval(estimate: float, se: float, df: float, how: str) -> SeedInterval:
    """:class:`SeedInterval` ``estimate +- t(df) se`` at 95% and 90%."""
    h95, h90 = t_quantile(0.975, df) * se, t_quantile(0.95, df) * se
    return SeedInterval(estimate, estimate - h95, estimate + h95, estimate - h90, estimate + h90, how, se=se, df=df)


def two_way_mean_squares(cells: np.ndarray) -> tuple[tuple[float, int], tuple[float, int], tuple[float, int]]:
    """``((MS_seed, df), (MS_problem, df), (MS_residual, df))`` of an ``(S, P)`` table with one value per (seed, problem)
    cell: the two-way analysis of variance without replication (``S - 1``, ``P - 1`` and ``(S - 1)(P - 1)`` df). A table
    of one problem has no problem or residual mean square (0, with 0 df)."""
    seeds, problems = cells.shape
    grand, by_seed, by_problem = cells.mean(), cells.mean(axis=1), cells.mean(axis=0)
    ms_seed = problems * float(((by_seed - grand) ** 2).sum()) / (seeds - 1)
    if problems < 2:
        return (ms_seed, seeds - 1), (0.0, 0), (0.0, 0)
    ms_problem = seeds * float(((by_problem - grand) ** 2).sum()) / (problems - 1)
    residual = cells - by_seed[:, None] - by_problem[None, :] + grand
    df = (seeds - 1) * (problems - 1)
    return (ms_seed, seeds - 1), (ms_problem, problems - 1), (float((residual ** 2).sum()) / df, df)


class _Variance:
    """A variance estimate written as ``sum_j c_j MS_j`` over independent mean squares ``MS_j`` (each with its df),
    for Satterthwaite's degrees of freedom; terms are keyed so that coefficients on one mean square add up."""

    def __init__(self) -> None:
        self.terms: dict[object, list] = {}

    def add(self, key: object, coefficient: float, mean_square: tuple[float, int]) -> None:
        term = self.terms.setdefault(key, [0.0, *mean_square])
        term[0] += coefficient

    def value_and_df(self) -> tuple[float, float]:
        """The variance and its Satterthwaite (1946) df, ``(sum_j c_j MS_j)^2 / sum_j (c_j MS_j)^2 / df_j``."""
        parts = [(c * ms, df) for c, ms, df in self.terms.values() if c != 0.0 and df > 0]
        variance = sum(part for part, _ in parts)
        spread = sum(part * part / df for part, df in parts)
        return max(variance, 0.0), (variance * variance / spread if spread > 0.0 else float(sum(df for _, df in parts)) or 1.0)


def _crossed_terms(variance: _Variance, key: object, cells: np.ndarray, weight: float) -> None:
    """Add ``weight^2 * Var(mean of cells)`` for an ``(S, P)`` table whose seeds and problems are crossed random effects
    (``y_sp = mu + a_s + b_p + e_sp``): ``sigma_a^2 / S + sigma_e^2 / (S P)`` is ``E[MS_seed] / (S P)``, always kept, and
    ``sigma_b^2 / P`` is ``(MS_problem - MS_residual) / (S P)``, counted when positive. Keeping the seeds' mean square
    whole keeps its few degrees of freedom in the t quantile: dropping it when it falls below the residual's by chance
    (likely with 2 seeds, 1 df) would make the interval too narrow."""
    seeds, problems = cells.shape
    ms_seed, ms_problem, ms_residual = two_way_mean_squares(cells)
    scale = weight * weight / (seeds * problems)
    variance.add((key, "seed"), scale, ms_seed)
    if ms_problem[1] > 0 and ms_problem[0] > ms_residual[0]:
        variance.add((key, "problem"), scale, ms_problem)
        variance.add((key, "residual"), -scale, ms_residual)


def shared_items(sets: list[list]) -> list:
    """The items every list holds, in the first one's order."""
    shared = set(sets[0]).intersection(*map(set, sets[1:]))
    return [item for item in sets[0] if item in shared]


def paired_interval(cells: np.ndarray) -> SeedInterval:
    """The seed-level interval of the mean of ``cells`` ``(S, P)``, each (seed, problem) cell's contrast of configurations
    that share their seeds: seeds and problems crossed random effects, ``Var = (MS_seed + max(MS_problem - MS_residual,
    0)) / (S P)`` (:func:`two_way_mean_squares`, :func:`_crossed_terms`), t with Satterthwaite's df. Problems that do not
    differ more than the residual, or one problem: the paired t-test over the seeds' means."""
    variance = _Variance()
    _crossed_terms(variance, "paired", cells, 1.0)
    value, df = variance.value_and_df()
    seeds, problems = cells.shape
    return t_interval(float(cells.mean()), math.sqrt(value), df,
                      f"paired seeds x problems, {seeds} seeds x {problems} problems, Satterthwaite df {df:.1f}")


def seed_contrast(terms: list[tuple[float, dict[Any, dict[str, list[float]]]]], k: int | None = None) -> SeedInterval:
    """Seed-level interval of ``sum_i w_i * mean_i`` over ``terms`` ``(w_i, {seed: table})`` (a table: ``example id ->
    scores of its samples``; ``mean_i`` the configuration's mean over its seeds and problems of the mean accuracy, ``k``
    None, or of the unbiased pass@k). Each (seed, problem) cell enters with its own samples' mean, never resampled: the
    spread between seeds and problems already holds the samples' noise, so it is counted once.

    Seeds and problems are crossed random effects: the interval covers which seeds trained the models and which
    problems were drawn (a seed interval that takes each seed's mean over fixed problems leaves the second out, and
    a percentile bootstrap over five seeds is too narrow). The variance of the contrast comes from two-way mean
    squares (:func:`two_way_mean_squares`), its t quantile from Satterthwaite's df; one method for every number of seeds.

    Paired (two seeds or more that every configuration has; the seed fixes the data order and the evaluation's
    sampling streams, so same-seed runs share random numbers): the contrast of each (seed, problem) cell,
    ``D = sum_i w_i Y_i`` ``(S, P)``, and ``Var = (MS_seed + max(MS_problem - MS_residual, 0)) / (S P)`` of ``D`` (:func:`paired_interval`).
    Unpaired: each configuration's seed mean square, and the problems' part from the spread of the
    problems' contrasts of configuration means where the configurations share their problems, each configuration's
    own problems' part where they do not. Only the seeds every configuration has are paired, and only problems in
    every table compared (every configuration's where they are shared); ``how`` says what was left out."""
    if any(len(by_seed) < 2 for _, by_seed in terms):
        raise ValueError("a seed-level interval needs at least two seeds in every configuration")
    tables = [table for _, by_seed in terms for table in by_seed.values()]
    ids = shared_items([sorted(table) for table in tables])
    seeds = shared_items([sorted(by_seed, key=str) for _, by_seed in terms])
    left = []
    if ids and len(ids) < max(len(table) for table in tables):
        left.append(f"{len(set().union(*tables)) - len(ids)} problems not in every run")
    variance = _Variance()
    if len(seeds) >= 2 and ids:
        skipped = sum(len(by_seed) - len(seeds) for _, by_seed in terms)
        if skipped:
            left.append(f"{skipped} runs whose seed not every configuration has")
        cells = sum(w * seed_cells([by_seed[s] for s in seeds], k, ids) for w, by_seed in terms)  # (S, P)
        found = paired_interval(cells)
        return dataclasses.replace(found, how=found.how + (f"; left out: {', '.join(left)}" if left else ""))
    if ids:  # unpaired seeds, shared problems: the problems' contrast is paired, the seeds are not
        prepared = [(w, seed_cells(list(by_seed.values()), k, ids)) for w, by_seed in terms]
        estimate = float(sum(w * cells.mean() for w, cells in prepared))
        contrast = sum(w * cells.mean(axis=0) for w, cells in prepared)  # (P,) problems' contrasts of configuration means
        squares = [two_way_mean_squares(cells) for _, cells in prepared]
        # Var = sum_i w_i^2 E[MS_seed,i] / (S_i P) (each configuration's seeds, its residual within) + sigma_problem^2 / P,
        # where the problems' contrasts' spread estimates sigma_problem^2 + sum_i w_i^2 sigma_e,i^2 / S_i
        residual_share = sum(w * w * ms_residual[0] / cells.shape[0] for (w, cells), (_, _, ms_residual) in zip(prepared, squares))
        spread = float(np.var(contrast, ddof=1)) if len(ids) > 1 else 0.0
        if spread > residual_share:
            variance.add("problems", 1.0 / len(ids), (spread, len(ids) - 1))
            for i, ((w, cells), (_, _, ms_residual)) in enumerate(zip(prepared, squares)):
                variance.add((i, "residual"), -w * w / (cells.shape[0] * len(ids)), ms_residual)
        for i, ((w, cells), (ms_seed, _, _)) in enumerate(zip(prepared, squares)):
            variance.add((i, "seed"), w * w / (cells.shape[0] * len(ids)), ms_seed)
        how = f"unpaired seeds, shared problems, >= {min(len(b) for _, b in terms)} seeds x {len(ids)} problems"
    else:  # nothing shared: each configuration's own seeds and problems
        estimate = 0.0
        for i, (w, by_seed) in enumerate(terms):
            own = shared_items([sorted(table) for table in by_seed.values()])
            if not own:
                raise ValueError("a seed-level interval needs problems that every seed of a configuration was evaluated on")
            cells = seed_cells(list(by_seed.values()), k, own)
            _crossed_terms(variance, i, cells, w)
            estimate += w * float(cells.mean())
        how = f"unpaired seeds and problems, >= {min(len(b) for _, b in terms)} seeds per configuration"
    value, df = variance.value_and_df()
    how += f", Satterthwaite df {df:.1f}" + (f"; left out: {', '.join(left)}" if left else "")
    return t_interval(estimate, math.sqrt(value), df, how)


def hierarchical_bootstrap_contrast(
    terms: list[tuple[float, list[dict[str, list[float]]]]], k: int | None = None, draws: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """``(estimate, low, high)`` of configurations whose seeds are not paired (each list's tables its seeds): kdlab 0.1's
    name, now :func:`seed_contrast`'s interval (no longer a bootstrap); one seed: :func:`bootstrap_contrast` (``draws``,
    ``seed``)."""
    if any(len(tables) < 2 for _, tables in terms):
        return bootstrap_contrast(terms, k, draws=draws, seed=seed)  # no seed variance to estimate
    result = seed_contrast([(w, {(i, j): t for j, t in enumerate(tables)}) for i, (w, tables) in enumerate(terms)], k)
    return result.estimate, result.low, result.high


# ---- t intervals over seeds ----------------------------------------------------------------------
def t_cdf(t: float, df: float) -> float:
    """Student's t distribution function with ``df`` (any real > 0; ``math.inf`` for the normal) degrees of
    freedom (``scipy.stats.t``)."""
    scipy_stats = statistics_library("scipy.stats")
    norm, student = scipy_stats.norm, scipy_stats.t

    return float(norm.cdf(t) if math.isinf(df) else student.cdf(t, df))


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` (any real > 0; ``math.inf`` for the normal) degrees
    of freedom (``scipy.stats.t``); ``df`` of 0 or less: infinite."""
    scipy_stats = statistics_library("scipy.stats")
    norm, student = scipy_stats.norm, scipy_stats.t

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
