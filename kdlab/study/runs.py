"""Reading finished runs: a run's config (settings at their class defaults dropped), its metrics
(``metrics.jsonl``, the last value of each), its evaluation records, its fit time, and
whether it finished (a done marker, or its last step at ``trainer.max_steps - 1``)."""

from __future__ import annotations

import functools
import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kdlab.provenance import evaluation_command
from kdlab.runlog import METRICS_FILE, metrics_lines
from kdlab.study.setups import style_transfer_rows

# the report's main table; heldout_kl/forward_closed is the HeldOutKL callback's share of the held-out
# forward-KL gap closed, the figure docs/real_model.md leads with
MAIN_METRICS = ("val/accuracy", "heldout_kl/forward_closed", "ood/mean_delta", "sparsity/1e-06")
PASS_AT_K = re.compile(r"^(val/pass@\d+|coverage/.+/pass@\d+)$")
STYLE_METRICS = ("style/spanish_share", "style/teacher_spanish_share", "style/log_odds")  # log-odds: kdlab.callbacks.StyleLogOdds
# settings that differ between the seeds of one configuration, or only say where it was logged; a model
# given by class_path (a notebook's run, kdlab.run_config.describe_run; kdlab fit --model GRPOModule) has
# its seed under init_args
PER_RUN_KEYS = ("seed_everything", "model.seed", "model.init_args.seed", "trainer.logger", "trainer.default_root_dir", "ckpt_path", "config")
# settings that have their own columns
COLUMN_KEYS = (
    "model.task.class_path",
    "model.task.init_args.variant",
    "model.rollout.class_path",
    "model.rollout.init_args.lam",
    "model.objective.class_path",
    "model.lr",
)
# the teacher-written rollout policies (kdlab.rollouts.policies): the paper's OffPD, each under its own name
TEACHER_ROLLOUTS = frozenset({"TeacherRollouts", "TeacherDatasetRollouts", "CachedTeacherRollouts"})


