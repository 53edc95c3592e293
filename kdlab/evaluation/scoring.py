"""Scoring one model's completions on a task: :func:`completion_texts` samples them (kdlab's KV-cache
decoding loop, :func:`kdlab.rollouts.decoding.sample_completions`, with a seeded generator, so evaluation
samples are reproducible) and :func:`accuracy` scores them with the task's verifier."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kdlab.rollouts.decoding import sample_completions
from kdlab.tasks.base import Example, Task


def completion_texts(model: torch.nn.Module, tokenizer: Any, task: Task, examples: Sequence[Example], **settings: Any) -> list[str]:
    """Completion texts only; the settings are :func:`sample_completions`'."""
    return [text for text, _ in sample_completions(model, tokenizer, task, examples, **settings)]


class ScoreError(RuntimeError):
    """A task's ``score`` broke its contract (:meth:`kdlab.tasks.base.Task.score`: a number in [0, 1], never raising)."""


def scored(task: Task, example: Example, completion: str) -> float:
    """``task.score(example, completion)`` as a float, checked against its contract: an exception or a value
    outside [0, 1] (NaN included) becomes a :class:`ScoreError` naming the task, the example's id and the
    completion's start, instead of a bare traceback from inside an evaluation or a wrong accuracy."""
    where = f"{type(task).__name__}.score on example {example.get('id')!r} (completion starting {completion[:60]!r})"
    try:
        value = float(task.score(example, completion))
    except Exception as error:
        raise ScoreError(f"{where} raised {type(error).__name__}: {error} (a task's score must never raise)") from error
    if not 0.0 <= value <= 1.0:
        raise ScoreError(f"{where} returned {value}, outside [0, 1]")
    return value


def accuracy(task: Task, examples: Sequence[Example], completions: Sequence[str]) -> float:
    """Mean of ``task.score`` over the examples (0 for an empty list), each checked (:func:`scored`)."""
    if not examples:
        return 0.0
    return sum(scored(task, ex, text) for ex, text in zip(examples, completions)) / len(examples)
