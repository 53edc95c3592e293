"""The student's own base model as its teacher (:class:`BaseModelTeacher`): with LoRA adapters on the student, the
teacher is the same weights with the adapters disabled (:class:`AdaptersDisabled`), so self-distillation keeps one
model in memory (e.g. context distillation: the teacher prompt carries what the student's does not)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kdlab.models.loading import end_token_ids
from kdlab.teachers.base import TeacherRun, hold
from kdlab.teachers.model import InProcessTeacher


class AdaptersDisabled(torch.nn.Module):
    """The base model under a peft model's LoRA adapters: every call runs the student with its adapters disabled
    (``disable_adapter()``), so the base weights are read in place: no copy, no second model.

    ``student`` is the peft model, or a callable that returns the student as the stage holds it at the time of the
    call: under ``strategy: fsdp`` (FSDP1) the stage replaces the peft model by an FSDP root around it
    (:func:`~kdlab.stages.sharding.wrap_fsdp1`), and only calling that root gathers the weights (the peft model
    inside holds flat shards). It holds no parameters or buffers of its own and ignores mode, ``requires_grad_``
    and device moves (the student is the stage's, which trains and moves it); any other attribute is the
    student's (``config``, ``generation_config``, ``get_output_embeddings``...; an FSDP1 root passes them on to the
    peft model). With the adapters disabled the LoRA branch, LoRA dropout included, is skipped; the base model's
    own dropout applies when the student is in train mode."""

    def __init__(self, student: torch.nn.Module | Callable[[], torch.nn.Module]) -> None:
        super().__init__()
        current = (lambda: student) if isinstance(student, torch.nn.Module) else student
        object.__setattr__(self, "_current", current)  # not a submodule: no parameters of its own
        if not callable(getattr(current(), "disable_adapter", None)):
            raise ValueError("AdaptersDisabled needs a peft model (apply_lora's result)")

    @property
    def peft_model(self) -> torch.nn.Module:
        """The student now: the peft model, or the wrapper the stage put around it (an FSDP1 root)."""
        return self.__dict__["_current"]()

    def forward(self, *args, **kwargs):
        student = self.peft_model
        with student.disable_adapter():
            return student(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_current"](), name)

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
        hold(self.run, self.name, AdaptersDisabled(self.run.student))  # the student at each call: the stage may wrap it (FSDP1)
        self.end_ids = end_token_ids(self.tokenizer, self.model)
