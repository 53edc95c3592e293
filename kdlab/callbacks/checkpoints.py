"""Never end a run without a checkpoint of its final state.

Lightning's ``ModelCheckpoint`` saves on validation or epoch ends and every N steps, so a run that stops
at ``max_steps`` in the middle of an epoch can lose everything after its last save.
:class:`FinalCheckpoint` saves ``final.ckpt`` when fit ends (files are written to a temporary name and
renamed by Lightning's checkpoint IO, so a crash during the save leaves the previous files intact), and
:class:`ExceptionCheckpoint` (Lightning's ``OnExceptionCheckpoint``) ``on_exception.ckpt`` when fit
raises, saying which file to resume from. ``kdlab fit`` adds each unless the config already has one.
Resuming: :mod:`kdlab.cli.resume`."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import OnExceptionCheckpoint


def checkpoint_directory(trainer: pl.Trainer) -> Path:
    """The ``ModelCheckpoint``'s directory if there is one, else ``<log_dir>/checkpoints``."""
    callback = trainer.checkpoint_callback
    if callback is not None and getattr(callback, "dirpath", None):
        return Path(callback.dirpath)
    return Path(trainer.log_dir or trainer.default_root_dir) / "checkpoints"


class FinalCheckpoint(pl.Callback):
    """Saves ``<checkpoint dir>/final.ckpt`` when fit ends (:func:`checkpoint_directory`)."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(checkpoint_directory(trainer) / "final.ckpt", weights_only=False)


class ExceptionCheckpoint(OnExceptionCheckpoint):
    """Lightning's ``OnExceptionCheckpoint`` in the run's checkpoint directory (``on_exception.ckpt``),
    for an exception during fit after at least one optimiser step (Ctrl+C and SIGTERM included), then the
    command-line option that resumes from it. A SIGTERM'd fit exits with status 143, not 0 (Lightning's
    ``SIGTERMException`` is a ``SystemExit(0)``: the run would look finished to a scheduler or a sweep).
    Like Lightning's, it removes the file when fit ends normally, so a stale one never wins a resume."""

    def __init__(self) -> None:
        super().__init__(dirpath="checkpoints", filename="on_exception")  # the run's own directory from setup on

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.dirpath = str(checkpoint_directory(trainer))

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SystemExit) and not exception.code:
            exception.code = 128 + signal.SIGTERM
        if trainer.state.fn != "fit" or trainer.global_step == 0:
            return
        super().on_exception(trainer, pl_module, exception)
        if trainer.is_global_zero:
            what = "interrupted" if isinstance(exception, KeyboardInterrupt) else f"stopped by {type(exception).__name__}"
            print(
                f"[kdlab] {what} at step {trainer.global_step}; its state is in {self.ckpt_path} (newer than any other "
                f"checkpoint of the run). Resume with the same command and --ckpt_path={self.ckpt_path}",
                file=sys.stderr,
                flush=True,
            )
