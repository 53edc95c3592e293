"""What kdlab's callbacks share: a schedule (every ``every_n_steps`` optimiser steps, and at fit start
and end), and sampling from the student (or a teacher) through the task's prompts for the evaluating
callbacks.

They work on any module that has ``student`` and ``student_tokenizer`` attributes
(:class:`~kdlab.stages.DistillModule`, :class:`~kdlab.stages.GRPOModule`). A callback that cannot
measure on the module stops ``fit`` at setup, before any work, naming the setting."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import lightning.pytorch as pl
import torch

from kdlab.evaluation.scoring import completion_texts
from kdlab.rollouts.decoding import PROMPT_LIMIT
from kdlab.run_config import remember_arguments
from kdlab.tasks.base import SPLITS, Example, Task


def require_teacher(pl_module: pl.LightningModule, owner: str, what: str, needs: frozenset[str] = frozenset()) -> None:
    """Stop fit at setup, naming ``owner``, unless ``pl_module`` is a DistillModule whose teacher source offers
    ``needs`` (capability names of :mod:`kdlab.teachers.base`): ``<owner> <what> and needs a DistillModule, got ...`` /
    ``<owner> needs <capability> ...``."""
    from kdlab.teachers.base import CAPABILITIES

    source = getattr(pl_module, "teacher_source", None)
    if source is None:
        raise ValueError(f"{owner} {what} and needs a DistillModule, got {type(pl_module).__name__}")
    missing = sorted(needs - source.offers(source.run))
    if missing:
        raise ValueError(f"{owner} needs {'; '.join(CAPABILITIES[name] for name in missing)}, which DistillModule.teacher "
                         f"({type(source).__name__}) does not offer")


def module_writes_teacher_texts(pl_module: pl.LightningModule) -> bool:
    """Whether the module's teacher source writes completions (the evaluating callbacks' teacher samples)."""
    from kdlab.teachers.base import WRITES

    source = getattr(pl_module, "teacher_source", None)
    return source is not None and WRITES in source.offers(source.run)


def resume_path(trainer: pl.Trainer | None) -> str | None:
    """The checkpoint the running fit resumes from, or ``None`` for a fresh fit; right from ``setup`` on under every
    strategy. ``trainer.ckpt_path`` is set only when Lightning reads the checkpoint, which strategies that restore after
    setup (``restore_checkpoint_after_setup``: FSDP1's ``FSDPStrategy``, FSDP2's ``ModelParallelStrategy``) do after
    ``on_fit_start``; until then the path is the ``ckpt_path`` Lightning's ``Trainer._run`` was called with (read from
    its frame on the call stack, the one place it is kept)."""
    if trainer is None:
        return None
    if getattr(trainer, "ckpt_path", None):
        return str(trainer.ckpt_path)
    if not getattr(getattr(trainer, "strategy", None), "restore_checkpoint_after_setup", False):
        return None
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code is pl.Trainer._run.__code__ and frame.f_locals.get("self") is trainer:
            path = frame.f_locals.get("ckpt_path")
            return str(path) if path else None
        frame = frame.f_back
    return None


def _due(every_n_steps: int | None, step_before: int, trainer: pl.Trainer) -> bool:
    """Whether the batch that took the run from ``step_before`` to ``trainer.global_step`` optimiser steps crossed
    a multiple of ``every_n_steps``: a batch may take several (a GRPOModule's ``mini_batches``), so a step count that
    never lands on the multiple (2, 4, ... with every 25) still measures once in each period."""
    return bool(every_n_steps) and trainer.global_step // every_n_steps > step_before // every_n_steps


class PeriodicCallback(pl.Callback):
    """Runs :meth:`measure` every ``every_n_steps`` optimiser steps (after the batch whose steps reach or pass each
    multiple: the step itself, or the first after it when a batch takes several) and at the end of fit."""

    def __init__(self, every_n_steps: int | None = None) -> None:
        remember_arguments(self, inspect.currentframe())  # named with its settings in a run's config.yaml and hyperparameters
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"{type(self).__name__}.every_n_steps must be >= 1 or null, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self._last_step = -1
        self._step_before = 0  # global_step when the current training batch started

    def measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        raise NotImplementedError

    def _measure_once(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step != self._last_step:
            self._last_step = trainer.global_step
            self.measure(trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step_before = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # after the last micro-batch of an accumulation the step counter has moved; measure once per step
        if _due(self.every_n_steps, self._step_before, trainer):
            self._measure_once(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self._measure_once(trainer, pl_module)


# ---- evaluation callbacks ----------------------------------------------------------------------
def task_name(task: Task) -> str:
    return getattr(task, "variant", None) or type(task).__name__.lower()


class TaskPrompts:
    """The prompts an evaluating callback samples: the first ``examples`` rows of ``task``'s ``split``, in the task's
    fixed order (fewer when the split is shorter). A plain task in ``StyleTransfer.tasks`` reads as
    ``TaskPrompts(task)``: the first of its ``val`` rows, as many as the callback's ``examples``.

    Args:
        task: the task whose prompts are sampled.
        split: ``train``, ``val`` or ``test``.
        examples: how many rows; ``None``: the callback's ``examples``.
    """

    def __init__(self, task: Task, split: str = "val", examples: int | None = None) -> None:
        remember_arguments(self, inspect.currentframe())  # named with its settings in a run's config.yaml
        if split not in SPLITS:
            raise ValueError(f"TaskPrompts.split must be one of {SPLITS}, got {split!r}")
        if examples is not None and examples < 1:
            raise ValueError(f"TaskPrompts.examples must be >= 1 or null, got {examples}")
        self.task, self.split, self.examples = task, split, examples

    def rows(self, default_examples: int) -> list[Example]:
        """The first ``examples`` rows of the split (``default_examples`` when ``examples`` is ``None``)."""
        return self.task.examples(self.split)[: self.examples or default_examples]


class EvaluationCallback(PeriodicCallback):
    """Shared settings of callbacks that sample from the student.

    ``before_cache``: a folder where the scores before training (``OODForgetting`` on the tiny back end,
    ``Coverage``) are kept and reused by every later run that starts from the same student weights with the same
    evaluation (:meth:`before_scores`); every run of a grid then measures "before" once instead of once per run.
    """

    def __init__(
        self,
        examples: int = 200,
        temperature: float = 0.0,
        max_new_tokens: int = 256,
        batch_size: int = 32,
        every_n_steps: int | None = None,
        seed: int = 0,
        before_cache: str | None = None,
    ) -> None:
        super().__init__(every_n_steps)
        if examples < 1:
            raise ValueError(f"{type(self).__name__}.examples must be >= 1, got {examples}")
        if temperature < 0:
            raise ValueError(f"{type(self).__name__}.temperature must be >= 0, got {temperature}")
        for name, value in (("max_new_tokens", max_new_tokens), ("batch_size", batch_size)):
            if value < 1:  # else every completion is empty (scored 0) or the evaluation fails after training
                raise ValueError(f"{type(self).__name__}.{name} must be >= 1, got {value}")
        self.examples, self.temperature = examples, temperature
        self.max_new_tokens, self.batch_size, self.seed = max_new_tokens, batch_size, seed
        self.before_cache = before_cache

    def before_scores(self, trainer, pl_module, tasks: list[Task], examples: list[list[dict]], measure) -> dict[str, float]:
        """``measure()``, the scores before training; with ``before_cache`` (a folder) read from it when a run has
        already measured them on the same student weights with the same settings, tasks and examples, tokenizer,
        precision, device and kdlab source (:func:`kdlab.evaluation.before_cache.evaluation_key`), and written to it
        otherwise. One process only: under several the key would need every rank's shard of the weights."""
        if self.before_cache is None:
            return measure()
        from kdlab.evaluation.before_cache import (
            BeforeCache,
            evaluation_key,
            weights_digest,
        )

        if trainer is not None and trainer.world_size > 1:
            raise ValueError(f"{type(self).__name__}.before_cache works on one process; this run has {trainer.world_size}")
        cache = BeforeCache(self.before_cache)
        weights = weights_digest(pl_module.student)
        precision = getattr(trainer, "precision", None) if trainer is not None else None
        key = evaluation_key(self, tasks, examples, pl_module.student_tokenizer, (1, 0), str(precision), module_decoding(pl_module),
                             pl_module.device)
        scores = cache.get(weights, key)
        if scores is None:
            scores = measure()
            cache.put(weights, key, scores, callback=type(self).__name__)
        return scores

    def sample(self, pl_module, task: Task, examples, role: str = "student", repeat: int = 1, model: Any = None) -> list[str]:
        """Completions of ``examples`` (each ``repeat`` times) prompted as ``role``, from the module's
        student or teacher, or from ``model = (network, tokenizer)`` (its own vocabulary) when given.

        Decoded as the module's validation decodes: under the trainer's precision (Lightning wraps its steps in
        it, not callback hooks: ``bf16-mixed`` decodes in bf16 autocast here too), and the module's student ending
        its completions at the module's end tokens and stop strings, its prompts held to ``max_prompt_tokens``; so a
        callback's pass@1 and ``val/accuracy`` on the same prompts and temperature measure one thing."""
        gathered = pl_module.decoding_gathered() if hasattr(pl_module, "decoding_gathered") else contextlib.nullcontext()
        trainer = getattr(pl_module, "_trainer", None)
        precision = trainer.precision_plugin.val_step_context() if trainer is not None else contextlib.nullcontext()
        with gathered, precision:  # sharded models stay gathered for the whole decode
            return self._sample(pl_module, task, examples, role, repeat, model)

    def _sample(self, pl_module, task: Task, examples, role: str, repeat: int, model: Any) -> list[str]:
        generator = torch.Generator(device=pl_module.device).manual_seed(self.seed)
        repeated = [ex for ex in examples for _ in range(repeat)]
        settings = dict(temperature=self.temperature, max_new_tokens=self.max_new_tokens, batch_size=self.batch_size, generator=generator,
                        all_done=pl_module.all_done_hook() if hasattr(pl_module, "all_done_hook") else None)
        if model is None and role == "teacher":  # whatever the run's teacher source is writes them
            return pl_module.teacher_source.texts(task, repeated, pl_module.device, **settings)
        if model is not None:
            (network, tokenizer), token_columns = model, None
        else:
            network, tokenizer, token_columns = pl_module.student, pl_module.student_tokenizer, getattr(pl_module, "token_columns", None)
            settings.update(module_decoding(pl_module))
        return completion_texts(network, tokenizer, task, repeated, role=role, token_columns=token_columns, device=pl_module.device, **settings)


def module_decoding(pl_module: pl.LightningModule) -> dict[str, Any]:
    """How the module's validation ends its student's completions, for a callback's decode of the same student: its end
    tokens and stop strings (those it has), and a prompt limit no smaller than the decoder's default (a callback task's
    longer prompts are not refused where they were; a prompt the module's limit refuses would fail its validation too)."""
    found = {key: getattr(pl_module, key) for key in ("end_ids", "stop_strings") if getattr(pl_module, key, None)}
    limit = getattr(pl_module, "max_prompt_tokens", None)
    if limit:
        found["max_prompt_tokens"] = max(int(limit), PROMPT_LIMIT)
    return found


def module_teacher(pl_module: pl.LightningModule) -> torch.nn.Module | None:
    """The module's in-process teacher model, or ``None`` (a GRPOModule; a DistillModule whose teacher is a cache, a
    server or several teachers)."""
    try:
        return getattr(pl_module, "teacher", None)
    except RuntimeError:  # DistillModule says so when its source has no model
        return None
