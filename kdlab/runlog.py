"""A run's folder, its metrics file and its evaluation samples.

Every number a run logs reaches ``<log_dir>/metrics.jsonl`` through one Lightning logger,
:class:`MetricsFile`: the stages' ``self.log`` values (at Lightning's ``log_every_n_steps``) and the
callbacks' numbers (:func:`log_metrics`) alike, one ``{"step": ..., "<name>": value}`` object per call.
Each stage attaches it beside the Trainer's own loggers (TensorBoard by default) when it is set up, so
a sweep is tabulated from one file per run (:mod:`kdlab.study.runs`) and TensorBoard shows the same
numbers. The file is appended to and flushed on every call: a killed run keeps every line it logged,
and a resumed run continues the same file (:func:`kdlab.cli.resume.trim_logs` first drops the lines
written after its checkpoint).

Steps: every number a run logs is at the optimiser steps taken (``trainer.global_step``): TensorBoard,
``metrics.jsonl``, the progress lines, the end summary, ``samples/<split>-stepNNNNNN.jsonl`` and the
callbacks' lines (:func:`log_metrics`) all say step 150 after 150 optimiser steps.
:func:`log_at_optimiser_steps` makes Lightning's ``self.log`` lines (they carry ``epoch``) follow it: by
itself Lightning records them at its logger step, which counts the steps before the current one (the
``train/loss`` and ``val/accuracy`` of step 150 at 149). Their lines in ``metrics.jsonl`` carry
``"steps": "optimiser"``; runs written before carry no such mark, and :func:`metrics_lines` with
``optimiser_steps=True`` moves their Lightning lines one step on, so old and new runs read alike."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities import rank_zero_only

METRICS_FILE = "metrics.jsonl"
STEPS_MARK = ("steps", "optimiser")  # on a Lightning line of metrics.jsonl: its step is the optimiser step count


class MetricsFile(Logger):
    """A Lightning logger that appends every ``log_metrics`` call to ``<directory>/metrics.jsonl``
    (rank 0 only). It does not pick a folder of its own: ``directory`` is the run's log directory
    (:func:`run_directory`), and ``name``/``version`` are empty so a checkpoint folder derived from it
    is ``<directory>/checkpoints``. Hyperparameters are not written: the CLI saves ``config.yaml``."""

    def __init__(self, directory: str | Path) -> None:
        super().__init__()
        self.directory = Path(directory)
        self.optimiser_steps = False  # set by log_at_optimiser_steps: Lightning's lines then carry STEPS_MARK

    @property
    def name(self) -> str:
        return ""

    @property
    def version(self) -> str:
        return ""

    @property
    def save_dir(self) -> str:
        return str(self.directory)

    @property
    def log_dir(self) -> str:
        return str(self.directory)

    @property
    def path(self) -> Path:
        return self.directory / METRICS_FILE

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if step is None:
            raise ValueError("MetricsFile.log_metrics needs a step: every line of metrics.jsonl names one")
        values: dict[str, Any] = {name: float(value) for name, value in metrics.items()}
        if self.optimiser_steps and "epoch" in values:
            values[STEPS_MARK[0]] = STEPS_MARK[1]
        self.directory.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({"step": int(step), **values}) + "\n")

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        return None


def run_directory(trainer: pl.Trainer) -> str:
    """The run's log directory. Call it on every rank: ``Trainer.log_dir`` is a collective broadcast."""
    return trainer.log_dir or trainer.default_root_dir


def metrics_file(trainer: pl.Trainer) -> MetricsFile:
    """The trainer's :class:`MetricsFile`, appended to ``trainer.loggers`` on first use (in the run's
    directory). Call it on every rank: it reads :func:`run_directory`."""
    for logger in trainer.loggers:
        if isinstance(logger, MetricsFile):
            return logger
    logger = MetricsFile(run_directory(trainer))
    trainer.loggers = [*trainer.loggers, logger]
    return logger


def log_at_optimiser_steps(trainer: pl.Trainer) -> None:
    """Send Lightning's own ``self.log`` lines to every logger at ``trainer.global_step`` (the optimiser
    steps taken) instead of its logger step, one lower during fit (the module docstring's "Steps"), and
    mark them so in the run's :class:`MetricsFile`. Idempotent; call it on every rank after
    :func:`metrics_file`."""
    for logger in trainer.loggers:
        if isinstance(logger, MetricsFile):
            logger.optimiser_steps = True
    connector = trainer._logger_connector
    if getattr(connector, "_kdlab_optimiser_steps", False):
        return
    lightning_log_metrics = connector.log_metrics

    def log_metrics(metrics, step=None):
        if metrics and step is None and "step" not in metrics:  # the lines of self.log (Lightning adds epoch to them)
            metrics = {**metrics, "epoch": trainer.current_epoch}
            step = trainer.global_step
        lightning_log_metrics(metrics, step=step)

    connector.log_metrics = log_metrics
    connector._kdlab_optimiser_steps = True


def rewrite_file(path: str | Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` through a temporary file beside it and a rename: an interruption
    leaves the old file or the new one, never half of one."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    partial.replace(path)


def log_metrics(trainer: pl.Trainer, metrics: dict[str, float], step: int | None = None) -> None:
    """Send ``metrics`` at ``step`` (default: the global step) to every logger of the trainer, the
    run's :class:`MetricsFile` included. Call it on every rank."""
    metrics_file(trainer)
    step = trainer.global_step if step is None else step
    values = {name: float(value) for name, value in metrics.items()}
    for logger in trainer.loggers:
        logger.log_metrics(values, step=step)


def write_samples(trainer: pl.Trainer, split: str, records: list[dict[str, Any]]) -> Path:
    """Write one evaluation's per-example ``records`` (JSON objects) to
    ``<log_dir>/samples/<split>-step<global step, 6 digits>[-rank<r>].jsonl`` and return that path; under
    several processes each rank writes the shard it evaluated. Call it on every rank (it reads
    :func:`run_directory`). :func:`kdlab.cli.resume.trim_logs` drops the files of steps after a checkpoint."""
    rank = f"-rank{trainer.global_rank}" if trainer.world_size > 1 else ""
    path = Path(run_directory(trainer)) / "samples" / f"{split}-step{trainer.global_step:06d}{rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def metrics_lines(path: str | Path, optimiser_steps: bool = False) -> Iterator[tuple[int, str, float]]:
    """``(step, name, value)`` for every scalar of a ``metrics.jsonl`` file, in file order (none if it
    does not exist), at the step the line records; with ``optimiser_steps`` at the number of optimiser
    steps taken, and without Lightning's ``epoch``: the step a line records, except a Lightning line (it
    carries ``epoch``) written before kdlab logged at optimiser steps (no ``"steps": "optimiser"``), one
    later (the module docstring's "Steps")."""
    path = Path(path)
    if not path.is_file():
        return
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            step = int(row.pop("step"))
            marked = row.pop(STEPS_MARK[0], None) == STEPS_MARK[1]
            if optimiser_steps and "epoch" in row:
                step += 0 if marked else 1
                row.pop("epoch")
            for name, value in row.items():
                yield step, name, float(value)
