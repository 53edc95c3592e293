"""kdlab.runlog: one logger (MetricsFile) carries every number of a run into metrics.jsonl."""

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

from kdlab.callbacks import UpdateSparsity
from kdlab.runlog import MetricsFile, log_metrics, metrics_file
from kdlab.stages import DistillModule
from kdlab.study.runs import read_metrics
from kdlab.tasks import Addition


def small_fit(tiny_pair, tmp_path, logger):
    model = DistillModule(*tiny_pair, Addition(num_train=8, num_val=2), max_completion_tokens=4, batch_size=4, val_examples=2)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=logger, default_root_dir=tmp_path, enable_progress_bar=False,
                         enable_model_summary=False, log_every_n_steps=1, val_check_interval=2, num_sanity_val_steps=0,
                         enable_checkpointing=False, callbacks=[UpdateSparsity(every_n_steps=1)])
    trainer.fit(model)
    return trainer


def test_every_tensorboard_scalar_is_in_metrics_jsonl_at_the_same_step(tiny_pair, tmp_path):
    """``self.log`` values (train/*, val/*) and a callback's numbers (sparsity/*) reach the one file, so
    the report needs nothing else: each TensorBoard point is a metrics.jsonl point (float32 apart)."""
    trainer = small_fit(tiny_pair, tmp_path, TensorBoardLogger(tmp_path, name="run"))
    assert sum(isinstance(logger, MetricsFile) for logger in trainer.loggers) == 1
    events = EventAccumulator(trainer.log_dir, size_guidance={SCALARS: 0})
    events.Reload()
    board = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    metrics = read_metrics(trainer.log_dir)
    assert {"train/loss", "val/accuracy", "sparsity/1e-06"} <= set(board)
    assert set(metrics) == set(board)
    for tag, points in board.items():
        last = dict(points)  # at one step (epoch after a train and a val line) the later point wins
        assert [step for step, _ in metrics[tag]] == sorted(last), tag
        assert [value for _, value in metrics[tag]] == pytest.approx([last[step] for step in sorted(last)], rel=1e-6), tag


def test_without_a_logger_the_metrics_file_is_in_default_root_dir(tiny_pair, tmp_path):
    """``logger=False``: no TensorBoard, but the run's numbers still land in ``default_root_dir``."""
    trainer = small_fit(tiny_pair, tmp_path, False)
    assert Path(trainer.log_dir) == tmp_path
    assert {"train/loss", "sparsity/1e-06"} <= set(read_metrics(tmp_path))


def test_log_metrics_writes_its_line_at_once_and_attaches_one_file(tmp_path):
    """A killed run loses nothing it logged: the line is on disk when log_metrics returns; a second call
    reuses the same MetricsFile."""
    trainer = pl.Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path)
    log_metrics(trainer, {"a/b": 1.5}, step=3)
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 3, "a/b": 1.5}
    log_metrics(trainer, {"a/b": 2}, step=4)
    assert [logger for logger in trainer.loggers if isinstance(logger, MetricsFile)] == [metrics_file(trainer)]
    assert read_metrics(tmp_path) == {"a/b": [(3, 1.5), (4, 2.0)]}


def test_a_line_without_a_step_is_refused(tmp_path):
    with pytest.raises(ValueError, match="needs a step"):
        MetricsFile(tmp_path).log_metrics({"a": 1.0})
