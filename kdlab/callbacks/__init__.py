"""Callbacks that measure what a stage does to the student: they read and log, never train.

* :mod:`kdlab.callbacks.periodic`: the shared schedule (every N steps, at start and end), sampling, and ``TaskPrompts``
  (which split of a task, how many rows);
* :mod:`kdlab.callbacks.sparsity`: ``UpdateSparsity``;
* :mod:`kdlab.callbacks.evaluations`: ``OODForgetting``, ``StyleTransfer``, ``Coverage``;
* :mod:`kdlab.callbacks.heldout_kl`: ``HeldOutKL``;
* :mod:`kdlab.callbacks.style_log_odds`: ``StyleLogOdds``;
* :mod:`kdlab.callbacks.monitors`: ``RolloutSensitivity``, ``RewardCollapse``;
* :mod:`kdlab.callbacks.checkpoints`: ``FinalCheckpoint``, ``ExceptionCheckpoint`` (Lightning's ``OnExceptionCheckpoint``).
"""

from kdlab.callbacks.checkpoints import ExceptionCheckpoint, FinalCheckpoint
from kdlab.callbacks.evaluations import Coverage, OODForgetting, StyleTransfer
from kdlab.callbacks.heldout_kl import HeldOutKL
from kdlab.callbacks.monitors import RewardCollapse, RolloutSensitivity
from kdlab.callbacks.periodic import TaskPrompts
from kdlab.callbacks.sparsity import UpdateSparsity
from kdlab.callbacks.style_log_odds import StyleLogOdds

__all__ = ["UpdateSparsity", "OODForgetting", "StyleTransfer", "Coverage", "HeldOutKL", "StyleLogOdds", "RolloutSensitivity", "RewardCollapse", "FinalCheckpoint", "ExceptionCheckpoint", "TaskPrompts"]


def __getattr__(name: str):
    """kdlab 0.1's names of this module path that moved (:data:`kdlab._legacy.MOVED`), with a FutureWarning."""
    from kdlab._legacy import moved_attribute

    return moved_attribute(__name__, name)
