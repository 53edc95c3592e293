"""Training stages: LightningModules that train one model on a task.

* :mod:`kdlab.stages.base`: ``TaskStage``, what every stage on a task shares (data order, FSDP, evaluation);
* :mod:`kdlab.stages.checkpointing`: ``CheckpointedStage``, what every training stage, SFT's too, keeps (run log, checkpoint positions, LoRA settings);
* :mod:`kdlab.stages.distill`: ``DistillModule`` (rollout policy x objective, the study's stage);
* :mod:`kdlab.stages.grpo`: ``GRPOModule`` (RLVR after distillation);
* :mod:`kdlab.stages.sft`: ``SFTModule`` (teacher training), with :mod:`kdlab.stages.lora`;
* :mod:`kdlab.stages.loaders`, :mod:`kdlab.stages.optim`: resumable data order, optimiser and schedule.
"""

from kdlab.stages.base import TaskStage
from kdlab.stages.distill import DistillModule
from kdlab.stages.grpo import GRPOModule
from kdlab.stages.sft import SFTModule

__all__ = ["TaskStage", "DistillModule", "GRPOModule", "SFTModule"]
