"""Callbacks that evaluate the student on prompts of other tasks or styles: ``OODForgetting`` (earlier
skills), ``StyleTransfer`` (the teacher's Spanish), ``Coverage`` (pass@k on a task). Numbers are logged
through :func:`kdlab.runlog.log_metrics`.

They work on any module that has ``student`` and ``student_tokenizer`` attributes
(:class:`~kdlab.stages.distill.DistillModule`, :class:`~kdlab.stages.grpo.GRPOModule`). :class:`StyleTransfer`'s teacher
reference uses the module's ``teacher`` and ``teacher_tokenizer`` or a teacher given to the callback;
:class:`RolloutSensitivity` needs a :class:`~kdlab.stages.distill.DistillModule` with its teacher model. A
callback that cannot measure on the module stops ``fit`` at setup, before any work, naming the setting.

Under several processes: ``OODForgetting``'s lm-eval suite runs once, on global rank 0, over the whole
student (gathered from its shards under FSDP1/FSDP2), and every rank logs the scores rank 0 broadcasts;
``Coverage`` splits its prompts over the data-parallel replicas and pools the per-prompt counts.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kdlab.callbacks.periodic import EvaluationCallback, TaskPrompts, module_writes_teacher_texts, resume_path, task_name
from kdlab.evaluation.lm_eval_suite import (
    LMEvalTask,
    evaluate_suite,
    import_lm_eval,
    resolve_suite,
    validate_suite,
    whole_model,
)
from kdlab.evaluation.metrics import pass_at_k, require_language_detector, spanish_share
from kdlab.evaluation.scoring import accuracy, scored
from kdlab.models.loading import ModelSpec
from kdlab.runlog import log_metrics
from kdlab.stages.loaders import EvalShard
from kdlab.tasks.base import Task

LM_EVAL_WAIT = datetime.timedelta(hours=24)
"""How long the other ranks wait for rank 0's lm-eval suite (a gloo group of its own, so the training
process group's timeout, 30 minutes by default, does not apply to the wait)."""


def distributed(trainer) -> bool:
    """Whether ``trainer`` runs several processes in an initialised process group."""
    return trainer is not None and trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()


def replica_layout(trainer, pl_module) -> tuple[int, int]:
    """``(data-parallel replicas, this process's replica)``: the ranks of one tensor-parallel group are one
    replica (:meth:`~kdlab.stages.checkpointing.CheckpointedStage.data_parallel_layout`)."""
    if hasattr(pl_module, "data_parallel_layout") and pl_module._trainer is not None:
        layout = pl_module.data_parallel_layout()
    else:
        layout = (getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer is not None else None) or {}
    return int(layout.get("num_replicas", 1)), int(layout.get("rank", 0))


