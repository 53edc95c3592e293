"""A teacher model in the training process (:class:`ModelTeacher`), replicated on every device or sharded like
the student (``DistillModule.teacher_placement``), read through its fused LM head or its logits."""

from __future__ import annotations

from typing import Any

import torch

from kdlab.models.loading import ModelSpec, end_token_ids, load_causal_lm, load_config, load_tokenizer, output_rows, shared_vocab_size
from kdlab.objectives.logits import fused_head_unsupported
from kdlab.rollouts.packing import Padded, RowLayout
from kdlab.teachers.base import DECODES, SCORES, WEIGHTS, WRITES, TeacherRun, TeacherSource, hold


def vocabulary_columns(tokenizer: Any, config: Any, role: str) -> int:
    """``len(tokenizer)``: the logit columns of one model (its head may have padding rows), checked
    against the head's rows."""
    columns = len(tokenizer)
    if output_rows(config) < columns:
        raise ValueError(f"{role} has {output_rows(config)} output rows, fewer than the tokenizer's {columns} tokens")
    return columns


def teacher_columns(run: TeacherRun, tokenizer: Any, config: Any, setting: str) -> int:
    """A teacher's logit columns: with one vocabulary, the columns it shares with the student (an error naming
    ``setting`` unless they are the student's); across tokenizers, its own tokenizer's."""
    from kdlab.errors import ConfigError

    if run.cross_tokenizer:
        return vocabulary_columns(tokenizer, config, setting)
    try:
        columns = shared_vocab_size(run.student_tokenizer, tokenizer, run.student_config, config)
    except ValueError as error:
        raise ConfigError(f"{setting}: {error}") from None
    if columns != run.student_columns:
        raise ConfigError(f"{setting}: shares {columns} token columns with the student, not its {run.student_columns}")
    return columns


class InProcessTeacher(TeacherSource):
    """What every teacher whose model runs in this process shares: it decodes, writes and scores with the model
    the stage holds under ``name``."""

    name = "teacher"

    def offers(self, run: TeacherRun) -> frozenset[str]:
        return super().offers(run) | {DECODES, WRITES, SCORES}

    def models(self) -> dict[str, torch.nn.Module]:
        return {self.name: self.model}

    @property
    def model(self) -> torch.nn.Module:
        return self.run.held[self.name]

    def fused(self) -> bool:
        """Whether its logits reach the objective as hidden states and head (``fused_lm_head``)."""
        if self.run.fused_lm_head is not None:
            return bool(self.run.fused_lm_head)
        return fused_head_unsupported(self.model) is None

    @property
    def layout(self) -> RowLayout:
        """How its model reads a micro-batch: the student's layout (``TeacherRun.layout``), padded rows by default."""
        return self.run.layout if self.run.layout is not None else Padded()

    @torch.no_grad()
    def completion_logprobs(self, rollout: Any, student: Any = None) -> Any:
        """Tempered logits ``(B, C, V)`` of its forward on ``[teacher prompt | completion]`` (a ``HeadLogits``
        with the fused head), read in the run's :attr:`layout`."""
        temperature = self.run.teacher_temperature
        if self.fused():
            return self.layout.completion_head_logits(self.model, rollout, "teacher", self.token_columns, temperature).detach()
        logits = self.layout.completion_logits(self.model, rollout, "teacher", self.token_columns)
        return logits.div_(temperature) if temperature != 1.0 else logits  # a fresh no-grad tensor: no second copy

    def rows_logprobs(self, rollout: Any, rows: torch.Tensor) -> torch.Tensor:
        """Tempered logits ``(len(rows), C, V)`` on rows ``rows`` of ``rollout`` (several teachers, routed)."""
        with torch.no_grad():
            return self.layout.completion_logits(self.model, rollout, "teacher", self.token_columns, rows) / self.run.teacher_temperature

    def decoder(self, prompts: Any, temperature: float) -> Any:
        from kdlab.rollouts.decoding import IncrementalLM, incremental_decoder

        budget = getattr(self.run, "max_completion_tokens", None)
        if budget is None:
            return IncrementalLM(self.model, prompts.teacher_ids, prompts.teacher_mask, self.token_columns, temperature)
        return incremental_decoder(self.model, prompts.teacher_ids, prompts.teacher_mask, self.token_columns, temperature, budget)

    def texts(self, task: Any, examples: list[Any], device: torch.device, **settings: Any) -> list[str]:
        from kdlab.evaluation.scoring import completion_texts

        return completion_texts(self.model, self.tokenizer, task, examples, role="teacher", token_columns=self.token_columns,
                                device=device, end_ids=self.end_ids, **settings)


class ModelTeacher(InProcessTeacher):
    """A frozen teacher model loaded in this process (``teacher: {path: ..., dtype: ...}`` is this source).

    Args:
        model: where it comes from (:class:`~kdlab.models.loading.ModelSpec`: path, dtype, layers...).
        name: the name the stage holds it under (``teacher``; ``teachers/<name>`` as one of several).
    """

    def __init__(self, model: ModelSpec | str, name: str = "teacher") -> None:
        super().__init__()
        self.spec = ModelSpec(model) if isinstance(model, str) else model
        self.name = name

    def bind(self, run: TeacherRun, setting: str = "DistillModule.teacher") -> None:
        self._run, self.setting = run, setting
        self.tokenizer = load_tokenizer(self.spec, setting.removeprefix("DistillModule."))
        self._config = load_config(self.spec, setting.removeprefix("DistillModule."))
        if run.layout is not None:
            run.layout.check_model(self._config, setting)
        self.token_columns = teacher_columns(run, self.tokenizer, self._config, setting)

    def offers(self, run: TeacherRun) -> frozenset[str]:
        return super().offers(run) | {WEIGHTS}

    def model_specs(self) -> list[Any]:
        return [self.spec]

    @classmethod
    def config_models(cls, init_args, visit):
        return visit(init_args.get("model"))

    def load(self) -> None:
        model = load_causal_lm(self.spec, self.setting.removeprefix("DistillModule."), config=self._config)
        hold(self.run, self.name, model)
        self.end_ids = end_token_ids(self.tokenizer, model)
