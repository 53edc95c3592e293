"""Held-out KL to the teacher: how close the student's next-token distributions have come to the
teacher's on teacher-written text it never trained on (``kdlab.callbacks.heldout_kl.HeldOutKL``)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from kdlab.callbacks.periodic import PeriodicCallback, require_teacher_model
from kdlab.runlog import log_metrics


class HeldOutKL(PeriodicCallback):
    """Full-vocabulary KL between teacher and student on teacher samples of held-out prompts.

    At fit start the teacher writes one completion (at the module's ``teacher_temperature``, seeded by
    ``seed``) for each of the first ``examples`` prompts of the task's ``split``; the same completions are
    scored before training, every ``every_n_steps`` steps and at the end of fit:

    * ``heldout_kl/forward`` = KL(pi_T || pi_S) and ``heldout_kl/reverse`` = KL(pi_S || pi_T), nats per
      completion token (the mean over every token of every completion), between the tempered
      distributions the objective compares (``teacher_temperature``, ``student_temperature``), each model
      conditioned on its own prompt;
    * ``heldout_kl/forward_before`` / ``heldout_kl/reverse_before`` once, before training;
    * ``heldout_kl/forward_closed`` = 1 - forward / forward_before: the share of the starting forward-KL gap
      the student has closed (1 = it matches the teacher, 0 = no closer, negative = further away).

    Needs a :class:`~kdlab.stages.distill.DistillModule` with its teacher model. The completions are redrawn
    identically on resume (same seed, same teacher); the "before" values are kept in the checkpoint.
    """

    def __init__(self, examples: int = 50, batch_size: int = 10, split: str = "val", seed: int = 0, every_n_steps: int | None = None) -> None:
        super().__init__(every_n_steps)
        if examples < 1 or batch_size < 1:
            raise ValueError(f"HeldOutKL.examples and batch_size must be >= 1, got {examples} and {batch_size}")
        self.examples, self.batch_size, self.split, self.seed = examples, batch_size, split, seed
        self.before: dict[str, float] = {}
        self._rollouts: list[Any] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        require_teacher_model(pl_module, "HeldOutKL", "compares a student with its teacher", "it samples the held-out completions")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from kdlab.rollouts.policies import TeacherRollouts

        examples = list(pl_module.task.examples(self.split))[: self.examples]
        if not examples:
            raise ValueError(f"HeldOutKL: the task's {self.split!r} split is empty")
        policy = TeacherRollouts()
        self._rollouts = [
            pl_module.make_rollout(examples[start : start + self.batch_size], self.seed + start, policy=policy)
            for start in range(0, len(examples), self.batch_size)
        ]
        if not self.before and trainer.global_step == 0 and not trainer.ckpt_path:
            forward, reverse = self.kl(pl_module)
            self.before = {"forward": forward, "reverse": reverse}
            log_metrics(trainer, {"heldout_kl/forward": forward, "heldout_kl/reverse": reverse,
                             "heldout_kl/forward_before": forward, "heldout_kl/reverse_before": reverse})

    @torch.no_grad()
    def kl(self, pl_module: pl.LightningModule) -> tuple[float, float]:
        """(forward, reverse) KL in nats per completion token over the held-out completions."""
        totals, tokens = torch.zeros(2, dtype=torch.float64), 0
        was_training = pl_module.student.training
        pl_module.student.eval()
        try:
            for rollout in self._rollouts:
                mask = rollout.completion_mask
                count = int(mask.sum())
                if count == 0:
                    continue
                values = pl_module.divergences(rollout, "token")
                totals += torch.stack([values["kl_forward"], values["kl_reverse"]]).double().cpu() * count
                tokens += count
        finally:
            pl_module.student.train(was_training)
        if tokens == 0:
            raise ValueError("HeldOutKL: the teacher's held-out completions hold no token")
        forward, reverse = (totals / tokens).tolist()
        return forward, reverse

    def measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        forward, reverse = self.kl(pl_module)
        metrics = {"heldout_kl/forward": forward, "heldout_kl/reverse": reverse}
        if self.before.get("forward"):
            metrics["heldout_kl/forward_closed"] = 1.0 - forward / self.before["forward"]
        log_metrics(trainer, metrics)

    def state_dict(self) -> dict[str, Any]:
        return {"before": dict(self.before)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.before = dict(state_dict.get("before", {}))