class OODForgetting(EvaluationCallback):
    """Scores on earlier skills before training and after it: ``ood/<task>``, ``ood/mean``,
    ``ood/<task>_before``, ``ood/mean_before`` and ``ood/mean_delta`` (after - before, in points).

    Two back ends; give exactly one of ``tasks`` and ``lm_eval_tasks``:

    * the tiny world: kdlab tasks, scored by sampling from the student and verifying;
    * real models: lm-evaluation-harness tasks run on the student in memory (no reload, no copy of the
      weights), see :mod:`kdlab.evaluation.lm_eval_suite`; needs ``pip install 'kdlab[eval]'``. Task names are
      checked against lm-eval's index when the callback is built.

    The mean is unweighted over the suite's entries. Each tiny-back-end task's scores are named by its entry of
    ``names``, else by its ``variant`` or lower-cased class name (:func:`~kdlab.callbacks.periodic.task_name`); two
    tasks of one name (``Addition(max_digits=1)`` and ``Addition(max_digits=4)``) are refused at construction,
    naming both, until ``names`` tells them apart (one score would have replaced the other in the mean).

    Under several processes (DDP, FSDP1, FSDP2) the lm-eval suite runs on global rank 0 alone, over a
    whole model: the student itself when it is not sharded, else a plain copy built from its gathered
    full weights (:func:`~kdlab.evaluation.lm_eval_suite.whole_model`; one more copy of the student on
    rank 0 while the suite runs). The other ranks wait (up to :data:`LM_EVAL_WAIT`) and log the scores
    rank 0 broadcasts, so every rank logs the same numbers. The tiny back end samples on every rank.

    Args:
        tasks: tiny back end: the suite of earlier capabilities (each task's ``val`` split; first ``examples``).
        lm_eval_tasks: real back end: ``paper`` for the paper's seven tasks (MMLU-Pro 14 x 200,
            TruthfulQA-MC1 200, IFEval 200 strict prompt-level, HumanEval-Instruct 164 pass@1,
            EQ-Bench 171, BBQ 200, ToxiGen 200), a list of names from
            :data:`~kdlab.evaluation.lm_eval_suite.PAPER_SUITE`, or a mapping name -> ``{task, limit, metric,
            scale, executes_code}`` for any lm-eval task.
        lm_eval_include_path: a folder of extra lm-eval task YAMLs (local tasks over local data).
        lm_eval_batch_size: lm-eval's batch size.
        lm_eval_allow_code_execution: let HumanEval run the student's code (sets ``HF_ALLOW_CODE_EVAL=1``
            and lm-eval's ``confirm_run_unsafe_code``); required when the suite includes it.
        lm_eval_apply_chat_template: render lm-eval prompts with the student's chat template.
        examples, temperature, max_new_tokens, batch_size, seed: tiny back end sampling settings
            (greedy by default); lm-eval tasks carry their own.
        every_n_steps: also measure every N optimiser steps; the end of fit is always measured.
        names: tiny back end: one distinct name per entry of ``tasks``, in its order (``ood/<name>``); default: each
            task's variant or lower-cased class name.
    """

    def __init__(
        self,
        tasks: list[Task] | None = None,
        lm_eval_tasks: str | list[str] | dict[str, LMEvalTask] | None = None,
        lm_eval_include_path: str | None = None,
        lm_eval_batch_size: int = 8,
        lm_eval_allow_code_execution: bool = False,
        lm_eval_apply_chat_template: bool = False,
        names: list[str] | None = None,
        **settings: Any,
    ) -> None:
        super().__init__(**settings)
        self.before: dict[str, float] | None = None
        self.tasks = list(tasks or [])
        self.names: list[str] | None = None
        self.lm_eval_tasks: dict[str, LMEvalTask] | None = None
        if tasks is not None and lm_eval_tasks is not None:
            raise ValueError("OODForgetting: give tasks (tiny back end) or lm_eval_tasks (lm-evaluation-harness), not both")
        if lm_eval_tasks is None:
            if lm_eval_include_path is not None:
                raise ValueError("OODForgetting.lm_eval_include_path is set but lm_eval_tasks is not")
            if not self.tasks:
                raise ValueError("OODForgetting.tasks (or lm_eval_tasks) must name at least one task")
            self.names = task_names(self.tasks, names)
            return
        if names is not None:
            raise ValueError("OODForgetting.names names the tiny back end's tasks; lm_eval_tasks are named by their own keys")
        # LightningCLI passes every setting, so only a value other than the default is a mistake
        defaults = inspect.signature(EvaluationCallback.__init__).parameters
        tiny_only = sorted(name for name, value in settings.items() if name != "every_n_steps" and value != defaults[name].default)
        if tiny_only:
            raise ValueError(f"OODForgetting: {tiny_only} apply to the tiny back end only; lm-eval tasks carry their own settings")
        if lm_eval_batch_size < 1:
            raise ValueError(f"OODForgetting.lm_eval_batch_size must be >= 1, got {lm_eval_batch_size}")
        if lm_eval_include_path is not None and not Path(lm_eval_include_path).is_dir():
            raise ValueError(f"OODForgetting.lm_eval_include_path must be a folder of lm-eval task YAMLs, got {lm_eval_include_path!r}")
        setting = "OODForgetting.lm_eval_tasks"
        import_lm_eval(setting)  # fails now, naming the extra, if lm-eval is not installed
        self.lm_eval_tasks = resolve_suite(lm_eval_tasks, setting)
        validate_suite(self.lm_eval_tasks, lm_eval_include_path, lm_eval_allow_code_execution, setting)
        self.lm_eval_include_path, self.lm_eval_batch_size = lm_eval_include_path, lm_eval_batch_size
        self.lm_eval_allow_code_execution = lm_eval_allow_code_execution
        self.lm_eval_apply_chat_template = lm_eval_apply_chat_template

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._wait_group = None
        if stage == "fit" and self.lm_eval_tasks is not None and distributed(trainer):
            # every rank builds the group (a collective); the others wait on it for rank 0's suite
            self._wait_group = torch.distributed.new_group(backend="gloo", timeout=LM_EVAL_WAIT)

    def run_suite(self, model, tokenizer) -> dict[str, float]:
        """The lm-eval suite on ``model`` in this process alone."""
        return evaluate_suite(
            model,
            tokenizer,
            self.lm_eval_tasks,
            include_path=self.lm_eval_include_path,
            batch_size=self.lm_eval_batch_size,
            allow_code_execution=self.lm_eval_allow_code_execution,
            apply_chat_template=self.lm_eval_apply_chat_template,
        )

    def lm_eval_scores(self, pl_module) -> dict[str, float]:
        """The suite's scores, on every rank; under several processes measured on global rank 0 over the
        whole student and broadcast (a failure there is raised on every rank)."""
        trainer = pl_module._trainer
        if not distributed(trainer):
            return self.run_suite(pl_module.student, pl_module.student_tokenizer)
        first = trainer.is_global_zero
        scores, failure = None, None
        try:
            with whole_model(pl_module.student, pl_module.device, keep=first) as model:  # a collective when sharded
                if first:
                    scores = self.run_suite(model, pl_module.student_tokenizer)
                model = None  # a gathered copy is freed on leaving the block
        except Exception as error:  # said to the other ranks before raising, so none waits for nothing
            failure = error
        message = [scores, None if failure is None else f"{type(failure).__name__}: {failure}"]
        torch.distributed.broadcast_object_list(message, src=0, group=getattr(self, "_wait_group", None))
        if failure is not None:
            raise failure
        if message[1] is not None:
            raise RuntimeError(f"OODForgetting: the lm-eval suite failed on global rank 0: {message[1]}")
        return message[0]

    def scores(self, pl_module) -> dict[str, float]:
        if self.lm_eval_tasks is not None:
            return self.lm_eval_scores(pl_module)
        result = {}
        for name, task in zip(self.names, self.tasks):
            examples = task.examples("val")[: self.examples]
            result[name] = 100.0 * accuracy(task, examples, self.sample(pl_module, task, examples))
        return result

    def on_fit_start(self, trainer, pl_module) -> None:
        # a resumed run keeps the scores measured at the real start: its state_dict restores them, before this hook
        # on most strategies, after it under FSDP1 and FSDP2 (restore_checkpoint_after_setup: resume_path says so)
        if self.before is None and trainer.global_step == 0 and not resume_path(trainer):
            chosen = [task.examples("val")[: self.examples] for task in self.tasks]
            self.before = self.before_scores(trainer, pl_module, self.tasks, chosen, lambda: self.scores(pl_module))
            metrics = {f"ood/{name}_before": value for name, value in self.before.items()}
            metrics["ood/mean_before"] = sum(self.before.values()) / len(self.before)
            log_metrics(trainer, metrics)

    def measure(self, trainer, pl_module) -> None:
        after = self.scores(pl_module)
        metrics = {f"ood/{name}": value for name, value in after.items()}
        metrics["ood/mean"] = sum(after.values()) / len(after)
        if self.before:  # none when a resumed checkpoint holds no OODForgetting state (the callback added on resume)
            metrics["ood/mean_delta"] = metrics["ood/mean"] - sum(self.before.values()) / len(self.before)
        log_metrics(trainer, metrics)

    def state_dict(self) -> dict[str, Any]:
        return {"before": self.before}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.before = state_dict.get("before")


