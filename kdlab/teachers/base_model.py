"""The student's own base model as its teacher (:class:`BaseModelTeacher`): with LoRA adapters on the student, the
teacher is the same weights with the adapters disabled (:class:`AdaptersDisabled`), so self-distillation keeps one
model in memory (e.g. context distillation: the teacher prompt carries what the student's does not)."""

from __future__ import annotations


import torch

from kdlab.models.loading import end_token_ids
from kdlab.teachers.base import TeacherRun, hold
from kdlab.teachers.model import InProcessTeacher


class AdaptersDisabled(torch.nn.Module):
    """The base model under a peft model's LoRA adapters: every call runs ``peft_model`` with its adapters
    disabled (``peft_model.disable_adapter()``), so the base weights are read in place: no copy, no second
    model. It holds no parameters or buffers of its own and ignores mode, ``requires_grad_`` and device
    moves (the peft model is the student, which the stage trains and moves); any other attribute is the
    peft model's (``config``, ``generation_config``, ``get_output_embeddings``...). The student's dropout
    applies when it is in train mode (LoRA dropout included; kdlab's default is 0)."""

    def __init__(self, peft_model: torch.nn.Module) -> None:
        super().__init__()
        if not callable(getattr(peft_model, "disable_adapter", None)):
            raise ValueError("AdaptersDisabled needs a peft model (apply_lora's result)")
        object.__setattr__(self, "peft_model", peft_model)  # not a submodule: no parameters of its own

    def forward(self, *args, **kwargs):
        with self.peft_model.disable_adapter():
            return self.peft_model(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["peft_model"], name)

    def train(self, mode: bool = True) -> AdaptersDisabled:
        return self

    def requires_grad_(self, requires_grad: bool = True) -> AdaptersDisabled:
        return self

    def _apply(self, fn, recurse: bool = True) -> AdaptersDisabled:
        return self


class BaseModelTeacher(InProcessTeacher):
    """The student's base under its disabled LoRA adapters (``DistillModule.lora`` is required). It shares the
    student's tokenizer, so it cannot be used across tokenizers, and it is the student, so it is never sharded apart
    from it (``teacher_placement: replicate``)."""

    def bind(self, run: TeacherRun, setting: str = "DistillModule.teacher") -> None:
        from kdlab.errors import ConfigError

        self._run, self.setting = run, setting
        if run.student is None:
            raise ConfigError(f"{setting}: BaseModelTeacher is the student's base under its LoRA adapters: set DistillModule.lora")
        if run.cross_tokenizer:
            raise ConfigError(f"{setting}: BaseModelTeacher shares the student's tokenizer; remove cross_tokenizer")
        if run.placement != "replicate":
            raise ConfigError(f"{setting}: BaseModelTeacher is the student itself, so DistillModule.teacher_placement must be 'replicate'")
        self.tokenizer, self.token_columns = run.student_tokenizer, run.student_columns

    def load(self) -> None:
        hold(self.run, self.name, AdaptersDisabled(self.run.student()))
        self.end_ids = end_token_ids(self.tokenizer, self.model)
