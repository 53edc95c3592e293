"""Checkpoints a fit leaves, each sized for its use.

* :class:`FinalCheckpoint` saves ``final.ckpt`` when fit ends: the trained weights (``state_dict``, the
  trained model only: a teacher is never saved), the step and kdlab's data and log positions, without
  optimiser, scheduler or callback state. It is what the next stage (``policy: {checkpoint:
  .../final.ckpt}``), ``kdlab pipeline``, evaluation and export read, and the mark of a finished run for
  ``kdlab sweep`` and ``kdlab report``. It is about a third of a full AdamW state (weights, plus two
  moments per weight). Lightning's
  ``ModelCheckpoint`` stays the only writer of full states (``last.ckpt``, ``epoch=E-step=S.ckpt``):
  resume, or continue a finished run, from one of those; ``--ckpt_path`` of a weights-only file fails
  naming the files that can resume.
* :class:`FinalCheckpoint` also makes a finished run's ``last.ckpt`` hold its final step: a step-periodic
  ``ModelCheckpoint`` whose period does not divide ``max_steps`` saves the final step too (:func:`save_final_step`).
* :class:`ExceptionCheckpoint` saves ``on_exception.ckpt`` (a full state) when fit raises, Ctrl+C and
  SIGTERM included, and says which file to resume from.

Files are written to a temporary name and renamed by Lightning's checkpoint IO, so a crash during a
save leaves the previous files intact. ``kdlab fit`` adds each callback unless the config already has
one (and makes a ``ModelCheckpoint(save_last=True)`` link ``last.ckpt`` to the newest file it wrote
instead of copying it, :func:`kdlab.cli.lightning.link_last_checkpoints`). Resuming: :mod:`kdlab.cli.resume`."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Checkpoint

from kdlab.errors import ConfigError


def checkpoint_directory(trainer: pl.Trainer) -> Path:
    """The ``ModelCheckpoint``'s directory if there is one, else ``<log_dir>/checkpoints`` (never
    :class:`ExceptionCheckpoint`'s own, which follows this)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    callback = next((c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath), None)
    if callback is not None:
        return Path(callback.dirpath)
    return Path(trainer.log_dir or trainer.default_root_dir) / "checkpoints"


class FinalCheckpoint(pl.Callback):
    """Saves ``<checkpoint dir>/final.ckpt`` (:func:`checkpoint_directory`) when training ends: the weights only
    (the module docstring says why); refuses to resume from a weights-only file.

    The save comes after every other callback's ``on_train_end`` (the end-of-fit evaluations, sparsity, held-out
    KL: :meth:`setup` puts a saver at the end of the Trainer's callbacks), so ``final.ckpt`` marks a run whose
    every end-of-fit measurement was logged: a run that fails or is killed during them has none and reads as
    unfinished (``kdlab report``, ``kdlab sweep``). It is still before Lightning's teardown (a sharded model is
    saved where it trained).

    A fit resumed from a checkpoint of its last step (a run killed outright while its end-of-fit evaluations
    ran) skips Lightning's training loop and with it every ``on_train_end`` hook. Then, at ``on_fit_end``, it
    moves the module back to the strategy's device (Lightning's teardown has moved it to the CPU by then) and
    runs kdlab's end-of-training hooks itself before its save: every
    :class:`~kdlab.callbacks.periodic.PeriodicCallback`'s end-of-fit measurement and the module's
    ``on_train_end``. Other callbacks' ``on_train_end`` is not replayed.

    It also saves the final step's full state through a step-periodic ``ModelCheckpoint`` whose period does not
    divide ``max_steps`` (:func:`save_final_step`), so a finished run's ``last.ckpt`` holds its final step."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._ended = False
        if stage == "fit" and not any(isinstance(callback, _SaveFinal) and callback.owner is self for callback in trainer.callbacks):
            trainer.callbacks.append(_SaveFinal(self))

    def save(self, trainer: pl.Trainer) -> None:
        """``final.ckpt`` as one file of whole tensors whatever the strategy saves its full states as (FSDP1's
        ``state_dict_type="sharded"`` and FSDP2's ``save_distributed_checkpoint`` write folders of shards, which
        the next stage, ``kdlab forgetting`` and export read as no checkpoint)."""
        self._ended = True
        with whole_tensors(trainer.strategy):
            trainer.save_checkpoint(checkpoint_directory(trainer) / "final.ckpt", weights_only=True)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if getattr(self, "_ended", True):
            return
        from kdlab.callbacks.periodic import PeriodicCallback

        device = trainer.strategy.root_device
        if device.type != "cpu":
            pl_module.to(device)
        for callback in trainer.callbacks:
            if isinstance(callback, PeriodicCallback):
                callback.on_train_end(trainer, pl_module)
        pl_module.on_train_end()
        self.save(trainer)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After ``--ckpt_path``'s weights were loaded (a checkpoint of another model has failed by then; under FSDP1
        and FSDP2 before) and before the optimiser state is: a checkpoint without one cannot resume a fit, and Lightning's own
        error blames ``ModelCheckpoint.save_weights_only``. ``kdlab fit`` puts this callback first, so
        the error comes before other callbacks' start-of-fit work.

        Under FSDP1 and FSDP2 (``restore_checkpoint_after_setup``) Lightning reads the checkpoint only after this hook,
        so the file ``ckpt_path`` names is read here, memory-mapped (its small entries only); a folder of shards is
        left to Lightning."""
        from kdlab.callbacks.periodic import resume_path

        checkpoint = loaded_checkpoint(trainer)
        if not checkpoint or "optimizer_states" in checkpoint:
            return
        where = Path(resume_path(trainer))
        role = getattr(pl_module, "trained_role", "student")
        raise ConfigError(
            f"ckpt_path={str(where)!r} holds the weights only (no optimiser state), so it cannot resume a fit; "
            f"resume from a full state ({where.parent / 'last.ckpt'}, {where.parent / 'on_exception.ckpt'} or an "
            f"epoch=E-step=S.ckpt), or train on from these weights in a new run with --model.{role}.checkpoint={where}"
        )


