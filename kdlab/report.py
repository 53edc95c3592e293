"""``kdlab report RUN_DIR... [--output DIR]``: tables and figures of finished runs, beside the paper's numbers.

Each run directory needs the ``config.yaml`` the fit wrote (what was run: task, rollout policy and its
``lam``, objective, learning rate, seed); directories without one are listed and skipped. A sweep's
output directory (it holds ``sweep.json``) stands for all its runs, and any other folder for the run
directories inside it (``runs/<name>`` for its ``version_N``). Metrics come from ``metrics.jsonl``
and the TensorBoard event files together; a metric's value is the one at its last step (at the same
step ``metrics.jsonl``'s float64 wins over TensorBoard's float32). Missing metrics are left out.

Unfinished runs are refused (listed as skipped, never averaged): a run is finished when it has a done
marker (``DONE`` from ``kdlab sweep``, ``checkpoints/final.ckpt`` from every ``kdlab fit``) or, without
one, when its last logged step reaches ``trainer.max_steps - 1``; a run with neither marker nor
``max_steps`` is reported and flagged.

Runs whose configs differ only in the seed are one configuration: mean +- sample standard deviation
(n - 1) over its seeds, n seeds shown; reruns of one seed are averaged into that seed first. Each
value also gets a 95% interval in brackets where one can be made: a bootstrap over problems (and,
for the accuracy, the samples within each) of each seed's last evaluation (``samples/val-*.jsonl``) for ``val/accuracy`` and
``val/pass@k``, a Wilson interval over the callback's examples x samples for
``coverage/<task>/pass@1``. Settings other than task, rollout, ``lam``, objective and learning rate
that vary between configurations are shown in an ``other`` column, so no two settings are ever averaged.

Written to ``--output`` (default: ``report/`` in the folder holding every given run, e.g.
``runs/sweep-smoke/report``):

- ``report.md``: results by configuration (``val/accuracy``, ``ood/mean_delta``, ``sparsity/1e-06``)
  with the paper's headline numbers beside the matching rows; the rollout spectrum (MixtureRollouts,
  x = lam, y = val/accuracy, per objective); pass@k (``val/pass@k``, ``coverage/<name>/pass@k``);
  ``style/spanish_share``; final ``rlvr/reward*``. Fractions are shown in percent, ``ood/*`` in points.
- CSV files in the units the runs logged: ``runs.csv`` (every run, every metric's last value, and the
  fit's wall time from ``kdlab sweep``'s ``DONE`` summary),
  ``summary.csv``, ``spectrum.csv``, ``pass_at_k.csv``, ``style.csv``, ``rlvr_curves.csv`` (whole curves).
- PNG figures (each titled with its metric, error bars the 95% interval or else +- std over seeds, a
  note on the figure when every plotted value is equal), also embedded with the Markdown in
  TensorBoard under ``<output>/tensorboard``.

The paper's numbers sit beside a row when the setting matches: rollout OffPD (TeacherRollouts, or
MixtureRollouts at lam = -1) or OnPD (StudentRollouts, or lam = 1), full-vocabulary ForwardKL or
ReverseKL, and, for numbers the paper gives per learning rate, the "low" (paper: 1e-5) or "high"
(5e-5) rate. The tiny world uses other rates, so ``--low_lr`` / ``--high_lr`` map them; by default, of
exactly two learning rates the smaller is low, otherwise only 1e-5 and 5e-5 themselves are mapped.
Figures need matplotlib: ``pip install 'kdlab[report]'``.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kdlab.sweep import short_keys, value_label

MAIN_METRICS = ("val/accuracy", "ood/mean_delta", "sparsity/1e-06")
PASS_AT_K = re.compile(r"^(val/pass@\d+|coverage/.+/pass@\d+)$")
STYLE_METRICS = ("style/spanish_share", "style/teacher_spanish_share")
# settings that differ between the seeds of one configuration, or only say where it was logged
PER_RUN_KEYS = ("seed_everything", "model.seed", "trainer.logger", "trainer.default_root_dir", "ckpt_path", "config")
# settings that have their own columns
COLUMN_KEYS = (
    "model.task.class_path",
    "model.task.init_args.variant",
    "model.rollout.class_path",
    "model.rollout.init_args.lam",
    "model.objective.class_path",
    "model.lr",
)
ROLLOUT_ORDER = {"TeacherRollouts": 0, "MixtureRollouts": 1, "StudentRollouts": 2}
PAPER_LR = {1e-5: "low", 5e-5: "high"}


# ---- the paper's numbers -------------------------------------------------------------------------
PAPER = "Piskorz, Berthon, van der Schaar, arXiv 2609.35259, Headline results"


@dataclass(frozen=True)
class PaperResult:
    """A headline number of the paper (Qwen/Llama on Countdown-3, Science, MedReason), in report units.

    ``rollout`` (``OffPD``/``OnPD``), ``direction`` (``forward``/``reverse``) and ``lr`` (``low`` = 1e-5,
    ``high`` = 5e-5) say which rows it is compared with; None means any.
    """

    key: str
    metric: str
    value: str
    claim: str
    source: str
    rollout: str | None = None
    direction: str | None = None
    lr: str | None = None


_BEST = "Best mean accuracy: OnPD 72% vs OffPD 73% (no consistent on-policy advantage)."
_KL = "Forward KL 71-73% across every rollout policy and LR; reverse KL 35-72%, LR-sensitive."
_FORGET = "Forgetting: at LR 1e-5 mean OOD change <= 1.3 points; at 5e-5 drops of 11.2-14.0 points."
_SPARSE = "Sparsity: 85.3-89.6% at 1e-5 vs 51.9-60.0% at 5e-5; OffPD at least as sparse as OnPD."
PAPER_RESULTS = (
    PaperResult("P1", "val/accuracy", "72", "best mean accuracy, OnPD", _BEST, rollout="OnPD"),
    PaperResult("P2", "val/accuracy", "73", "best mean accuracy, OffPD", _BEST, rollout="OffPD"),
    PaperResult("P3", "val/accuracy", "71-73", "forward KL, every rollout policy and LR", _KL, direction="forward"),
    PaperResult("P4", "val/accuracy", "35-72", "reverse KL, LR-sensitive", _KL, direction="reverse"),
    PaperResult("P5", "ood/mean_delta", "|change| <= 1.3", "mean OOD change at LR 1e-5", _FORGET, lr="low"),
    PaperResult("P6", "ood/mean_delta", "-14.0 to -11.2", "mean OOD drop at LR 5e-5", _FORGET, lr="high"),
    PaperResult("P7", "sparsity/1e-06", "85.3-89.6", "update sparsity (tau 1e-6) at LR 1e-5", _SPARSE, lr="low"),
    PaperResult("P8", "sparsity/1e-06", "51.9-60.0", "update sparsity (tau 1e-6) at LR 5e-5", _SPARSE, lr="high"),
)
PAPER_NOTES = {
    "spectrum": "Spectrum: forward KL stays above 80% held-out across lambda (5.2-point spread at 1e-5); "
    "reverse KL favours lambda > 0 and is unstable at the high LR.",
    "pass@k": "On-policy rollouts give 10-15% higher pass@k on Countdown-4E; the edge does not survive RLVR.",
    "style": "OnPD + reverse KL keeps the student's English style; other settings transfer Spanish almost fully.",
}


# ---- reading runs --------------------------------------------------------------------------------
def read_metrics(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of a run as ``name -> [(step, value), ...]`` sorted by step, from TensorBoard and
    ``metrics.jsonl`` (the later wins at equal steps, and a later line over an earlier one)."""
    from tensorboard.backend.event_processing.event_accumulator import (
        SCALARS,
        EventAccumulator,
    )

    points: dict[str, dict[int, float]] = {}
    events = EventAccumulator(str(run_dir), size_guidance={SCALARS: 0})  # 0 keeps every point
    events.Reload()
    for tag in events.Tags().get("scalars", []):
        for event in events.Scalars(tag):
            points.setdefault(tag, {})[int(event.step)] = float(event.value)
    for step, name, value in metrics_lines(Path(run_dir, "metrics.jsonl")):
        points.setdefault(name, {})[step] = value
    return {name: sorted(series.items()) for name, series in points.items()}


