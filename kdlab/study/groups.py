"""Runs grouped into configurations (runs whose configs differ only in the seed), with their means,
standard deviations and intervals, and how a group's value is written in a table cell.

The grouping and the statistics go through pandas: :func:`runs_frame` is one row per run (also the
place to start for an analysis of one's own in a notebook), a configuration is a ``groupby`` on its
settings, and a metric's mean and standard deviation over seeds a ``groupby`` on the seed."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from kdlab.study.grid import short_keys, value_label
from kdlab.study.paper import PAPER_LR, PAPER_RESULTS, PaperResult
from kdlab.study.runs import COLUMN_KEYS, TEACHER_ROLLOUTS, RunResult, read_samples
from kdlab.study.stats import bootstrap_interval, wilson_interval

ROLLOUT_ORDER = {**dict.fromkeys(TEACHER_ROLLOUTS, 0), "MixtureRollouts": 1, "StudentRollouts": 2}


# ---- configurations ------------------------------------------------------------------------------
def runs_frame(runs: list[RunResult]) -> pd.DataFrame:
    """One row per run, in the given order: ``run`` (the :class:`~kdlab.study.runs.RunResult`),
    ``configuration`` (its settings as JSON: runs that differ only in the seed share it), ``seed_key``
    (the seed; a run without one is its own, ``run-<index>``), the columns ``task``, ``rollout``,
    ``lam``, ``objective``, ``lr``, ``seed``, ``path``, and the last value of every metric under its
    name (NaN where a run did not log it)."""
    rows = [
        {
            "run": run,
            "configuration": json.dumps(run.settings, sort_keys=True),
            "seed_key": run.seed if run.seed is not None else f"run-{index}",
            "task": run.task, "rollout": run.rollout, "lam": run.lam, "objective": run.objective, "lr": run.lr,
            "seed": run.seed, "path": str(run.path),
        }
        for index, run in enumerate(runs)
    ]
    metrics = pd.DataFrame([run.last for run in runs], index=range(len(runs)), dtype=float)
    return pd.concat([pd.DataFrame(rows, columns=[*RUN_COLUMNS]), metrics], axis=1)


RUN_COLUMNS = ("run", "configuration", "seed_key", "task", "rollout", "lam", "objective", "lr", "seed", "path")


@dataclass
class Group:
    """The runs of one configuration (they differ only in the seed); ``frame`` is their
    :func:`runs_frame`."""

    runs: list[RunResult]
    other: str = ""
    level: str | None = None  # "low" / "high" learning rate, for the paper's numbers
    _intervals: dict = field(default_factory=dict, repr=False)
    frame: pd.DataFrame = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.frame = runs_frame(self.runs)

    # what the columns show is the same in every run of the configuration
    task = property(lambda self: self.runs[0].task)
    rollout = property(lambda self: self.runs[0].rollout)
    lam = property(lambda self: self.runs[0].lam)
    objective = property(lambda self: self.runs[0].objective)
    lr = property(lambda self: self.runs[0].lr)

    @property
    def rollout_label(self) -> str:
        return f"{self.rollout} (lam={self.lam:g})" if self.lam is not None else self.rollout

    @property
    def kind(self) -> str | None:
        """The paper's name for the rollout policy, where it has one."""
        if self.rollout in TEACHER_ROLLOUTS or (self.lam is not None and math.isclose(self.lam, -1.0)):
            return "OffPD"
        if self.rollout == "StudentRollouts" or (self.lam is not None and math.isclose(self.lam, 1.0)):
            return "OnPD"
        return None

    @property
    def direction(self) -> str | None:
        return {"ForwardKL": "forward", "ReverseKL": "reverse"}.get(self.objective)

    def by_seed(self) -> dict[Any, list[RunResult]]:
        """The runs of each seed (a run without a seed is its own): reruns of a seed are one seed."""
        return {key: list(rows["run"]) for key, rows in self.frame.groupby("seed_key", sort=False)}

    @property
    def seeds(self) -> int:
        return len(self.by_seed())

    def stats(self, metric: str) -> tuple[float, float | None, int] | None:
        """(mean, sample std or None for one value, n seeds) of the metric's last values, None when
        absent. Reruns of one seed are averaged first: they are one seed, not more evidence."""
        present = self.frame[[metric in run.last for run in self.runs]]  # a logged NaN stays NaN, never "absent"
        if present.empty:
            return None
        per_seed = present.groupby("seed_key", sort=False)[metric].agg(lambda values: values.mean(skipna=False))
        std = float(per_seed.std(ddof=1, skipna=False)) if len(per_seed) > 1 else None
        return float(per_seed.mean(skipna=False)), std, len(per_seed)

    def interval(self, metric: str) -> tuple[float, float, str] | None:
        """:meth:`compute_interval`, computed once per metric."""
        if metric not in self._intervals:
            self._intervals[metric] = self.compute_interval(metric)
        return self._intervals[metric]

    def compute_interval(self, metric: str, draws: int = 2000) -> tuple[float, float, str] | None:
        """A 95% interval of the metric's mean over the configuration's seeds, with how it was made:
        ``val/accuracy`` and ``val/pass@k`` by bootstrap over problems (and samples, for the accuracy) of each seed's last
        evaluation (``samples/val-*.jsonl``); ``coverage/<name>/pass@1`` by a Wilson interval over the
        callback's examples x samples (correlated samples of one problem make it a little narrow);
        None otherwise."""
        if metric == "val/accuracy" or re.fullmatch(r"val/pass@\d+", metric):
            tables = []
            for runs in self.by_seed().values():
                scores = read_samples(runs[-1].path)
                if scores is None:
                    return None
                tables.append(scores)
            k = None if metric == "val/accuracy" else int(metric.rsplit("@", 1)[1])
            return (*bootstrap_interval(tables, k=k, draws=draws), "bootstrap")
        match = re.fullmatch(r"(coverage/.+)/pass@1", metric)
        stats = self.stats(metric)
        if match and stats is not None:
            total = sum(run.coverage_draws.get(match.group(1), 0) for runs in self.by_seed().values() for run in runs[-1:])
            if total:
                return (*wilson_interval(stats[0], total), "Wilson")
        return None

    def paper(self, metric: str) -> list[PaperResult]:
        if self.kind is None or self.direction is None:  # outside the paper's grid
            return []
        return [
            p
            for p in PAPER_RESULTS
            if p.metric == metric and p.rollout in (None, self.kind) and p.direction in (None, self.direction) and p.lr in (None, self.level)
        ]