def loaded_checkpoint(trainer: pl.Trainer) -> dict[str, Any] | None:
    """The checkpoint ``trainer`` resumes from, as its restore reads it: the one Lightning has loaded, else (a strategy
    that restores after setup, FSDP1 and FSDP2) the file ``trainer.ckpt_path`` names, memory-mapped; ``None`` for a
    fresh fit, or a folder of shards."""
    import torch

    from kdlab.callbacks.periodic import resume_path

    checkpoint = getattr(getattr(trainer, "_checkpoint_connector", None), "_loaded_checkpoint", None)
    if checkpoint:
        return checkpoint
    path = resume_path(trainer)
    if not path or not Path(path).is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


@contextlib.contextmanager
def whole_tensors(strategy: Any) -> Iterator[None]:
    """Within it, Lightning's FSDP1 and FSDP2 strategies save a checkpoint as one file of whole tensors (rank 0
    writes it; their ``state_dict_type`` / ``save_distributed_checkpoint`` settings are restored after)."""
    settings = {name: value for name, value in (("_state_dict_type", "full"), ("_save_distributed_checkpoint", False)) if hasattr(strategy, name)}
    kept = {name: getattr(strategy, name) for name in settings}
    for name, value in settings.items():
        setattr(strategy, name, value)
    try:
        yield
    finally:
        for name, value in kept.items():
            setattr(strategy, name, value)


