"""Never end a run without a checkpoint of its final state.

Lightning's ``ModelCheckpoint`` saves on validation or epoch ends and every N steps, so a run that stops
at ``max_steps`` in the middle of an epoch, or dies from an exception, can lose everything after its last
save. :class:`FinalCheckpoint` saves ``final.ckpt`` when fit ends and ``on_exception.ckpt`` when it
raises (files are written to a temporary name and renamed by Lightning's checkpoint IO, so a crash during
the save leaves the previous files intact). ``kdlab fit`` adds it unless the config already has one.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl


class FinalCheckpoint(pl.Callback):
    """Saves ``<checkpoint dir>/final.ckpt`` at the end of fit and ``on_exception.ckpt`` on an exception.

    The checkpoint directory is the ``ModelCheckpoint``'s if there is one, else ``<log_dir>/checkpoints``.
    """

    def directory(self, trainer: pl.Trainer) -> Path:
        callback = trainer.checkpoint_callback
        if callback is not None and getattr(callback, "dirpath", None):
            return Path(callback.dirpath)
        return Path(trainer.log_dir or trainer.default_root_dir) / "checkpoints"

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.directory(trainer) / "final.ckpt")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if trainer.state.fn == "fit" and trainer.global_step > 0:
            trainer.save_checkpoint(self.directory(trainer) / "on_exception.ckpt")
