"""Callbacks that measure what distillation does to the student: they read and report, never train.

Every number goes to the Trainer's loggers (TensorBoard by default) under ``stage/metric`` names and
is appended to ``<log_dir>/metrics.jsonl`` (one ``{"step": ..., "<name>": value}`` object per
report) so sweeps can be tabulated without TensorBoard.

They work on any module that has ``student`` and ``student_tokenizer`` attributes
(:class:`~kdlab.module.DistillModule`, :class:`~kdlab.grpo.GRPOModule`). :class:`StyleTransfer`'s teacher
reference uses the module's ``teacher`` and ``teacher_tokenizer`` or a teacher given to the callback;
:class:`RolloutSensitivity` needs a :class:`~kdlab.module.DistillModule` with its teacher model. A
callback that cannot measure on the module stops ``fit`` at setup, before any work, naming the setting.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from kdlab.evaluation import accuracy, generate
from kdlab.lm_eval_suite import LMEvalTask, evaluate_suite, import_lm_eval, resolve_suite, validate_suite
from kdlab.metrics import pass_at_k, sparsity_counts, spanish_share
from kdlab.tasks.base import Task


def run_directory(trainer: pl.Trainer) -> str:
    """The run's log directory. Call it on every rank: ``Trainer.log_dir`` is a collective broadcast."""
    return trainer.log_dir or trainer.default_root_dir


def report(trainer: pl.Trainer, metrics: dict[str, float], step: int | None = None) -> None:
    """Send ``metrics`` to every logger and append them to ``<log_dir>/metrics.jsonl`` (rank 0)."""
    step = trainer.global_step if step is None else step
    values = {name: float(value) for name, value in metrics.items()}
    for logger in trainer.loggers:
        logger.log_metrics(values, step=step)
    directory = Path(run_directory(trainer))
    if trainer.is_global_zero:
        directory.mkdir(parents=True, exist_ok=True)
        with (directory / "metrics.jsonl").open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({"step": step, **values}) + "\n")


def _due(every_n_steps: int | None, trainer: pl.Trainer) -> bool:
    return bool(every_n_steps) and trainer.global_step > 0 and trainer.global_step % every_n_steps == 0


