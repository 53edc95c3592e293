"""A verdict's effect: a weighted sum of configuration means (for example OnPD minus OffPD) with its 95%
intervals (:class:`~kdlab.study.labels.Effect`). Held-out accuracy and pass@k come from each seed's last
evaluation samples, with the paired bootstrap over problems beside the seed-level hierarchical bootstrap
(:func:`table_effect`); per-run numbers (OOD change, sparsity, Spanish share) get a t interval over seeds
(:func:`scalar_effect`)."""

from __future__ import annotations

import statistics

from kdlab.study import stats
from kdlab.study.groups import Group
from kdlab.study.labels import Effect
from kdlab.study.runs import read_samples
from kdlab.study.stats import bootstrap_contrast, hierarchical_bootstrap_contrast


def table_effect(terms: list[tuple[float, list[dict[str, list[float]]]]], k: int | None = None, draws: int = 2000) -> Effect:
    """``sum w * mean`` over ``terms`` ``(w, seed tables)`` with both intervals: the paired bootstrap over
    problems (:func:`~kdlab.study.stats.bootstrap_contrast`) and, with two seeds or more in every
    configuration, the seed-level one (:func:`~kdlab.study.stats.hierarchical_bootstrap_contrast`)."""
    value, *problems = bootstrap_contrast(terms, k=k, draws=draws)
    seeds = min(len(tables) for _, tables in terms)
    low, high = hierarchical_bootstrap_contrast(terms, k=k, draws=draws)[1:] if seeds >= 2 else (None, None)
    return Effect(value, low, high, f"paired bootstrap over problems; over seeds (n >= {seeds}), problems, samples", tuple(problems))


def accuracy_effect(terms: list[tuple[float, Group]], k: int | None = None, draws: int = 2000) -> Effect | None:
    """``sum w * mean`` of ``val/accuracy`` (``k`` None) or ``val/pass@k`` from each seed's last evaluation
    samples, with both intervals (:func:`table_effect`); None when a run has no samples file."""
    tables = []
    for weight, group in terms:
        seeds = [read_samples(runs[-1].path) for runs in group.by_seed().values()]
        if not seeds or any(table is None for table in seeds):
            return None
        tables.append((weight, seeds))
    return table_effect(tables, k, draws)


def difference(plus: list[Group], minus: list[Group]) -> list[tuple[float, Group]]:
    """Terms of ``mean(plus) - mean(minus)``, each configuration weighted equally within its side."""
    return [(1.0 / len(plus), g) for g in plus] + [(-1.0 / len(minus), g) for g in minus]


def scalar_effect(terms: list[tuple[float, Group]], metric: str) -> Effect | None:
    """``sum w * mean`` of a per-run metric over seeds (reruns of a seed averaged first), with a t
    interval over seeds with Welch-Satterthwaite degrees of freedom (:func:`~kdlab.study.stats.t_contrast`);
    None without two seeds in every configuration."""
    values = []
    for weight, group in terms:
        seeds = [statistics.fmean(r.last[metric] for r in runs if metric in r.last) for runs in group.by_seed().values()
                 if any(metric in r.last for r in runs)]
        if len(seeds) < 2:
            return None
        values.append((weight, seeds))
    value, low, high, df = stats.t_contrast(values)
    return Effect(value, low, high, f"t over seeds (n >= {min(len(v) for _, v in values)}, Welch-Satterthwaite df {df:.1f})")