def task_names(tasks: list[Task], names: list[str] | None) -> list[str]:
    """``OODForgetting``'s name of each of ``tasks`` (``names``, else :func:`~kdlab.callbacks.periodic.task_name`), all
    distinct: raises ``ValueError`` naming the tasks that share one."""
    if names is not None:
        names = [str(name) for name in names]
        if len(names) != len(tasks):
            raise ValueError(f"OODForgetting.names must give one name per task: {len(names)} names for {len(tasks)} tasks")
    chosen = names if names is not None else [task_name(task) for task in tasks]
    for name in dict.fromkeys(chosen):
        positions = [i for i, other in enumerate(chosen) if other == name]
        if len(positions) > 1:
            which = ", ".join(f"tasks[{i}] ({type(tasks[i]).__name__})" for i in positions)
            if names is not None:
                raise ValueError(f"OODForgetting.names: {which} are all named {name!r}; give each task its own name")
            raise ValueError(f"OODForgetting.tasks: {which} are all named {name!r}, so one's score would replace the other's; "
                             "give OODForgetting.names, one distinct name per task (e.g. names: [addition_1digit, addition_4digit])")
    return chosen


class StyleTransfer(EvaluationCallback):
    """``style/spanish_share``: share of student responses that are primarily Spanish
    (:func:`~kdlab.evaluation.metrics.spanish_share`: py3langid after removing answers, maths, tags, numbers and code;
    a response with too little language left counts as not Spanish), on the student's own prompts.

    The teacher's share on its own prompts (which may carry the style instruction) is logged once at
    the start of fit as ``style/teacher_spanish_share`` for reference. The teacher is ``teacher`` when
    given, else the module's own. A module without a teacher model (a :class:`~kdlab.stages.grpo.GRPOModule`, a
    :class:`~kdlab.stages.distill.DistillModule` with ``teacher: null`` reading a teacher cache) needs
    ``teacher``; without it ``fit`` stops at setup with an error naming ``StyleTransfer.teacher``.

    Args:
        tasks: prompt sources, each a task (its ``val`` split, the first ``examples``) or a
            :class:`~kdlab.callbacks.periodic.TaskPrompts` naming its split and count (the paper's 1,000 responses: 200
            each of Science train and test, MedReason test, GSM8K test, Countdown-3 test).
        temperature: sampling temperature (paper's style run: 1.0).
        teacher: the reference teacher (a model path, ``kdlab://...``, or a
            :class:`~kdlab.models.loading.ModelSpec`). Its tokenizer is read at setup; its weights are loaded at
            the start of fit onto the module's device for the one measurement, then released.
        at_start: measure at the start of fit (the teacher's share and the student's before training; not when the
            fit resumes from a checkpoint, whose first run logged them at step 0); False
            measures the student only at the end (and every ``every_n_steps``), for a grid whose runs all
            start from the same student and teacher, measured once elsewhere.
    """

    def __init__(self, tasks: list[Task | TaskPrompts], temperature: float = 1.0, teacher: ModelSpec | str | None = None, at_start: bool = True,
                 **settings: Any) -> None:

        super().__init__(temperature=temperature, **settings)
        if not tasks:
            raise ValueError("StyleTransfer.tasks must name at least one task")
        require_language_detector()  # fails now, naming the extra, if the detector is not installed
        self.prompts = [entry if isinstance(entry, TaskPrompts) else TaskPrompts(entry) for entry in tasks]
        self.teacher = ModelSpec(teacher) if isinstance(teacher, str) else teacher
        self.at_start = at_start
        self._teacher_tokenizer: Any = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        if self.teacher is not None:
            from kdlab.models.loading import load_tokenizer

            self._teacher_tokenizer = load_tokenizer(self.teacher, "StyleTransfer.teacher")
        elif not module_writes_teacher_texts(pl_module):
            raise ValueError(
                f"StyleTransfer.teacher is required on a {type(pl_module).__name__} whose teacher writes no completions: "
                "style/teacher_spanish_share needs a teacher to sample from (give StyleTransfer.teacher a model path)"
            )

    def share(self, pl_module, role: str, model: Any = None) -> float:
        texts = []
        for prompts in self.prompts:
            texts += self.sample(pl_module, prompts.task, prompts.rows(self.examples), role=role, model=model)
        return spanish_share(texts)

    def teacher_share(self, pl_module) -> float:
        if self.teacher is None:
            return self.share(pl_module, "teacher")
        from kdlab.models.loading import load_causal_lm

        network = load_causal_lm(self.teacher, "StyleTransfer.teacher").to(pl_module.device).eval().requires_grad_(False)
        try:
            return self.share(pl_module, "teacher", model=(network, self._teacher_tokenizer))
        finally:
            del network  # held for this one measurement only

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.at_start and trainer.global_step == 0 and not resume_path(trainer):  # a resumed run's "before" was logged by the first run
            log_metrics(trainer, {"style/teacher_spanish_share": self.teacher_share(pl_module), "style/spanish_share": self.share(pl_module, "student")})

    def measure(self, trainer, pl_module) -> None:
        log_metrics(trainer, {"style/spanish_share": self.share(pl_module, "student")})


