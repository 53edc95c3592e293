"""``TaskStage``: what every kdlab training stage on a task shares (distillation, RLVR).

A stage trains one model, called ``student`` (the distilled student, or the policy of an RLVR stage
that starts from it), on a :class:`~kdlab.tasks.base.Task`. This base class gives it:

* data: the task's ``train`` split in an order drawn from (seed, epoch), resumable mid-epoch;
  ``val``/``test`` use the first ``val_examples`` held-out examples, each counted once over data-parallel ranks;
* seeded, resumable random streams per step (:meth:`TaskStage.step_seed`);
* evaluation: ``<split>/accuracy`` (mean task score over ``eval_samples`` completions per prompt at
  ``val_temperature``), ``<split>/pass@k`` and a per-example JSONL under ``<log_dir>/samples/``; a fit
  that ``max_steps`` ends before its first ``val_check_interval`` validates after its last step
  (:class:`ValidateLastStep`), so a shortened run keeps its evaluation;
* ``run_info.json`` provenance at fit start; the run log (``metrics.jsonl``) and what every checkpoint carries
  (data and log positions, a LoRA student's settings) as every training stage, SFT's too
  (:class:`~kdlab.stages.checkpointing.CheckpointedStage`);
* on a CUDA device, TF32 for fp32 matmuls from ``setup`` on (``torch.set_float32_matmul_precision("high")``
  unless already set otherwise; ``TaskStage.float32_matmul_precision = None`` keeps torch's setting): before
  any callback's ``on_fit_start``, so a callback's "before" evaluation runs at the precision of its "after";
  the exact KLs' dot products stay full fp32 (:func:`~kdlab.objectives.precision.ieee_fp32`).

Subclasses set ``student``, ``student_tokenizer``, ``token_columns``, ``end_ids`` and ``pad_id`` and
implement ``training_step``. Callbacks of :mod:`kdlab.callbacks` work on any ``TaskStage``.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from kdlab.components import Component
from kdlab.evaluation.metrics import MeanScore, PassAtK
from kdlab.evaluation.scoring import completion_texts, scored
from kdlab.objectives.precision import use_float32_matmul_precision
from kdlab.provenance import write_run_info
from kdlab.run_config import describe_run, remember_arguments
from kdlab.rollouts.decoding import stop_strings_check
from kdlab.runlog import Console, quiet, run_directory, write_samples
from kdlab.stages.checkpointing import CheckpointedStage
from kdlab.stages.loaders import evaluation_loader, resumable_loader
from kdlab.stages.optim import FiniteAdamW
from kdlab.stages.sharding import check_strategy, fsdp1_root, gathered_for_decoding, global_grad_norm, require_gradient_sync, shard_fsdp2, wrap_fsdp1
from kdlab.tasks.base import Example, Task


class ValidateLastStep(pl.Callback):
    """Validation after the last optimiser step of a fit that ``max_steps`` ends before its first
    ``val_check_interval``: ``--trainer.max_steps=20`` with ``val_check_interval: 150`` would otherwise
    end without ``val/accuracy`` or ``samples/``, silently; a line at the start says that it validates at
    the end instead. A run long enough to reach its interval validates where the interval says, as
    before; validation the trainer disables (``limit_val_batches: 0``) stays off. It asks for the stop
    Lightning makes anyway at ``max_steps`` (``trainer.should_stop``), which Lightning validates before."""

    def __init__(self) -> None:
        self.active = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        interval, steps = trainer.val_check_batch, trainer.max_steps  # batches between validations (set by now)
        # the run's training batches: micro-batches under accumulation; a GRPOModule's rollout batches make
        # mini_batches optimiser steps each (the last may take the run past max_steps)
        per_batch = max(1, int(getattr(pl_module, "mini_batches", 1) or 1))
        batches = -(-(steps or 0) * max(1, int(trainer.accumulate_grad_batches or 1)) // per_batch)
        self.active = bool(steps and steps > 0 and interval is not None and interval != float("inf")
                           and interval > batches and trainer.limit_val_batches != 0)
        if self.active and trainer.is_global_zero:
            print(f"[kdlab] validation after the last step ({steps}): val_check_interval ({interval:g} batches) "
                  f"is beyond max_steps={steps} ({batches} batches)", flush=True)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx: int) -> None:
        if self.active and trainer.global_step >= trainer.max_steps:
            trainer.should_stop = True


class TaskStage(CheckpointedStage):
    """Base of :class:`~kdlab.stages.distill.DistillModule` and :class:`~kdlab.stages.grpo.GRPOModule` (see module docstring).

    Args:
        task: prompts, per-model prompting and the verifier.
        batch_size: prompts per micro-batch.
        max_prompt_tokens: longer prompts are an error naming the example.
        max_completion_tokens: generation budget for training rollouts and evaluation.
        val_examples: validation/test use the first N held-out examples (paper: 200).
        val_temperature: evaluation sampling temperature; 0 decodes greedily (paper: 0.5).
        val_batch_size: prompts per evaluation batch.
        eval_samples: completions per evaluation prompt (paper: 10 for pass@k).
        eval_ks: the k of ``<split>/pass@k``, each <= ``eval_samples``.
        seed: seeds data order and every sampling stream.
        stop_strings: a completion (training rollout or evaluation) also ends once it contains one of
            these (e.g. ``"</answer>"``), the stop string kept; the end tokens always end it.
    """

    student: torch.nn.Module
    student_tokenizer: Any
    token_columns: int  # logit columns in use: one per token id of the (shared) tokenizer, not the head's row count
    end_ids: tuple[int, ...]
    pad_id: int

    def __init__(
        self,
        task: Task,
        batch_size: int,
        max_prompt_tokens: int,
        max_completion_tokens: int,
        val_examples: int,
        val_temperature: float,
        val_batch_size: int,
        eval_samples: int,
        eval_ks: tuple[int, ...],
        seed: int,
        stop_strings: list[str] | None = None,
    ) -> None:
        super().__init__()
        remember_arguments(self, inspect.currentframe())  # for the run's config.yaml and logged hyperparameters
        quiet()  # before the models load and the Trainer is made: a notebook's run prints what kdlab fit's does
        for name, value in (
            ("batch_size", batch_size),
            ("max_prompt_tokens", max_prompt_tokens),
            ("max_completion_tokens", max_completion_tokens),
            ("val_examples", val_examples),
            ("val_batch_size", val_batch_size),
        ):
            self.require_positive(name, value)
        if val_temperature < 0:
            raise ValueError(f"{type(self).__name__}.val_temperature must be >= 0, got {val_temperature}")
        if eval_samples < 1 or not eval_ks or min(eval_ks) < 1 or max(eval_ks) > eval_samples:
            raise ValueError(f"{type(self).__name__}.eval_ks must be in [1, eval_samples={eval_samples}], got {list(eval_ks)}")
        self.task = task
        self.batch_size = batch_size
        self.max_prompt_tokens, self.max_completion_tokens = max_prompt_tokens, max_completion_tokens
        self.val_examples, self.val_temperature, self.val_batch_size = val_examples, val_temperature, val_batch_size
        self.eval_samples = eval_samples
        self.pass_at_k = torch.nn.ModuleDict({split: PassAtK(ks=tuple(eval_ks)) for split in ("val", "test")})
        self.mean_score = torch.nn.ModuleDict({split: MeanScore() for split in ("val", "test")})  # <split>/accuracy
        self.seed = seed
        self.stop_strings = [text for text in (stop_strings or []) if text]
        self._eval_records: list[dict[str, Any]] = []
        self._sharded = False
        self._frozen: dict[str, torch.nn.Module] = {}  # a plain dict: not submodules (see hold_frozen)

    # ---- frozen models --------------------------------------------------------------------
    def hold_frozen(self, name: str, model: torch.nn.Module) -> torch.nn.Module:
        """Keep ``model`` (a teacher, a KL reference) frozen, in eval mode, and outside this module's
        tree: it is in no ``state_dict`` (checkpoints, whole or sharded, never carry it: it is reloaded
        from its path), no ``parameters()`` and no DDP bucket, yet it follows the module's device and
        dtype moves (``to``, ``cuda``, precision casts)."""
        model.requires_grad_(False).eval()
        self._frozen[name] = model
        return model

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        for model in getattr(self, "_frozen", {}).values():
            model._apply(fn, recurse)
        return self

    def require_positive(self, name: str, value: float) -> None:
        """Raise ``ValueError`` naming ``<Class>.<name>`` unless ``value > 0``."""
        if not value > 0:
            raise ValueError(f"{type(self).__name__}.{name} must be > 0, got {value}")

    def components(self) -> dict[str, Component]:
        """The swappable parts whose reports are logged after each step."""
        return {"task": self.task}

    def _log_records(self, split: str, batch_size: int) -> None:
        for component in self.components().values():
            for name, value in component.pop_records().items():
                self.log(f"{split}/{name}", value, batch_size=batch_size, sync_dist=True)

    # ---- parallelism ----------------------------------------------------------------------
    def sharded_models(self) -> list[torch.nn.Module]:
        """The models ``fully_shard`` under ``ModelParallelStrategy`` (default: the trained one)."""
        return [self.student]

    def decoding_gathered(self):
        """A block in which every sharded model of the stage (:meth:`sharded_models`, its frozen models) stays
        gathered for the whole decode, FSDP2 and FSDP1 alike (:func:`~kdlab.stages.sharding.gathered_for_decoding`):
        every decode of a stage or a callback runs inside one, so a decoded token all-gathers nothing."""
        return gathered_for_decoding([*self.sharded_models(), *getattr(self, "_frozen", {}).values()])

    def configure_model(self) -> None:
        """Shard :meth:`sharded_models` under an FSDP strategy (:mod:`kdlab.stages.sharding`): FSDP2
        (``ModelParallelStrategy``, over its data-parallel mesh, bf16 gathers with
        ``trainer.precision: bf16-mixed``) or FSDP1 (``strategy: fsdp``, CUDA only, the trained model
        wrapped whole). Other strategies need nothing here."""
        if self._sharded or self._trainer is None:
            return
        from lightning.pytorch.strategies import FSDPStrategy

        if isinstance(self.trainer.strategy, FSDPStrategy):
            wrap_fsdp1(self)
        elif self.device_mesh is not None:
            shard_fsdp2(self.sharded_models(), self.device_mesh["data_parallel"], str(self.trainer.precision))
        else:
            return
        self._sharded = True

    def student_grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the trained model's gradients, before clipping (a collective under FSDP1)."""
        return global_grad_norm(self.student, self.device)

    def clip_student_gradients(self, optimizer: torch.optim.Optimizer, max_norm: float) -> None:
        """Clip the trained model's gradients to global norm ``max_norm``: FSDP1's own ``clip_grad_norm_``
        (Lightning's FSDP1 precision plugin refuses norm clipping), else Lightning's."""
        root = fsdp1_root(self.student)
        if root is not None:
            root.clip_grad_norm_(max_norm)
        else:
            self.clip_gradients(optimizer, gradient_clip_val=max_norm, gradient_clip_algorithm="norm")

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        if gradient_clip_val and fsdp1_root(self.student) is not None and gradient_clip_algorithm in (None, "norm"):
            self.clip_student_gradients(optimizer, float(gradient_clip_val))
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def place_frozen_models(self, device: torch.device) -> None:
        """Move each frozen model whose parameters are not on ``device`` there."""
        for model in self._frozen.values():
            first = next(model.parameters(), None)
            if first is not None and first.device != device:
                model.to(device)

    # ---- non-finite steps -----------------------------------------------------------------
    def set_max_bad_steps(self, max_bad_steps: int) -> None:
        if max_bad_steps < 1:
            raise ValueError(f"{type(self).__name__}.max_bad_steps must be >= 1, got {max_bad_steps}")
        self.max_bad_steps, self._bad_steps = max_bad_steps, 0

    def count_skipped_step(self, optimizer: FiniteAdamW, what: str) -> None:
        """After an optimiser call: log ``train/skipped_steps`` and stop the run, naming the step,
        ``what`` was trained and the last good checkpoint, after ``max_bad_steps`` skipped in a row."""
        self._bad_steps = self._bad_steps + 1 if optimizer.last_skipped else 0
        self.log("train/skipped_steps", float(optimizer.skipped))
        if self._bad_steps >= self.max_bad_steps:
            callback = self.trainer.checkpoint_callback
            last = (callback.last_model_path or callback.best_model_path) if callback else ""
            raise RuntimeError(
                f"step {self.global_step}: {self._bad_steps} consecutive optimiser steps had non-finite gradients "
                f"({what}); no update was applied for them. Last good checkpoint: {last or 'none saved yet'}"
            )

    # ---- data -----------------------------------------------------------------------------
    def trains_on(self, example: Example) -> bool:
        """Whether ``example`` of the train split is used (e.g. it has a teacher completion)."""
        return True

    def _split(self, split: str, limit: int | None = None) -> list[Example]:
        examples = self.task.examples(split)
        if not examples:
            raise ValueError(f"{type(self.task).__name__}: the {split!r} split is empty")
        return examples[:limit] if limit is not None else examples

    def training_examples(self) -> list[Example]:
        """The train split's examples this stage trains on; a ``ValueError`` naming the task and the
        rollout's dataset (when there is one) when that is none of them, e.g. a teacher dataset whose ids
        match no example. ``kdlab fit`` calls it before the trainer starts (no run directory is written,
        no evaluation runs); :meth:`setup` calls it for Python callers."""
        examples = self._split("train")
        kept = [ex for ex in examples if self.trains_on(ex)]
        if not kept:
            dataset = getattr(getattr(self, "rollout", None), "dataset", None)
            source = f" ({type(self.rollout).__name__}.dataset={str(dataset)!r} covers none of its ids, e.g. {examples[0]['id']!r})" if dataset else ""
            raise ValueError(f"{type(self).__name__} can train on no train example of {type(self.task).__name__}{source}")
        return kept

    def configure_callbacks(self) -> list[pl.Callback]:
        """:class:`ValidateLastStep` (a fit shorter than its validation interval evaluates its final weights)
        and, unless the trainer has one (``kdlab fit`` adds it), :class:`~kdlab.runlog.Console`: a notebook's
        ``Trainer.fit`` prints the run directory and ends with the summary ``kdlab fit`` prints."""
        console = [] if any(isinstance(callback, Console) for callback in self.trainer.callbacks) else [Console()]
        return [ValidateLastStep(), *console]

    def setup(self, stage: str) -> None:
        """Attach the run's :class:`~kdlab.runlog.MetricsFile` (every ``self.log`` value and every
        callback number lands in ``metrics.jsonl``), log Lightning's lines at optimiser steps like every
        other number (:func:`~kdlab.runlog.log_at_optimiser_steps`), refuse a strategy kdlab does not train under
        (:func:`~kdlab.stages.sharding.check_strategy`), set the fp32 matmul precision on CUDA
        (:attr:`float32_matmul_precision`) and, for a fit, check the training examples."""
        # Lightning calls every callback's on_fit_start before the module's: set here, the callbacks' first
        # evaluations run at the precision of every later one
        check_strategy(self.trainer.strategy)
        use_float32_matmul_precision(self.trainer.strategy.root_device, self.float32_matmul_precision)
        self.attach_run_log()
        if stage == "fit":
            self.training_examples()

    def train_dataloader(self) -> DataLoader:
        examples = self.training_examples()
        resume, self._resume_position = getattr(self, "_resume_position", None), None
        loader = resumable_loader(examples, self.batch_size, self.seed, self.data_parallel_layout(), resume, self.decode_group())
        self._train_sampler = loader.sampler
        return loader

    def decode_group(self) -> int:
        """Micro-batches whose prompts one batched decode serves (:class:`~kdlab.stages.loaders.DecodeGroup`);
        1 here: each micro-batch alone."""
        return 1

    def on_train_epoch_start(self) -> None:
        # Lightning may wrap the sampler for data parallelism and then set the wrapper's epoch only
        if getattr(self, "_train_sampler", None) is not None:
            self._train_sampler.set_epoch(self.current_epoch)

    def val_dataloader(self) -> DataLoader:
        """The first ``val_examples`` of the ``val`` split, this rank's share (:func:`~kdlab.stages.loaders.evaluation_loader`:
        every example counted once over the ranks, whether or not their number divides it)."""
        return evaluation_loader(self._split("val", self.val_examples), self.val_batch_size, self.data_parallel_layout())

    def test_dataloader(self) -> DataLoader:
        return evaluation_loader(self._split("test", self.val_examples), self.val_batch_size, self.data_parallel_layout())

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return batch  # a list of example dicts; tensors are made on the device in the step

    # ---- random streams and collectives (data_parallel_layout: CheckpointedStage's) ---------
    def step_seed(self, split: str, batch_idx: int) -> int:
        """A 63-bit seed for one step's random streams, from (seed, split, data-parallel rank, epoch, batch
        index): reproducible, resumable, independent across data-parallel replicas and shared by the
        tensor-parallel ranks of one replica."""
        key = f"{self.seed}/{split}/{self.data_parallel_layout()['rank']}/{self.current_epoch}/{batch_idx}"
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1

    def _generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def all_done_hook(self):
        """A collective "have all ranks finished decoding" decision when models are sharded (FSDP1/FSDP2:
        a forward may be a collective, so every rank must take as many decoding steps); ``None`` otherwise
        (one process, or DDP with whole models: each rank stops when its own rows end, with no per-token
        all-reduce)."""
        trainer = self._trainer
        if trainer is None or trainer.world_size == 1 or not self._sharded:
            return None
        return lambda done: trainer.strategy.reduce_boolean_decision(done, all=True)

    # ---- evaluation -----------------------------------------------------------------------
    def eval_completions(self, examples: list[Example], temperature: float, seed: int) -> list[str]:
        """Student completions (text) for ``examples``; ``temperature`` 0 decodes greedily (sharded models kept
        gathered for the decode, :meth:`decoding_gathered`)."""
        with self.decoding_gathered():
            return completion_texts(
                self.student,
                self.student_tokenizer,
                self.task,
                examples,
                temperature=temperature,
                max_new_tokens=self.max_completion_tokens,
                max_prompt_tokens=self.max_prompt_tokens,
                batch_size=len(examples),
                generator=self._generator(seed),
                token_columns=self.token_columns,
                all_done=self.all_done_hook(),
                end_ids=self.end_ids,
                stop_strings=self.stop_strings,
            )

    def stop_check(self):
        """The rollout engine's stop-string check for this stage (``None`` without stop strings)."""
        return stop_strings_check(self.student_tokenizer, self.stop_strings)

    def _evaluate(self, split: str, batch: list[Example], batch_idx: int) -> None:
        """Decode ``eval_samples`` completions of every example of ``batch`` and score the counted ones: an
        :class:`~kdlab.stages.loaders.EvalBatch`'s padding repeat is decoded (every rank decodes as many batches) but
        left out of ``<split>/accuracy``, pass@k and ``samples/``. Accuracy and pass@k are torchmetrics metrics, summed
        (score sums, counts) over the ranks at the evaluation's end (:meth:`_finish_evaluation`), so ranks that counted
        different numbers of examples weigh each example the same."""
        n = self.eval_samples
        repeated = [example for example in batch for _ in range(n)]
        completions = self.eval_completions(repeated, self.val_temperature, self.step_seed(split, batch_idx))
        counted = getattr(batch, "counted", None) or [True] * len(batch)
        kept = [(example, text) for row, (example, text) in enumerate(zip(repeated, completions)) if counted[row // n]]
        scores = [scored(self.task, example, text) for example, text in kept]
        examples = len(kept) // n
        self.mean_score[split].update(scores)
        self.pass_at_k[split].update(torch.tensor(scores, dtype=torch.float64).reshape(examples, n) >= 1.0)
        self._log_records(split, examples)
        self._eval_records.extend(
            {"id": ex["id"], "prompt": self.task.user_prompt(ex), "completion": text, "score": score}
            for (ex, text), score in zip(kept, scores)
        )

    def _finish_evaluation(self, split: str) -> None:
        # the metrics are already reduced across ranks (their sums and counts summed)
        self.log(f"{split}/accuracy", self.mean_score[split].compute().float(), prog_bar=split == "val")
        for k, value in self.pass_at_k[split].compute().items():
            self.log(f"{split}/pass@{k}", value.float())
        self.mean_score[split].reset()
        self.pass_at_k[split].reset()
        self._write_records(split)

    def validation_step(self, batch: list[Example], batch_idx: int) -> None:
        self._evaluate("val", batch, batch_idx)

    def test_step(self, batch: list[Example], batch_idx: int) -> None:
        self._evaluate("test", batch, batch_idx)

    def on_validation_epoch_end(self) -> None:
        self._finish_evaluation("val")

    def on_test_epoch_end(self) -> None:
        self._finish_evaluation("test")

    def _write_records(self, split: str) -> None:
        """This evaluation's per-example results (prompt, completion, score) to the run's ``samples/``
        (:func:`~kdlab.runlog.write_samples`); none during the sanity check."""
        records, self._eval_records = self._eval_records, []
        if self._trainer is not None and not self._trainer.sanity_checking:
            write_samples(self._trainer, split, records)

    float32_matmul_precision: str | None = "high"
    """What :meth:`setup` sets ``torch.set_float32_matmul_precision`` to on a CUDA device ("high": TF32
    for fp32 matmuls) when it is still torch's default ("highest"); ``None`` leaves torch's setting alone.
    A precision the user set before fit ("high", "medium") is kept."""

    def on_fit_start(self) -> None:
        """Write ``run_info.json``, the ``config.yaml`` of a run ``kdlab fit`` did not start, and give every
        logger the run's description as hyperparameters (:mod:`kdlab.run_config`)."""
        log_dir = run_directory(self.trainer)  # on every rank: it is a collective call
        if self.trainer.is_global_zero:
            write_run_info(log_dir)
            describe_run(self, self.trainer, log_dir)

    # ---- per batch: the log step (CheckpointedStage's), FSDP2's gradient sync ---------------
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)  # the log step (CheckpointedStage)
        if self.automatic_optimization:  # FSDP2 reduces gradients on a step's last micro-batch only
            require_gradient_sync(self.sharded_models(), not self.trainer.fit_loop.epoch_loop._should_accumulate())

    trained_role = "student"
    """How configs name the trained model (``student``, or ``policy`` for RLVR), for error messages."""

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a checkpoint's trained model; one of a different model (other architecture or size)
        fails with a message naming ``<role>.path`` before any training step runs."""
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        except RuntimeError as error:
            path = getattr(getattr(self, "student_spec", None), "path", "?")
            raise RuntimeError(f"the checkpoint does not fit this {self.trained_role} ({self.trained_role}.path={path!r}): {str(error)[:500]}") from error
