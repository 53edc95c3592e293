"""The teacher settings ``DistillModule`` took before :mod:`kdlab.teachers` (``served_teacher``, ``teachers`` +
``teacher_choice``, ``base_teacher``, and a ``CachedTeacherRollouts``' cache standing for the teacher), kept working:
:func:`teacher_source` turns them into the one teacher source they stand for, with a ``FutureWarning`` naming the new
spelling. This is the one place that looks at which of them a run gave."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from kdlab.errors import ConfigError
from kdlab.models.loading import ModelSpec
from kdlab.rollouts.served import ServedTeacher
from kdlab.teachers.base import TeacherSource
from kdlab.teachers.base_model import BaseModelTeacher
from kdlab.teachers.cache import CachedTeacher
from kdlab.teachers.choice import TeacherChoice
from kdlab.teachers.model import ModelTeacher
from kdlab.teachers.served import Served
from kdlab.teachers.several import Several


@dataclass
class TeacherEntry:
    """One named teacher of ``DistillModule(teachers=...)``: exactly one of

    Args:
        model: an in-process model (``{path: ..., dtype: ...}``).
        served: a teacher behind vLLM's HTTP API (``class_path: kdlab.rollouts.served.ServedTeacher``).
        cache: a top-k teacher cache (``<dataset>.topk.safetensors``) over the run's teacher dataset.
    """

    model: ModelSpec | None = None
    served: ServedTeacher | None = None
    cache: str | None = None

    def source(self, name: str) -> TeacherSource:
        """The teacher source this entry stands for."""
        given = [key for key in ("model", "served", "cache") if getattr(self, key) is not None]
        if len(given) != 1:
            raise ConfigError(f"DistillModule.teachers.{name}: give exactly one of model, served, cache (got {given or 'none'})")
        if self.model is not None:
            return ModelTeacher(self.model, name=f"teachers/{name}")
        return Served(self.served) if self.served is not None else CachedTeacher(self.cache)


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"DistillModule.{old} is deprecated: use DistillModule.teacher: {new}", FutureWarning, stacklevel=4)


def teacher_source(teacher: Any, rollout: Any, cross_tokenizer: Any = None, served_teacher: ServedTeacher | None = None,
                   teachers: dict[str, TeacherEntry] | None = None, teacher_choice: TeacherChoice | None = None, base_teacher: bool = False) -> TeacherSource:
    """The teacher source of a ``DistillModule`` given ``teacher`` (a source, a model spec or path) or the older
    settings; refuses more than one source, naming them.

    Args:
        teacher: ``DistillModule.teacher``.
        rollout: ``DistillModule.rollout`` (a ``CachedTeacherRollouts``' cache stands for the teacher).
        cross_tokenizer: ``DistillModule.cross_tokenizer``.
        served_teacher: deprecated: ``teacher: {class_path: kdlab.teachers.Served, init_args: {server: ...}}``.
        teachers: deprecated: ``teacher: {class_path: kdlab.teachers.Several, init_args: {teachers: ..., choice: ...}}``
            (each entry: ``model``, ``served`` or ``cache``).
        teacher_choice: deprecated: ``Several``'s ``choice``.
        base_teacher: deprecated: ``teacher: {class_path: kdlab.teachers.BaseModelTeacher}``.
    """
    cache = getattr(rollout, "teacher_cache", None) if hasattr(rollout, "cache") else None
    if teachers is not None:
        given = [name for name, value in (("teacher", teacher), ("served_teacher", served_teacher), ("base_teacher", base_teacher),
                                          ("cross_tokenizer", cross_tokenizer)) if value not in (None, False)]
        if given or cache is not None:
            raise ConfigError(f"DistillModule.teachers replaces {given or ['a CachedTeacherRollouts cache']}: give each teacher as an "
                              "entry of teachers (model, served or cache) and leave the single-teacher settings unset")
        _deprecated("teachers", "{class_path: kdlab.teachers.Several, init_args: {teachers: {name: <teacher>}, choice: ...}}")
        return Several({name: entry.source(name) if isinstance(entry, TeacherEntry) else entry for name, entry in teachers.items()},
                       teacher_choice)
    if teacher_choice is not None:
        raise ConfigError("DistillModule.teacher_choice needs several teachers (kdlab.teachers.Several's choice)")
    if served_teacher is not None:
        if teacher is not None or base_teacher:
            raise ConfigError("DistillModule.served_teacher is the teacher: set teacher: null (and base_teacher: false); "
                              "ServedTeacher.tokenizer gives its tokenizer")
        if cache is not None:
            raise ConfigError("DistillModule.rollout: CachedTeacherRollouts brings its own teacher (its cache); with served_teacher "
                              "use TeacherRollouts (sampled by the server), StudentRollouts or TeacherDatasetRollouts (scored by it)")
        _deprecated("served_teacher", "{class_path: kdlab.teachers.Served, init_args: {server: <ServedTeacher>}}")
        return Served(served_teacher)
    if base_teacher:
        if teacher is not None or cache is not None or cross_tokenizer is not None:
            raise ConfigError("DistillModule.base_teacher: the teacher is the student's base under its LoRA adapters, so it needs "
                              "lora, teacher: null, no teacher_cache and no cross_tokenizer")
        _deprecated("base_teacher", "{class_path: kdlab.teachers.BaseModelTeacher}")
        return BaseModelTeacher()
    if cache is not None:
        if isinstance(teacher, TeacherSource):
            raise ConfigError(f"DistillModule.rollout: CachedTeacherRollouts brings its own teacher (its cache), and DistillModule.teacher "
                              f"is a {type(teacher).__name__}: use TeacherDatasetRollouts with the teacher, or teacher: null")
        if cross_tokenizer is not None and teacher is None:
            raise ConfigError("DistillModule.teacher is required with cross_tokenizer (its tokenizer re-tokenises the completions), "
                              "even when its log-probs come from CachedTeacherRollouts.teacher_cache")
        _deprecated("rollout: CachedTeacherRollouts",
                    "{class_path: kdlab.teachers.CachedTeacher, init_args: {path: <cache>}} with rollout: TeacherDatasetRollouts")
        spec = ModelSpec(teacher) if isinstance(teacher, str) else teacher
        return CachedTeacher(cache, tokenizer=spec)  # only the teacher's tokenizer: the cache replaces its weights
    if isinstance(teacher, TeacherSource):
        return teacher
    if teacher is None:
        raise ConfigError("DistillModule.teacher is required unless the rollout is CachedTeacherRollouts (a teacher_cache) "
                          "or base_teacher is true")
    return ModelTeacher(teacher)
