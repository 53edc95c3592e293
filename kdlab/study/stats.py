"""Intervals for the report and the verdicts: bootstrap over problems (and samples) of evaluation
records, paired bootstrap contrasts between configurations, and Wilson intervals for fractions."""

from __future__ import annotations

import math


# ---- uncertainty -------------------------------------------------------------------------------
def bootstrap_interval(tables: list[dict[str, list[float]]], k: int | None = None, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval (2.5th, 97.5th percentiles) of the mean over ``tables`` (one per seed:
    ``example id -> scores of its samples``) of the mean accuracy (``k`` None) or of the unbiased pass@k:
    :func:`bootstrap_contrast` of one configuration."""
    return bootstrap_contrast([(1.0, tables)], k, draws, seed)[1:]


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
    all_tables = [table for _, tables in terms for table in tables]
    ids = [sorted(table) for table in all_tables]
    shared = all(i == ids[0] for i in ids)
    problem_draws = rng.integers(len(ids[0]), size=(draws, len(ids[0]))) if shared else None
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
