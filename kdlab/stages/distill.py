"""``DistillModule``: one distillation step = rollout policy x KL objective x task.

Per training step:

1. the task's examples are rendered into a student prompt and a teacher prompt (each with its own
   tokenizer's chat template) and left-padded;
2. the rollout policy writes completions (no grad, models in eval mode);
3. student and teacher read ``[own prompt | completion]``; their logits at the completion positions,
   divided by their temperatures, go to the objective with the completion mask;
4. ``train/loss``, the exact full-vocabulary ``train/kl_forward`` / ``train/kl_reverse`` of the batch
   (whatever is trained), entropies, completion length and the components' reports are logged. A top-k
   teacher (a cache, a server) stands for its distribution with its top k and an even spread of the rest,
   so its KLs are exact for that stand-in; ``train/teacher_tail_mass`` is the mass the spread holds.

The teacher is frozen, kept in eval mode and held outside the module's state, so no checkpoint (whole or
sharded) carries it: it is reloaded from its path.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from kdlab.components import Component
from kdlab.data import encode_prompts
from kdlab.models.loading import ModelSpec, end_token_ids, load_causal_lm, load_config, load_tokenizer
from kdlab.objectives.aligned import CrossTokenizer
from kdlab.objectives.pairing import SharedVocabulary
from kdlab.objectives.lazy import LazyLogits
from kdlab.objectives.kl import ForwardKL, KLObjective, sampled_logprobs
from kdlab.objectives.logits import fused_head_unsupported
from kdlab.objectives.precision import check_kl_temperature
from kdlab.rollouts.packing import Packed, Padded, RowLayout
from kdlab.rollouts.policies import RolloutContext, RolloutPolicy, TeacherRollouts, TeacherTokens, importance_weights
from kdlab.stages.base import TaskStage
from kdlab.stages.lora import LoraSpec, apply_lora
from kdlab.stages.optim import FiniteAdamW, check_adamw, check_schedule, lr_multiplier
from kdlab.stages.sharding import gathered_for_decoding
from kdlab.tasks.base import Example, Task
from kdlab.teachers.base import TeacherRun, TeacherSource, check_needs
from kdlab.teachers.legacy import teacher_source
from kdlab.teachers.model import vocabulary_columns


class DistillModule(TaskStage):
    """Distil ``teacher`` into ``student`` on ``task`` with a rollout policy and a KL objective.

    Args:
        student: the model trained: all its parameters, or LoRA adapters on it (``lora``).
        teacher: where the teacher's distribution comes from, one :class:`~kdlab.teachers.base.TeacherSource`: a model
            in this process (``{path: ..., dtype: ...}``, i.e. :class:`~kdlab.teachers.ModelTeacher`), a top-k cache
            (:class:`~kdlab.teachers.CachedTeacher`), a served teacher (:class:`~kdlab.teachers.Served`), several teachers
            (:class:`~kdlab.teachers.Several`) or the student's base under its LoRA adapters
            (:class:`~kdlab.teachers.BaseModelTeacher`). It shares the student's vocabulary unless ``cross_tokenizer`` is
            given. What the rollout policy needs of it is checked before any weights load.
        task: prompts, per-model prompting and the verifier used for validation accuracy.
        rollout: who writes completions (default :class:`~kdlab.rollouts.policies.TeacherRollouts`, online).
        objective: the token-level divergence (default :class:`~kdlab.objectives.kl.ForwardKL`).
        teacher_temperature: pi_T = softmax(z_T / teacher_temperature), for sampling and the KL (paper: 0.5).
        student_temperature: pi_S = softmax(z_S / student_temperature), for sampling and the KL (paper: 1.0).
        max_prompt_tokens: longer prompts are an error naming the example (paper: 2048).
        max_completion_tokens: rollout length budget (paper: 512 Countdown, 1024 Science/MedReason).
        batch_size: prompts per micro-batch; the effective batch is this x ``accumulate_grad_batches``.
        rollout_micro_batches: how many consecutive micro-batches one batched decode writes completions
            for: ``None`` (default) all of an optimiser step's (``batch_size x accumulate_grad_batches``
            prompts per decode on each rank), ``1`` each micro-batch alone, any divisor of
            ``accumulate_grad_batches`` in between (to bound the decode's KV caches). Training still runs
            one micro-batch at a time, each on its own rows with its own padding, so the loss and
            gradients on given completions do not depend on it; the sampled completions do (one random stream
            per decode, seeded by its first micro-batch's index; 1 reproduces kdlab 0.1's draws).
        lr: peak learning rate (paper: 1e-5 and 5e-5).
        warmup_steps: optimiser step k (0-based) uses ``lr * min(1, (k + 1) / warmup_steps)``, constant after.
        betas, eps, weight_decay: AdamW settings (paper: (0.9, 0.999), 1e-8, no weight decay).
        val_examples: validation/test use the first N held-out examples (paper: 200).
        val_temperature: sampling temperature for evaluation; 0 decodes greedily (paper: 0.5).
        val_batch_size: prompts per evaluation batch.
        eval_samples: completions drawn per evaluation prompt; ``<split>/accuracy`` is the mean score
            over all of them and ``<split>/pass@k`` uses the unbiased estimator (paper: 10 for pass@k).
        eval_ks: the k values of ``<split>/pass@k``, each <= ``eval_samples``.
        max_bad_steps: a step whose gradients are non-finite is skipped (no parameter or optimiser-state
            update) and counted in ``train/skipped_steps``; this many in a row stop the run with a
            message naming the step, the objective and the last good checkpoint.
        teacher_placement: under ``ModelParallelStrategy`` (FSDP2) or ``strategy: fsdp`` (FSDP1) the
            student is always sharded; ``replicate`` keeps a whole teacher on every device, ``shard``
            shards it like the student.
        fused_lm_head: feed the objective the models' final hidden states and LM heads
            (:class:`~kdlab.objectives.lazy.HeadLogits`) instead of logits, so neither model's ``(B, C, V)``
            logits (nor the student's logits gradient) is ever materialised; same loss and gradients.
            Works under FSDP2 (the head is read whole after the forward); refused under FSDP1.
            ``None`` (default): the fused path for each model wherever it is valid
            (:func:`~kdlab.objectives.logits.fused_head_unsupported` says why not: a head bias, soft-capped or
            scaled logits, FSDP1), the logits path otherwise. ``true`` insists (an error where invalid),
            ``false`` always takes the logits path.
        max_tokens_per_row: padding-free micro-batches (:class:`~kdlab.rollouts.packing.Packed`): each micro-batch's
            sequences (each model's own prompt + the completion, no padding) are packed end to end into rows of at most
            this many tokens, each attending only to itself (restarting position ids; a block-diagonal mask, or a
            flash-attention model's variable-length path), and the rows run in one forward, student and in-process
            teacher alike. Every objective, reduction and diagnostic reads the same completion tokens as with padded
            rows (same loss and gradients up to float rounding); cached and served teachers' top-k stay aligned.
            It must hold the longest possible sequence (``max_prompt_tokens + max_completion_tokens``).
            ``None`` (default): padded rows, ``(B, P + C)``.
        stop_strings: rollouts and evaluation also stop once a completion contains one of these.
        cross_tokenizer: distil across tokenizers (:class:`~kdlab.objectives.aligned.CrossTokenizer`): each
            model reads the completion in its own tokens, aligned by bytes, and ``objective`` is taken over
            the aligned groups (with identical tokenizers it equals the usual objective). Required when the
            vocabularies differ; ``MixtureRollouts`` and vLLM rollouts need one vocabulary and are refused.
        lora: train LoRA adapters on the student instead of all its weights (peft, as SFT and GRPO; ``pip
            install kdlab[lora]``): only the adapters move and hold optimiser state; checkpoints carry the
            student with its adapters and their settings, and a stage that starts from one (``policy.checkpoint``,
            ``student.checkpoint``) gets the adapters merged into the weights
            (:func:`~kdlab.models.export.load_stage_weights`), as vLLM weight pushes merge them.
        legacy: the earlier spellings of ``teacher`` (``base_teacher``, ``served_teacher``, ``teachers``, ``teacher_choice``;
            deprecated, with a ``FutureWarning``), see :func:`kdlab.teachers.legacy.teacher_source`.
        seed: seeds rollout sampling, sampled-KL draws, evaluation sampling and data order; each
            step's streams are derived from (seed, split, rank, epoch, batch index) and each epoch's
            order from (seed, epoch), not from how long the process has been running.
    """

    def __init__(
        self,
        student: ModelSpec | str,
        teacher: TeacherSource | ModelSpec | str | None = None,
        task: Task | None = None,
        rollout: RolloutPolicy | None = None,
        objective: KLObjective | None = None,
        teacher_temperature: float = 0.5,
        student_temperature: float = 1.0,
        max_prompt_tokens: int = 2048,
        max_completion_tokens: int = 512,
        batch_size: int = 1,
        rollout_micro_batches: int | None = None,
        lr: float = 1e-5,
        warmup_steps: int = 10,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        val_examples: int = 200,
        val_temperature: float = 0.5,
        val_batch_size: int = 8,
        eval_samples: int = 1,
        eval_ks: tuple[int, ...] = (1,),
        max_bad_steps: int = 10,
        teacher_placement: str = "replicate",
        fused_lm_head: bool | None = None,
        seed: int = 42,
        stop_strings: list[str] | None = None,
        cross_tokenizer: CrossTokenizer | None = None,
        lora: LoraSpec | None = None,
        max_tokens_per_row: int | None = None,
        **legacy: Any,
    ) -> None:
        if task is None:
            raise ValueError("DistillModule.task is required (a kdlab.tasks Task chosen by class_path)")
        super().__init__(
            task, batch_size, max_prompt_tokens, max_completion_tokens, val_examples,
            val_temperature, val_batch_size, eval_samples, tuple(eval_ks), seed, stop_strings,
        )
        for name, value in (("teacher_temperature", teacher_temperature), ("student_temperature", student_temperature)):
            check_kl_temperature("DistillModule", name, value)
        check_adamw("DistillModule", lr, betas, eps, weight_decay)
        check_schedule("DistillModule", warmup_steps)
        self.student_spec = ModelSpec(student) if isinstance(student, str) else student
        self.rollout = rollout if rollout is not None else TeacherRollouts()
        self.objective = objective if objective is not None else ForwardKL()
        if rollout_micro_batches is not None and rollout_micro_batches < 1:
            raise ValueError(f"DistillModule.rollout_micro_batches must be >= 1 (or null: a whole optimiser step), got {rollout_micro_batches}")
        self.rollout_micro_batches = rollout_micro_batches
        self.teacher_temperature = teacher_temperature
        self.student_temperature = student_temperature
        self.lr, self.warmup_steps, self.betas, self.eps, self.weight_decay = lr, warmup_steps, tuple(betas), eps, weight_decay
        self.set_max_bad_steps(max_bad_steps)
        self._counted_step = 0
        if teacher_placement not in ("replicate", "shard"):
            raise ValueError(f"DistillModule.teacher_placement must be 'replicate' or 'shard', got {teacher_placement!r}")
        self.teacher_placement = teacher_placement
        self.fused_lm_head = fused_lm_head
        self.layout = self.row_layout(max_tokens_per_row, max_prompt_tokens + max_completion_tokens)
        self.cross_tokenizer = cross_tokenizer
        self.pairing = cross_tokenizer if cross_tokenizer is not None else SharedVocabulary()  # how the two models' tokens meet
        # the earlier spellings (served_teacher, teachers + teacher_choice, base_teacher) arrive in ``legacy``; jsonargparse
        # reads their types and help from teacher_source's signature, so old configs keep parsing
        self.teacher_source = teacher_source(teacher, self.rollout, cross_tokenizer, **legacy)

        # Tokenizers and configs first: what the rollout needs of the teacher, a vocabulary mismatch (or a head too
        # small for the tokenizer) fail before any weights are read.
        self.student_tokenizer = load_tokenizer(self.student_spec, "student")
        student_config = load_config(self.student_spec, "student")
        self.layout.check_model(student_config, "the student")
        self.token_columns = vocabulary_columns(self.student_tokenizer, student_config, "student")
        run = TeacherRun(student_tokenizer=self.student_tokenizer, student_config=student_config, student_columns=self.token_columns,
                         teacher_temperature=teacher_temperature, cross_tokenizer=cross_tokenizer is not None, placement=teacher_placement,
                         fused_lm_head=fused_lm_head, reduction=self.objective.reduction, chunk_size=self.objective.chunk_size,
                         stop_strings=tuple(self.stop_strings), max_completion_tokens=max_completion_tokens, held=self._frozen,
                         student=(lambda: self.student) if lora is not None else None, layout=self.layout)
        check_needs(self.rollout.needs(), self.teacher_source.offers(run), type(self.rollout).__name__, type(self.teacher_source).__name__)
        self.teacher_source.bind(run)
        self.teacher_tokenizer, self.teacher_columns = self.teacher_source.tokenizer, self.teacher_source.token_columns
        if cross_tokenizer is not None:
            cross_tokenizer.check_texts(task, self.student_tokenizer, self.teacher_tokenizer)
        self.student = load_causal_lm(self.student_spec, "student", config=student_config)
        self.lora = lora
        if lora is not None:
            self.student = apply_lora(self.student, lora)
        self.teacher_source.load()
        self.student.train()  # from_pretrained returns eval mode; Lightning keeps modes as it finds them
        # a completion ends at either model's end token (their chat templates may differ); across
        # tokenizers each model's own end tokens end the completions it writes
        teacher_ends = self.teacher_source.end_ids
        student_ends = end_token_ids(self.student_tokenizer, self.student)
        if cross_tokenizer is None:
            self.end_ids = tuple(dict.fromkeys(student_ends + teacher_ends))
            self.teacher_end_ids = self.end_ids
        else:
            self.end_ids = student_ends
            self.teacher_end_ids = teacher_ends or (int(self.teacher_tokenizer.eos_token_id),)
            # every end id of each side is one shared end event (known once the models' generation configs are read)
            cross_tokenizer.bind(self.teacher_tokenizer, self.student_tokenizer, self.teacher_columns, self.token_columns,
                                 self.teacher_end_ids, self.end_ids)
        self.pad_id = int(self.student_tokenizer.pad_token_id)

    @staticmethod
    def row_layout(max_tokens_per_row: int | None, longest_sequence: int) -> RowLayout:
        """Padded rows, or packed rows of ``max_tokens_per_row`` tokens, which must hold ``longest_sequence``."""
        if max_tokens_per_row is None:
            return Padded()
        layout = Packed(max_tokens_per_row, "DistillModule.max_tokens_per_row")
        layout.check_fits(longest_sequence, "max_prompt_tokens + max_completion_tokens")
        return layout

    # ---- parallelism ----------------------------------------------------------------------
    def sharded_models(self) -> list[torch.nn.Module]:
        """The student, and the teacher source's in-process models when ``teacher_placement == "shard"``."""
        return [self.student] + (list(self.teacher_source.models().values()) if self.teacher_placement == "shard" else [])

    @property
    def teacher(self) -> torch.nn.Module:
        """The frozen in-process teacher model (eval mode, outside the module's state; see ``TaskStage.hold_frozen``);
        an error naming the source when the teacher has none (a cache, a server, several teachers)."""
        return self.teacher_source.model

    def components(self) -> dict[str, Component]:
        parts = {"rollout": self.rollout, "objective": self.objective, "task": self.task}
        if self.cross_tokenizer is not None:
            parts["cross_tokenizer"] = self.cross_tokenizer
        return parts

    # ---- data -----------------------------------------------------------------------------
    def trains_on(self, example: Example) -> bool:
        return self.rollout.covers(example)

    def _prompts(self, examples: list[Example]):
        teacher_pad = None  # one tokenizer: the student's pad id; across tokenizers the teacher's own
        if self.cross_tokenizer is not None:
            teacher_pad = TeacherTokens(self.teacher_tokenizer, self.teacher_columns, self.teacher_end_ids).pad_token_id
        prompts = encode_prompts(self.task, examples, self.student_tokenizer, self.teacher_tokenizer, self.max_prompt_tokens, self.pad_id,
                                 teacher_pad_token_id=teacher_pad)
        for name in ("student_ids", "student_mask", "teacher_ids", "teacher_mask"):
            setattr(prompts, name, getattr(prompts, name).to(self.device))
        return prompts

    # ---- training -------------------------------------------------------------------------
    def rollout_context(self, generator: torch.Generator | None, seed: int | None = None) -> RolloutContext:
        in_process = self.teacher_source.models()
        return RolloutContext(
            student=self.student,
            teacher=next(iter(in_process.values())) if len(in_process) == 1 else None,
            tokenizer=self.student_tokenizer,
            token_columns=self.token_columns,
            max_new_tokens=self.max_completion_tokens,
            eos_token_ids=self.end_ids,
            pad_token_id=self.pad_id,
            student_temperature=self.student_temperature,
            teacher_temperature=self.teacher_temperature,
            generator=generator,
            all_done=self.all_done_hook(),
            step=self.global_step,
            student_spec=self.student_spec,
            teacher_spec=self.teacher_source.spec,
            stop=self.stop_check(),
            stop_strings=tuple(self.stop_strings),
            teacher_tokens=self.teacher_tokens(),
            teacher_source=self.teacher_source,
            seed=seed,
        )

    def teacher_tokens(self) -> TeacherTokens | None:
        """The teacher's tokenizer, columns and end tokens across tokenizers (``None`` with one vocabulary)."""
        if self.cross_tokenizer is None:
            return None
        from kdlab.rollouts.decoding import stop_strings_check

        return TeacherTokens(self.teacher_tokenizer, self.teacher_columns, self.teacher_end_ids,
                             stop_strings_check(self.teacher_tokenizer, self.stop_strings))

    def make_rollout(self, examples: list[Example], seed: int, policy: RolloutPolicy | None = None):
        """Completions for ``examples`` from ``policy`` (default: this module's rollout policy), sampled in
        one batched decode with the student in eval mode (FSDP2-sharded models stay gathered for the whole
        decode: :func:`~kdlab.stages.sharding.gathered_for_decoding`)."""
        policy = self.rollout if policy is None else policy
        prompts = self._prompts(examples)
        was_training = self.student.training
        self.student.eval()
        try:
            with torch.no_grad(), gathered_for_decoding([self.student, *self._frozen.values()]):
                return self.teacher_source.rollout(policy, prompts, self.rollout_context(self._generator(seed), seed))
        finally:
            self.student.train(was_training)
            # Under Lightning's autocast the decode cached bf16 casts of the fp32 student's weights, made
            # without grad; torch before pytorch#165068 reused them in the training forward, which then had
            # no gradient. Dropping the cache costs one cast per weight per step.
            torch.clear_autocast_cache()

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage == "fit":
            self.teacher_source.ready()

    def teardown(self, stage: str) -> None:
        """The rollout policy's threads end with the fit, validation or test (:meth:`RolloutPolicy.close
        <kdlab.rollouts.policies.RolloutPolicy.close>`), also when it stopped on an error."""
        super().teardown(stage)
        self.rollout.close()

    def decode_group(self) -> int:
        """Micro-batches per batched decode: ``rollout_micro_batches``, by default the trainer's
        ``accumulate_grad_batches``; it must divide the latter (decodes never straddle optimiser steps)."""
        accumulate = int(getattr(self._trainer, "accumulate_grad_batches", 1) or 1) if self._trainer is not None else 1
        group = accumulate if self.rollout_micro_batches is None else self.rollout_micro_batches
        if accumulate % group:
            raise ValueError(
                f"DistillModule.rollout_micro_batches={group} must divide trainer.accumulate_grad_batches={accumulate} "
                "(one decode serves micro-batches of one optimiser step)"
            )
        return group

    def micro_batch_rollout(self, batch: list[Example], batch_idx: int):
        """The rollout of micro-batch ``batch``: at the first micro-batch of its
        :class:`~kdlab.stages.loaders.DecodeGroup`, one batched decode writes the whole group's completions
        (seeded by that micro-batch's ``step_seed``), split into each micro-batch's rows and trimmed to its
        own padding; the group's other micro-batches take theirs. A plain list (no group) decodes alone."""
        group, index = getattr(batch, "group", None), getattr(batch, "index", 0)
        if group is None:
            return self.make_rollout(batch, self.step_seed("train", batch_idx))
        if group.rollouts is None:
            rollout = self.make_rollout(group.examples, self.step_seed("train", batch_idx - index))
            group.rollouts = rollout.split([len(part) for part in group.batches]) if len(group.batches) > 1 else [rollout]
            if group.following is not None:  # a source may start on the next group now (a served teacher's prefetch)
                examples, seed = group.following.examples, self.step_seed("train", batch_idx - index + len(group.batches))
                self.teacher_source.prefetch(self.rollout, lambda: self._prompts(examples), seed,
                                             lambda: self.rollout_context(self._generator(seed), seed))
            self.rollout.prefetch(self.upcoming_groups(group, batch_idx - index))
        taken, group.rollouts[index] = group.rollouts[index], None  # each micro-batch's tensors freed after its step
        return taken

    def upcoming_groups(self, group: Any, first: int):
        """The decode groups after ``group`` (whose first micro-batch is ``first``), drawn as they are walked, as
        :class:`~kdlab.rollouts.overlap.Upcoming` items: optimiser steps ahead, examples, seed, prompts and context;
        the walk ends before a group of a step the trainer's ``max_steps`` does not reach."""
        from kdlab.rollouts.overlap import Upcoming

        accumulate = int(getattr(self._trainer, "accumulate_grad_batches", 1) or 1) if self._trainer is not None else 1
        max_steps = int(getattr(self._trainer, "max_steps", -1)) if self._trainer is not None else -1
        start, ahead = first + len(group.batches), group.following
        while ahead is not None:
            steps_ahead = start // accumulate - first // accumulate
            if 0 <= max_steps <= self.global_step + steps_ahead:
                return
            seed, examples = self.step_seed("train", start), ahead.examples
            yield Upcoming(steps_ahead, examples, seed, lambda examples=examples: self._prompts(examples),
                           lambda seed=seed: self.rollout_context(self._generator(seed), seed))
            start, ahead = start + len(ahead.batches), ahead.following

    def distillation_logits(self, rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """Tempered student and teacher logits ``(B, C, V)`` at the completion positions (as
        :class:`~kdlab.objectives.lazy.HeadLogits` with ``fused_lm_head``), each model's forward in ``self.layout``."""
        if self.uses_fused_head(self.student):
            student = self.layout.completion_head_logits(self.student, rollout, "student", self.token_columns, self.student_temperature)
        else:
            student = self.layout.completion_logits(self.student, rollout, "student", self.token_columns)
            if self.student_temperature != 1.0:
                student = student / self.student_temperature
        if rollout.teacher_logprobs is not None:  # scored already (a served teacher scores a decode group in one go)
            return student, rollout.teacher_logprobs
        return student, self.teacher_source.completion_logprobs(rollout, student)

    def uses_fused_head(self, model: torch.nn.Module) -> bool:
        """Whether ``model``'s logits reach the objective as hidden states and head (``fused_lm_head``)."""
        if self.fused_lm_head is not None:
            return bool(self.fused_lm_head)
        return fused_head_unsupported(model) is None

    def training_step(self, batch: list[Example], batch_idx: int) -> torch.Tensor | None:
        seed = self.step_seed("train", batch_idx)
        rollout = self.micro_batch_rollout(batch, batch_idx)
        mask = rollout.completion_mask
        if not bool(mask.any()):
            warnings.warn(f"step {self.global_step}: the rollouts hold no completion token; batch skipped", stacklevel=2)
            return None
        student_logits, teacher_logits = self.distillation_logits(rollout)
        self.objective.reseed(seed + 1)
        size = len(batch)
        weights = None
        if rollout.behaviour_logprobs is not None:  # sampled by an engine whose weights may lag the student's
            sampled = sampled_logprobs(student_logits.detach(), rollout.completion_ids, self.objective.chunk_size)
            weights = importance_weights(sampled, rollout.behaviour_logprobs, mask, rollout.importance_cap)
            self.log("train/importance_weight", weights.mean(), batch_size=size, sync_dist=True)
            # mean log q - log p_theta over sampled tokens: an estimate of KL(q || p_theta), 0 only when the
            # engine samples the student exactly (the weight's mean is ~1 for any q, so it cannot tell)
            self.log("train/engine_kl", ((rollout.behaviour_logprobs - sampled) * mask).sum() / mask.sum(), batch_size=size, sync_dist=True)
        loss, diagnostics = self.pairing.rollout_loss(self.objective, rollout, student_logits, teacher_logits, weights)
        self.log("train/loss", loss, prog_bar=True, batch_size=size, sync_dist=True)
        diagnostics.update(self.teacher_source.named_diagnostics(diagnostics))
        if isinstance(teacher_logits, LazyLogits):  # a top-k teacher: train/teacher_tail_mass, over the teacher's own positions
            diagnostics.update(teacher_logits.summary(rollout.completion("teacher")[1]))
        for name, value in diagnostics.items():
            self.log(f"train/{name}", value, batch_size=size, sync_dist=True)
        self.log("train/completion_length", mask.sum(1).float().mean(), batch_size=size, sync_dist=True)
        if rollout.sampling_entropy is not None:
            self.log("train/rollout_entropy", rollout.sampling_entropy[mask].mean(), batch_size=size, sync_dist=True)
        self._log_records("train", size)
        return loss

    @torch.no_grad()
    def divergences(self, rollout, reduction: str = "token") -> dict[str, torch.Tensor]:
        """Exact ``kl_forward``, ``kl_reverse`` and entropies of ``rollout`` (no grad), reduced per token or per
        sequence; across tokenizers, over its aligned groups (:class:`~kdlab.objectives.pairing.TokenPairing`)."""
        student, teacher = self.distillation_logits(rollout)
        return self.pairing.divergences(self.objective, rollout, student, teacher, reduction)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.log("train/grad_norm", self.student_grad_norm())  # before clipping: Lightning clips after this hook

    def configure_optimizers(self):
        params = [p for p in self.student.parameters() if p.requires_grad]
        optimizer = FiniteAdamW(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(self.warmup_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Count optimiser steps skipped for non-finite gradients; stop after ``max_bad_steps`` in a row."""
        optimizer = self.optimizers().optimizer
        if not isinstance(optimizer, FiniteAdamW) or self.global_step == self._counted_step:
            return  # no optimiser call since the last check (an accumulation micro-batch)
        self._counted_step = self.global_step
        self.count_skipped_step(optimizer, f"objective {type(self.objective).__name__}, lr {self.lr}")
