"""A whole fit's wall time from its configuration: ``max_steps x`` :func:`~kdlab.study.step_time.step_time` plus
every evaluation the run makes (the stage's validation and each evaluating callback, each time it runs), on one
:class:`~kdlab.study.step_time.Hardware`. Decodes are counted at their caps (``max_new_tokens``, the prompt cap),
as the memory arithmetic counts lengths, so the figures are bounds for decoding that stops early.

Per evaluation, on rank 0's share (the ranks split ``Coverage`` and validation prompts; the lm-eval suite runs
on rank 0 alone while the others wait), each kdlab-evaluated row also costing ``Hardware.row_seconds`` of host work:

* validation: ``val_examples x eval_samples`` rows in decodes of ``val_batch_size x eval_samples`` rows, every
  ``trainer.val_check_interval`` training batches (a distillation's micro-batches, a GRPO fit's rollout batches of
  ``mini_batches`` optimiser steps each), or once after the last step when the interval is beyond the run's batches
  (:class:`~kdlab.stages.base.ValidateLastStep`);
* ``Coverage``: ``examples x samples`` rows in decodes of ``batch_size`` rows, at the start (``at_start``), every
  ``every_n_steps`` and at the end;
* ``StyleTransfer``: each entry's rows (:func:`~kdlab.study.setups.style_transfer_rows`) in decodes of ``batch_size``, the student at the start (``at_start``)
  and the end, the teacher (its own shape and dtype) once at the start, only with ``at_start``;
* ``OODForgetting`` with lm-eval: before, every ``every_n_steps`` and at the end, each task of :data:`LM_EVAL_COST` on the student as it is held
  (the fp32 student outside autocast is read in 4 bytes a weight), generations through the Hugging Face back end
  (:func:`~kdlab.study.step_time.decode_token_seconds` with ``kdlab``'s per-token host cost) in batches of
  ``lm_eval_batch_size``, multiple-choice tasks as forwards; with kdlab tasks, as ``Coverage`` with one sample.

Not counted: ``UpdateSparsity``, ``RolloutSensitivity``, ``HeldOutKL``, ``RewardCollapse``, checkpoint writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kdlab.study.setups import BYTES, Setup, name_of, style_transfer_rows
from kdlab.study.step_time import (
    Hardware,
    StepTime,
    decode_seconds,
    forward_seconds,
    step_time,
)

LM_EVAL_COST: dict[str, tuple[int, str, int, int]] = {
    "mmlu_pro": (14 * 200, "generate_until", 2048, 1500),
    "truthfulqa_mc1": (200, "multiple_choice", 0, 300),
    "ifeval": (200, "generate_until", 1280, 150),
    "humaneval_instruct": (164, "generate_until", 1024, 250),
    "eq_bench": (171, "generate_until", 80, 600),
    "bbq": (200, "multiple_choice", 0, 200),
    "toxigen": (200, "multiple_choice", 0, 100),
}
"""Each paper suite task (:data:`kdlab.evaluation.lm_eval_suite.PAPER_SUITE`): ``(requests, output_type,
max_gen_toks, prompt tokens)``. Requests are the suite's limits (MMLU-Pro: 14 subjects x 200); ``output_type`` and
``max_gen_toks`` are lm-eval 0.4's task YAMLs (``tests/test_step_time.py`` reads them back); prompt tokens are an
assumption (MMLU-Pro's five chain-of-thought exemplars; a multiple-choice request is one forward per choice, 4
choices counted)."""
CHOICES = 4


@dataclass
class RunTime:
    """A fit's wall time: ``steps x step`` and each evaluation's total (name -> seconds)."""

    steps: int
    step: StepTime
    evaluations: dict[str, float]

    @property
    def training_seconds(self) -> float:
        return self.steps * self.step.seconds

    @property
    def seconds(self) -> float:
        return self.training_seconds + sum(self.evaluations.values())


def _decodes(setup: Setup, rows: int, batch: int, tokens: int, hardware: Hardware, role: str = "student", replicas: int = 1) -> float:
    """``rows`` rows (this rank's share of ``replicas``) in decodes of ``batch`` rows, ``tokens`` tokens each, and
    each row's host work outside the decode (``Hardware.row_seconds``)."""
    shape = setup.teacher if role == "teacher" and setup.teacher is not None else setup.student
    size = 2 if setup.mixed or BYTES[setup.student_dtype if role == "student" else setup.teacher_dtype] == 2 else 4
    share = -(-rows // max(replicas, 1))
    full, rest = divmod(share, max(batch, 1))
    one = decode_seconds(shape, size, batch, setup.prompt_tokens, tokens, "kdlab", hardware)
    rest_seconds = decode_seconds(shape, size, rest, setup.prompt_tokens, tokens, "kdlab", hardware) if rest else 0.0
    return full * one + rest_seconds + share * hardware.row_seconds


def _times(every: int | None, steps: int, at_start: bool) -> int:
    periodic = steps // every if every else 0
    return int(at_start) + periodic + (0 if every and steps % every == 0 else 1)


def suite_names(suite: Any, setting: str = "OODForgetting.lm_eval_tasks") -> list[str]:
    """The :data:`LM_EVAL_COST` names of a suite (``paper``, a name, a list of names, or a mapping keyed by them)."""
    names = list(LM_EVAL_COST) if suite == "paper" else [suite] if isinstance(suite, str) else list(suite or [])
    unknown = [name for name in names if name not in LM_EVAL_COST]
    if unknown or not names:
        raise ValueError(f"{setting} {unknown or suite!r}: kdlab estimate knows the cost of {sorted(LM_EVAL_COST)} only")
    return names


def lm_eval_seconds(setup: Setup, suite: Any, batch: int, hardware: Hardware) -> float:
    """One pass of an lm-eval suite (``paper``, a list of :data:`LM_EVAL_COST` names) on the student as held."""
    names = suite_names(suite)
    size, total = BYTES[setup.student_dtype], 0.0  # in-loop lm-eval: outside autocast, the weights as held
    for name in names:
        requests, kind, generated, prompt = LM_EVAL_COST[name]
        if kind == "generate_until":
            full, rest = divmod(requests, batch)
            total += full * decode_seconds(setup.student, size, batch, prompt, generated, "kdlab", hardware)
            total += decode_seconds(setup.student, size, rest, prompt, generated, "kdlab", hardware) if rest else 0.0
        else:
            forwards = -(-requests * CHOICES // batch)
            total += forwards * forward_seconds(setup.student, batch * prompt, hardware)
    return total


def evaluation_seconds(setup: Setup, config: dict[str, Any], steps: int, hardware: Hardware) -> dict[str, float]:
    """Each evaluation's total seconds over the run (module docstring), keyed ``validation``, ``<Callback> <n>``."""
    model, trainer = dict(config.get("model") or {}), dict(config.get("trainer") or {})
    model = dict(model.get("init_args") or {}) if "class_path" in model else model
    replicas = setup.world  # data-parallel replicas
    out: dict[str, float] = {}
    interval = trainer.get("val_check_interval")
    if setup.stage != "sft" and isinstance(interval, int) and interval > 0 and trainer.get("limit_val_batches") != 0:
        # the interval counts training batches: a distillation's micro-batches, a GRPO fit's rollout batches (each
        # makes mini_batches optimiser steps; the last one may take the run past max_steps)
        if setup.stage == "distill":
            batches = steps * max(setup.accumulate, 1)
        else:
            batches = -(-steps // max(int(model.get("mini_batches") or 1), 1))
        runs = batches // interval or 1  # an interval beyond the run's batches: once after the last step (ValidateLastStep)
        samples = int(model.get("eval_samples") or 1)
        rows = int(model.get("val_examples") or 200) * samples
        batch = int(model.get("val_batch_size") or 8) * samples
        if runs:
            out["validation"] = runs * _decodes(setup, rows, batch, setup.completion_tokens, hardware, replicas=replicas)
    for index, callback in enumerate(trainer.get("callbacks") or [], 1):
        name, args = name_of(callback)
        every = args.get("every_n_steps")
        if name == "Coverage":
            times = _times(every, steps, bool(args.get("at_start", True)))
            rows = int(args.get("examples", 200)) * int(args.get("samples", 10))
            out[f"Coverage {index}"] = times * _decodes(setup, rows, int(args.get("batch_size", 32)), int(args.get("max_new_tokens", 256)),
                                                        hardware, replicas=replicas)
        elif name == "StyleTransfer":
            rows = style_transfer_rows(args) or [args.get("examples", 200)]
            at_start = bool(args.get("at_start", True))

            def once(role: str) -> float:
                return sum(_decodes(setup, int(count), int(args.get("batch_size", 32)), int(args.get("max_new_tokens", 256)), hardware, role,
                                    replicas=replicas) for count in rows)

            # the teacher's share: sampled once, at the start, and only with at_start, on the teacher
            teacher = once("teacher") if at_start and setup.teacher is not None else 0.0
            out[f"StyleTransfer {index}"] = _times(every, steps, at_start) * once("student") + teacher
        elif name == "OODForgetting":
            if args.get("lm_eval_tasks") is not None:
                passes = _times(every, steps, True)  # before, every every_n_steps, and at the end: as with kdlab tasks
                out[f"OODForgetting {index}"] = passes * lm_eval_seconds(setup, args["lm_eval_tasks"], int(args.get("lm_eval_batch_size") or 8), hardware)
            else:
                rows = len(args.get("tasks") or []) * int(args.get("examples", 200))
                out[f"OODForgetting {index}"] = _times(every, steps, True) * _decodes(setup, rows, int(args.get("batch_size", 32)),
                                                                                       int(args.get("max_new_tokens", 256)), hardware, replicas=replicas)
    return out


def run_time(setup: Setup, work: dict[str, float], config: dict[str, Any], hardware: Hardware) -> RunTime:
    """``trainer.max_steps`` steps and every evaluation of the fit ``config`` describes."""
    steps = int((config.get("trainer") or {}).get("max_steps") or 0)
    if steps <= 0:
        raise ValueError("trainer.max_steps: kdlab estimate's run time needs a positive max_steps")
    return RunTime(steps, step_time(setup, work, hardware), evaluation_seconds(setup, config, steps, hardware))