class _SaveFinal(pl.Callback):
    """:class:`FinalCheckpoint`'s saves, last among the Trainer's callbacks (after Lightning's ``ModelCheckpoint``,
    which it moves to the end of the list): the final step's full state (:func:`save_final_step`) after the batch
    that ends the fit, ``final.ckpt`` at the end of training."""

    def __init__(self, owner: FinalCheckpoint) -> None:
        self.owner = owner

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if fit_ends_after_batch(trainer):
            save_final_step(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.owner.save(trainer)


def fit_ends_after_batch(trainer: pl.Trainer) -> bool:
    """Whether the training batch that just ended is the fit's last: ``max_steps`` optimiser steps are done (at the
    last micro-batch of the step under accumulation), or it ended the last of ``max_epochs`` epochs."""
    if trainer.max_steps is not None and trainer.max_steps >= 0 and trainer.global_step >= trainer.max_steps:
        return True
    progress = trainer.fit_loop.epoch_loop.batch_progress
    epoch_ends = progress.is_last_batch or progress.current.ready >= trainer.num_training_batches
    return epoch_ends and trainer.max_epochs is not None and trainer.max_epochs >= 0 and trainer.current_epoch + 1 >= trainer.max_epochs


def save_final_step(trainer: pl.Trainer) -> None:
    """After a fit's last batch: a step-periodic ``ModelCheckpoint(save_last=True, every_n_train_steps=N)`` without a
    ``monitor`` that did not save at this step (``max_steps`` not a multiple of N) saves it now, as its period would
    have: ``epoch=E-step=S.ckpt`` at the final step, and ``last.ckpt`` (a link to it under ``kdlab fit``). So a
    finished run's ``last.ckpt`` holds its final step, and continuing it with a larger ``max_steps`` replays
    nothing. Saved where a periodic save is (after the batch, before the validation that follows it and the
    end-of-fit evaluations): resuming from it is resuming from a periodic save. A call on every rank (a save is a
    collective)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    for callback in trainer.checkpoint_callbacks:
        if (not isinstance(callback, ModelCheckpoint) or not callback.save_last or callback.monitor is not None
                or callback._every_n_train_steps < 1 or callback._should_skip_saving_checkpoint(trainer)):
            continue  # not step-periodic, monitored (its last.ckpt follows its best files), or saved at this step already
        candidates = callback._monitor_candidates(trainer)
        callback._save_topk_checkpoint(trainer, candidates)
        callback._save_last_checkpoint(trainer, candidates)


class ExceptionCheckpoint(Checkpoint):
    """``on_exception.ckpt`` in the run's checkpoint directory, a full state saved when fit raises after at
    least one optimiser step (Ctrl+C and SIGTERM included; not when restoring ``--ckpt_path`` failed),
    then the command-line option that resumes from it. A SIGTERM'd fit exits with status 143, not 0
    (Lightning's ``SIGTERMException`` is a ``SystemExit(0)``: the run would look finished to a scheduler
    or a sweep). Like Lightning's
    ``OnExceptionCheckpoint``, a fit resumed from the run removes the file when it ends normally, so a stale
    one never wins a resume; a fresh fit leaves one it found (:meth:`teardown`).

    It is not an ``OnExceptionCheckpoint``: with one of those among the callbacks Lightning turns every
    ``fit(ckpt_path=None)`` into ``ckpt_path="last"``, so a fresh fit warns that it found no last
    checkpoint to resume (or silently resumes from ``./checkpoints/on_exception.ckpt`` when the working
    directory holds one)."""

    FILE_EXTENSION = ".ckpt"

    def __init__(self) -> None:
        self.dirpath = "checkpoints"  # the run's own directory from setup on
        self.filename = "on_exception"

    @property
    def ckpt_path(self) -> str:
        return os.path.join(self.dirpath, self.filename + self.FILE_EXTENSION)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.dirpath = str(checkpoint_directory(trainer))
        self._training = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._training = True  # a resumed run's state is whole from here on (a failed restore is not saved)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SystemExit) and not exception.code:
            exception.code = 128 + signal.SIGTERM
        if trainer.state.fn != "fit" or trainer.global_step == 0 or not getattr(self, "_training", False):
            return
        trainer.save_checkpoint(self.ckpt_path, weights_only=False)  # a full state (and no "weights_only was not set" log)
        if trainer.is_global_zero:
            what = "interrupted" if isinstance(exception, KeyboardInterrupt) else f"stopped by {type(exception).__name__}"
            print(
                f"[kdlab] {what} at step {trainer.global_step}; its state is in {self.ckpt_path} (newer than any other "
                f"checkpoint of the run). Resume with the same command and --ckpt_path={self.ckpt_path}",
                file=sys.stderr,
                flush=True,
            )

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """After a fit that ended normally: remove the file of a resumed fit (older than the state this fit
        ended with), never one a fresh fit found in its directory (another run's only saved state)."""
        if trainer.ckpt_path:
            trainer.strategy.remove_checkpoint(self.ckpt_path)
