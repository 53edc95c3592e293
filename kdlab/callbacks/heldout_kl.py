"""Held-out KL to the teacher: how close the student's next-token distributions have come to the
teacher's on teacher-written text it never trained on (``kdlab.callbacks.heldout_kl.HeldOutKL``)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from kdlab.callbacks.periodic import PeriodicCallback, require_teacher, resume_path
from kdlab.runlog import log_metrics


class HeldOutKL(PeriodicCallback):
    """Full-vocabulary KL between teacher and student on teacher (or student) samples of held-out prompts.

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

    ``prefixes="student"`` measures on the student's own samples instead (the prefixes an on-policy run trains
    on): at every measurement the current student writes one completion per prompt (at ``student_temperature``,
    seeded by ``seed``), and the same metrics are logged under ``heldout_kl/student_prefixes/`` (``.../forward``,
    ``.../reverse``, ``..._before``, ``.../forward_closed``). Two callbacks, one of each, measure both.

    Needs a :class:`~kdlab.stages.distill.DistillModule`; on teacher prefixes its teacher must write completions (an
    in-process model, the student's base, a served teacher that samples); any teacher source scores them. The completions are redrawn
    identically on resume (same seed, same teacher); the "before" values are kept in the checkpoint.
    """

    PREFIXES = ("teacher", "student")

    def __init__(self, examples: int = 50, batch_size: int = 10, split: str = "val", seed: int = 0, every_n_steps: int | None = None,
                 prefixes: str = "teacher") -> None:
        super().__init__(every_n_steps)
        if examples < 1 or batch_size < 1:
            raise ValueError(f"HeldOutKL.examples and batch_size must be >= 1, got {examples} and {batch_size}")
        if prefixes not in self.PREFIXES:
            raise ValueError(f"HeldOutKL.prefixes must be one of {self.PREFIXES}, got {prefixes!r}")
        self.examples, self.batch_size, self.split, self.seed = examples, batch_size, split, seed
        self.prefixes = prefixes
        self.name = "heldout_kl" if prefixes == "teacher" else "heldout_kl/student_prefixes"
        self._examples: list[Any] = []
        self.before: dict[str, float] = {}
        self._rollouts: list[Any] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # the teacher writes the held-out completions (prefixes: teacher); any source scores them
        require_teacher(pl_module, "HeldOutKL", "compares a student with its teacher", frozenset({"teacher_writes", "teacher_scores"}) if self.prefixes == "teacher" else frozenset({"teacher_scores"}))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._examples = list(pl_module.task.examples(self.split))[: self.examples]
        if not self._examples:
            raise ValueError(f"HeldOutKL: the task's {self.split!r} split is empty")
        self._rollouts = self.sample(pl_module) if self.prefixes == "teacher" else []  # the student's: drawn at each measurement
        if not self.before and trainer.global_step == 0 and not resume_path(trainer):
            forward, reverse = self.kl(pl_module)
            self.before = {"forward": forward, "reverse": reverse}
            log_metrics(trainer, {f"{self.name}/forward": forward, f"{self.name}/reverse": reverse,
                                  f"{self.name}/forward_before": forward, f"{self.name}/reverse_before": reverse})

    def sample(self, pl_module: pl.LightningModule) -> list[Any]:
        """One completion per held-out prompt from the ``prefixes`` model, in batches of ``batch_size``."""
        from kdlab.rollouts.policies import StudentRollouts, TeacherRollouts

        policy = TeacherRollouts() if self.prefixes == "teacher" else StudentRollouts()
        return [pl_module.make_rollout(self._examples[start : start + self.batch_size], self.seed + start, policy=policy)
                for start in range(0, len(self._examples), self.batch_size)]

    @torch.no_grad()
    def kl(self, pl_module: pl.LightningModule) -> tuple[float, float]:
        """(forward, reverse) KL in nats per completion token over the held-out completions (the student's drawn now)."""
        totals, tokens = torch.zeros(2, dtype=torch.float64), 0
        rollouts = self._rollouts if self.prefixes == "teacher" else self.sample(pl_module)
        was_training = pl_module.student.training
        pl_module.student.eval()
        try:
            for rollout in rollouts:
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
            raise ValueError(f"HeldOutKL: the {self.prefixes}'s held-out completions hold no token")
        forward, reverse = (totals / tokens).tolist()
        return forward, reverse

    def measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        forward, reverse = self.kl(pl_module)
        metrics = {f"{self.name}/forward": forward, f"{self.name}/reverse": reverse}
        if self.before.get("forward"):
            metrics[f"{self.name}/forward_closed"] = 1.0 - forward / self.before["forward"]
        log_metrics(trainer, metrics)

    @property
    def state_key(self) -> str:
        """``HeldOutKL`` on teacher prefixes (as before ``prefixes`` existed), else keyed by it: one of each fits in a Trainer."""
        return "HeldOutKL" if self.prefixes == "teacher" else self._generate_state_key(prefixes=self.prefixes)

    def state_dict(self) -> dict[str, Any]:
        return {"before": dict(self.before)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.before = dict(state_dict.get("before", {}))
