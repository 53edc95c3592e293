"""Callbacks that watch training rather than the student's skills: :class:`RolloutSensitivity`
(how much the objective's value depends on who wrote the rollout) and :class:`RewardCollapse` (an RLVR
stage whose rewards stop varying)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from kdlab.callbacks.periodic import PeriodicCallback, require_teacher
from kdlab.rollouts.policies import RolloutPolicy
from kdlab.runlog import log_metrics, run_directory


# ---- the paper's gradient analysis, measured ------------------------------------------------------
class RolloutSensitivity(PeriodicCallback):
    """How much the rollout policy changes the update, next to how far apart the policies are.

    Every ``every_n_steps`` steps, on the first ``examples`` training prompts, rollouts are drawn from
    the module's policy and from a ``reference`` policy (default: teacher rollouts for a policy on the
    student's side of the spectrum, lam >= 0, else student rollouts), and
    for the module's objective it logs:

    * ``theory/tv_policy_teacher``, ``theory/tv_policy_student`` (and ``theory/tv_reference_*``):
      mean total variation between the policy's next-token distribution and the teacher's / the
      student's along the policy's own rollouts;
    * ``theory/grad_norm``, ``theory/grad_norm_reference`` and ``theory/grad_diff`` =
      ``||g_policy - g_reference||`` over the student's parameters, plus ``theory/grad_diff_rel``
      (divided by ``||g_policy||``).

    Forward KL's logit gradient is pi_S - pi_T, bounded by 1 per token, so its update difference is
    bounded by the distance between the prefix distributions; reverse KL's is not. Gradients come from
    ``torch.autograd.grad`` and never touch the parameters' ``.grad``; the step's training is unchanged.
    """

    def __init__(self, reference: RolloutPolicy | None = None, examples: int = 8, every_n_steps: int | None = 10, seed: int = 0) -> None:
        super().__init__(every_n_steps)
        if examples < 1:
            raise ValueError(f"RolloutSensitivity.examples must be >= 1, got {examples}")
        self.reference, self.examples, self.seed = reference, examples, seed

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        require_teacher(pl_module, "RolloutSensitivity", "measures a distillation objective's gradients",
                        self.reference_policy(pl_module).needs() | pl_module.rollout.needs())
        if getattr(pl_module, "cross_tokenizer", None) is not None:
            from kdlab.errors import ConfigError

            raise ConfigError(
                "RolloutSensitivity compares the rollout policy's next-token distribution with both models' on one "
                "vocabulary, which DistillModule.cross_tokenizer runs do not have; measure those with HeldOutKL and "
                "the logged train/kl_forward, train/kl_reverse instead"
            )

    def reference_policy(self, pl_module):
        from kdlab.rollouts.policies import StudentRollouts, TeacherRollouts

        if self.reference is not None:
            return self.reference
        policy = pl_module.rollout
        student_side = isinstance(policy, StudentRollouts) or getattr(policy, "lam", -1.0) >= 0
        return TeacherRollouts() if student_side else StudentRollouts()

    @staticmethod
    def total_variation(policy, student_logits, teacher_logits, mask) -> tuple[float, float]:
        """Mean over masked tokens of TV(policy, teacher) and TV(policy, student), chunked over tokens."""
        from kdlab.objectives.kernels import iter_token_chunks
        from kdlab.objectives.lazy import gather_rows

        totals, count = torch.zeros(2, dtype=torch.float64), int(mask.sum())
        with torch.no_grad():
            for b, t in iter_token_chunks(mask, 256):  # logits tensors or fused HeadLogits alike
                log_s = torch.log_softmax(gather_rows(student_logits, b, t, torch.float32), -1)
                log_t = torch.log_softmax(gather_rows(teacher_logits, b, t, torch.float32), -1)
                p = policy.next_token_logprobs(log_s, log_t).exp()
                totals[0] += 0.5 * (p - log_t.exp()).abs().sum().item()
                totals[1] += 0.5 * (p - log_s.exp()).abs().sum().item()
        return (totals / max(count, 1)).tolist()

    def measure(self, trainer, pl_module) -> None:
        reference = self.reference_policy(pl_module)
        usable = [ex for ex in pl_module.task.examples("train") if pl_module.rollout.covers(ex) and reference.covers(ex)]
        examples = usable[: self.examples]
        if not examples:
            return
        params = [p for p in pl_module.student.parameters() if p.requires_grad]
        metrics, grads = {}, {}
        for name, policy in (("policy", pl_module.rollout), ("reference", reference)):
            rollout = pl_module.make_rollout(examples, self.seed + trainer.global_step, policy=policy)
            if not bool(rollout.completion_mask.any()):
                return
            student_logits, teacher_logits = pl_module.distillation_logits(rollout)
            mask = rollout.completion_mask
            tv_teacher, tv_student = self.total_variation(policy, student_logits.detach(), teacher_logits, mask)
            metrics[f"theory/tv_{name}_teacher"], metrics[f"theory/tv_{name}_student"] = tv_teacher, tv_student
            loss = pl_module.objective(student_logits, teacher_logits, mask)
            pl_module.objective.pop_records()
            grads[name] = [g if g is not None else torch.zeros_like(p) for g, p in zip(torch.autograd.grad(loss, params, allow_unused=True), params)]
        norm = lambda tensors: torch.sqrt(sum((t.double() ** 2).sum() for t in tensors)).item()
        metrics["theory/grad_norm"] = norm(grads["policy"])
        metrics["theory/grad_norm_reference"] = norm(grads["reference"])
        metrics["theory/grad_diff"] = norm([a - b for a, b in zip(grads["policy"], grads["reference"])])
        metrics["theory/grad_diff_rel"] = metrics["theory/grad_diff"] / max(metrics["theory/grad_norm"], 1e-30)
        log_metrics(trainer, metrics)


# ---- RLVR ------------------------------------------------------------------------------------------
class RewardCollapse(pl.Callback):
    """Flags reward collapse without stopping the run (the paper's reverse-KL RLVR runs improved, then
    collapsed).

    After each optimiser step the latest ``metric`` is added to a running mean over the last
    ``window`` values. When that mean falls below ``(1 - drop)`` times the best running mean seen so
    far, one event is recorded: a TensorBoard text entry ``events/reward_collapse``, a line in
    ``<log_dir>/events.jsonl`` (``{"step", "event", "message", "running", "best", "best_step"}``), the
    scalar ``events/reward_collapse`` (running / best) in the loggers and ``metrics.jsonl``, and a warning.
    It fires again only after the running mean has recovered above the threshold.

    Args:
        metric: the logged reward (default ``rlvr/reward_mean`` of :class:`~kdlab.stages.grpo.GRPOModule`).
        window: values in the running mean.
        drop: the fraction of the best running mean that counts as a collapse, in (0, 1].
    """

    def __init__(self, metric: str = "rlvr/reward_mean", window: int = 10, drop: float = 0.5) -> None:
        if window < 1:
            raise ValueError(f"RewardCollapse.window must be >= 1, got {window}")
        if not 0 < drop <= 1:
            raise ValueError(f"RewardCollapse.drop must be in (0, 1], got {drop}")
        self.metric, self.window, self.drop = metric, window, drop
        self.values: list[float] = []
        self.best, self.best_step, self.collapsed, self.events = float("-inf"), -1, False, 0
        self._last_step = -1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        value = trainer.callback_metrics.get(self.metric)
        if value is None or trainer.global_step == self._last_step:
            return
        self._last_step = trainer.global_step
        self.values = (self.values + [float(value)])[-self.window :]
        if len(self.values) < self.window:
            return
        running = sum(self.values) / len(self.values)
        if running > self.best:
            self.best, self.best_step = running, trainer.global_step
        collapsed = self.best > 0 and running < (1 - self.drop) * self.best
        if collapsed and not self.collapsed:
            self.record(trainer, running)
        self.collapsed = collapsed

    def record(self, trainer: pl.Trainer, running: float) -> None:
        from lightning.pytorch.loggers import TensorBoardLogger
        from lightning.pytorch.utilities import rank_zero_warn

        step = trainer.global_step
        message = (
            f"reward collapse at step {step}: running mean of {self.metric} over {self.window} steps is {running:.4g}, "
            f"below {1 - self.drop:.0%} of its best {self.best:.4g} (step {self.best_step})"
        )
        self.events += 1
        log_metrics(trainer, {"events/reward_collapse": running / self.best}, step=step)
        directory = Path(run_directory(trainer))
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_text("events/reward_collapse", message, global_step=step)
            with (directory / "events.jsonl").open("a", encoding="utf-8") as handle:
                row = {"step": step, "event": "reward_collapse", "message": message, "running": running, "best": self.best, "best_step": self.best_step}
                handle.write(json.dumps(row) + "\n")
        rank_zero_warn(message)

    def state_dict(self) -> dict[str, Any]:
        return {"values": self.values, "best": self.best, "best_step": self.best_step, "collapsed": self.collapsed, "events": self.events}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, value in state_dict.items():
            setattr(self, name, value)
