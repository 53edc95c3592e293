"""A verdict's effect: a weighted sum of configuration means (for example OnPD minus OffPD) with its intervals
(:class:`~kdlab.study.labels.Effect`). Held-out accuracy and pass@k come from each seed's last evaluation samples,
with the bootstrap over problems (the trained models held fixed) beside the seed-level interval, paired where the
configurations share their seeds (:func:`table_effect`, :func:`~kdlab.study.stats.seed_contrast`); per-run numbers
(OOD change, sparsity) get a t interval over seeds (:func:`scalar_effect`), shares of answers (the Spanish share) one
on the logit scale (:func:`share_effect`)."""

from __future__ import annotations

import functools
import math
import statistics
from pathlib import Path
from typing import Any

from kdlab.study import stats
from kdlab.study.groups import Group
from kdlab.study.labels import Effect
from kdlab.study.runs import read_samples
from kdlab.study.stats import bootstrap_contrast, seed_contrast, t_interval

SEED = 0  # the problems bootstrap's random numbers (shown, never labelled; every label is the same under any seed: tests/test_verdict_stability.py)
PROBLEM_DRAWS = 2000  # draws of the problems interval (the models held fixed; shown, never labelled)


def table_effect(terms: list[tuple[float, Any]], k: int | None = None, draws: int | None = None) -> Effect:
    """``sum w * mean`` over ``terms`` ``(w, seed tables)`` with both intervals: the bootstrap over problems
    (:func:`~kdlab.study.stats.bootstrap_contrast`, ``draws`` draws, default :data:`PROBLEM_DRAWS`) and, with two seeds or more in every
    configuration, the seed-level one (:func:`~kdlab.study.stats.seed_contrast`, paired on the seeds every configuration
    has, when there are two or more). The seed tables are ``{seed: table}`` (seeds named, so same-seed runs pair) or a
    list (unnamed: never paired)."""
    named = [(w, tables if isinstance(tables, dict) else {(i, j): t for j, t in enumerate(tables)}) for i, (w, tables) in enumerate(terms)]
    value, *problems = bootstrap_contrast([(w, list(by_seed.values())) for w, by_seed in named], k=k, draws=draws or PROBLEM_DRAWS, seed=SEED)
    if min(len(by_seed) for _, by_seed in named) < 2:
        return Effect(value, None, None, "bootstrap over problems; one seed", tuple(problems))
    seeds = seed_contrast(named, k=k)
    return Effect(value, seeds.low, seeds.high, f"bootstrap over problems; {seeds.how}", tuple(problems), seeds)


@functools.lru_cache(maxsize=4096)
def _read_samples(path: str, stamp: tuple) -> dict[str, list[float]] | None:
    return read_samples(path)


def samples(run_dir: Any) -> dict[str, list[float]] | None:
    """:func:`~kdlab.study.runs.read_samples` of a run, read once while its samples folder is unchanged (a study's
    verdicts read each configuration's tables several times)."""
    folder = Path(run_dir, "samples")
    stamp = tuple(sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in folder.glob("*.jsonl"))) if folder.is_dir() else ()
    table = _read_samples(str(run_dir), stamp)
    return None if table is None else {key: list(scores) for key, scores in table.items()}


def seed_tables(group: Group) -> dict[Any, dict[str, list[float]]] | None:
    """``{seed: its last run's evaluation table}`` of a configuration; None when a run has no samples file."""
    tables = {seed if not str(seed).startswith("run-") else (id(group), seed): samples(runs[-1].path)  # a run without a seed pairs with none
              for seed, runs in group.by_seed().items()}
    return None if not tables or any(table is None for table in tables.values()) else tables


def accuracy_effect(terms: list[tuple[float, Group]], k: int | None = None, draws: int | None = None) -> Effect | None:
    """``sum w * mean`` of ``val/accuracy`` (``k`` None) or ``val/pass@k`` from each seed's last evaluation
    samples, with both intervals (:func:`table_effect`); None when a run has no samples file."""
    tables = []
    for weight, group in terms:
        by_seed = seed_tables(group)
        if by_seed is None:
            return None
        tables.append((weight, by_seed))
    return table_effect(tables, k, draws)


def difference(plus: list[Group], minus: list[Group]) -> list[tuple[float, Group]]:
    """Terms of ``mean(plus) - mean(minus)``, each configuration weighted equally within its side."""
    return [(1.0 / len(plus), g) for g in plus] + [(-1.0 / len(minus), g) for g in minus]


def _per_seed(group: Group, metric: str) -> dict[Any, float]:
    """``{seed: value}`` of a per-run metric (reruns of a seed averaged)."""
    return {seed if not str(seed).startswith("run-") else (id(group), seed): statistics.fmean(r.last[metric] for r in runs if metric in r.last)
            for seed, runs in group.by_seed().items() if any(metric in r.last for r in runs)}


