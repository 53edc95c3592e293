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


def accuracy(task: Task, examples: Sequence[Example], completions: Sequence[str]) -> float:
    """Mean of ``task.score`` over the examples (0 for an empty list)."""
    if not examples:
        return 0.0
    return sum(float(task.score(ex, text)) for ex, text in zip(examples, completions)) / len(examples)
