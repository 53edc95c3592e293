"""``GRPOModule``: the RLVR stage after distillation, GRPO with the DAPO policy loss.

Per rollout batch of ``batch_size`` prompts:

1. the rollout policy (default :class:`~kdlab.rollouts.policies.StudentRollouts`, the same engine as
   distillation) samples a group of ``group_size`` completions per prompt from the current policy at
   ``temperature`` with nucleus ``top_p``;
2. each completion is scored by the task's verifier: ``reward = correct_reward * task.score`` (the
   paper's Countdown-4 reward is 2 if correct else 0), plus ``format_reward`` if well formed;
3. advantages are group-normalised (:func:`group_advantages`);
4. the rows are split into ``mini_batches`` consecutive mini-batches (whole groups), and each one
   takes one optimiser step on the DAPO loss (:func:`dapo_loss`); the first mini-batch is on-policy
   (ratio 1), later ones are importance-weighted against pi_old, the policy before this batch's first
   step, whose log-probs the training model recomputes. With ``mini_batches: 1`` (the default and the
   paper presets') every ratio is 1, so the clip range never binds and the step is a token-mean policy
   gradient with group-normalised advantages.

DAPO's dynamic sampling (drawing more groups until every group's rewards differ) is not implemented: a group
whose rewards are all equal gets advantage 0 and adds nothing to the loss's sum, but its tokens still count in
the token mean, so the step shrinks with the share of such groups (as TRL's ``loss_type="dapo"`` does);
``rlvr/zero_variance_groups`` logs that share. Over data-parallel ranks the token mean is over every rank's
tokens (:meth:`GRPOModule.tokens_per_rank`).

An engine that samples with other numerics or stale weights (vLLM, whose log-probs are its own and are
taken after its top-p truncation; ``sync_every > 1``) reports its sampling log-probs q. They are never used
as pi_old (they differ from the trained model's own by more than the policy's change); each token's policy
term is instead weighted by the truncated importance weight ``min(importance_cap, pi_old(y) / q(y))`` (its
mean is logged as ``rlvr/engine_ratio``), which corrects for sampling from q. ``rlvr/engine_kl``, the mean
of ``log q - log pi_old`` over the sampled tokens, estimates KL(q || pi_old): 0 only when the engine samples
pi_old exactly (the ratio's mean is near 1 for any q that covers pi_old, so it cannot tell). kdlab's own
decoder (``StudentRollouts``) reports no q: its top-p sampling (``top_p``, default 0.95 as in the paper) is
not corrected for, as in most GRPO implementations (the paper asks for no such correction).

Logged: ``rlvr/reward_mean``, ``rlvr/reward_std``, ``rlvr/zero_variance_groups`` (share of groups whose
rewards are all equal), ``rlvr/completion_length``, ``rlvr/entropy`` (mean per-token entropy of the
policy on its completions), ``rlvr/clip_fraction`` (share of tokens where the clipped term is taken),
``rlvr/kl_to_reference`` (beta > 0), ``rlvr/engine_ratio`` and ``rlvr/engine_kl`` (engine rollouts), and ``train/loss``, ``train/grad_norm`` (before clipping),
``train/skipped_steps``.

``trainer.max_steps`` counts optimiser steps (rollout batches x ``mini_batches``). The module
optimises manually, so gradient clipping is its own ``grad_clip`` setting (``trainer.gradient_clip_val``
is not used). The trained model is called ``student`` (it starts as the distilled student), so the
callbacks that read it (``UpdateSparsity``, ``OODForgetting``, ``Coverage``, ``StyleTransfer``'s student
share, ``RewardCollapse``) work on this stage too; those that need a teacher or an objective do not.
"""

from __future__ import annotations

import math
import warnings

import torch

from kdlab.components import Component
from kdlab.data import Rollout, decode_completions, encode_prompts
from kdlab.models.export import export_pretrained
from kdlab.models.loading import (
    ModelSpec,
    end_token_ids,
    load_causal_lm,
    load_tokenizer,
)
from kdlab.evaluation.scoring import scored
from kdlab.objectives.logits import completion_head_logits, completion_logits
from kdlab.objectives.logprobs import token_logprobs
from kdlab.objectives.precision import check_kl_temperature
from kdlab.rollouts.policies import RolloutContext, RolloutPolicy, StudentRollouts
from kdlab.stages.base import TaskStage
from kdlab.stages.lora import LoraSpec, apply_lora
from kdlab.stages.optim import FiniteAdamW, check_adamw, check_schedule, lr_multiplier
from kdlab.stages.sharding import require_gradient_sync
from kdlab.tasks.base import Example, Task