def metrics_lines(path: str | Path):
    """``(step, name, value)`` for every scalar of a ``metrics.jsonl`` file, in file order (none if it
    does not exist)."""
    path = Path(path)
    if not path.is_file():
        return
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            step = int(row.pop("step"))
            for name, value in row.items():
                yield step, name, float(value)


def _flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """Dotted keys -> JSON values. A null value is left out: it reads the same as an absent key (a run
    saved before that setting existed), so the two do not split a configuration."""
    if isinstance(value, dict) and value:
        flat = {}
        for key, item in value.items():
            flat.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {} if value is None else {prefix: json.dumps(value, sort_keys=True, default=str)}


@functools.lru_cache(maxsize=None)
def _defaults(class_path: str) -> dict[str, Any]:
    """``{argument: default}`` of a class's ``__init__`` (empty when it cannot be imported)."""
    import importlib
    import inspect

    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        parameters = inspect.signature(cls.__init__).parameters.values()
    except (ImportError, AttributeError, ValueError, TypeError):
        return {}
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def without_defaults(value: Any, class_path: str | None = None) -> Any:
    """``value`` with every ``init_args`` entry (and, for ``class_path``, every top-level entry) that equals
    its class's default removed, at any depth: a run saved before a setting existed reads the same as one
    that left it at its default, so adding an argument to a class never splits a configuration."""
    if isinstance(value, list):
        return [without_defaults(item) for item in value]
    if not isinstance(value, dict):
        return value
    inner = value.get("class_path") if isinstance(value.get("class_path"), str) else None
    result = {key: without_defaults(item) for key, item in value.items()}
    for target, path in ((result.get("init_args"), inner), (result, class_path)):
        if isinstance(target, dict) and path:
            defaults = _defaults(path)
            for key in [k for k in target if k in defaults]:
                if json.dumps(target[key], sort_keys=True, default=str) == json.dumps(defaults[key], sort_keys=True, default=str):
                    del target[key]
    return result


