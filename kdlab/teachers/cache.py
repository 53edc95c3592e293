"""A teacher read from a top-k cache file (:class:`CachedTeacher`): the teacher's tempered top-k log-probs on the
completions of a teacher dataset, written by ``kdlab generate --top_k K``; the teacher never sits in training memory.
How full-vocabulary objectives treat a top-k teacher: :mod:`kdlab.rollouts.teacher_cache`."""

from __future__ import annotations

import math
from typing import Any

import torch

from kdlab.models.loading import ModelSpec, load_tokenizer
from kdlab.rollouts.teacher_cache import TeacherCache, TopKLogprobs
from kdlab.teachers.base import TeacherRun, TeacherSource, tokenizer_end_ids


class CachedTeacher(TeacherSource):
    """The teacher's cached top-k log-probs on a teacher dataset's completions (pair it with
    :class:`~kdlab.rollouts.policies.TeacherDatasetRollouts` over the dataset the cache was computed on).

    Args:
        path: the cache (``<dataset>.topk.safetensors``).
        tokenizer: the teacher's tokenizer (only its tokenizer: no weights load), needed across tokenizers to read
            the completions in the teacher's tokens; default the student's.
    """

    def __init__(self, path: str, tokenizer: ModelSpec | str | None = None) -> None:
        super().__init__()
        self.path = path
        self.tokenizer_spec = ModelSpec(tokenizer) if isinstance(tokenizer, str) else tokenizer

    def bind(self, run: TeacherRun, setting: str = "DistillModule.teacher") -> None:
        from kdlab.errors import ConfigError

        self._run, self.setting = run, setting
        self.cache = TeacherCache(self.path, f"{setting}.path")
        if self.tokenizer_spec is not None:
            self.tokenizer = load_tokenizer(self.tokenizer_spec, f"{setting.removeprefix('DistillModule.')}.tokenizer")
        elif run.cross_tokenizer:
            raise ConfigError(f"{setting}.tokenizer is required across tokenizers (the completions are read in the teacher's tokens)")
        else:
            self.tokenizer = run.student_tokenizer
        wanted = len(self.tokenizer) if run.cross_tokenizer else run.student_columns
        if self.cache.token_columns != wanted:
            raise ConfigError(f"{setting}.path {self.path!r} has {self.cache.token_columns} token columns, the teacher {wanted}")
        if not math.isclose(self.cache.temperature, run.teacher_temperature):
            raise ConfigError(f"{setting}.path {self.path!r} holds log-probs at teacher temperature {self.cache.temperature}, "
                              f"but DistillModule.teacher_temperature is {run.teacher_temperature}")
        self.token_columns = self.cache.token_columns

    @classmethod
    def config_models(cls, init_args, visit):
        return [], True  # the cache replaces the teacher's weights

    def load(self) -> None:
        self.end_ids = tokenizer_end_ids(self.tokenizer)

    def rows_logprobs(self, rollout: Any, rows: torch.Tensor | list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The cached ``(indices, logprobs)`` of rows ``rows`` of ``rollout`` (checked against its teacher prompts and tokens)."""
        ids, mask = rollout.completion("teacher")
        examples, prompts = rollout.prompts.examples, rollout.prompts.prompt_tokens("teacher")
        return [self.cache.row(examples[row]["id"], ids[row][mask[row]].tolist(), prompts[row]) for row in list(map(int, rows))]

    def rollout(self, policy: Any, prompts: Any, context: Any) -> Any:
        """The dataset's rollout with its cached top-k attached (``teacher_logprobs``): a few ``(B, C, k)`` tensors."""
        rollout = policy.sample(prompts, context)
        rollout.teacher_logprobs = self.completion_logprobs(rollout)
        return rollout

    @torch.no_grad()
    def completion_logprobs(self, rollout: Any, student: Any = None) -> TopKLogprobs:
        """Held as the top k (a :class:`~kdlab.rollouts.teacher_cache.TopKLogprobs` on the rollout's device): the
        dense ``(B, C, V)`` teacher is never built."""
        ids = rollout.completion("teacher")[0]
        rows = self.rows_logprobs(rollout, list(range(ids.shape[0])))
        return TopKLogprobs.from_rows(rows, ids.shape[1], self.cache.top_k, self.token_columns).to(ids.device)
