"""Batched generation and scoring for one model: held-out accuracy, samples for pass@k, teacher data.

Generation uses kdlab's own KV-cache decoding loop (:mod:`kdlab.decoding`) with a seeded generator,
so evaluation samples are reproducible.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kdlab.data import decode_completions, left_pad, prompt_token_ids
from kdlab.decoding import IncrementalLM, sample_tokens, stop_strings_check
from kdlab.models import end_token_ids
from kdlab.tasks.base import Example, Task


@torch.no_grad()
def sample_completions(
    model: torch.nn.Module,
    tokenizer: Any,
    task: Task,
    examples: Sequence[Example],
    *,
    role: str = "student",
    temperature: float = 0.0,
    max_new_tokens: int | Sequence[int] = 512,
    max_prompt_tokens: int = 2048,
    batch_size: int = 16,
    generator: torch.Generator | None = None,
    vocab_size: int | None = None,
    all_done: Callable[[bool], bool] | None = None,
    end_ids: Sequence[int] | None = None,
    stop_strings: Sequence[str] = (),
) -> list[tuple[str, bool]]:
    """``(text, ended)`` for each of ``examples``, prompted as ``role`` (``"student"`` or ``"teacher"``);
    ``ended`` is False when the completion was cut by ``max_new_tokens`` instead of ending with an end
    token (``end_ids``, default: the tokenizer's and the model's) or a stop string (kept in the text).
    ``max_new_tokens``: one budget, or one per example.

    ``temperature`` 0 decodes greedily. The model is put in eval mode for the call and its mode is
    restored afterwards. ``all_done`` makes stopping collective under sharded training; every rank
    must then call with the same number of batches.
    """
    device = next(model.parameters()).device
    vocab = vocab_size or len(tokenizer)
    end_ids = tuple(end_ids) if end_ids else end_token_ids(tokenizer, model)
    was_training = model.training
    model.eval()
    results: list[tuple[str, bool]] = []
    stop = stop_strings_check(tokenizer, stop_strings)
    budgets = [max_new_tokens] * len(examples) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != len(examples):
        raise ValueError(f"sample_completions: {len(budgets)} budgets for {len(examples)} examples")
    try:
        for start in range(0, len(examples), batch_size):
            batch = examples[start : start + batch_size]
            rows = [prompt_token_ids(task, tokenizer, ex, role, max_prompt_tokens) for ex in batch]
            ids, mask = left_pad(rows, tokenizer.pad_token_id)
            decoder = IncrementalLM(model, ids.to(device), mask.to(device), vocab, temperature)
            out_ids, out_mask, _ = sample_tokens(
                decoder,
                batch_size=len(batch),
                max_new_tokens=torch.tensor(budgets[start : start + batch_size], device=device),
                eos_token_ids=end_ids,
                pad_token_id=tokenizer.pad_token_id,
                generator=generator,
                greedy=temperature == 0,
                device=device,
                all_done=all_done,
                stop=stop,
            )
            results += completion_records(tokenizer, out_ids, out_mask, end_ids, stop_strings)
    finally:
        model.train(was_training)
    return results


def completion_records(
    tokenizer: Any, completion_ids: torch.Tensor, completion_mask: torch.Tensor, end_ids: Sequence[int], stop_strings: Sequence[str] = ()
) -> list[tuple[str, bool]]:
    """``(text, ended)`` per completion ``(B, C)``: the text without a final end token, and whether the
    completion ended (an end token or a stop string) rather than running out of budget."""
    texts = decode_completions(tokenizer, completion_ids, completion_mask, end_ids)
    return [
        (text, bool(row_mask.any()) and (int(row_ids[row_mask.bool()][-1]) in end_ids or any(s and s in text for s in stop_strings)))
        for row_ids, row_mask, text in zip(completion_ids, completion_mask, texts)
    ]


def generate(model: torch.nn.Module, tokenizer: Any, task: Task, examples: Sequence[Example], **settings: Any) -> list[str]:
    """Completion texts only; the settings are :func:`sample_completions`'."""
    return [text for text, _ in sample_completions(model, tokenizer, task, examples, **settings)]


def accuracy(task: Task, examples: Sequence[Example], completions: Sequence[str]) -> float:
    """Mean of ``task.score`` over the examples (0 for an empty list)."""
    if not examples:
        return 0.0
    return sum(float(task.score(ex, text)) for ex, text in zip(examples, completions)) / len(examples)
