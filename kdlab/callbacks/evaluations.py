"""Callbacks that evaluate the student on prompts of other tasks or styles: ``OODForgetting`` (earlier
skills), ``StyleTransfer`` (the teacher's Spanish), ``Coverage`` (pass@k on a task). Numbers are logged
through :func:`kdlab.runlog.log_metrics`.

They work on any module that has ``student`` and ``student_tokenizer`` attributes
(:class:`~kdlab.stages.distill.DistillModule`, :class:`~kdlab.stages.grpo.GRPOModule`). :class:`StyleTransfer`'s teacher
reference uses the module's ``teacher`` and ``teacher_tokenizer`` or a teacher given to the callback;
:class:`RolloutSensitivity` needs a :class:`~kdlab.stages.distill.DistillModule` with its teacher model. A
callback that cannot measure on the module stops ``fit`` at setup, before any work, naming the setting.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kdlab.callbacks.periodic import EvaluationCallback, module_teacher, task_name
from kdlab.evaluation.lm_eval_suite import (
    LMEvalTask,
    evaluate_suite,
    import_lm_eval,
    resolve_suite,
    validate_suite,
)
from kdlab.evaluation.metrics import pass_at_k, spanish_share
from kdlab.evaluation.scoring import accuracy
from kdlab.runlog import log_metrics
from kdlab.tasks.base import Task


class OODForgetting(EvaluationCallback):
    """Scores on earlier skills before training and after it: ``ood/<task>``, ``ood/mean``,
    ``ood/<task>_before``, ``ood/mean_before`` and ``ood/mean_delta`` (after - before, in points).

    Two back ends; give exactly one of ``tasks`` and ``lm_eval_tasks``:

    * the tiny world: kdlab tasks, scored by sampling from the student and verifying;
    * real models: lm-evaluation-harness tasks run on the student in memory (no reload, no copy of the
      weights), see :mod:`kdlab.evaluation.lm_eval_suite`; needs ``pip install 'kdlab[eval]'``. Task names are
      checked against lm-eval's index when the callback is built.

    The mean is unweighted over the suite's entries.

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
    """

    def __init__(
        self,
        tasks: list[Task] | None = None,
        lm_eval_tasks: str | list[str] | dict[str, LMEvalTask] | None = None,
        lm_eval_include_path: str | None = None,
        lm_eval_batch_size: int = 8,
        lm_eval_allow_code_execution: bool = False,
        lm_eval_apply_chat_template: bool = False,
        **settings: Any,
    ) -> None:
        super().__init__(**settings)
        self.before: dict[str, float] | None = None
        self.tasks = list(tasks or [])
        self.lm_eval_tasks: dict[str, LMEvalTask] | None = None
        if tasks is not None and lm_eval_tasks is not None:
            raise ValueError("OODForgetting: give tasks (tiny back end) or lm_eval_tasks (lm-evaluation-harness), not both")
        if lm_eval_tasks is None:
            if lm_eval_include_path is not None:
                raise ValueError("OODForgetting.lm_eval_include_path is set but lm_eval_tasks is not")
            if not self.tasks:
                raise ValueError("OODForgetting.tasks (or lm_eval_tasks) must name at least one task")
            return
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

    def scores(self, pl_module) -> dict[str, float]:
        if self.lm_eval_tasks is not None:
            return evaluate_suite(
                pl_module.student,
                pl_module.student_tokenizer,
                self.lm_eval_tasks,
                include_path=self.lm_eval_include_path,
                batch_size=self.lm_eval_batch_size,
                allow_code_execution=self.lm_eval_allow_code_execution,
                apply_chat_template=self.lm_eval_apply_chat_template,
            )
        result = {}
        for task in self.tasks:
            examples = task.examples("val")[: self.examples]
            result[task_name(task)] = 100.0 * accuracy(task, examples, self.sample(pl_module, task, examples))
        return result

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.before is None:  # a resumed run keeps the scores measured at the real start
            self.before = self.scores(pl_module)
            metrics = {f"ood/{name}_before": value for name, value in self.before.items()}
            metrics["ood/mean_before"] = sum(self.before.values()) / len(self.before)
            log_metrics(trainer, metrics)

    def measure(self, trainer, pl_module) -> None:
        after = self.scores(pl_module)
        metrics = {f"ood/{name}": value for name, value in after.items()}
        metrics["ood/mean"] = sum(after.values()) / len(after)
        metrics["ood/mean_delta"] = metrics["ood/mean"] - sum(self.before.values()) / len(self.before)
        log_metrics(trainer, metrics)

    def state_dict(self) -> dict[str, Any]:
        return {"before": self.before}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.before = state_dict.get("before")


class StyleTransfer(EvaluationCallback):
    """``style/spanish_share``: share of student responses that are primarily Spanish (real language
    detection after removing tags, equations, numbers and code), on the student's own prompts.

    The teacher's share on its own prompts (which may carry the style instruction) is logged once at
    the start of fit as ``style/teacher_spanish_share`` for reference. The teacher is ``teacher`` when
    given, else the module's own. A module without a teacher model (a :class:`~kdlab.stages.grpo.GRPOModule`, a
    :class:`~kdlab.stages.distill.DistillModule` with ``teacher: null`` reading a teacher cache) needs
    ``teacher``; without it ``fit`` stops at setup with an error naming ``StyleTransfer.teacher``.

    Args:
        tasks: prompt sources (each task's ``val`` split; first ``examples`` of each).
        temperature: sampling temperature (paper's style run: 1.0).
        teacher: the reference teacher (a model path, ``kdlab://...``, or a
            :class:`~kdlab.models.loading.ModelSpec`). Its tokenizer is read at setup; its weights are loaded at
            the start of fit onto the module's device for the one measurement, then released.
    """

    def __init__(self, tasks: list[Task], temperature: float = 1.0, teacher: Any = None, **settings: Any) -> None:
        from kdlab.models.loading import ModelSpec

        super().__init__(temperature=temperature, **settings)
        if not tasks:
            raise ValueError("StyleTransfer.tasks must name at least one task")
        spanish_share(["probe"])  # fails now, naming the extra, if the detector is not installed
        self.tasks = list(tasks)
        self.teacher = ModelSpec(teacher) if isinstance(teacher, str) else teacher
        self._teacher_tokenizer: Any = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        if self.teacher is not None:
            from kdlab.models.loading import load_tokenizer

            self._teacher_tokenizer = load_tokenizer(self.teacher, "StyleTransfer.teacher")
        elif module_teacher(pl_module) is None:
            raise ValueError(
                f"StyleTransfer.teacher is required on a {type(pl_module).__name__} without a teacher model: "
                "style/teacher_spanish_share needs a teacher to sample from (give StyleTransfer.teacher a model path)"
            )

    def share(self, pl_module, role: str, model: Any = None) -> float:
        texts = []
        for task in self.tasks:
            texts += self.sample(pl_module, task, task.examples("val")[: self.examples], role=role, model=model)
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
        at_start: also measure before training.
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

    def measure(self, trainer, pl_module) -> None:
        examples = self.task.examples("val")[: self.examples]
        texts = self.sample(pl_module, self.task, examples, repeat=self.samples)
        metrics = {}
        for k in self.ks:
            total = 0.0
            for index, example in enumerate(examples):
                chunk = texts[index * self.samples : (index + 1) * self.samples]
                correct = sum(float(self.task.score(example, text)) >= 1.0 for text in chunk)
                total += pass_at_k(self.samples, correct, k)
            metrics[f"coverage/{self.name}/pass@{k}"] = total / len(examples)
        log_metrics(trainer, metrics)

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.at_start and trainer.global_step == 0 and not trainer.ckpt_path:  # a resumed run's "before" was logged by the first run
            self.measure(trainer, pl_module)
