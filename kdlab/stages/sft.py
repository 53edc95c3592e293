"""``SFTModule``: supervised fine-tuning on (prompt, completion) pairs, loss on completion tokens only.

Used to train teachers on their task before distillation (the paper: SFT 500 steps, LR 5e-5 cosine,
10 warm-up, batch 32, clip 1.0, LoRA r = alpha = 256 on all attention and MLP projections) and to
build the tiny world's models from scratch.

The loss of an optimiser step is the mean over every completion token of its whole batch (``batch_size`` rows x
``accumulate_grad_batches`` micro-batches x data-parallel ranks), what one batch of all those rows gives: not a mean
of the micro-batches' means (which would weigh a token of a short-completion micro-batch more), see
:meth:`SFTModule.step_tokens`.

Data is either a JSONL file, one ``{"messages": [...], "completion": "..."}`` (chat prompt) or
``{"prompt": "...", "completion": "..."}`` (plain-text prompt) object per line, or the reference
completions of one or more :class:`~kdlab.tasks.base.Task` objects.
"""

from __future__ import annotations

import inspect
import numbers
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch.utils.data import DataLoader

from kdlab.data import read_jsonl, right_pad
from kdlab.models.export import export_pretrained
from kdlab.models.loading import ModelSpec, load_causal_lm, load_tokenizer
from kdlab.objectives.logits import completion_head_logits, completion_logits, fused_head_unsupported
from kdlab.objectives.logprobs import token_logprobs
from kdlab.run_config import describe_run, remember_arguments
from kdlab.runlog import run_directory
from kdlab.stages.checkpointing import CheckpointedStage
from kdlab.stages.lora import LoraSpec, apply_lora
from kdlab.stages.optim import FiniteAdamW, check_adamw, check_schedule, lr_multiplier
from kdlab.stages.loaders import resumable_loader
from kdlab.stages.sharding import check_strategy
from kdlab.tasks.base import Task
from kdlab.teachers.model import vocabulary_columns


def read_pairs(path: str) -> list[dict[str, Any]]:
    """Rows of an SFT JSONL file, each with its ``where`` (``<file>:<line>``, for later errors); errors name the file,
    line and field. Every row has a prompt to condition on: a non-empty ``messages`` list of ``{"role", "content"}``
    strings (a chat prompt) or, without ``messages``, a non-empty ``prompt`` string."""
    rows = []
    for where, row in read_jsonl(path, "SFTModule.dataset", ("completion",)):
        messages = row.get("messages")
        chat = isinstance(messages, list) and bool(messages) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)
        if not (chat if "messages" in row else isinstance(row.get("prompt"), str) and row["prompt"]):
            raise ValueError(f"{where}: needs a non-empty 'prompt' string or a non-empty 'messages' list of "
                             "{'role': str, 'content': str} objects")
        rows.append({**row, "where": where})
    if not rows:
        raise ValueError(f"SFTModule.dataset {path!r} holds no rows")
    return rows


def task_pairs(task: Task, split: str = "train") -> list[dict[str, Any]]:
    """``{"messages", "completion", "plain", "where"}`` rows from a task's student prompts and reference completions
    (``where``: ``<Task> example '<id>'``, for errors)."""
    rows = []
    for example in task.examples(split):
        completion = task.reference_completion(example)
        if completion is None:
            raise ValueError(f"{type(task).__name__} writes no reference completion; it cannot be used for SFT")
        rows.append({"messages": task.student_messages(example), "completion": completion, "plain": not task.chat_template,
                     "where": f"{type(task).__name__} example {example['id']!r}"})
    return rows


def check_sft_strategy(fsdp2: bool) -> None:
    """SFTModule's strategy rule, for its ``setup`` and for ``kdlab estimate`` (:func:`kdlab.study.setups.sft_setup`): refuse
    ``ModelParallelStrategy`` (FSDP2, ``fsdp2`` true) naming ``trainer.strategy`` and what trains SFT. SFTModule has no
    ``configure_model`` to shard its model, and Lightning would refuse the fit in its own words."""
    if fsdp2:
        raise ValueError("trainer.strategy: SFTModule does not shard under ModelParallelStrategy (FSDP2); use one device, ddp or "
                         "fsdp (FSDP1)")