def seed_values_effect(values: list[tuple[float, dict[Any, float]]], unit: str = "",
                       within: list[dict[Any, float]] | None = None) -> Effect | None:
    """``sum w * mean`` of per-seed values ``(w, {seed: value})``: on the seeds every configuration has, when there are
    two or more (a paired design; the other seeds' runs left out, as ``how`` says), a t interval over the seeds'
    contrasts (``n - 1`` df), else Welch's t over the seeds with
    Welch-Satterthwaite df (:func:`~kdlab.study.stats.t_contrast`); None without two seeds in every configuration.
    ``within`` (one ``{seed: variance}`` per term): each value's own sampling variance, a floor under the seeds'
    variance (the between-seed variance holds it in expectation, but few seeds at a share of 0 or 1 can show none)."""
    if any(len(by_seed) < 2 for _, by_seed in values):
        return None
    floors = within or [{} for _ in values]
    keys = stats.shared_items([sorted(by_seed, key=str) for _, by_seed in values])  # the seeds every configuration has
    if len(keys) >= 2:
        contrasts = [sum(w * by_seed[key] for w, by_seed in values) for key in keys]
        estimate = statistics.fmean(contrasts)
        floor = statistics.fmean(sum(w * w * f.get(key, 0.0) for (w, _), f in zip(values, floors)) for key in keys)
        variance = max(statistics.variance(contrasts), floor)
        left = sum(len(by_seed) - len(keys) for _, by_seed in values)
        interval = t_interval(estimate, math.sqrt(variance / len(keys)), len(keys) - 1,
                              f"paired t over {len(keys)} seeds{unit} (df {len(keys) - 1})"
                              + (f"; left out: {left} runs whose seed not every configuration has" if left else ""))
    else:
        parts, estimate = [], 0.0
        for (weight, by_seed), floor in zip(values, floors):
            seen = list(by_seed.values())
            variance = max(statistics.variance(seen), statistics.fmean(floor.values()) if floor else 0.0)
            estimate += weight * statistics.fmean(seen)
            parts.append((weight * weight * variance / len(seen), len(seen) - 1))
        df = stats.welch_satterthwaite_df(parts)
        interval = t_interval(estimate, math.sqrt(sum(part for part, _ in parts)), df,
                              f"t over seeds{unit} (n >= {min(len(v) for _, v in values)}, Welch-Satterthwaite df {df:.1f})")
    return Effect(interval.estimate, interval.low, interval.high, interval.how, seeds=interval)


def scalar_effect(terms: list[tuple[float, Group]], metric: str) -> Effect | None:
    """``sum w * mean`` of a per-run metric over seeds (reruns of a seed averaged first), with a t interval over the
    seeds (:func:`seed_values_effect`: paired when the configurations share their seeds); None without two seeds in
    every configuration."""
    return seed_values_effect([(weight, _per_seed(group, metric)) for weight, group in terms])


def share_effect(terms: list[tuple[float, Group]], metric: str, draws: str) -> Effect | None:
    """A contrast of shares of judged answers (``metric``, e.g. ``style/spanish_share``, each run's share of its
    ``draws`` answers, :attr:`~kdlab.study.runs.RunResult.coverage_draws`) that may sit at 0 or 100%, on the logit
    scale: each run's share moved to the centre of its Wilson interval (``(x + z^2/2) / (n + z^2)``, never 0 or 1) and
    its sampling variance from the Wilson interval's width there (``((logit(high) - logit(low)) / (2 z))^2``), then the
    t interval of :func:`seed_values_effect` with that variance as its floor. The effect is ``sum w * log-odds`` (its
    text in log-odds: ``scale`` 1). A run without its count of answers: None."""
    z = 1.959964
    values, within = [], []
    for weight, group in terms:
        by_seed, variances = {}, {}
        for seed, runs in group.by_seed().items():
            logits, spreads = [], []
            for run in runs:
                n = run.coverage_draws.get(draws, 0)
                if metric not in run.last or not n:
                    return None
                centre = (run.last[metric] * n + z * z / 2) / (n + z * z)
                low, high = (min(max(e, 0.5 / n), 1.0 - 0.5 / n) for e in stats.wilson_interval(run.last[metric], n))
                logits.append(math.log(centre / (1.0 - centre)))
                spreads.append(((math.log(high / (1 - high)) - math.log(low / (1 - low))) / (2 * z)) ** 2)
            key = seed if not str(seed).startswith("run-") else (id(group), seed)
            by_seed[key], variances[key] = statistics.fmean(logits), statistics.fmean(spreads) / len(runs)
        values.append((weight, by_seed))
        within.append(variances)
    return seed_values_effect(values, " on the logit scale", within)
