"""A run's folder, its metrics file and its evaluation samples.

Every number a run logs reaches ``<log_dir>/metrics.jsonl`` through one Lightning logger,
:class:`MetricsFile`: the stages' ``self.log`` values (at Lightning's ``log_every_n_steps``) and the
callbacks' numbers (:func:`log_metrics`) alike, one ``{"step": ..., "<name>": value}`` object per call.
Each stage attaches it beside the Trainer's own loggers (TensorBoard by default) when it is set up, so
a sweep is tabulated from one file per run (:mod:`kdlab.study.runs`) and TensorBoard shows the same
numbers. The file is appended to and flushed on every call: a killed run keeps every line it logged,
and a resumed run continues the same file (:func:`kdlab.cli.resume.trim_logs` first drops the lines
written after its checkpoint).

Steps: kdlab numbers a run's progress by optimiser steps taken (``trainer.global_step``): the progress
lines, the end summary, ``samples/<split>-stepNNNNNN.jsonl`` and the callbacks' lines
(:func:`log_metrics`) all say step 150 after 150 optimiser steps. Lightning's ``self.log`` lines (they
carry ``epoch``) and their TensorBoard scalars are at Lightning's logger step, which counts the steps
before the current one: the ``train/loss`` and ``val/accuracy`` of step 150 are recorded at 149. That
recorded number is kept (the study tables and resumed runs read it); :func:`metrics_lines` with
``optimiser_steps=True`` turns it into the step count, as the end summary shows it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities import rank_zero_only

METRICS_FILE = "metrics.jsonl"


class MetricsFile(Logger):
    """A Lightning logger that appends every ``log_metrics`` call to ``<directory>/metrics.jsonl``
    (rank 0 only). It does not pick a folder of its own: ``directory`` is the run's log directory
    (:func:`run_directory`), and ``name``/``version`` are empty so a checkpoint folder derived from it
    is ``<directory>/checkpoints``. Hyperparameters are not written: the CLI saves ``config.yaml``."""

    def __init__(self, directory: str | Path) -> None:
        super().__init__()
        self.directory = Path(directory)

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
        values = {name: float(value) for name, value in metrics.items()}
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
    steps taken instead: a Lightning line (it carries ``epoch``) one later, and without its ``epoch``
    (the module docstring's "Steps")."""
    path = Path(path)
    if not path.is_file():
        return
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            step = int(row.pop("step"))
            if optimiser_steps and "epoch" in row:
                step += 1
                row.pop("epoch")
            for name, value in row.items():
                yield step, name, float(value)