def _settings_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config with defaults removed (:func:`without_defaults`); a ``model`` given without ``class_path``
    is a ``DistillModule`` (kdlab fit's default)."""
    normal = without_defaults(config)
    model = normal.get("model")
    if isinstance(model, dict) and "class_path" not in model:
        normal["model"] = without_defaults(model, "kdlab.module.DistillModule")
    return normal


def _class_name(value: Any, default: str) -> str:
    if isinstance(value, dict):
        value = value.get("class_path")
    return value.rsplit(".", 1)[-1] if isinstance(value, str) else default


@dataclass
class RunResult:
    """One run: what was run (from ``config.yaml``) and every metric's series."""

    path: Path
    task: str
    rollout: str
    lam: float | None
    objective: str
    lr: float
    seed: int | None
    settings: dict[str, str]
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    unfinished: str = ""  # why the run is not finished ("" when it is)
    flag: str = ""  # a caveat shown in the report (e.g. no done marker)
    coverage_draws: dict[str, int] = field(default_factory=dict)  # coverage/<name> -> examples x samples
    seconds: float | None = None  # the fit's own wall time, from kdlab sweep's DONE summary

    @property
    def last(self) -> dict[str, float]:
        return {name: points[-1][1] for name, points in self.series.items() if points}


def read_run(run_dir: str | Path) -> RunResult:
    """A run directory; ``ValueError`` when it has no readable ``config.yaml``."""
    run_dir = Path(run_dir)
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ValueError("no config.yaml")
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as error:
        raise ValueError(f"config.yaml does not parse: {error}") from error
    model = config.get("model") or {}
    stage = "DistillModule"
    if isinstance(model.get("class_path"), str):  # a stage chosen by class (e.g. GRPOModule)
        stage = _class_name(model, "DistillModule")
        model = model.get("init_args") or {}
    task = model.get("task") or {}
    variant = (task.get("init_args") or {}).get("variant") if isinstance(task, dict) else None
    rollout = model.get("rollout") or {}
    # DistillModule's defaults; another stage (GRPO, SFT) has no rollout policy or KL objective: its
    # name stands in both columns, so it never reads as (or takes the paper's numbers of) a distillation
    rollout_name = _class_name(rollout, "TeacherRollouts") if stage == "DistillModule" else stage
    lam = None
    if rollout_name == "MixtureRollouts":
        lam = float(((rollout.get("init_args") or {}) if isinstance(rollout, dict) else {}).get("lam", 0.0))
    seed = config.get("seed_everything")
    seed = seed if type(seed) is int else model.get("seed")
    settings = {
        key: value
        for key, value in _flatten(_settings_config(config)).items()
        if not any(key == k or key.startswith(k + ".") for k in PER_RUN_KEYS)
    }
    series = read_metrics(run_dir)
    unfinished, flag = run_status(run_dir, config, series)
    return RunResult(
        path=run_dir,
        task=variant or _class_name(task, "?"),
        rollout=rollout_name,
        lam=lam,
        objective=_class_name(model.get("objective"), "ForwardKL") if stage == "DistillModule" else stage,
        lr=float(model.get("lr", 1e-5)),
        seed=seed,
        settings=settings,
        series=series,
        unfinished=unfinished,
        flag=flag,
        coverage_draws=_coverage_draws(config),
        seconds=_fit_seconds(run_dir),
    )


def _fit_seconds(run_dir: Path) -> float | None:
    try:
        seconds = json.loads((run_dir / "DONE").read_text(encoding="utf-8")).get("seconds")
    except (OSError, ValueError, AttributeError):
        return None
    return float(seconds) if isinstance(seconds, (int, float)) else None


DONE_MARKERS = ("DONE", "checkpoints/final.ckpt")  # kdlab sweep's summary; the checkpoint every kdlab fit ends with


def run_status(run_dir: Path, config: dict[str, Any], series: dict[str, list[tuple[int, float]]]) -> tuple[str, str]:
    """``(unfinished, flag)``: ``unfinished`` says why a run did not finish ("" when it did), ``flag`` a
    caveat. A run with a done marker (``DONE``, ``checkpoints/final.ckpt``) finished; one without, whose
    last logged step is before ``trainer.max_steps - 1`` (Lightning logs step s's scalars at s - 1), did
    not (interrupted, crashed or still running); one without a marker or ``max_steps`` is flagged."""
    if any((run_dir / marker).is_file() for marker in DONE_MARKERS):
        return "", ""
    max_steps = (config.get("trainer") or {}).get("max_steps") if isinstance(config.get("trainer"), dict) else None
    last = max((points[-1][0] for points in series.values() if points), default=None)
    if type(max_steps) is int and max_steps > 0:
        if last is None or last < max_steps - 1:
            logged = "nothing logged" if last is None else f"last logged step {last}"
            return f"unfinished: no done marker ({' or '.join(DONE_MARKERS)}) and {logged} of max_steps={max_steps}", ""
        return "", ""
    return "", "no done marker and no trainer.max_steps: cannot tell whether it finished"


def _coverage_draws(config: dict[str, Any]) -> dict[str, int]:
    """``coverage/<name>`` -> examples x samples of each ``Coverage`` callback in the config (for the
    interval of its pass@1)."""
    callbacks = (config.get("trainer") or {}).get("callbacks") if isinstance(config.get("trainer"), dict) else None
    draws = {}
    for callback in callbacks if isinstance(callbacks, list) else []:
        if not (isinstance(callback, dict) and str(callback.get("class_path", "")).endswith("Coverage")):
            continue
        args = callback.get("init_args") or {}
        task = args.get("task") or {}
        task_args = (task.get("init_args") or {}) if isinstance(task, dict) else {}
        name = args.get("name") or task_args.get("variant") or _class_name(task, "task").lower()
        examples = args.get("examples", 200)
        samples = args.get("samples", 10)
        if isinstance(examples, int) and isinstance(samples, int):
            draws[f"coverage/{name}"] = examples * samples
    return draws


def read_samples(run_dir: str | Path, stage: str = "val") -> dict[str, list[float]] | None:
    """The scores of a run's last evaluation (``samples/<stage>-stepNNNNNN[-rankR].jsonl`` at the
    largest step, every rank) as ``example id -> [score of each sample]``; None without such files."""
    files: dict[int, list[Path]] = {}
    for path in Path(run_dir, "samples").glob(f"{stage}-step*.jsonl"):
        match = re.fullmatch(rf"{stage}-step(\d+)(-rank\d+)?\.jsonl", path.name)
        if match:
            files.setdefault(int(match.group(1)), []).append(path)
    if not files:
        return None
    scores: dict[str, list[float]] = {}
    for path in sorted(files[max(files)]):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                record = json.loads(line)
                scores.setdefault(str(record["id"]), []).append(float(record["score"]))
    return scores or None


def collect(paths: list[str | Path]) -> tuple[list[RunResult], list[tuple[str, str]]]:
    """Runs read from ``paths`` (a sweep's output directory stands for its runs) and ``(path, reason)``
    for each one skipped."""
    runs, skipped, seen = [], [], set()
    expanded: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir() and not (path / "config.yaml").is_file() and (path / "sweep.json").is_file():
            expanded += sorted(p for p in path.iterdir() if p.is_dir() and not (p / "report.md").is_file())  # not an earlier report
        elif path.is_dir() and not (path / "config.yaml").is_file():
            found = run_directories(path)
            expanded += found or [path]  # nothing inside: skipped below as "no config.yaml"
        else:
            expanded.append(path)
    for path in expanded:
        if path.resolve() in seen:
            continue
        seen.add(path.resolve())
        if not path.is_dir():
            skipped.append((str(path), "not a directory" if path.exists() else "does not exist"))
            continue
        try:
            runs.append(read_run(path))
        except ValueError as error:
            skipped.append((str(path), str(error)))
    return runs, skipped


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
    import numpy as np
    from math import comb

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


def run_directories(folder: Path, depth: int = 3) -> list[Path]:
    """Run directories (with a ``config.yaml``) inside ``folder`` up to ``depth`` levels down, e.g. the
    ``version_N`` of ``runs/<name>`` or every run of ``runs/``; ``checkpoints``/``samples`` are not searched."""
    found: list[Path] = []
    for child in sorted(p for p in folder.iterdir() if p.is_dir() and p.name not in ("checkpoints", "samples") and not (p / "report.md").is_file()):
        if (child / "config.yaml").is_file():
            found.append(child)
        elif depth > 1:
            found += run_directories(child, depth - 1)
    return found


# ---- configurations ------------------------------------------------------------------------------
@dataclass
class Group:
    """The runs of one configuration (they differ only in the seed)."""

    runs: list[RunResult]
    other: str = ""
    level: str | None = None  # "low" / "high" learning rate, for the paper's numbers
    _intervals: dict = field(default_factory=dict, repr=False)

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
        if self.rollout == "TeacherRollouts" or (self.lam is not None and math.isclose(self.lam, -1.0)):
            return "OffPD"
        if self.rollout == "StudentRollouts" or (self.lam is not None and math.isclose(self.lam, 1.0)):
            return "OnPD"
        return None

    @property
    def direction(self) -> str | None:
        return {"ForwardKL": "forward", "ReverseKL": "reverse"}.get(self.objective)

    def by_seed(self) -> dict[Any, list[RunResult]]:
        """The runs of each seed (a run without a seed is its own): reruns of a seed are one seed."""
        seeds: dict[Any, list[RunResult]] = {}
        for index, run in enumerate(self.runs):
            seeds.setdefault(run.seed if run.seed is not None else ("run", index), []).append(run)
        return seeds

    @property
    def seeds(self) -> int:
        return len(self.by_seed())

    def stats(self, metric: str) -> tuple[float, float | None, int] | None:
        """(mean, sample std or None for one value, n seeds) of the metric's last values, None when
        absent. Reruns of one seed are averaged first: they are one seed, not more evidence."""
        values = [
            statistics.fmean(run.last[metric] for run in runs if metric in run.last)
            for runs in self.by_seed().values()
            if any(metric in run.last for run in runs)
        ]
        if not values:
            return None
        return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None, len(values)

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
    by_settings: dict[str, list[RunResult]] = {}
    for run in runs:
        by_settings.setdefault(json.dumps(run.settings, sort_keys=True), []).append(run)
    groups = [Group(sorted(members, key=lambda r: (r.seed is None, r.seed or 0, str(r.path)))) for members in by_settings.values()]
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
def _percent(metric: str) -> bool:
    return bool(re.search(r"(accuracy|pass@\d+|share)$", metric)) or metric.startswith("sparsity/")


def _number(metric: str, value: float) -> str:
    if _percent(metric):
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


def error_bars(groups: list[Group], metric: str) -> tuple[list[float], list[list[float]]]:
    """Means and (below, above) error-bar lengths in report units: the 95% interval where there is one,
    else ± the std over seeds, else none."""
    scale = 100.0 if _percent(metric) else 1.0
    means, below, above = [], [], []
    for g in groups:
        mean, std, _ = g.stats(metric)
        interval = g.interval(metric)
        low, high = interval[:2] if interval else (mean - (std or 0.0), mean + (std or 0.0))
        means.append(scale * mean)
        below.append(scale * max(0.0, mean - low))
        above.append(scale * max(0.0, high - mean))
    return means, [below, above]


def note_if_equal(ax: Any, values: list[float], what: str) -> None:
    """Say on the figure when every plotted value is the same (a flat chart is otherwise unreadable)."""
    if values and max(values) - min(values) < 1e-9:
        ax.text(0.5, 0.5, f"all {len(values)} values of {what} are {values[0]:.4g}", transform=ax.transAxes,
                ha="center", va="center", fontsize=9, bbox={"facecolor": "white", "alpha": 0.8})


def _unit(metric: str) -> str:
    return f"{metric} (%)" if _percent(metric) else f"{metric} (points)" if metric.startswith("ood/") else metric


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(header), "|" + " --- |" * len(header), *map(line, rows)])


