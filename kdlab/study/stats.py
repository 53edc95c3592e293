"""Intervals for the report and the verdicts: bootstrap over problems (and samples) of evaluation
records, paired bootstrap contrasts between configurations with the trained models held fixed
(:func:`bootstrap_contrast`) or with the training seeds resampled too (:func:`hierarchical_bootstrap_contrast`),
t intervals over seeds with Welch-Satterthwaite degrees of freedom (:func:`t_contrast`), and Wilson
intervals for fractions."""

from __future__ import annotations

import math


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
    """The 95% Wilson score interval of a fraction of ``n`` Bernoulli draws."""
    centre = (fraction + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(fraction * (1 - fraction) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def newcombe_difference(after: float, n_after: int, before: float, n_before: int) -> tuple[float, float]:
    """The 95% interval of ``after - before``, two fractions of ``n_after`` and ``n_before`` draws, by Newcombe's
    hybrid score method (his method 10: the two Wilson intervals combined). It treats the samples as independent;
    for the same prompts measured twice (positively correlated) it is conservative (too wide)."""
    low_a, high_a = wilson_interval(after, n_after)
    low_b, high_b = wilson_interval(before, n_before)
    difference = after - before
    return (difference - math.sqrt((after - low_a) ** 2 + (high_b - before) ** 2),
            difference + math.sqrt((high_a - after) ** 2 + (before - low_b) ** 2))


def hierarchical_bootstrap_contrast(
    terms: list[tuple[float, list[dict[str, list[float]]]]], k: int | None = None, draws: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """``(estimate, low, high)`` of the same contrast as :func:`bootstrap_contrast` (same estimate), with an
    interval that also covers the training seed: :func:`bootstrap_contrast` holds each trained model fixed,
    so a configuration whose seeds disagree gets no wider interval for it.

    Each of the ``draws`` bootstrap draws does, in this order:

    1. seeds: within each configuration (term) independently, draw as many seed slots as it has tables,
       each a table picked uniformly with replacement (configurations are separate trainings, so no seed
       is paired across them, even where the seed numbers match);
    2. problems: when every table of every term holds the same problem ids, one problem draw (with
       replacement) shared by every slot of every term, as in :func:`bootstrap_contrast` (the pairing that
       cancels the problems' difficulty in a difference); otherwise each slot draws its own;
    3. samples: for the accuracy (``k`` None), within each drawn problem its samples with replacement,
       drawn afresh for every slot (a table picked twice gets two sample draws); for pass@k each problem
       keeps its unbiased estimate, as in :func:`bootstrap_contrast`.

    The draw's value is ``sum_i w_i * (mean over configuration i's slots of the slot's mean)``; ``low`` and
    ``high`` are the 2.5th and 97.5th percentiles over the draws. Seeds and problems are crossed (every
    seed is evaluated on the same problems), so this is a two-way (seed, problem) bootstrap. Like every
    percentile bootstrap over few units it is optimistic with few seeds: resampling n seeds gives the seed
    variance times (n - 1) / n and no t-like tails (with 3 seeds, 10 distinct seed multisets). A
    configuration with one table gets no seed variance at all (the caller should not call that seed-level).
    A problem's samples are cut to the smallest count of its table. Deterministic (``seed``)."""
    from math import comb

    import numpy as np

    rng = np.random.default_rng(seed)
    shared, problem_draws = shared_problem_draws(terms, draws, rng)
    total, estimate = np.zeros(draws), 0.0
    for weight, tables in terms:
        prepared = []  # per table: (P, n) scores for the accuracy, (P,) unbiased pass@k estimates otherwise
        for table in tables:
            keys = sorted(table)
            n = min(len(table[key]) for key in keys)
            scores = np.array([table[key][:n] for key in keys], dtype=np.float64)
            if k is None:
                prepared.append(scores)
            else:
                pass_k = np.array([1.0 - comb(n - c, k) / comb(n, k) for c in range(n + 1)])
                prepared.append(pass_k[(scores >= 1.0).sum(axis=1)])
            estimate += weight / len(tables) * float(prepared[-1].mean())
        seeds = len(tables)
        picks = rng.integers(seeds, size=(draws, seeds))  # (B, S): the table in each seed slot
        for slot in range(seeds):
            for index, values in enumerate(prepared):
                rows = np.nonzero(picks[:, slot] == index)[0]
                if rows.size == 0:
                    continue
                count = values.shape[0]
                problems = problem_draws[rows] if shared else rng.integers(count, size=(rows.size, count))
                if k is None:
                    n = values.shape[1]
                    samples = rng.integers(n, size=(*problems.shape, n))
                    total[rows] += weight / seeds * values[problems[..., None], samples].mean(axis=(1, 2))
                else:
                    total[rows] += weight / seeds * values[problems].mean(axis=1)
    low, high = np.percentile(total, [2.5, 97.5])
    return estimate, float(low), float(high)


# ---- t intervals over seeds ----------------------------------------------------------------------
def _incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b) (continued fraction, modified Lentz)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):  # the continued fraction converges fast on this side only
        return 1.0 - _incomplete_beta(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * result


def t_cdf(t: float, df: float) -> float:
    """Student's t distribution function with ``df`` (any real > 0) degrees of freedom."""
    if math.isinf(df):
        return 0.5 * math.erfc(-t / math.sqrt(2.0))
    tail = 0.5 * _incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` (any real > 0; ``math.inf`` for the normal) degrees
    of freedom, by bisection on :func:`t_cdf` (to about 1e-12)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must lie in (0, 1), got {p}")
    if not df > 0:
        return math.inf if p > 0.5 else -math.inf
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        low, high = high, 2.0 * high
    for _ in range(200):
        middle = 0.5 * (low + high)
        if t_cdf(middle, df) < p:
            low = middle
        else:
            high = middle
        if high - low < 1e-12 * max(1.0, high):
            break
    return 0.5 * (low + high)


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