class SFTModule(CheckpointedStage):
    """Fine-tune ``model`` to write each row's completion after its prompt.

    Args:
        model: the model trained.
        dataset: an SFT JSONL file (see module docstring); or use ``tasks``.
        tasks: tasks whose reference completions are the data (their ``train`` split).
        lr: peak learning rate (paper: 5e-5).
        warmup_steps: linear warm-up steps (paper: 10).
        schedule: ``cosine`` (decay to ``min_lr_ratio * lr`` at ``max_steps``) or ``constant``.
        min_lr_ratio: floor of the cosine schedule, in [0, 1].
        batch_size: rows per micro-batch (>= 1); a step's batch is this x ``accumulate_grad_batches`` x processes,
            and its loss the mean over all their completion tokens.
        max_length: prompt + completion tokens; a longer row is an error naming it (its task example id, or its
            JSONL file and line), raised when the fit is set up, before any step.
        lora: train LoRA adapters instead of all weights; checkpoints record their settings, so a stage that starts
            from one (``policy.checkpoint``, ``student.checkpoint``) gets the adapters merged into the weights
            (:func:`~kdlab.models.export.load_stage_weights`), as ``export_dir`` merges them.
        weight_decay, betas, eps: AdamW settings.
        seed: data order: a permutation per epoch drawn from (seed, epoch), rank r of W processes taking positions
            r, r + W, ... of it; a fit resumed from a checkpoint continues it (same batch size and process count).
        export_dir: when training ends, write the (LoRA-merged) model and tokenizer there as a Hugging
            Face folder (how a trained teacher becomes the next stage's ``teacher.path``).
        fused_lm_head: take the loss from the final hidden states and the LM head, a chunk of positions at a
            time, so the ``(B, T, V)`` logits and their gradient never exist (same loss and gradients; what
            ``DistillModule.fused_lm_head`` does for the KL). ``None`` (default): wherever it is valid
            (:func:`~kdlab.objectives.logits.fused_head_unsupported`: no head bias, no soft-capping, not
            FSDP1); ``false``: from the model's logits, still without an fp32 copy of them; ``true`` insists.
    """

    trained_role = "model"
    """How configs name the trained model, for messages."""

    def __init__(
        self,
        model: ModelSpec | str,
        dataset: str | None = None,
        tasks: list[Task] | None = None,
        lr: float = 5e-5,
        warmup_steps: int = 10,
        schedule: str = "cosine",
        min_lr_ratio: float = 0.0,
        batch_size: int = 32,
        max_length: int = 2048,
        lora: LoraSpec | None = None,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        seed: int = 42,
        export_dir: str | None = None,
        fused_lm_head: bool | None = None,
    ) -> None:
        super().__init__()
        remember_arguments(self, inspect.currentframe())  # for the run's config.yaml and logged hyperparameters
        self.export_dir, self.fused_lm_head = export_dir, fused_lm_head
        if (dataset is None) == (not tasks):
            raise ValueError("SFTModule needs exactly one of dataset or tasks")
        check_adamw("SFTModule", lr, betas, eps, weight_decay)
        check_schedule("SFTModule", warmup_steps, schedule, min_lr_ratio)
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
            raise ValueError(f"SFTModule.batch_size must be >= 1, got {batch_size}")
        if isinstance(max_length, bool) or not isinstance(max_length, numbers.Integral) or max_length < 2:
            raise ValueError(f"SFTModule.max_length must be >= 2 (a prompt token and a completion token), got {max_length}")
        self.spec = ModelSpec(model) if isinstance(model, str) else model
        self.tokenizer = load_tokenizer(self.spec, "model")
        self.model = load_causal_lm(self.spec, "model")
        self.token_columns = vocabulary_columns(self.tokenizer, self.model.config, "model")  # len(tokenizer), checked against the head
        self.model.train()
        if lora is not None:
            self.model = apply_lora(self.model, lora)
        self.tasks = torch.nn.ModuleList(tasks or [])
        # a JSONL file is read (and checked) now; tasks, which may download, when training starts
        self._rows = read_pairs(dataset) if dataset is not None else None
        self._encoded: list[tuple[list[int], int]] | None = None
        self._train_sampler = None
        self._step_tokens: tuple[Any, float] | None = None  # (the step's micro-batches, their mean count over ranks)
        self.lr, self.warmup_steps, self.schedule, self.min_lr_ratio = lr, warmup_steps, schedule, min_lr_ratio
        self.batch_size, self.max_length = batch_size, max_length
        self.weight_decay, self.betas, self.eps, self.seed = weight_decay, tuple(betas), eps, seed

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The training rows (a task's are built on first use)."""
        if self._rows is None:
            self._rows = [row for task in self.tasks for row in task_pairs(task)]
        return self._rows

    @property
    def encoded(self) -> list[tuple[list[int], int]]:
        """Every row's :meth:`encode`, encoded once (on first use: ``setup`` of a fit, before any step). Rows longer
        than ``max_length`` are refused together, naming the first by its ``where`` and counting the others."""
        if self._encoded is None:
            encoded = [self.encode(row) for row in self.rows]
            long = [(row.get("where", "?"), len(ids)) for row, (ids, _) in zip(self.rows, encoded) if len(ids) > self.max_length]
            if long:
                more = f" (and {len(long) - 1} more rows are longer)" if len(long) > 1 else ""
                raise ValueError(f"SFTModule.max_length={self.max_length}: {long[0][0]} has {long[0][1]} tokens (prompt, completion "
                                 f"and EOS){more}; raise max_length or shorten the rows")
            self._encoded = encoded
        return self._encoded

    def encode(self, row: dict[str, Any]) -> tuple[list[int], int]:
        """Token ids of prompt + completion + EOS, and the prompt length (``max_length`` is checked by :attr:`encoded`)."""
        tokenizer = self.tokenizer
        if "messages" in row and not row.get("plain"):
            prompt = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        else:
            text = row["prompt"] if row.get("prompt") else "\n\n".join(m["content"] for m in row["messages"]) + "\n"
            prompt_ids = tokenizer(text)["input_ids"]
        completion_ids = tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return prompt_ids + completion_ids, len(prompt_ids)

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """:meth:`pad` of ``rows``, encoded."""
        return self.pad([self.encode(row) for row in rows])

    def pad(self, encoded: list[tuple[list[int], int]]) -> dict[str, torch.Tensor]:
        """A batch of encoded rows (:meth:`encode`), right-padded: ``input_ids`` and ``attention_mask`` ``(B, T)``, and
        ``labels`` ``(B, T)``, the ids with -100 on prompt and padding positions (the loss is on completion tokens only)."""
        ids, attention = right_pad([ids for ids, _ in encoded], self.tokenizer.pad_token_id)
        labels = ids.clone()
        labels[~attention] = -100
        for i, (_, prompt_length) in enumerate(encoded):
            labels[i, :prompt_length] = -100
        return {"input_ids": ids, "attention_mask": attention.long(), "labels": labels}

    def train_dataloader(self) -> DataLoader:
        """This rank's share of the (seed, epoch) order of the encoded rows (:func:`~kdlab.stages.loaders.resumable_loader`:
        the same order on any number of processes, which Lightning does not replace under DDP), resumed after the last
        trained micro-batch of a checkpoint's epoch, each optimiser step's micro-batches drawn together."""
        resume, self._resume_position = self._resume_position, None
        accumulate = int(getattr(self._trainer, "accumulate_grad_batches", 1) or 1) if self._trainer is not None else 1
        # each optimiser step's micro-batches drawn as one group, so each knows its step's tokens (step_tokens)
        loader = resumable_loader(self.encoded, self.batch_size, self.seed, self.data_parallel_layout(), resume, accumulate)
        self._train_sampler = loader.sampler
        return loader

    def on_train_epoch_start(self) -> None:
        if self._train_sampler is not None:
            self._train_sampler.set_epoch(self.current_epoch)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return batch  # a list of encoded rows; padded to tensors on the device in the step

    def trained_model(self) -> torch.nn.Module:
        """``model``: its checkpoints record its LoRA settings (:class:`~kdlab.stages.checkpointing.CheckpointedStage`)."""
        return self.model

    def setup(self, stage: str) -> None:
        check_strategy(self.trainer.strategy)  # a strategy kdlab does not know (DeepSpeed) is refused before any step
        from lightning.pytorch.strategies import ModelParallelStrategy

        check_sft_strategy(isinstance(self.trainer.strategy, ModelParallelStrategy))
        self.attach_run_log()  # metrics.jsonl, at optimiser steps, as every stage's
        if stage == "fit":
            self.encoded  # every row encoded and its length checked now, not when its batch comes

    def on_fit_start(self) -> None:
        """The ``config.yaml`` of a run ``kdlab fit`` did not start, and the run's description for every logger
        (:mod:`kdlab.run_config`), as every kdlab stage gives them."""
        log_dir = run_directory(self.trainer)  # on every rank: Trainer.log_dir is a collective broadcast under DDP
        if self.trainer.is_global_zero:
            describe_run(self, self.trainer, log_dir)

    def uses_fused_head(self) -> bool:
        """Whether the loss reads the final hidden states and the head (``fused_lm_head``) rather than logits: by
        default wherever :func:`~kdlab.objectives.logits.fused_head_unsupported` allows it and the strategy is not
        FSDP1 (which Lightning wraps around this module, so the head's weight is a flat shard after the forward)."""
        if self.fused_lm_head is not None:
            return bool(self.fused_lm_head)
        if self._trainer is not None and isinstance(self.trainer.strategy, FSDPStrategy):
            return False
        return fused_head_unsupported(self.model) is None

    def loss(self, batch: dict[str, torch.Tensor], num_tokens: float | None = None) -> torch.Tensor:
        """Next-token cross-entropy summed over the batch's completion tokens (``labels[:, 1:] != -100``, ``(B, T - 1)``)
        and divided by ``num_tokens`` (``None``: their count, the batch's token mean; training passes
        :meth:`step_tokens`), in fp32, each position's distribution over the tokenizer's ``len(tokenizer)`` tokens (a
        head's padding rows are no token), computed a chunk of positions at a time
        (:func:`~kdlab.objectives.logprobs.token_logprobs`): from ``(B, T - 1, H)`` hidden states and the head with the
        fused head, else from the model's ``(B, T - 1, V)`` logits in their own dtype (never upcast whole)."""
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        labels = batch["labels"][:, 1:]  # (B, T - 1): the token each position predicts
        mask = labels != -100
        read = completion_head_logits if self.uses_fused_head() else completion_logits
        logits = read(self.model, inputs, labels.shape[1], self.token_columns)
        chosen, _ = token_logprobs(logits, labels.clamp(min=0), mask)
        return -(chosen * mask).sum() / (mask.sum().clamp(min=1) if num_tokens is None else num_tokens)

    @staticmethod
    def completion_tokens(encoded: tuple[list[int], int]) -> int:
        """The tokens an encoded row's loss is taken on: the positions after the prompt (each predicted by the one
        before it, so never the first), completion and EOS."""
        ids, prompt_length = encoded
        return len(ids) - max(prompt_length, 1)

    def step_tokens(self, batch: list[tuple[list[int], int]], batch_idx: int) -> float | None:
        """What :meth:`loss` divides this micro-batch's token sum by: the completion tokens of its whole optimiser step
        (every micro-batch of the accumulation window, on every data-parallel rank), averaged over the ranks and
        divided by ``accumulate_grad_batches``.

        Lightning divides each micro-batch's loss by ``accumulate_grad_batches`` and DDP/FSDP average the ranks'
        gradients, so the step's gradient is that of (sum over all its completion tokens) / (their count): the token
        mean of one batch of all its rows. The loader draws a step's micro-batches together
        (:class:`~kdlab.stages.loaders.DecodeGroup`), so the count is known at its first micro-batch, and taken then
        on every rank (one collective per step; a window that an epoch's end or ``limit_train_batches`` cuts short
        counts only the micro-batches it trains). ``None`` for a batch that does not know its step (a loader other
        than :meth:`train_dataloader`'s): its own token mean."""
        group = getattr(batch, "group", None)
        if group is None:
            return None
        if self._step_tokens is None or self._step_tokens[0] is not group:
            trained = group.batches
            limit = self.trainer.num_training_batches
            if limit != float("inf"):
                trained = trained[: max(1, int(limit) - (batch_idx - batch.index))]
            local = torch.tensor(float(sum(self.completion_tokens(row) for micro in trained for row in micro)), device=self.device)
            self._step_tokens = (group, float(self.trainer.strategy.reduce(local, reduce_op="mean")))
        return self._step_tokens[1] / self.trainer.accumulate_grad_batches

    def training_step(self, batch: list[tuple[list[int], int]], batch_idx: int) -> torch.Tensor:
        """The micro-batch's share of the step's token-mean loss (:meth:`step_tokens`); logs ``train/loss``, the
        micro-batch's own mean over its completion tokens, averaged over the ranks (as every stage's ``train/`` values)."""
        tensors = {name: value.to(self.device) for name, value in self.pad(batch).items()}
        num_tokens = self.step_tokens(batch, batch_idx)
        loss = self.loss(tensors, num_tokens)
        own = sum(self.completion_tokens(row) for row in batch)
        self.log("train/loss", loss.detach() * (own if num_tokens is None else num_tokens) / own, prog_bar=True, batch_size=len(batch), sync_dist=True)
        return loss

    def configure_optimizers(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = FiniteAdamW(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)
        total = max(1, int(self.trainer.estimated_stepping_batches)) if self._trainer else 1
        factor = lr_multiplier(self.warmup_steps, total, cosine=self.schedule == "cosine", floor=self.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def save_pretrained(self, directory: str | Path) -> None:
        """Write the (LoRA-merged) model and its tokenizer as a standard Hugging Face folder."""
        export_pretrained(self.model, self.tokenizer, directory)

    def on_train_end(self) -> None:
        if self.export_dir is not None:  # every rank gathers (sharded weights), rank zero writes
            export_pretrained(self.model, self.tokenizer, self.export_dir, write=self.trainer.is_global_zero)