class _Periodic(pl.Callback):
    """Runs :meth:`measure` every ``every_n_steps`` optimiser steps (after the step) and at the end of fit."""

    def __init__(self, every_n_steps: int | None = None) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"{type(self).__name__}.every_n_steps must be >= 1 or null, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self._last_step = -1

    def measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        raise NotImplementedError

    def _measure_once(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step != self._last_step:
            self._last_step = trainer.global_step
            self.measure(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # after the last micro-batch of an accumulation the step counter has moved; measure once per step
        if _due(self.every_n_steps, trainer):
            self._measure_once(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self._measure_once(trainer, pl_module)


# ---- update sparsity ---------------------------------------------------------------------------
MODULE_GROUPS = (
    ("embeddings", re.compile(r"embed|lm_head|wte|wpe")),
    ("norms", re.compile(r"norm|ln_")),
    ("attention", re.compile(r"attn|attention")),
    ("mlp", re.compile(r"mlp|feed_forward|ffn")),
)


def module_group(name: str) -> str:
    """``attention``, ``mlp``, ``embeddings``, ``norms`` or ``other`` for a parameter name."""
    for group, pattern in MODULE_GROUPS:
        if pattern.search(name):
            return group
    return "other"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds of a (possibly DTensor-sharded) parameter."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _shard_like(full: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
    """The part of ``full`` that this rank holds of ``parameter`` (all of it when not sharded)."""
    if hasattr(parameter, "to_local") and hasattr(parameter, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full.to(parameter.device), parameter.device_mesh, parameter.placements).to_local()
    return full


class UpdateSparsity(_Periodic):
    """Logs ``sparsity/<tau>``: the fraction of student parameters with ``|theta - theta_init| < tau``.

    The initial parameters are copied off the accelerator when fit starts (on a resumed run they are
    reloaded from the student's original path, since the run's start is not in the checkpoint).
    Also logs ``sparsity/<tau>/<group>`` for attention, MLP, embeddings and norms. Under sharded
    training each rank counts its own shard and the counts are summed, so the number is the same
    as unsharded.

    Args:
        thresholds: the taus (paper: 1e-6 main, 1e-8 appendix), each > 0.
        every_n_steps: also measure every N optimiser steps; the end of fit is always measured.
        reference: measure against this model instead of the run's starting weights, e.g. the
            original student in an RLVR stage that starts from a distilled checkpoint (a model path,
            ``kdlab://...``, or a :class:`~kdlab.models.ModelSpec` with ``checkpoint``).
    """

    def __init__(self, thresholds: Sequence[float] = (1e-6, 1e-8), every_n_steps: int | None = None, reference: Any = None) -> None:
        super().__init__(every_n_steps)
        if not thresholds or any(not tau > 0 for tau in thresholds):
            raise ValueError(f"UpdateSparsity.thresholds must be positive numbers, got {list(thresholds)}")
        self.thresholds = tuple(float(tau) for tau in thresholds)
        self.reference = reference
        self.initial: dict[str, torch.Tensor] | None = None

    @staticmethod
    def parameters(pl_module: pl.LightningModule) -> dict[str, torch.Tensor]:
        model = getattr(pl_module, "student", pl_module)
        return {name: _local(p.detach()) for name, p in model.named_parameters()}

    def on_fit_start(self, trainer, pl_module) -> None:
        from kdlab.models import ModelSpec, hf_weight_name, load_causal_lm

        current = self.parameters(pl_module)
        if self.reference is not None or (trainer.ckpt_path and hasattr(pl_module, "student_spec")):
            if self.reference is None:
                spec, role = pl_module.student_spec, "student"
            else:
                spec, role = (ModelSpec(self.reference) if isinstance(self.reference, str) else self.reference), "UpdateSparsity.reference"
            original = dict(load_causal_lm(spec, role).named_parameters())
            # the trained model may be wrapped (peft, compile): match by plain Hugging Face names; LoRA
            # adapters have no counterpart in the original and are left out of the count
            self.initial = {}
            for name, parameter in pl_module.student.named_parameters():
                source = original.get(name) if name in original else original.get(hf_weight_name(name) or "")
                if source is None:
                    continue
                if source.shape != parameter.shape:  # a DTensor reports its global shape
                    raise ValueError(f"{role} {spec.path!r}: parameter {name!r} has shape {tuple(source.shape)}, the trained model {tuple(parameter.shape)}")
                self.initial[name] = _shard_like(source.detach(), parameter).to(current[name].dtype)
            if not self.initial:
                raise ValueError(f"{role} {spec.path!r}: none of its parameters match the trained model's")
        else:
            self.initial = {name: p.to("cpu", copy=True) for name, p in current.items()}

    def measure(self, trainer, pl_module) -> None:
        current = {name: value for name, value in self.parameters(pl_module).items() if name in self.initial}
        metrics = {}
        groups = sorted({module_group(name) for name in current})
        for tau in self.thresholds:
            counts = {}
            for group in groups:
                names = [n for n in current if module_group(n) == group]
                counts[group] = sparsity_counts({n: self.initial[n] for n in names}, {n: current[n] for n in names}, tau)
            small = torch.tensor([float(sum(c[0] for c in counts.values()))] + [float(counts[g][0]) for g in groups], dtype=torch.float64)
            total = torch.tensor([float(sum(c[1] for c in counts.values()))] + [float(counts[g][1]) for g in groups], dtype=torch.float64)
            small = trainer.strategy.reduce(small.to(pl_module.device), reduce_op="sum").cpu()
            total = trainer.strategy.reduce(total.to(pl_module.device), reduce_op="sum").cpu()
            key = f"sparsity/{tau:g}"
            metrics[key] = (small[0] / total[0]).item()
            for index, group in enumerate(groups, start=1):
                metrics[f"{key}/{group}"] = (small[index] / total[index]).item()
        report(trainer, metrics)


# ---- evaluation callbacks ----------------------------------------------------------------------
def _task_name(task: Task) -> str:
    return getattr(task, "variant", None) or type(task).__name__.lower()


class _Evaluates(_Periodic):
    """Shared settings of callbacks that sample from the student."""

    def __init__(
        self,
        examples: int = 200,
        temperature: float = 0.0,
        max_new_tokens: int = 256,
        batch_size: int = 32,
        every_n_steps: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(every_n_steps)
        if examples < 1:
            raise ValueError(f"{type(self).__name__}.examples must be >= 1, got {examples}")
        if temperature < 0:
            raise ValueError(f"{type(self).__name__}.temperature must be >= 0, got {temperature}")
        self.examples, self.temperature = examples, temperature
        self.max_new_tokens, self.batch_size, self.seed = max_new_tokens, batch_size, seed

    def sample(self, pl_module, task: Task, examples, role: str = "student", repeat: int = 1, model: Any = None) -> list[str]:
        """Completions of ``examples`` (each ``repeat`` times) prompted as ``role``, from the module's
        student or teacher, or from ``model = (network, tokenizer)`` (its own vocabulary) when given."""
        if model is not None:
            (network, tokenizer), vocab_size = model, None
        else:
            network = pl_module.student if role == "student" else pl_module.teacher
            tokenizer = pl_module.student_tokenizer if role == "student" else pl_module.teacher_tokenizer
            vocab_size = getattr(pl_module, "vocab_size", None)
        generator = torch.Generator(device=pl_module.device).manual_seed(self.seed)
        repeated = [ex for ex in examples for _ in range(repeat)]
        return generate(
            network,
            tokenizer,
            task,
            repeated,
            role=role,
            temperature=self.temperature,
            max_new_tokens=self.max_new_tokens,
            batch_size=self.batch_size,
            generator=generator,
            vocab_size=vocab_size,
            all_done=pl_module.all_done_hook() if hasattr(pl_module, "all_done_hook") else None,
        )


class OODForgetting(_Evaluates):
    """Scores on earlier skills before training and after it: ``ood/<task>``, ``ood/mean``,
    ``ood/<task>_before``, ``ood/mean_before`` and ``ood/mean_delta`` (after - before, in points).

    Two back ends; give exactly one of ``tasks`` and ``lm_eval_tasks``:

    * the tiny world: kdlab tasks, scored by sampling from the student and verifying;
    * real models: lm-evaluation-harness tasks run on the student in memory (no reload, no copy of the
      weights), see :mod:`kdlab.lm_eval_suite`; needs ``pip install 'kdlab[eval]'``. Task names are
      checked against lm-eval's index when the callback is built.

    The mean is unweighted over the suite's entries.

    Args:
        tasks: tiny back end: the suite of earlier capabilities (each task's ``val`` split; first ``examples``).
        lm_eval_tasks: real back end: ``paper`` for the paper's seven tasks (MMLU-Pro 14 x 200,
            TruthfulQA-MC1 200, IFEval 200 strict prompt-level, HumanEval-Instruct 164 pass@1,
            EQ-Bench 171, BBQ 200, ToxiGen 200), a list of names from
            :data:`~kdlab.lm_eval_suite.PAPER_SUITE`, or a mapping name -> ``{task, limit, metric,
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
        defaults = inspect.signature(_Evaluates.__init__).parameters
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
            result[_task_name(task)] = 100.0 * accuracy(task, examples, self.sample(pl_module, task, examples))
        return result

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.before is None:  # a resumed run keeps the scores measured at the real start
            self.before = self.scores(pl_module)
            metrics = {f"ood/{name}_before": value for name, value in self.before.items()}
            metrics["ood/mean_before"] = sum(self.before.values()) / len(self.before)
            report(trainer, metrics)

    def measure(self, trainer, pl_module) -> None:
        after = self.scores(pl_module)
        metrics = {f"ood/{name}": value for name, value in after.items()}
        metrics["ood/mean"] = sum(after.values()) / len(after)
        metrics["ood/mean_delta"] = metrics["ood/mean"] - sum(self.before.values()) / len(self.before)
        report(trainer, metrics)

    def state_dict(self) -> dict[str, Any]:
        return {"before": self.before}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.before = state_dict.get("before")


def module_teacher(pl_module: pl.LightningModule) -> torch.nn.Module | None:
    """The module's teacher model, or ``None`` (a GRPOModule; a DistillModule reading a teacher cache)."""
    try:
        return getattr(pl_module, "teacher", None)
    except RuntimeError:  # DistillModule(teacher=None) says so when asked
        return None


class StyleTransfer(_Evaluates):
    """``style/spanish_share``: share of student responses that are primarily Spanish (real language
    detection after removing tags, equations, numbers and code), on the student's own prompts.

    The teacher's share on its own prompts (which may carry the style instruction) is logged once at
    the start of fit as ``style/teacher_spanish_share`` for reference. The teacher is ``teacher`` when
    given, else the module's own. A module without a teacher model (a :class:`~kdlab.grpo.GRPOModule`, a
    :class:`~kdlab.module.DistillModule` with ``teacher: null`` reading a teacher cache) needs
    ``teacher``; without it ``fit`` stops at setup with an error naming ``StyleTransfer.teacher``.

    Args:
        tasks: prompt sources (each task's ``val`` split; first ``examples`` of each).
        temperature: sampling temperature (paper's style run: 1.0).
        teacher: the reference teacher (a model path, ``kdlab://...``, or a
            :class:`~kdlab.models.ModelSpec`). Its tokenizer is read at setup; its weights are loaded at
            the start of fit onto the module's device for the one measurement, then released.
    """

    def __init__(self, tasks: list[Task], temperature: float = 1.0, teacher: Any = None, **settings: Any) -> None:
        from kdlab.models import ModelSpec

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
            from kdlab.models import load_tokenizer

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
        from kdlab.models import load_causal_lm

        network = load_causal_lm(self.teacher, "StyleTransfer.teacher").to(pl_module.device).eval().requires_grad_(False)
        try:
            return self.share(pl_module, "teacher", model=(network, self._teacher_tokenizer))
        finally:
            del network  # held for this one measurement only

    def on_fit_start(self, trainer, pl_module) -> None:
        report(trainer, {"style/teacher_spanish_share": self.teacher_share(pl_module), "style/spanish_share": self.share(pl_module, "student")})

    def measure(self, trainer, pl_module) -> None:
        report(trainer, {"style/spanish_share": self.share(pl_module, "student")})


class Coverage(_Evaluates):
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
        self.name, self.at_start = name or _task_name(task), at_start

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
        report(trainer, metrics)

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.at_start and trainer.global_step == 0 and not trainer.ckpt_path:  # a resumed run's "before" was logged by the first run
            self.measure(trainer, pl_module)


# ---- the paper's gradient analysis, measured ------------------------------------------------------
class RolloutSensitivity(_Periodic):
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

    def __init__(self, reference: Any = None, examples: int = 8, every_n_steps: int | None = 10, seed: int = 0) -> None:
        super().__init__(every_n_steps)
        if examples < 1:
            raise ValueError(f"RolloutSensitivity.examples must be >= 1, got {examples}")
        self.reference, self.examples, self.seed = reference, examples, seed

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        if not hasattr(pl_module, "distillation_logits"):
            raise ValueError(f"RolloutSensitivity measures a distillation objective's gradients and needs a DistillModule, got {type(pl_module).__name__}")
        if module_teacher(pl_module) is None:
            raise ValueError("RolloutSensitivity needs the teacher model (DistillModule.teacher): the reference rollouts' teacher log-probs are not in a teacher cache")

    def reference_policy(self, pl_module):
        from kdlab.rollouts import StudentRollouts, TeacherRollouts

        if self.reference is not None:
            return self.reference
        policy = pl_module.rollout
        student_side = isinstance(policy, StudentRollouts) or getattr(policy, "lam", -1.0) >= 0
        return TeacherRollouts() if student_side else StudentRollouts()

    @staticmethod
    def total_variation(policy, student_logits, teacher_logits, mask) -> tuple[float, float]:
        """Mean over masked tokens of TV(policy, teacher) and TV(policy, student), chunked over tokens."""
        from kdlab.kl_kernels import gather_rows, iter_token_chunks

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
            pl_module.objective.pop_reports()
            grads[name] = [g if g is not None else torch.zeros_like(p) for g, p in zip(torch.autograd.grad(loss, params, allow_unused=True), params)]
        norm = lambda tensors: torch.sqrt(sum((t.double() ** 2).sum() for t in tensors)).item()
        metrics["theory/grad_norm"] = norm(grads["policy"])
        metrics["theory/grad_norm_reference"] = norm(grads["reference"])
        metrics["theory/grad_diff"] = norm([a - b for a, b in zip(grads["policy"], grads["reference"])])
        metrics["theory/grad_diff_rel"] = metrics["theory/grad_diff"] / max(metrics["theory/grad_norm"], 1e-30)
        report(trainer, metrics)


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
        metric: the logged reward (default ``rlvr/reward_mean`` of :class:`~kdlab.grpo.GRPOModule`).
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
        report(trainer, {"events/reward_collapse": running / self.best}, step=step)
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
