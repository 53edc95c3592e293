"""``CheckpointedStage``: what every kdlab stage that trains a model keeps for a resume or a later stage, shared by
:class:`~kdlab.stages.base.TaskStage` (distillation, RLVR) and :class:`~kdlab.stages.sft.SFTModule`:

* the run log: every number in ``metrics.jsonl`` (:class:`~kdlab.runlog.MetricsFile`), at the optimiser steps taken
  (:func:`~kdlab.runlog.log_at_optimiser_steps`), attached when the stage is set up (:meth:`CheckpointedStage.attach_run_log`);
* in every checkpoint of a fit, the data position (``kdlab_data_position``: the epoch and its micro-batches trained,
  :func:`~kdlab.stages.loaders.data_position`), so a resumed fit continues with the next micro-batch, and the log
  position (``kdlab_log_position``), so a resumed fit logs each step at the step the uninterrupted fit did, once
  (:func:`kdlab.cli.resume.trim_logs` drops what the interrupted fit logged after the save);
* in every checkpoint, weights-only ones (``final.ckpt``) included, a LoRA model's adapter settings
  (:data:`~kdlab.models.export.LORA_SETTINGS`), so a stage that starts from it (``student.checkpoint``,
  ``policy.checkpoint``) gets the adapters merged into the weights (:func:`~kdlab.models.export.load_stage_weights`).

A subclass names the model it trains (:meth:`CheckpointedStage.trained_model`), sets ``batch_size`` (examples per
micro-batch) and calls :meth:`CheckpointedStage.attach_run_log` from its ``setup``.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch

from kdlab.models.export import LORA_SETTINGS, lora_settings
from kdlab.runlog import STEPS_MARK, log_at_optimiser_steps, metrics_file
from kdlab.stages.loaders import data_parallel_layout, data_position


class CheckpointedStage(pl.LightningModule):
    """Base of :class:`~kdlab.stages.base.TaskStage` and :class:`~kdlab.stages.sft.SFTModule` (see module docstring)."""

    batch_size: int  # examples (prompts, or SFT rows) per micro-batch, recorded with the data position

    def __init__(self) -> None:
        super().__init__()
        self._resume_position: dict[str, Any] | None = None  # the checkpoint's data position, taken by the next train loader
        self._resume_log_step: int | None = None  # see _next_log_step
        self._log_step_at_batch_start: int | None = None

    def trained_model(self) -> torch.nn.Module | None:
        """The model the stage trains, whose LoRA settings its checkpoints record (default: ``student``)."""
        model = getattr(self, "student", None)
        return model if isinstance(model, torch.nn.Module) else None

    def data_parallel_layout(self) -> dict[str, int]:
        """``{"num_replicas", "rank"}`` of this process among the data-parallel replicas. Under tensor
        parallelism the ranks of one TP group are one replica: they read the same data and must draw the
        same rollouts."""
        return data_parallel_layout(self._trainer)

    def attach_run_log(self) -> None:
        """Attach the run's :class:`~kdlab.runlog.MetricsFile` (every ``self.log`` value and every callback number
        lands in ``metrics.jsonl``) and log Lightning's lines at optimiser steps like every other number
        (:func:`~kdlab.runlog.log_at_optimiser_steps`). Call it from ``setup``, on every rank."""
        metrics_file(self.trainer)
        log_at_optimiser_steps(self.trainer)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record the data position (epoch, batches of it already trained) so a resumed run
        continues with the next batch, and the log position (``kdlab_log_position``: the logger step
        of the next batch, the global step, the save's wall time and the size of ``metrics.jsonl``) so
        a resumed run logs each step at the step the uninterrupted run did (see
        :func:`kdlab.cli.resume.trim_logs`). A LoRA model's adapter settings go in too (:data:`~kdlab.models.export.LORA_SETTINGS`),
        weights-only checkpoints included, so a later stage that starts from the checkpoint merges the adapters
        (:func:`~kdlab.models.export.load_stage_weights`)."""
        model = self.trained_model()
        settings = lora_settings(model) if model is not None else None
        if settings is not None:
            checkpoint[LORA_SETTINGS] = settings
        if self._trainer is not None and self.trainer.state.fn == "fit":  # also for saves at validation end
            checkpoint["kdlab_data_position"] = data_position(self.trainer, checkpoint, self.batch_size, self.data_parallel_layout()["num_replicas"],
                                                              whole_steps=self.automatic_optimization)
            metrics = metrics_file(self.trainer).path  # on every rank: it reads the run directory
            checkpoint["kdlab_log_position"] = {
                "step": self._next_log_step(),
                "global_step": self.trainer.global_step,
                "time": time.time(),
                "metrics_bytes": metrics.stat().st_size if metrics.is_file() else 0,
                STEPS_MARK[0]: STEPS_MARK[1],  # this run logs at optimiser steps (kdlab.cli.resume.trim_logs)
            }

    def _next_log_step(self) -> int:
        """The logger step (Lightning's count of stepped batches) of the batch after the last processed one.

        Lightning counts a batch only after its validation, and on resume adds one to the saved count
        whatever the save interrupted; from a checkpoint written on an exception inside a batch that
        puts every later scalar one step late. The count is therefore taken here from the step at the
        start of the last batch, plus one when that batch was processed and stepped the optimiser."""
        loop = self.trainer.fit_loop.epoch_loop
        if self._resume_log_step is not None:  # saved before the first batch after a resume
            return self._resume_log_step
        progress = loop.batch_progress.current
        if self._log_step_at_batch_start is None or progress.ready > progress.processed:
            return loop._batches_that_stepped  # no batch yet, or the last one was interrupted: nothing pending
        return self._log_step_at_batch_start + (0 if loop._should_accumulate() else 1)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        loop = self.trainer.fit_loop.epoch_loop
        if self._resume_log_step is not None:  # the first batch after a resume: Lightning's guess corrected
            loop._batches_that_stepped, self._resume_log_step = self._resume_log_step, None
        self._log_step_at_batch_start = loop._batches_that_stepped

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._resume_position = checkpoint.get("kdlab_data_position")
        self._resume_log_step = (checkpoint.get("kdlab_log_position") or {}).get("step")
