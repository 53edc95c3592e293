"""A run's folder and how kdlab's callbacks and stages log a number to it.

Every number goes to the Trainer's loggers (TensorBoard by default) under ``stage/metric`` names and
is appended to ``<log_dir>/metrics.jsonl`` (one ``{"step": ..., "<name>": value}`` object per call),
so sweeps can be tabulated without TensorBoard (:mod:`kdlab.study.runs` reads both)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl


def run_directory(trainer: pl.Trainer) -> str:
    """The run's log directory. Call it on every rank: ``Trainer.log_dir`` is a collective broadcast."""
    return trainer.log_dir or trainer.default_root_dir


def log_metrics(trainer: pl.Trainer, metrics: dict[str, float], step: int | None = None) -> None:
    """Send ``metrics`` to every logger and append them to ``<log_dir>/metrics.jsonl`` (rank 0)."""
    step = trainer.global_step if step is None else step
    values = {name: float(value) for name, value in metrics.items()}
    for logger in trainer.loggers:
        logger.log_metrics(values, step=step)
    directory = Path(run_directory(trainer))
    if trainer.is_global_zero:
        directory.mkdir(parents=True, exist_ok=True)
        with (directory / "metrics.jsonl").open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({"step": step, **values}) + "\n")
