"""The common base of kdlab's swappable parts (rollout policies, objectives, tasks).

Each part is a ``LightningModule`` so that it can hold parameters or buffers of its own, follows the
parent's device and dtype, and is chosen in YAML with ``class_path``. A child LightningModule cannot
call ``self.log``: only the module the Trainer drives is attached to it. Components therefore
``record`` scalars, and :class:`kdlab.stages.distill.DistillModule` logs every recorded value after each step
under ``<split>/<name>`` (``train/rollout_entropy``, ``val/accuracy``), which is what reaches
TensorBoard.
"""

from __future__ import annotations

import inspect

import lightning.pytorch as pl
import torch

from kdlab.run_config import remember_arguments


class Component(pl.LightningModule):
    """A swappable part of a :class:`~kdlab.stages.distill.DistillModule`. It keeps the arguments its
    constructor was called with (:func:`~kdlab.run_config.remember_arguments`), which name it in the
    ``config.yaml`` of a run built in Python and in every run's logged hyperparameters."""

    def __init__(self) -> None:
        super().__init__()
        self._records: dict[str, float | torch.Tensor] = {}
        remember_arguments(self, inspect.currentframe())

    def record(self, name: str, value: float | torch.Tensor) -> None:
        """Queue a scalar to be logged by the parent module as ``<split>/<name>``.

        A tensor is detached; recording the same name twice in one step keeps the last value. Under several processes
        the logged value is the mean over the ranks (a collective): every rank records the same names each step.
        """
        if isinstance(value, torch.Tensor):
            value = value.detach()
        self._records[name] = value

    def pop_records(self) -> dict[str, float | torch.Tensor]:
        """Return and clear the scalars recorded since the last call."""
        records, self._records = self._records, {}
        return records
