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
from kdlab.study.runs import COLUMN_KEYS, TEACHER_ROLLOUTS, RunResult, class_defaults, read_samples
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
    other_parts: list[tuple[str, str]] = field(default_factory=list)  # ``other`` before it is joined and cut
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
        evaluation (``samples/val-*.jsonl``), the trained models held fixed (the seeds' spread is the standard deviation
        shown beside it; the verdicts' seed-level intervals cover both); ``coverage/<name>/pass@1`` by a Wilson interval over
        the callback's examples x samples pooled over the seeds, as if every draw were independent (samples of one problem
        agree more than that, and seeds differ, so it is too narrow: descriptive only);
        ``style/spanish_share`` by a Wilson interval over the answers judged, pooled over the seeds (the
        seeds' own variance left out: the verdicts' t interval over seeds has it); None otherwise."""
        if metric == "val/accuracy" or re.fullmatch(r"val/pass@\d+", metric):
            tables = []
            for runs in self.by_seed().values():
                scores = read_samples(runs[-1].path)
                if scores is None:
                    return None
                tables.append(scores)
            k = None if metric == "val/accuracy" else int(metric.rsplit("@", 1)[1])
            return (*bootstrap_interval(tables, k=k, draws=draws), "bootstrap")
        match = re.fullmatch(r"(coverage/.+)/pass@1", metric) or re.fullmatch(r"(style)/spanish_share", metric)
        stats = self.stats(metric)
        if match and stats is not None:
            total = sum(run.coverage_draws.get(match.group(1), 0) for runs in self.by_seed().values() for run in runs[-1:])
            if total:
                return (*wilson_interval(stats[0], total), "Wilson")
        return None

    def paper(self, metric: str) -> list[PaperResult]:
        """The paper's numbers for this row: same task (:attr:`PaperResult.tasks`), rollout kind, KL direction
        and learning-rate level; none outside the paper's grid (another task, stage or rollout)."""
        if self.kind is None or self.direction is None:  # outside the paper's grid
            return []
        return [
            p
            for p in PAPER_RESULTS
            if p.metric == metric and p.applies_to(self.task) and p.rollout in (None, self.kind)
            and p.direction in (None, self.direction) and p.lr in (None, self.level)
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


OTHER_WIDTH = 120  # the most characters of an ``other`` cell; a longer one keeps its start and end


@dataclass(frozen=True)
class _Shown:
    """One setting as the ``other`` column compares and names it: its JSON value, the settings key it came
    from (``base``) and the dotted path below it (``rest``: class names for list entries, no ``init_args``);
    ``presence`` marks the entry that says a class is in a list (shown ``on`` / ``off``)."""

    value: str
    base: str
    rest: tuple[str, ...] = ()
    presence: bool = False


def shown_settings(settings: dict[str, str]) -> dict[str, _Shown]:
    """A run's settings with every list of classes (``trainer.callbacks``, a callback's ``tasks``) opened
    up into one entry per argument, keyed by class name (``trainer.callbacks.HeldOutKL.init_args.every_n_steps``;
    a second entry of one class is ``HeldOutKL#2``), so configurations that differ in one argument of one
    callback differ in that entry alone. A list of plain values stays one entry."""
    shown: dict[str, _Shown] = {}
    for key, text in settings.items():
        value = json.loads(text)
        if isinstance(value, list) and any(isinstance(item, dict) for item in value):
            _open_list(key, value, key, (), shown)
        else:
            shown[key] = _Shown(text, key)
    return shown


def _open_value(key: str, value: Any, base: str, rest: tuple[str, ...], shown: dict[str, _Shown]) -> None:
    if value is None:  # as in kdlab.study.runs._flatten: a null reads like an absent key
        return
    if isinstance(value, dict) and value:
        for name, item in value.items():
            more = () if name in ("init_args", "class_path") else (str(name),)
            _open_value(f"{key}.{name}", item, base, rest + more, shown)
    elif isinstance(value, list) and any(isinstance(item, dict) for item in value):
        _open_list(key, value, base, rest, shown)
    else:
        shown[key] = _Shown(json.dumps(value, sort_keys=True, default=str), base, rest)


def _open_list(key: str, items: list, base: str, rest: tuple[str, ...], shown: dict[str, _Shown]) -> None:
    counts: dict[str, int] = {}
    for index, item in enumerate(items):
        if isinstance(item, dict) and isinstance(item.get("class_path"), str):
            name = item["class_path"].rsplit(".", 1)[-1]
            counts[name] = counts.get(name, 0) + 1
            name += f"#{counts[name]}" if counts[name] > 1 else ""
            shown[f"{key}.{name}.class_path"] = _Shown(json.dumps(item["class_path"]), base, rest + (name,), presence=True)
            _open_value(f"{key}.{name}", {k: v for k, v in item.items() if k != "class_path"}, base, rest + (name,), shown)
        else:
            _open_value(f"{key}.{index}", item, base, rest + (str(index),), shown)


def _class_default(key: str, entries: dict[str, _Shown]) -> Any:
    """The default of ``<...>.init_args.<argument>`` in the class the config names at ``<...>.class_path``
    (a setting at its default is left out of a run's settings, :func:`kdlab.study.runs.without_defaults`);
    None when there is no such class, argument or default."""
    parts = key.split(".")
    if len(parts) < 3 or parts[-2] != "init_args":
        return None
    owner = entries.get(".".join(parts[:-2]) + ".class_path")
    if owner is None:
        return None
    return class_defaults(json.loads(owner.value)).get(parts[-1])


def shorten(text: str, width: int = OTHER_WIDTH) -> str:
    """``text`` cut to ``width`` characters in the middle (``…``), its start and end kept."""
    if len(text) <= width:
        return text
    head = (width - 1) // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


def other_labels(settings: list[dict[str, str]]) -> list[str]:
    """For each configuration's settings (one stage), the settings that differ between them, beyond the
    columns: ``name=value`` joined by ``, ``, names as short as they stay distinct, class names without
    their module; a class in a list (a callback) by its name (``callbacks.HeldOutKL.every_n_steps=50``,
    ``callbacks.Coverage=off`` for one without it); each cell at most :data:`OTHER_WIDTH` characters."""
    return [_fit(parts) for parts in other_parts(settings)]


def other_parts(settings: list[dict[str, str]]) -> list[list[tuple[str, str]]]:
    """:func:`other_labels` before it is joined and cut: for each configuration, its ``(name, value)`` pairs
    (``("callbacks.Coverage", "off")``, ``("precision", "bf16-true")``), whole."""
    shown = [shown_settings(s) for s in settings]
    columns = set(COLUMN_KEYS)
    keys = sorted({key for entries in shown for key, entry in entries.items() if entry.base not in columns})
    values = [{key: entry.value for key, entry in entries.items()} for entries in shown]
    varying = [key for key in keys if _varies(key, values)]
    entry_of = {key: next(entries[key] for entries in shown if key in entries) for key in varying}
    bases = short_keys(sorted({entry_of[key].base.removesuffix(".class_path") for key in varying}))

    def name(key: str) -> str:
        entry = entry_of[key]
        return ".".join([bases[entry.base.removesuffix(".class_path")], *entry.rest])

    labels = []
    for entries in shown:
        parts = []
        for key in varying:
            if entry_of[key].presence:
                parts.append((name(key), "on" if key in entries else "off"))
            elif key in entries:
                parts.append((name(key), value_label(json.loads(entries[key].value))))
            elif (default := _class_default(key, entries)) is not None:  # left at its class's default (read as absent)
                parts.append((name(key), value_label(default)))
        labels.append(parts)
    return labels


def _fit(parts: list[tuple[str, str]], width: int = OTHER_WIDTH, shortest: int = 12) -> str:
    """``name=value, ...`` in at most ``width`` characters: the longest values are cut in the middle first
    (every name stays readable), then, if still too long, the whole."""
    names, values = [n for n, _ in parts], [v for _, v in parts]

    def text() -> str:
        return ", ".join(f"{n}={v}" for n, v in zip(names, values))

    while len(text()) > width:
        longest = max(range(len(values)), key=lambda i: len(values[i]))
        if len(values[longest]) <= shortest:
            break
        values[longest] = shorten(values[longest], max(shortest, len(values[longest]) - (len(text()) - width)))
    return shorten(text(), width)


def group_runs(runs: list[RunResult], levels: dict[float, str]) -> list[Group]:
    """Configurations in a stable order; ``other`` names the settings that tell configurations apart
    beyond the columns (:func:`other_labels`)."""
    configurations = runs_frame(runs).groupby("configuration", sort=False)["run"]
    groups = [Group(sorted(members, key=lambda r: (r.seed is None, r.seed or 0, str(r.path)))) for _, members in configurations]
    # settings are compared among configurations of the same stage (a GRPO config has other keys)
    stages: dict[str | None, list[Group]] = {}
    for group in groups:
        stages.setdefault(group.runs[0].settings.get("model.class_path"), []).append(group)
    for same_stage in stages.values():
        for group, parts in zip(same_stage, other_parts([g.runs[0].settings for g in same_stage])):
            group.other, group.other_parts = _fit(parts), parts
    for group in groups:
        group.level = levels.get(group.lr)
    return sorted(groups, key=lambda g: (g.task, ROLLOUT_ORDER.get(g.rollout, 3), g.rollout, g.lam or 0.0, g.objective, g.lr, g.other))


# ---- formatting ----------------------------------------------------------------------------------
def is_percent(metric: str) -> bool:
    return bool(re.search(r"(accuracy|pass@\d+|share|_closed)$", metric)) or metric.startswith("sparsity/")


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