def group_advantages(rewards: torch.Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages ``(N * G,)`` of rewards ``(N * G,)`` laid out group by group.

    ``A_i = (R_i - mean_g R) / (std_g R + eps)`` with the unbiased (n - 1) standard deviation of the
    group (as verl and TRL compute it), or ``R_i - mean_g R`` when ``scale_by_std`` is False (Dr. GRPO).
    A group whose rewards are all equal gets advantage 0 for every member: it carries no signal.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 to normalise rewards within a group, got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.float().reshape(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    # exactly 0 where every reward is the same: fp32's mean of e.g. 2.1s is not 2.1, and its residue over a std of
    # the same residue would push the whole group one way
    return centred.masked_fill(zero_variance_groups(grouped)[:, None], 0.0).reshape(-1)


def zero_variance_groups(grouped: torch.Tensor) -> torch.Tensor:
    """``(N,)`` bool: which groups of rewards ``(N, G)`` are all equal (no signal: their advantages are 0)."""
    return grouped.max(dim=1).values == grouped.min(dim=1).values


def dapo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    num_tokens: int | None = None,
    ref_logprobs: torch.Tensor | None = None,
    beta: float = 0.0,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DAPO policy loss (Yu et al., 2025): clip-higher and token-level averaging.

    With ratio ``r_t = exp(logp_t - logp_old_t)`` and the sequence's advantage ``A``::

        loss = -(1 / T) * sum_{i, t in mask} min(r_t A_i, clip(r_t, 1 - clip_low, 1 + clip_high) A_i)
               + beta * (1 / T) * sum_{i, t in mask} k3_t

    where ``T`` is the number of completion tokens in the whole (mini-)batch, not a per-sequence mean
    (token-level averaging: long completions weigh by their length), and
    ``k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1`` is GRPO's non-negative estimator of KL(policy ||
    reference) (only when ``beta > 0``). Its value is unbiased for that KL on tokens sampled from the policy, but
    its gradient as a loss is, in expectation, the gradient of the other direction, KL(reference || policy); from
    the second mini-batch on the tokens come from pi_old and no ratio corrects it (as in GRPO and TRL).

    Args:
        logprobs: ``(B, C)`` log-probs of the sampled tokens under the policy being trained (with grad).
        old_logprobs: ``(B, C)`` the same under the policy that sampled them (no grad).
        advantages: ``(B,)`` one per completion.
        mask: ``(B, C)`` bool, True on completion tokens.
        num_tokens: ``T``; default ``mask.sum()``. Pass the whole mini-batch's count when the loss is
            accumulated over micro-batches, so the sum of their losses is the mini-batch loss.
        token_weights: ``(B, C)`` constants multiplying each token's policy term (not the KL term):
            the truncated importance weights ``min(cap, pi_old / q)`` of tokens an engine sampled from
            a distribution q other than pi_old (see :class:`GRPOModule`); ``None``: all ones.

    Returns the loss and detached statistics summed over this call's tokens: ``clipped`` (tokens
    where the clipped term is the one taken and differs from the unclipped one), ``tokens`` and ``kl``.
    """
    mask = mask.bool()
    total = int(mask.sum()) if num_tokens is None else num_tokens
    ratio = torch.exp(logprobs - old_logprobs)
    advantage = advantages[:, None].to(logprobs.dtype)
    unclipped = ratio * advantage
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantage
    objective = torch.minimum(unclipped, clipped)
    if token_weights is not None:
        objective = objective * token_weights.detach().to(objective.dtype)
    loss = -(objective * mask).sum() / (total if total > 0 else 1)
    stats = {
        "clipped": ((clipped < unclipped) & mask).sum().detach().float(),
        "tokens": mask.sum().detach().float(),
        "kl": torch.zeros((), device=logprobs.device),
    }
    if beta > 0:
        if ref_logprobs is None:
            raise ValueError("dapo_loss: beta > 0 needs ref_logprobs")
        log_ratio = ref_logprobs - logprobs
        k3 = torch.exp(log_ratio) - log_ratio - 1
        loss = loss + beta * (k3 * mask).sum() / (total if total > 0 else 1)
        stats["kl"] = (k3.detach() * mask).sum()
    return loss, stats


class GRPOModule(TaskStage):
    """GRPO with the DAPO loss on ``task``, starting from ``policy`` (see module docstring).

    Args:
        policy: the model trained; a distilled student is chained in with ``policy.checkpoint``
            (a ``DistillModule`` checkpoint, see :class:`~kdlab.models.loading.ModelSpec`).
        task: prompts and the verifier that gives the reward.
        rollout: how completions are sampled from the policy (default: ``StudentRollouts``).
        group_size: completions per prompt, G (paper: 8).
        temperature: sampling temperature, also used for the log-probs in the loss (paper: 1.0).
        top_p: nucleus sampling (paper: 0.95). The loss's log-probs are the full tempered distribution's.
        correct_reward: reward per unit of ``task.score`` (paper: 2.0 for a correct answer, 0 otherwise).
        format_reward: added when the completion has the task's answer format (``task.well_formed``);
            the paper's Science/MedReason teachers got format terms <= 0.5, Countdown-4 RLVR none.
        scale_rewards_by_std: divide by the group's standard deviation (GRPO); False gives Dr. GRPO.
        clip_low, clip_high: the DAPO clip range ``[1 - clip_low, 1 + clip_high]`` (DAPO: 0.2, 0.28).
        beta: weight of the k3 KL to ``reference`` (paper: 0, and no reference model is loaded).
        reference: the KL reference when ``beta > 0`` (default: the policy as loaded).
        mini_batches: optimiser steps per rollout batch, each on ``1 / mini_batches`` of the groups.
        micro_batch_size: rows per forward/backward inside a mini-batch (default: the whole mini-batch).
        lr: peak learning rate (paper: 2e-6, cosine, 30 warm-up steps).
        warmup_steps, schedule, min_lr_ratio: linear warm-up, then ``cosine`` to ``min_lr_ratio * lr``
            at ``max_steps``, or ``constant``.
        grad_clip: clip the gradient norm to this (paper: 1.0); 0 disables clipping.
        lora: train LoRA adapters only (``pip install kdlab[lora]``).
        betas, eps, weight_decay: AdamW settings.
        max_bad_steps: stop after this many consecutive optimiser steps with non-finite gradients.
        max_prompt_tokens, max_completion_tokens, batch_size, val_*, eval_*, seed, stop_strings: see
            :class:`~kdlab.stages.base.TaskStage`; ``batch_size`` counts prompts (each gives G rows).
        export_dir: when training ends, write the (LoRA-merged) policy and tokenizer there as a Hugging
            Face folder (e.g. an RL-trained teacher for distillation).
        fused_lm_head: compute the loss's log-probs from the final hidden states and the LM head
            (:func:`token_logprobs` with :class:`~kdlab.objectives.lazy.HeadLogits`), so no ``(b, C, V)``
            logits exist even in the model's dtype (long RLVR traces); same values and gradients. Not with
            a sharded (FSDP1/FSDP2) head.

    The rollout decode and pi_old's log-probs run under ``no_grad`` inside Lightning's autocast (the RLVR
    presets train an fp32 policy under ``bf16-mixed``); the autocast cache is cleared after them, because
    torch before pytorch#165068 (2.10) reused their gradient-free bf16 casts of the weights in the training
    forward, which then gave the weights no gradient (``torch>=2.6`` allows those versions).
    """

    trained_role = "policy"

    def __init__(
        self,
        policy: ModelSpec | str,
        task: Task,
        rollout: RolloutPolicy | None = None,
        group_size: int = 8,
        temperature: float = 1.0,
        top_p: float = 0.95,
        correct_reward: float = 2.0,
        format_reward: float = 0.0,
        scale_rewards_by_std: bool = True,
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        beta: float = 0.0,
        reference: ModelSpec | str | None = None,
        mini_batches: int = 1,
        micro_batch_size: int | None = None,
        lr: float = 2e-6,
        warmup_steps: int = 30,
        schedule: str = "cosine",
        min_lr_ratio: float = 0.0,
        grad_clip: float = 1.0,
        lora: LoraSpec | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_bad_steps: int = 10,
        max_prompt_tokens: int = 2048,
        max_completion_tokens: int = 512,
        batch_size: int = 1,
        val_examples: int = 200,
        val_temperature: float = 0.5,
        val_batch_size: int = 8,
        eval_samples: int = 1,
        eval_ks: tuple[int, ...] = (1,),
        seed: int = 42,
        stop_strings: list[str] | None = None,
        export_dir: str | None = None,
        fused_lm_head: bool = False,
    ) -> None:
        super().__init__(
            task, batch_size, max_prompt_tokens, max_completion_tokens, val_examples,
            val_temperature, val_batch_size, eval_samples, tuple(eval_ks), seed, stop_strings,
        )
        self.automatic_optimization = False
        for name, value in (("top_p", top_p), ("mini_batches", mini_batches)):
            self.require_positive(name, value)
        check_kl_temperature("GRPOModule", "temperature", temperature)  # the loss's log-probs are at this temperature
        check_adamw("GRPOModule", lr, betas, eps, weight_decay)
        if group_size < 2:
            raise ValueError(f"GRPOModule.group_size must be >= 2 (advantages are relative to the group), got {group_size}")
        if top_p > 1:
            raise ValueError(f"GRPOModule.top_p must be in (0, 1], got {top_p}")
        if not 0 <= clip_low < 1 or clip_high < 0:
            raise ValueError(f"GRPOModule.clip_low must be in [0, 1) and clip_high >= 0, got {clip_low}, {clip_high}")
        check_schedule("GRPOModule", warmup_steps, schedule, min_lr_ratio)
        if beta < 0 or grad_clip < 0:
            raise ValueError(f"GRPOModule.beta and grad_clip must be >= 0, got {beta}, {grad_clip}")
        if batch_size % mini_batches:
            raise ValueError(f"GRPOModule.batch_size={batch_size} prompts do not split into mini_batches={mini_batches}")
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"GRPOModule.micro_batch_size must be >= 1 or null, got {micro_batch_size}")
        self.group_size, self.temperature, self.top_p = group_size, temperature, top_p
        self.correct_reward, self.format_reward, self.scale_rewards_by_std = correct_reward, format_reward, scale_rewards_by_std
        self.clip_low, self.clip_high, self.beta = clip_low, clip_high, beta
        self.mini_batches, self.micro_batch_size = mini_batches, micro_batch_size
        self.lr, self.warmup_steps, self.schedule, self.min_lr_ratio = lr, warmup_steps, schedule, min_lr_ratio
        self.grad_clip, self.betas, self.eps, self.weight_decay = grad_clip, tuple(betas), eps, weight_decay
        self.set_max_bad_steps(max_bad_steps)
        self.export_dir = export_dir
        self.fused_lm_head = fused_lm_head
        self.rollout = rollout if rollout is not None else StudentRollouts()

        self.student_spec = ModelSpec(policy) if isinstance(policy, str) else policy
        self.student_tokenizer = load_tokenizer(self.student_spec, "policy")
        self.student = load_causal_lm(self.student_spec, "policy")
        self.token_columns = len(self.student_tokenizer)
        self.end_ids = end_token_ids(self.student_tokenizer, self.student)
        self.pad_id = int(self.student_tokenizer.pad_token_id)
        if beta > 0:
            spec = self.student_spec if reference is None else (ModelSpec(reference) if isinstance(reference, str) else reference)
            self.hold_frozen("reference", load_causal_lm(spec, "reference"))
        if lora is not None:
            self.student = apply_lora(self.student, lora)
        self.student.train()

    def components(self) -> dict[str, Component]:
        return {"rollout": self.rollout, "task": self.task}

    @property
    def reference(self) -> torch.nn.Module | None:
        """The frozen KL reference (``beta > 0``), outside the module's state; else ``None``."""
        return self._frozen.get("reference")

    # ---- rollouts -------------------------------------------------------------------------
    def sample_groups(self, examples: list[Example], seed: int) -> tuple[Rollout, torch.Tensor]:
        """``group_size`` completions per example from the current policy (rows ordered group by
        group) and their rewards ``(N * G,)``."""
        repeated = [example for example in examples for _ in range(self.group_size)]
        prompts = encode_prompts(self.task, repeated, self.student_tokenizer, self.student_tokenizer, self.max_prompt_tokens, self.pad_id)
        for name in ("student_ids", "student_mask", "teacher_ids", "teacher_mask"):
            setattr(prompts, name, getattr(prompts, name).to(self.device))
        context = RolloutContext(
            student=self.student,
            teacher=self.reference if self.reference is not None else self.student,
            tokenizer=self.student_tokenizer,
            token_columns=self.token_columns,
            max_new_tokens=self.max_completion_tokens,
            eos_token_ids=self.end_ids,
            pad_token_id=self.pad_id,
            student_temperature=self.temperature,
            teacher_temperature=self.temperature,
            generator=self._generator(seed),
            all_done=self.all_done_hook(),
            top_p=self.top_p,
            step=self.global_step,
            student_spec=self.student_spec,
            stop=self.stop_check(),
            stop_strings=tuple(self.stop_strings),
        )
        was_training = self.student.training
        self.student.eval()
        try:
            with torch.no_grad(), self.decoding_gathered():
                rollout = self.rollout.sample(prompts, context)
        finally:
            self.student.train(was_training)
            torch.clear_autocast_cache()  # see the class docstring: the decode's casts have no grad
        texts = decode_completions(self.student_tokenizer, rollout.completion_ids, rollout.completion_mask, self.end_ids)
        return rollout, torch.tensor([self.reward(example, text) for example, text in zip(repeated, texts)], device=self.device)

    def reward(self, example: Example, completion: str) -> float:
        """``correct_reward * task.score`` plus ``format_reward`` for a well-formed completion."""
        reward = self.correct_reward * scored(self.task, example, completion)
        if self.format_reward and self.task.well_formed(completion):
            reward += self.format_reward
        return reward

    def sequence_logprobs(self, model: torch.nn.Module, rollout: Rollout, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Tempered log-probs and entropies ``(b, C)`` of the completion tokens of ``rows``."""
        inputs = {name: value[rows] for name, value in rollout.model_inputs("student").items()}
        ids = rollout.completion_ids[rows]
        if self.fused_lm_head:
            logits = completion_head_logits(model, inputs, ids.shape[1], self.token_columns, self.temperature)
        else:
            logits = completion_logits(model, inputs, ids.shape[1], self.token_columns)
        return token_logprobs(logits, ids, rollout.completion_mask[rows], self.temperature)

    # ---- training -------------------------------------------------------------------------
    def training_step(self, batch: list[Example], batch_idx: int) -> None:
        rollout, rewards = self.sample_groups(batch, self.step_seed("train", batch_idx))
        advantages = group_advantages(rewards, self.group_size, self.scale_rewards_by_std)
        mask = rollout.completion_mask
        rows = len(rewards)
        grouped = rewards.reshape(-1, self.group_size)
        size = len(batch)
        # averaged over ranks, so every rank's RewardCollapse sees the same reward
        self.log("rlvr/reward_mean", rewards.mean(), prog_bar=True, batch_size=size, sync_dist=True)
        self.log("rlvr/reward_std", rewards.std() if rows > 1 else torch.zeros((), device=self.device), batch_size=size, sync_dist=True)
        self.log("rlvr/zero_variance_groups", zero_variance_groups(grouped).float().mean(), batch_size=size, sync_dist=True)
        self.log("rlvr/completion_length", mask.sum(1).float().mean(), batch_size=size, sync_dist=True)
        if not bool(mask.any()):  # no early return: under data parallelism every rank must take the same steps
            warnings.warn(f"step {self.global_step}: the rollouts hold no completion token; the step changes nothing", stacklevel=2)
        old_logprobs = ref_logprobs = None
        behaviour = rollout.behaviour_logprobs  # an engine's (e.g. vLLM's) own sampling log-probs, or None
        with torch.no_grad():
            if self.mini_batches > 1:  # later mini-batches are trained after the policy has moved
                old_logprobs = self._all_rows(self.student, rollout, rows)
            if self.reference is not None:
                ref_logprobs = self._all_rows(self.reference, rollout, rows)
        if old_logprobs is not None or ref_logprobs is not None:
            torch.clear_autocast_cache()  # their no-grad casts of the policy's weights must not reach training
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        # whole groups per mini-batch; a short last batch (fewer prompts) takes fewer, smaller steps
        groups = rows // self.group_size
        per_mini = max(1, math.ceil(groups / self.mini_batches)) * self.group_size
        totals = {"clipped": 0.0, "tokens": 0.0, "kl": 0.0, "entropy": 0.0, "loss": 0.0, "steps": 0, "engine_ratio": 0.0, "engine_kl": 0.0}
        for start in range(0, rows, per_mini):
            optimizer.zero_grad()
            end = min(start + per_mini, rows)
            mini = slice(start, end)
            tokens = self.tokens_per_rank(mask[mini])
            step = self.micro_batch_size or per_mini
            for micro_start in range(start, end, step):
                micro = slice(micro_start, min(micro_start + step, end))
                require_gradient_sync([self.student], micro.stop == end)  # FSDP2: one reduction per mini-batch
                logprobs, entropy = self.sequence_logprobs(self.student, rollout, micro)
                old = logprobs.detach() if old_logprobs is None else old_logprobs[micro]
                correction = None
                if behaviour is not None:  # truncated importance weights from the engine's q to pi_old
                    correction = torch.exp((old - behaviour[micro]).masked_fill(~mask[micro], 0.0)).clamp(max=rollout.importance_cap)
                    totals["engine_ratio"] += float((correction * mask[micro]).sum())
                    totals["engine_kl"] += float(((behaviour[micro] - old) * mask[micro]).sum())
                loss, stats = dapo_loss(
                    logprobs, old, advantages[micro], mask[micro], self.clip_low, self.clip_high, num_tokens=tokens,
                    ref_logprobs=None if ref_logprobs is None else ref_logprobs[micro], beta=self.beta, token_weights=correction,
                )
                self.manual_backward(loss)
                for name in ("clipped", "tokens", "kl"):
                    totals[name] += float(stats[name])
                totals["entropy"] += float((entropy * mask[micro]).sum())
                totals["loss"] += float(loss.detach())
            self.log("train/grad_norm", self.student_grad_norm())
            if self.grad_clip > 0:
                self.clip_student_gradients(optimizer, self.grad_clip)
            optimizer.step()
            scheduler.step()
            totals["steps"] += 1
            self.count_skipped_step(optimizer.optimizer, f"GRPO, lr {self.lr}")
        count = max(totals["tokens"], 1.0)
        self.log("train/loss", totals["loss"] / max(totals["steps"], 1), prog_bar=True, batch_size=size, sync_dist=True)
        self.log("rlvr/clip_fraction", totals["clipped"] / count, batch_size=size, sync_dist=True)
        self.log("rlvr/entropy", totals["entropy"] / count, batch_size=size, sync_dist=True)
        if self.beta > 0:
            self.log("rlvr/kl_to_reference", totals["kl"] / count, batch_size=size, sync_dist=True)
        if behaviour is not None:
            self.log("rlvr/engine_ratio", totals["engine_ratio"] / count, batch_size=size, sync_dist=True)
            self.log("rlvr/engine_kl", totals["engine_kl"] / count, batch_size=size, sync_dist=True)
        self._log_records("train", size)

    def tokens_per_rank(self, mask: torch.Tensor) -> float:
        """DAPO's ``T`` for this rank's share of the loss: the mini-batch's completion tokens ``mask`` ``(B, C)`` summed over
        the data-parallel ranks and divided by their number. The ranks' gradients are averaged, so dividing each rank's
        sum by the mean count makes the step ``sum over every rank's tokens / all their tokens``, DAPO's token-level
        mean; a rank's own count would weigh a token on a rank of short completions more."""
        count = mask.sum().float()
        trainer = self._trainer
        if trainer is None or trainer.world_size == 1:
            return float(count)
        return float(trainer.strategy.reduce(count, reduce_op="mean"))

    def _all_rows(self, model: torch.nn.Module, rollout: Rollout, rows: int) -> torch.Tensor:
        step = self.micro_batch_size or rows
        return torch.cat([self.sequence_logprobs(model, rollout, slice(i, min(i + step, rows)))[0] for i in range(0, rows, step)])

    def configure_optimizers(self):
        params = [p for p in self.student.parameters() if p.requires_grad]
        optimizer = FiniteAdamW(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)
        total = 1
        if self._trainer is not None:  # optimiser steps: rollout batches x mini_batches unless max_steps bounds the run
            steps = self.trainer.max_steps
            total = steps if steps and steps > 0 else int(self.trainer.estimated_stepping_batches) * self.mini_batches
        factor = lr_multiplier(self.warmup_steps, total, cosine=self.schedule == "cosine", floor=self.min_lr_ratio)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, factor), "interval": "step"}}

    def on_train_end(self) -> None:
        if self.export_dir is not None:  # every rank gathers (sharded weights), rank zero writes
            export_pretrained(self.student, self.student_tokenizer, self.export_dir, write=self.trainer.is_global_zero)