def lr_levels(lrs: set[float], low: list[float] | None = None, high: list[float] | None = None) -> dict[float, str]:
    """``lr -> "low" | "high"``: the given ones; else the smaller of exactly two is low; else 1e-5 / 5e-5."""
    if low or high:
        given = [(x, "low") for x in low or []] + [(x, "high") for x in high or []]
        return {lr: level for lr in lrs for x, level in given if math.isclose(lr, x)}
    if len(lrs) == 2:
        small, large = sorted(lrs)
        return {small: "low", large: "high"}
    return {lr: level for lr in lrs for x, level in PAPER_LR.items() if math.isclose(lr, x)}


def _varies(key: str, configs: list[dict[str, str]]) -> bool:
    """Whether ``key`` differs between configs of the same classes: an ``init_args`` entry is compared only
    among configs whose ``class_path`` above it is the same (another class has other arguments)."""
    parts = key.split(".")
    classes = [".".join(parts[:i]) + ".class_path" for i, part in enumerate(parts) if part == "init_args"]
    values: dict[tuple, set] = {}
    for config in configs:
        values.setdefault(tuple(config.get(c) for c in classes), set()).add(config.get(key))
    return any(len(seen) > 1 for seen in values.values())


def group_runs(runs: list[RunResult], levels: dict[float, str]) -> list[Group]:
    """Configurations in a stable order; ``other`` names the settings that tell configurations apart
    beyond the columns."""
    configurations = runs_frame(runs).groupby("configuration", sort=False)["run"]
    groups = [Group(sorted(members, key=lambda r: (r.seed is None, r.seed or 0, str(r.path)))) for _, members in configurations]
    keys = sorted({key for run in runs for key in run.settings} - set(COLUMN_KEYS))
    # settings are compared among configurations of the same stage (a GRPO config has other keys)
    stages: dict[str | None, list[Group]] = {}
    for group in groups:
        stages.setdefault(group.runs[0].settings.get("model.class_path"), []).append(group)
    for same_stage in stages.values():
        varying = [key for key in keys if _varies(key, [g.runs[0].settings for g in same_stage])]
        short = short_keys([key.removesuffix(".class_path") for key in varying])
        for group in same_stage:
            settings = group.runs[0].settings
            group.other = ", ".join(
                f"{short[key.removesuffix('.class_path')]}={value_label(json.loads(settings[key]))}" for key in varying if key in settings
            )
    for group in groups:
        group.level = levels.get(group.lr)
    return sorted(groups, key=lambda g: (g.task, ROLLOUT_ORDER.get(g.rollout, 3), g.rollout, g.lam or 0.0, g.objective, g.lr, g.other))


# ---- formatting ----------------------------------------------------------------------------------
def is_percent(metric: str) -> bool:
    return bool(re.search(r"(accuracy|pass@\d+|share)$", metric)) or metric.startswith("sparsity/")


def _number(metric: str, value: float) -> str:
    if is_percent(metric):
        return f"{100 * value:.1f}"
    return f"{value:.1f}" if metric.startswith("ood/") else f"{value:.4g}"


def cell(group: Group, metric: str) -> str:
    """``mean ± std [low, high]`` in report units: the mean over seeds, the sample std over seeds (two or
    more), the 95% interval where one can be made (:meth:`Group.interval`); ``(n=k)`` when fewer seeds
    than the configuration's have the metric."""
    stats = group.stats(metric)
    if stats is None:
        return ""
    mean, std, n = stats
    text = _number(metric, mean) + (f" ± {_number(metric, std)}" if std is not None else "")
    interval = group.interval(metric)
    if interval is not None:
        text += f" [{_number(metric, interval[0])}, {_number(metric, interval[1])}]"
    return text + (f" (n={n})" if n < group.seeds else "")


def metric_unit(metric: str) -> str:
    return f"{metric} (%)" if is_percent(metric) else f"{metric} (points)" if metric.startswith("ood/") else metric


def group_label(group: Group) -> str:
    return f"{group.rollout_label} {group.objective} lr={group.lr:g}" + (f" {group.other}" if group.other else "")


def pass_at_k_order(metric: str) -> tuple[bool, str, int]:
    """``val/pass@k`` first, then each coverage task; k numerically (pass@10 after pass@2)."""
    prefix, k = metric.rsplit("@", 1)
    return not metric.startswith("val/"), prefix, int(k)
