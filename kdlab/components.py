"""The common base of kdlab's swappable parts (rollout policies, objectives, tasks).

Each part is a ``LightningModule`` so that it can hold parameters or buffers of its own, follows the
parent's device and dtype, and is chosen in YAML with ``class_path``. A child LightningModule cannot
call ``self.log``: only the module the Trainer drives is attached to it. Components therefore
``report`` scalars, and :class:`kdlab.module.DistillModule` logs every reported value after each step
under ``<stage>/<name>`` (``train/rollout_entropy``, ``val/accuracy``), which is what reaches
TensorBoard.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch


class Component(pl.LightningModule):
    """A swappable part of a :class:`~kdlab.module.DistillModule`."""

    def __init__(self) -> None:
        super().__init__()
        self._reports: dict[str, float | torch.Tensor] = {}

    def report(self, name: str, value: float | torch.Tensor) -> None:
        """Queue a scalar to be logged by the parent module as ``<stage>/<name>``.

        A tensor is detached; reporting the same name twice in one step keeps the last value.
        """
        if isinstance(value, torch.Tensor):
            value = value.detach()
        self._reports[name] = value

    def pop_reports(self) -> dict[str, float | torch.Tensor]:
        """Return and clear the scalars reported since the last call."""
        reports, self._reports = self._reports, {}
        return reports