# ---- reading runs --------------------------------------------------------------------------------
def read_metrics(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of a run as ``name -> [(step, value), ...]`` sorted by step, from its
    ``metrics.jsonl`` (:class:`kdlab.runlog.MetricsFile`; a later line wins over an earlier one at the
    same step). Every step is the number of optimiser steps taken, and Lightning's ``epoch`` is no
    metric (:func:`kdlab.runlog.metrics_lines` with ``optimiser_steps``): a run written before kdlab logged
    ``self.log`` values at optimiser steps reads as a new one.

    A run written before the metrics file carried ``self.log`` values (none of its lines has
    Lightning's ``epoch``) has those only in its TensorBoard events: they are read from there, at Lightning's
    logger step moved one on (a scalar the file does not hold is a ``self.log`` value), and the file's own
    lines win at equal steps."""
    path = Path(run_dir, METRICS_FILE)
    lines = read_metrics_lines(path, optimiser_steps=True)
    points: dict[str, dict[int, float]] = {}
    if not _has_lightning_lines(path):
        in_file = {name for _, name, _ in lines}
        points = {name: {step + (name not in in_file): value for step, value in series.items()}
                  for name, series in _tensorboard_scalars(run_dir).items()}
    for step, name, value in lines:
        points.setdefault(name, {})[step] = value
    return {name: sorted(series.items()) for name, series in points.items()}


def _has_lightning_lines(path: Path) -> bool:
    """Whether a line of the metrics file is one of Lightning's ``self.log`` lines (it carries ``epoch``); a
    line that does not parse is none (:func:`read_metrics_lines` says what is wrong with it)."""
    if not path.is_file():
        return False
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "epoch" in row:
            return True
    return False


def read_metrics_lines(path: Path, optimiser_steps: bool = False) -> list[tuple[int, str, float]]:
    """:func:`kdlab.runlog.metrics_lines` of ``path`` (with ``optimiser_steps``), except that a torn last line
    (a run killed while writing it, a full disk) is skipped with a warning naming the file; a bad line
    elsewhere raises ``ValueError`` naming the file and line."""
    lines: list[tuple[int, str, float]] = []
    try:
        lines.extend(metrics_lines(path, optimiser_steps=optimiser_steps))
    except (ValueError, KeyError, TypeError) as error:
        text = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        for number, line in enumerate(text[:-1], 1):
            try:
                json.loads(line)
            except ValueError:
                raise ValueError(f"{path}: line {number} is not JSON ({error})") from None
        try:
            json.loads(text[-1])
        except ValueError:
            warnings.warn(f"{path}: its last line is torn (a run stopped while writing it); skipped: {text[-1][:80]!r}", stacklevel=2)
        else:
            raise ValueError(f"{path}: a line without a step or with a value that is not a number ({error!r})") from None
    return lines


def _tensorboard_scalars(run_dir: str | Path) -> dict[str, dict[int, float]]:
    """``name -> {step: value}`` of a run directory's TensorBoard event files (empty without any)."""
    if not any(Path(run_dir).glob("events.out.tfevents.*")):
        return {}
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={SCALARS: 0})  # 0 keeps every point
    events.Reload()
    return {tag: {int(event.step): float(event.value) for event in events.Scalars(tag)} for tag in events.Tags().get("scalars", [])}


def _flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """Dotted keys -> JSON values. A null value is left out: it reads the same as an absent key (a run
    saved before that setting existed), so the two do not split a configuration."""
    if isinstance(value, dict) and value:
        flat = {}
        for key, item in value.items():
            flat.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {} if value is None else {prefix: json.dumps(value, sort_keys=True, default=str)}


TRUSTED_MODULES = ("kdlab.", "lightning.", "torch.")
"""The packages whose classes a report imports to read their defaults: a run directory (or someone's archive)
naming any other module in its config.yaml does not get it imported (importing runs its code)."""


@functools.lru_cache(maxsize=None)
def class_defaults(class_path: str) -> dict[str, Any]:
    """``{argument: default}`` of a class's ``__init__`` (empty when it cannot be imported, or lies outside
    :data:`TRUSTED_MODULES`)."""
    import importlib
    import inspect

    module, _, name = class_path.rpartition(".")
    if not module.startswith(TRUSTED_MODULES) and module not in ("kdlab", "lightning", "torch"):
        return {}
    try:
        cls = getattr(importlib.import_module(module), name)
        parameters = inspect.signature(cls.__init__).parameters.values()
    except (ImportError, AttributeError, ValueError, TypeError):
        return {}
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def without_defaults(value: Any, class_path: str | None = None) -> Any:
    """``value`` with every ``init_args`` entry (and, for ``class_path``, every top-level entry) that equals
    its class's default removed, at any depth: a run saved before a setting existed reads the same as one
    that left it at its default, so adding an argument to a class never splits a configuration. An
    ``init_args`` left empty (``MixtureRollouts`` with ``lam: 0.0``) is removed too: it reads like none."""
    if isinstance(value, list):
        return [without_defaults(item) for item in value]
    if not isinstance(value, dict):
        return value
    inner = value.get("class_path") if isinstance(value.get("class_path"), str) else None
    result = {key: without_defaults(item) for key, item in value.items()}
    for target, path in ((result.get("init_args"), inner), (result, class_path)):
        if isinstance(target, dict) and path:
            defaults = class_defaults(path)
            for key in [k for k in target if k in defaults]:
                if json.dumps(target[key], sort_keys=True, default=str) == json.dumps(defaults[key], sort_keys=True, default=str):
                    del target[key]
    if result.get("init_args") == {}:
        del result["init_args"]
    return result


def _settings_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config with defaults removed (:func:`without_defaults`); a ``model`` given without ``class_path``
    is a ``DistillModule`` (kdlab fit's default)."""
    normal = without_defaults(config)
    model = normal.get("model")
    if isinstance(model, dict) and "class_path" not in model:
        normal["model"] = model = without_defaults(model, "kdlab.stages.distill.DistillModule")
    arguments = model.get("init_args") if isinstance(model, dict) and "class_path" in model else model
    if isinstance(arguments, dict) and "teacher" in arguments:
        arguments["teacher"] = _teacher_source(arguments["teacher"])
    return normal


MODEL_TEACHER = "kdlab.teachers.ModelTeacher"


def _teacher_source(teacher: Any) -> Any:
    """``teacher`` as the source it builds: a model given by its path or its fields (``{path: ..., dtype: ...}``)
    is ``ModelTeacher(model=...)``, so a run spelling it that way and one naming ``class_path`` read as one
    setting, and an in-process run differs from a served one in the source's class (``teacher=ModelTeacher``
    against ``teacher=Served``), not in fields only one of them has."""
    if isinstance(teacher, str) or (isinstance(teacher, dict) and teacher and "class_path" not in teacher):
        return {"class_path": MODEL_TEACHER, "init_args": {"model": teacher}}
    return teacher


def _class_name(value: Any, default: str) -> str:
    if isinstance(value, dict):
        value = value.get("class_path")
    return value.rsplit(".", 1)[-1] if isinstance(value, str) else default


def _rollout_class(rollout: Any) -> str:
    """The rollout policy class a config builds: kdlab 0.1's ``TeacherRollouts`` with a ``dataset`` (and a
    ``teacher_cache``) builds ``TeacherDatasetRollouts`` (``CachedTeacherRollouts``), as
    ``TeacherRollouts.__new__`` does."""
    name = _class_name(rollout, "TeacherRollouts")
    init_args = (rollout.get("init_args") or {}) if isinstance(rollout, dict) else {}
    if name == "TeacherRollouts" and init_args.get("dataset") is not None:
        return "CachedTeacherRollouts" if init_args.get("teacher_cache") is not None else "TeacherDatasetRollouts"
    return name


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
    evaluation = evaluation_command(run_dir)
    if evaluation:  # kdlab validate|test's folder beside the run it scored: nothing trained there
        raise ValueError(f"an evaluation written by kdlab {evaluation}, not a training run")
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
    variant = variant or _split_tasks(task)
    rollout = model.get("rollout") or {}
    # DistillModule's defaults; another stage (GRPO, SFT) has no rollout policy or KL objective: its
    # name stands in both columns, so it never reads as (or takes the paper's numbers of) a distillation
    rollout_name = _rollout_class(rollout) if stage == "DistillModule" else stage
    old_spelling = stage == "DistillModule" and rollout_name != _class_name(rollout, "TeacherRollouts")
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
    for key in ("model.rollout.class_path", "model.init_args.rollout.class_path"):
        if old_spelling and key in settings:  # TeacherRollouts(dataset=...): the same configuration as the class it built
            settings[key] = json.dumps(f"kdlab.rollouts.{rollout_name}")
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


def _split_tasks(task: Any) -> str | None:
    """A ``MultiTask`` with ``splits`` as ``"<train tasks> (held out: <val tasks>)"``, e.g. ``countdown3 (held
    out: countdown3s)``: a run trained on one task and evaluated on another; None for any other task."""
    args = (task.get("init_args") or {}) if isinstance(task, dict) else {}
    splits, tasks = args.get("splits"), args.get("tasks")
    if _class_name(task, "") != "MultiTask" or not isinstance(splits, dict) or not isinstance(tasks, dict):
        return None
    train, held_out = (splits.get(split, list(tasks)) for split in ("train", "val"))
    return f"{'+'.join(map(str, train))} (held out: {'+'.join(map(str, held_out))})"


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
    last logged step in ``series`` (:func:`read_metrics`: in optimiser steps), is before ``trainer.max_steps``,
    did not (interrupted, crashed or still running); one without a marker or ``max_steps`` is flagged."""
    if any((run_dir / marker).is_file() for marker in DONE_MARKERS):
        return "", ""
    max_steps = (config.get("trainer") or {}).get("max_steps") if isinstance(config.get("trainer"), dict) else None
    last = max((points[-1][0] for points in series.values() if points), default=None)
    if type(max_steps) is int and max_steps > 0:
        if last is None or last < max_steps:
            logged = "nothing logged" if last is None else f"last logged step {last}"
            return f"unfinished: no done marker ({' or '.join(DONE_MARKERS)}) and {logged} of max_steps={max_steps}", ""
        return "", ""
    return "", "no done marker and no trainer.max_steps: cannot tell whether it finished"


def _coverage_draws(config: dict[str, Any]) -> dict[str, int]:
    """``coverage/<name>`` -> examples x samples of each ``Coverage`` callback in the config (for the
    interval of its pass@1); ``style`` -> the answers a ``StyleTransfer`` callback judges (the sum over its entries,
    :func:`~kdlab.study.setups.style_transfer_rows`)."""
    callbacks = (config.get("trainer") or {}).get("callbacks") if isinstance(config.get("trainer"), dict) else None
    draws = {}
    for callback in callbacks if isinstance(callbacks, list) else []:
        if isinstance(callback, dict) and str(callback.get("class_path", "")).endswith("StyleTransfer"):
            rows = style_transfer_rows(callback.get("init_args") or {})
            if rows and all(isinstance(count, int) for count in rows):
                draws["style"] = sum(rows)  # a split with fewer rows gives fewer: an upper bound
            continue
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


def read_samples(run_dir: str | Path, split: str = "val") -> dict[str, list[float]] | None:
    """The scores of a run's last evaluation (``samples/<split>-stepNNNNNN[-rankR].jsonl`` at the
    largest step, every rank) as ``example id -> [score of each sample]``; None without such files."""
    files: dict[int, list[Path]] = {}
    for path in Path(run_dir, "samples").glob(f"{split}-step*.jsonl"):
        match = re.fullmatch(rf"{split}-step(\d+)(-rank\d+)?\.jsonl", path.name)
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