def write_csv(path: Path, header: list[str], rows: list[list[Any]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)


def _label(group: Group) -> str:
    return f"{group.rollout_label} {group.objective} lr={group.lr:g}" + (f" {group.other}" if group.other else "")


def _pass_at_k_order(metric: str) -> tuple[bool, str, int]:
    """``val/pass@k`` first, then each coverage task; k numerically (pass@10 after pass@2)."""
    prefix, k = metric.rsplit("@", 1)
    return not metric.startswith("val/"), prefix, int(k)


# ---- the report ----------------------------------------------------------------------------------
def _figure_factory():
    """Makes matplotlib Figures on the Agg canvas (no pyplot state); a clear error when matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("kdlab report draws its figures with matplotlib: pip install 'kdlab[report]'") from error

    def figure(**kwargs: Any) -> Figure:
        fig = Figure(**kwargs)
        FigureCanvasAgg(fig)
        return fig

    return figure


class _Report:
    """Collects the Markdown lines, CSV files and figures of one report, section by section."""

    def __init__(self, runs: list[RunResult], output: Path, levels: dict[float, str]) -> None:
        self.new_figure = _figure_factory()  # fails before any work when matplotlib is missing
        self.runs, self.output, self.levels = runs, output, levels
        self.groups = group_runs(runs, levels)
        self.with_other = any(group.other for group in self.groups)
        self.present = {name for run in runs for name in run.last}
        self.md: list[str] = []
        self.figures: dict[str, Any] = {}

    def describe(self, group: Group) -> list[str]:
        lr = f"{group.lr:g}"
        return [group.task, group.rollout_label, group.objective, lr, group.level or ""] + ([group.other] if self.with_other else [])

    @property
    def describe_header(self) -> list[str]:
        return ["task", "rollout", "objective", "lr", "lr level"] + (["other"] if self.with_other else [])

    def csv(self, name: str, groups: list[Group], metrics: list[str]) -> None:
        """One row per configuration: its columns, then mean, std and n of each metric (logged units)."""
        header = ["task", "rollout", "lam", "objective", "lr", "lr_level", "other", "n", "runs"]
        header += [f"{metric} {part}" for metric in metrics for part in ("mean", "std", "n", "ci_low", "ci_high", "ci")]
        rows = []
        for g in groups:
            row = [g.task, g.rollout, "" if g.lam is None else g.lam, g.objective, g.lr, g.level or "", g.other, g.seeds, len(g.runs)]
            for metric in metrics:
                stats = g.stats(metric)
                interval = g.interval(metric) if stats else None
                row += [stats[0], "" if stats[1] is None else stats[1], stats[2]] if stats else ["", "", 0]
                row += list(interval) if interval else ["", "", ""]
            rows.append(row)
        write_csv(self.output / name, header, rows)

    def metric_section(self, title: str, metrics: list[str], csv_name: str, note: str | None = None) -> list[Group]:
        """A table (and CSV) of ``metrics`` for the configurations that logged any of them."""
        shown = [g for g in self.groups if any(g.stats(m) for m in metrics)]
        rows = [self.describe(g) + [str(g.seeds)] + [cell(g, m) for m in metrics] for g in shown]
        self.md += ["", f"## {title}", "", markdown_table(self.describe_header + ["n", *map(_unit, metrics)], rows)]
        if note:
            self.md += ["", f"> Paper: {note}"]
        self.csv(csv_name, shown, metrics)
        return shown

    # -- sections
    def results(self) -> None:
        """val/accuracy, ood/mean_delta, sparsity by configuration, the paper's numbers beside them."""
        metrics = [m for m in MAIN_METRICS if m in self.present]
        with_paper = [m for m in metrics if any(g.paper(m) for g in self.groups)]
        header = self.describe_header + ["n"]
        for metric in metrics:
            header += [_unit(metric)] + (["paper"] if metric in with_paper else [])
        rows = []
        for group in self.groups:
            row = self.describe(group) + [str(group.seeds)]
            for metric in metrics:
                row.append(cell(group, metric))
                if metric in with_paper:
                    row.append("; ".join(f"{p.value} [{p.key}]" for p in group.paper(metric)))
            rows.append(row)
        self.md += ["", "## Results by configuration", "", markdown_table(header, rows)]
        self.csv("summary.csv", self.groups, metrics)
        self.md += [
            "",
            "### The paper's headline numbers",
            "",
            (
                "From Qwen2.5-7B -> 1.5B and Llama-3.1-8B -> 3.2-1B on Countdown-3, Science and MedReason at LR 1e-5 "
                "(low) and 5e-5 (high): where a reproduction should land, not what the tiny world should give. "
                "OffPD = teacher rollouts, OnPD = student rollouts."
            ),
            "",
            markdown_table(
                ["key", "metric", "rollout", "KL", "lr", "paper", "what", f"source ({PAPER})"],
                [[p.key, p.metric, p.rollout or "any", p.direction or "any", p.lr or "any", p.value, p.claim, p.source] for p in PAPER_RESULTS],
            ),
        ]
        shown = [g for g in self.groups if g.stats("val/accuracy")]
        if shown:
            fig = self.new_figure(figsize=(7, 0.45 * len(shown) + 1.8))
            ax = fig.add_subplot()
            means, errors = error_bars(shown, "val/accuracy")
            ax.barh(range(len(shown)), means, xerr=errors, capsize=3, alpha=0.8)
            ax.plot(means, range(len(shown)), "k|", markersize=12)  # a zero-length bar still shows its value
            ax.set_yticks(range(len(shown)), [_label(g) for g in shown], fontsize=8)
            ax.invert_yaxis()
            ax.set_xlim(0, 100)
            ax.set(xlabel="val/accuracy (%)", title="val/accuracy (held-out, last evaluation): mean over seeds, bar = 95% interval or ± std")
            ax.title.set_fontsize(9)
            note_if_equal(ax, means, "val/accuracy (%)")
            fig.tight_layout()
            self.figures["accuracy"] = fig

    def spectrum(self) -> None:
        """MixtureRollouts: val/accuracy against lam, one curve per objective (and learning rate)."""
        mixture = [g for g in self.groups if g.lam is not None and g.stats("val/accuracy")]
        if not mixture:
            return
        self.md += ["", "## Rollout spectrum (MixtureRollouts: lam = -1 teacher, 1 student)", ""]
        csv_rows = []
        for task in sorted({g.task for g in mixture}):
            here = [g for g in mixture if g.task == task]
            curves: dict[str, list[Group]] = {}
            for g in sorted(here, key=lambda g: (g.objective, g.lr, g.other, g.lam)):
                curves.setdefault(f"{g.objective}, lr={g.lr:g}" + (f", {g.other}" if g.other else ""), []).append(g)
            table = []
            for lam in sorted({g.lam for g in here}):
                row = [f"{lam:g}"]
                for members in curves.values():
                    match = [g for g in members if g.lam == lam]
                    row.append(f"{cell(match[0], 'val/accuracy')} (n={match[0].seeds})" if match else "")
                table.append(row)
            self.md += [f"{task}: val/accuracy (%) by lam", "", markdown_table(["lam", *curves], table), ""]
            fig = self.new_figure(figsize=(6, 4))
            ax = fig.add_subplot()
            plotted = []
            for label, members in curves.items():
                means, errors = error_bars(members, "val/accuracy")
                ax.errorbar([g.lam for g in members], means, yerr=errors, marker="o", capsize=3, label=label)
                plotted += means
            ax.set(xlabel="lam (-1 teacher, 1 student)", ylabel="val/accuracy (%)", ylim=(0, 100),
                   title=f"Rollout spectrum, {task}: val/accuracy (bars: 95% interval or ± std)")
            ax.title.set_fontsize(9)
            note_if_equal(ax, plotted, "val/accuracy (%)")
            ax.legend(fontsize=8)
            fig.tight_layout()
            self.figures[f"spectrum-{task}"] = fig
            for g in here:
                mean, std, n = g.stats("val/accuracy")
                interval = g.interval("val/accuracy")
                csv_rows.append([task, g.objective, g.lr, g.other, g.lam, n, mean, "" if std is None else std, *(interval[:2] if interval else ("", ""))])
        self.md.append(f"> Paper: {PAPER_NOTES['spectrum']}")
        header = ["task", "objective", "lr", "other", "lam", "n", "val/accuracy mean", "val/accuracy std", "val/accuracy ci_low", "val/accuracy ci_high"]
        write_csv(self.output / "spectrum.csv", header, csv_rows)

    def pass_at_k(self) -> None:
        metrics = sorted((m for m in self.present if PASS_AT_K.match(m)), key=_pass_at_k_order)
        if not metrics:
            return
        shown = self.metric_section("pass@k", metrics, "pass_at_k.csv", PAPER_NOTES["pass@k"])
        for task in sorted({g.task for g in shown if g.lam is not None}):
            here = [g for g in shown if g.task == task and g.lam is not None]
            fig = self.new_figure(figsize=(6, 4))
            ax = fig.add_subplot()
            plotted = []
            for metric in metrics:
                for objective, lr in sorted({(g.objective, g.lr) for g in here}):
                    members = sorted((g for g in here if (g.objective, g.lr) == (objective, lr) and g.stats(metric)), key=lambda g: g.lam)
                    if members:
                        means, errors = error_bars(members, metric)
                        ax.errorbar([g.lam for g in members], means, yerr=errors, marker="o", capsize=3, label=f"{metric} {objective} lr={lr:g}")
                        plotted += means
            ax.set(xlabel="lam (-1 teacher, 1 student)", ylabel="pass@k (%)", ylim=(0, 100),
                   title=f"pass@k vs lam, {task}: {', '.join(metrics)}")
            ax.title.set_fontsize(8)
            note_if_equal(ax, plotted, "pass@k (%)")
            ax.legend(fontsize=7)
            fig.tight_layout()
            self.figures[f"pass_at_k-{task}"] = fig

    def style(self) -> None:
        metrics = [m for m in STYLE_METRICS if m in self.present]
        if metrics:
            title = "Style transfer (share of primarily Spanish student responses)"
            self.metric_section(title, metrics, "style.csv", PAPER_NOTES["style"])

    def rlvr(self) -> None:
        """Final rewards in a table; whole curves (every run, a colour per configuration) in figures and CSV."""
        metrics = sorted(m for m in self.present if m.startswith("rlvr/reward"))
        if not metrics:
            return
        shown = self.metric_section("RLVR reward (last value; whole curves in rlvr_curves.csv and the figures)", metrics, "rlvr.csv")
        rows = []
        for metric in metrics:
            fig = self.new_figure(figsize=(7, 4))
            ax = fig.add_subplot()
            for index, g in enumerate(shown):
                for number, run in enumerate(r for r in g.runs if metric in r.series):
                    steps, values = zip(*run.series[metric])
                    ax.plot(steps, values, color=f"C{index % 10}", alpha=0.8, label=_label(g) if number == 0 else None)
                    lam = "" if g.lam is None else g.lam
                    rows += [[str(run.path), g.task, g.rollout, lam, g.objective, g.lr, run.seed, metric, s, v] for s, v in run.series[metric]]
            ax.set(xlabel="step", ylabel=metric, title=metric)
            ax.legend(fontsize=7)
            fig.tight_layout()
            self.figures[metric.replace("/", "-")] = fig
        header = ["run", "task", "rollout", "lam", "objective", "lr", "seed", "metric", "step", "value"]
        write_csv(self.output / "rlvr_curves.csv", header, rows)

    def every_run(self) -> None:
        names = sorted(self.present)
        rows = [
            [str(r.path), r.task, r.rollout, "" if r.lam is None else r.lam, r.objective, r.lr, self.levels.get(r.lr, ""), r.seed,
             "" if r.seconds is None else r.seconds]
            + [r.last.get(name, "") for name in names]
            for r in self.runs
        ]
        header = ["run", "task", "rollout", "lam", "objective", "lr", "lr_level", "seed", "fit_seconds", *names]
        write_csv(self.output / "runs.csv", header, rows)


def write_report(
    runs: list[RunResult],
    skipped: list[tuple[str, str]],
    output: str | Path,
    low_lr: list[float] | None = None,
    high_lr: list[float] | None = None,
) -> Path:
    """Write ``report.md``, the CSV files, the PNG figures and ``tensorboard/`` to ``output``; returns
    the Markdown file's path."""
    output = Path(output)
    levels = lr_levels({run.lr for run in runs}, low_lr, high_lr)
    report = _Report(runs, output, levels)
    output.mkdir(parents=True, exist_ok=True)
    report.md += [
        "# kdlab report",
        "",
        (
            f"{len(runs)} runs in {len(report.groups)} configurations: mean ± sample standard deviation over the "
            "seeds of a configuration (n seeds; reruns of one seed are averaged into that seed), then, in brackets, "
            "a 95% interval of that mean: for val/accuracy and val/pass@k a bootstrap over the problems (for val/accuracy also the samples within each) "
            "of each seed's last evaluation (samples/val-*.jsonl), for coverage/<task>/pass@1 a Wilson interval over "
            "the callback's examples x samples. Accuracy, pass@k, sparsity and Spanish share in percent; "
            "ood/mean_delta in points (after - before). The CSV files keep the units the runs logged. "
            "val/accuracy is the mean score of eval_samples completions per held-out prompt at the last validation; "
            "coverage/<task>/pass@k is the Coverage callback's own draw on its task, a different number."
        ),
    ]
    reruns = [(g, g.seeds) for g in report.groups if len(g.runs) > g.seeds]
    if reruns:
        report.md += ["", "Reruns of a seed (averaged as one seed, not counted as more seeds):"]
        report.md += [f"- {_label(g)}: {len(g.runs)} runs, {seeds} seeds" for g, seeds in reruns]
    flagged = [run for run in runs if run.flag]
    if flagged:
        report.md += ["", "Flagged:", *(f"- `{run.path}`: {run.flag}" for run in flagged)]
    if levels:
        how = "as given" if (low_lr or high_lr) else "default: the smaller of two learning rates is low; set with --low_lr / --high_lr"
        mapping = ", ".join(f"{lr:g} = {level}" for lr, level in sorted(levels.items()))
        report.md += ["", f"Learning-rate levels for the paper's numbers: {mapping} ({how})."]
    if skipped:
        report.md += ["", "Skipped:", *(f"- `{path}`: {reason}" for path, reason in skipped)]
    report.results()
    report.spectrum()
    report.pass_at_k()
    report.style()
    report.rlvr()
    report.every_run()
    if report.figures:
        report.md += ["", "## Figures", "", *(f"![{name}]({name}.png)" for name in report.figures)]
    text = "\n".join(report.md) + "\n"
    path = output / "report.md"
    path.write_text(text, encoding="utf-8")
    for name, fig in report.figures.items():
        fig.savefig(output / f"{name}.png", dpi=120)
    _write_tensorboard(output / "tensorboard", report.figures, text)
    return path


def _write_tensorboard(directory: Path, figures: dict[str, Any], text: str) -> None:
    from torch.utils.tensorboard import SummaryWriter

    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("events.out.tfevents.*"):  # a rewritten report replaces the last one
        old.unlink()
    writer = SummaryWriter(str(directory))
    try:
        for name, fig in figures.items():
            writer.add_figure(f"report/{name}", fig, global_step=0)
        writer.add_text("report", text, global_step=0)
    finally:
        writer.close()


def default_output(paths: list[str | Path]) -> Path:
    """``<the folder holding every given run>/report``: beside the runs, never the current directory by
    accident (``kdlab report runs/sweep`` writes ``runs/sweep/report``)."""
    import os

    folders = [Path(path).resolve() for path in paths]
    return Path(os.path.commonpath(folders)) / "report"


def main(argv: list[str] | None = None) -> None:
    """``kdlab report RUN_DIR... [--output DIR] [--low_lr LR...] [--high_lr LR...]``."""
    parser = argparse.ArgumentParser(
        prog="kdlab report", description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR",
                        help="run directories, folders holding them (runs/<name> with its version_N) or a sweep's output directory")
    parser.add_argument("--output", help="where the report goes (default: report/ in the folder holding every given run)")
    parser.add_argument("--low_lr", type=float, nargs="+", help="learning rates compared with the paper's 1e-5")
    parser.add_argument("--high_lr", type=float, nargs="+", help="learning rates compared with the paper's 5e-5")
    options = parser.parse_args(argv)
    runs, skipped = collect(options.runs)
    skipped += [(str(run.path), run.unfinished) for run in runs if run.unfinished]  # never averaged with finished runs
    runs = [run for run in runs if not run.unfinished]
    for path, reason in skipped:
        print(f"[report] skipped {path}: {reason}", file=sys.stderr)
    for run in runs:
        if run.flag:
            print(f"[report] flagged {run.path}: {run.flag}", file=sys.stderr)
    if not runs:
        parser.error("no finished run directory with a config.yaml among " + " ".join(options.runs))
    output = Path(options.output) if options.output else default_output(options.runs)
    path = write_report(runs, skipped, output, options.low_lr, options.high_lr)
    print(f"[report] {len(runs)} runs -> {path} (CSV, PNG and tensorboard/ beside it)")
    from kdlab.verdicts import is_study, write_verdicts

    if len(options.runs) == 1 and is_study(Path(options.runs[0])):
        write_verdicts(Path(options.runs[0]), runs, output)
        print(f"[report] the study's verdicts -> {output / 'verdicts.md'}")