class Coverage(EvaluationCallback):
    """pass@k on a task (the target task or a harder variant such as Countdown-4E):
    ``coverage/<name>/pass@<k>`` from ``samples`` draws per prompt with the unbiased estimator.

    Args:
        task: the task (``val`` split, first ``examples``).
        ks: the k values, each <= ``samples``.
        samples: draws per prompt (paper: 10).
        temperature: sampling temperature (paper: 0.5).
        name: metric name (default: the task's variant or class name).
        at_start: also measure before training; that first measurement is logged as ``coverage/<name>/pass@k``
            at step 0 and again as ``coverage/<name>/pass@k_before`` (so a run's last values hold both).

    Under several processes each data-parallel replica samples its share of the prompts (every
    replica-th one, from its own seed ``seed + replica``; a share one short is padded with a prompt whose
    samples are dropped, so every rank decodes as many batches), and the per-prompt counts of correct
    samples are pooled before pass@k; on one process all prompts are sampled from ``seed``.
    """

    def __init__(
        self,
        task: Task,
        ks: Sequence[int] = (1, 10),
        samples: int = 10,
        temperature: float = 0.5,
        name: str | None = None,
        at_start: bool = True,
        **settings: Any,
    ) -> None:
        super().__init__(temperature=temperature, **settings)
        if not ks or min(ks) < 1 or max(ks) > samples:
            raise ValueError(f"Coverage.ks must be in [1, samples={samples}], got {list(ks)}")
        self.task, self.ks, self.samples = task, tuple(ks), samples
        self.name, self.at_start = name or task_name(task), at_start

    def correct_counts(self, trainer, pl_module, examples) -> list[int]:
        """Correct samples (of ``samples``) for each of ``examples``, every prompt counted by one replica."""
        replicas, rank = replica_layout(trainer, pl_module)
        count = len(examples)
        share = list(EvalShard(count, replicas, rank))  # padded to ceil(count / replicas), as an evaluation loader shares
        with self._seed(self.seed + rank if replicas > 1 else self.seed):
            texts = self.sample(pl_module, self.task, [examples[i % count] for i in share], repeat=self.samples)
        correct = [-1] * count
        for position, index in enumerate(share):
            if index < count:  # else a padding prompt
                chunk = texts[position * self.samples : (position + 1) * self.samples]
                correct[index] = sum(scored(self.task, examples[index], text) >= 1.0 for text in chunk)
        if distributed(trainer):  # each prompt's count from its replica (-1 elsewhere); TP ranks agree
            pooled = torch.tensor(correct, dtype=torch.long, device=pl_module.device)
            torch.distributed.all_reduce(pooled, op=torch.distributed.ReduceOp.MAX)
            correct = pooled.tolist()
        return correct

    @contextlib.contextmanager
    def _seed(self, seed: int):
        kept, self.seed = self.seed, seed
        try:
            yield
        finally:
            self.seed = kept

    def scores(self, trainer, pl_module) -> dict[str, float]:
        """``coverage/<name>/pass@k`` for each k, now."""
        examples = self.task.examples("val")[: self.examples]
        correct = self.correct_counts(trainer, pl_module, examples)
        return {f"coverage/{self.name}/pass@{k}": sum(pass_at_k(self.samples, count, k) for count in correct) / len(examples) for k in self.ks}

    def measure(self, trainer, pl_module) -> None:
        log_metrics(trainer, self.scores(trainer, pl_module))

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.at_start and trainer.global_step == 0 and not resume_path(trainer):  # a resumed run's "before" was logged by the first run
            examples = [self.task.examples("val")[: self.examples]]
            metrics = self.before_scores(trainer, pl_module, [self.task], examples, lambda: self.scores(trainer, pl_module))
            # the first measurement is also kept under its own name, so that a run's last values (kdlab report) hold both
            log_metrics(trainer, {**metrics, **{f"{name}_before": value for name, value in metrics.items()}})
