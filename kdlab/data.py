"""Batches that flow through a distillation step: prompts per model, then rollouts.

Layout. Each model gets its own prompt (rendered with its own tokenizer's chat template), left-padded
to ``P`` tokens; completions are shared token ids, right-padded to ``C`` tokens. A model's input is
``[prompt (P) | completion (C)]``, so the logits that predict the completion are always the last
``C + 1`` positions minus the final one, for student and teacher alike, whatever their prompt lengths.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kdlab.tasks.base import Example, Task


@dataclass
class PromptBatch:
    """Left-padded prompts of one batch.

    ``student_ids``/``student_mask``: ``(B, P_s)``; ``teacher_ids``/``teacher_mask``: ``(B, P_t)``;
    masks are 1 on real tokens and 0 on padding.
    """

    examples: list[Example]
    student_ids: torch.Tensor
    student_mask: torch.Tensor
    teacher_ids: torch.Tensor
    teacher_mask: torch.Tensor

    def __len__(self) -> int:
        return len(self.examples)

    def prompt_tokens(self, model: str) -> list[list[int]]:
        """Each row's prompt token ids for ``"student"`` or ``"teacher"``, its left padding dropped."""
        ids, mask = getattr(self, f"{model}_ids"), getattr(self, f"{model}_mask")
        return [row[kept.bool()].tolist() for row, kept in zip(ids, mask)]

    def select(self, rows: Sequence[int]) -> PromptBatch:
        """The prompts of ``rows``, left padding trimmed to the longest of them (as if encoded alone)."""
        index = torch.as_tensor(list(rows), dtype=torch.long, device=self.student_ids.device)
        student_ids, student_mask = trim_left(self.student_ids[index], self.student_mask[index])
        teacher_ids, teacher_mask = trim_left(self.teacher_ids[index], self.teacher_mask[index])
        return PromptBatch([self.examples[row] for row in rows], student_ids, student_mask, teacher_ids, teacher_mask)


@dataclass
class Rollout:
    """Completions for a :class:`PromptBatch`.

    ``completion_ids``: ``(B, C)`` long, padded after each completion's end; ``completion_mask``:
    ``(B, C)`` bool, True on the completion's tokens including its end-of-sequence token.
    ``sampling_entropy``: ``(B, C)`` entropy (nats) of the distribution each token was drawn from,
    or ``None`` when completions were read from a dataset.
    ``behaviour_logprobs``: ``(B, C)`` log q of each token under an engine whose weights may lag the
    student's (vLLM); distillation then weights each completion's loss by
    :func:`kdlab.rollouts.policies.importance_weights` with ``importance_cap``, and GRPO each token's policy
    term by ``min(importance_cap, pi_old / q)``. ``None``: exactly on-policy or off-policy, no correction.
    """

    prompts: PromptBatch
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    sampling_entropy: torch.Tensor | None = None
    behaviour_logprobs: torch.Tensor | None = None
    importance_cap: float = 2.0
    teacher_logprobs: Any = None
    """The teacher's tempered log-probs ``(B, C, V)`` when read from a cache (then no teacher forward
    runs): a :class:`~kdlab.rollouts.teacher_cache.TopKLogprobs`, which objectives expand chunk by chunk."""
    teacher_completion_ids: torch.Tensor | None = None
    teacher_completion_mask: torch.Tensor | None = None
    """Across tokenizers (``DistillModule(cross_tokenizer=...)``): the same completions in the teacher's
    tokens, ``(B, C_T)`` right-padded, re-tokenised from the text (``completion_ids`` are the student's).
    ``None`` when both models share one vocabulary."""

    def split(self, sizes: Sequence[int]) -> list[Rollout]:
        """Consecutive row groups of ``sizes`` (summing to ``B``), each with its prompts' left padding and
        its completions' right padding trimmed to its own rows: the rollout each group would have had if
        its prompts had been decoded alone with these completions (positions follow the masks, so the
        models' logits on the kept tokens do not depend on the trimmed padding)."""
        if sum(sizes) != len(self.prompts):
            raise ValueError(f"Rollout.split: sizes {list(sizes)} do not add up to the {len(self.prompts)} rows")
        parts, start = [], 0
        for size in sizes:
            rows = list(range(start, start + size))
            start += size
            index = torch.as_tensor(rows, dtype=torch.long, device=self.completion_ids.device)
            mask = self.completion_mask[index]
            width = int(mask.any(0).nonzero().max()) + 1 if bool(mask.any()) else 0
            select = lambda tensor: None if tensor is None else tensor[index][:, :width]  # noqa: E731
            teacher_ids = teacher_mask = None
            teacher_width = width
            if self.teacher_completion_ids is not None:
                teacher_mask = self.teacher_completion_mask[index]
                teacher_width = int(teacher_mask.any(0).nonzero().max()) + 1 if bool(teacher_mask.any()) else 0
                teacher_ids, teacher_mask = self.teacher_completion_ids[index][:, :teacher_width], teacher_mask[:, :teacher_width]
            teacher = self.teacher_logprobs
            if teacher is not None:
                teacher = teacher.select(rows, teacher_width) if hasattr(teacher, "select") else teacher[index][:, :teacher_width]
            parts.append(Rollout(
                self.prompts.select(rows), self.completion_ids[index][:, :width], mask[:, :width],
                select(self.sampling_entropy), select(self.behaviour_logprobs), self.importance_cap, teacher,
                teacher_ids, teacher_mask,
            ))
        return parts

    def completion(self, model: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, mask)`` of the completions in ``model``'s tokens: the teacher's own when the tokenizers
        differ, else the shared ``completion_ids`` / ``completion_mask``."""
        if model == "teacher" and self.teacher_completion_ids is not None:
            return self.teacher_completion_ids, self.teacher_completion_mask
        return self.completion_ids, self.completion_mask

    def model_inputs(self, model: str) -> dict[str, torch.Tensor]:
        """``input_ids``, ``attention_mask`` and ``position_ids`` ``(B, P + C)`` for ``"student"`` or ``"teacher"``."""
        ids = getattr(self.prompts, f"{model}_ids")
        mask = getattr(self.prompts, f"{model}_mask")
        completion, completion_mask = self.completion("teacher" if model == "teacher" else "student")
        input_ids = torch.cat([ids, completion.to(ids.device)], dim=1)
        attention_mask = torch.cat([mask, completion_mask.to(mask.device, mask.dtype)], dim=1)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids(attention_mask)}


def trim_left(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the leading columns that are padding on every row of left-padded ``ids``/``mask`` ``(B, P)``."""
    real = mask.bool().any(0)
    first = int(real.nonzero().min()) if bool(real.any()) else mask.shape[1]
    return ids[:, first:], mask[:, first:]


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that start at 0 on each row's first real token (left padding gets 0)."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists to ``(B, max_len)`` ids and a 0/1 attention mask."""
    width = max((len(row) for row in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row) :] = 1
    return ids, mask


def right_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists to ``(B, max_len)`` ids and a bool mask."""
    width = max((len(row) for row in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = True
    return ids, mask


def prompt_token_ids(task: Task, tokenizer: Any, example: Example, model: str, max_prompt_tokens: int) -> list[int]:
    """Token ids of ``example``'s prompt for ``model`` (``"student"`` or ``"teacher"``).

    Raises ValueError naming the example when the prompt is longer than ``max_prompt_tokens``, or empty (no
    position would predict the first completion token).
    """
    messages = task.student_messages(example) if model == "student" else task.teacher_messages(example)
    text = task.render(tokenizer, messages)
    # A chat template already writes the special tokens; plain text gets the tokenizer's own (e.g. BOS).
    ids = tokenizer(text, add_special_tokens=not task.chat_template)["input_ids"]
    if len(ids) > max_prompt_tokens:
        raise ValueError(
            f"{type(task).__name__} example {example['id']!r}: the {model} prompt has {len(ids)} tokens, "
            f"more than max_prompt_tokens={max_prompt_tokens}"
        )
    if not ids:
        raise ValueError(
            f"{type(task).__name__} example {example['id']!r}: the {model} prompt has no tokens, so no position predicts "
            "the first completion token; give it some text (or a tokenizer that adds a BOS token)"
        )
    return ids


def encode_prompts(
    task: Task,
    examples: Sequence[Example],
    student_tokenizer: Any,
    teacher_tokenizer: Any,
    max_prompt_tokens: int,
    pad_token_id: int,
    teacher_pad_token_id: int | None = None,
) -> PromptBatch:
    """Render and left-pad each example's student and teacher prompts: the student's with ``pad_token_id``,
    the teacher's with ``teacher_pad_token_id`` (across tokenizers the teacher's own, since the student's pad id
    may lie past the teacher's embedding rows; ``None``: one tokenizer, the same id)."""
    student_rows = [prompt_token_ids(task, student_tokenizer, ex, "student", max_prompt_tokens) for ex in examples]
    teacher_rows = [prompt_token_ids(task, teacher_tokenizer, ex, "teacher", max_prompt_tokens) for ex in examples]
    student_ids, student_mask = left_pad(student_rows, pad_token_id)
    teacher_ids, teacher_mask = left_pad(teacher_rows, pad_token_id if teacher_pad_token_id is None else teacher_pad_token_id)
    return PromptBatch(list(examples), student_ids, student_mask, teacher_ids, teacher_mask)


def decode_completions(tokenizer: Any, completion_ids: torch.Tensor, completion_mask: torch.Tensor, end_ids: Sequence[int]) -> list[str]:
    """Text of each completion: its masked-in tokens without a final end token, special tokens kept."""
    texts = []
    for ids, mask in zip(completion_ids.tolist(), completion_mask.tolist()):
        tokens = [token for token, keep in zip(ids, mask) if keep]
        if tokens and tokens[-1] in end_ids:
            tokens = tokens[:-1]
        texts.append(tokenizer.decode(tokens, skip_special_tokens=False))
    return texts


def read_jsonl(path: str, setting: str, fields: Sequence[str] = (), hint: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``("<path>:<line>", row)`` for each non-blank line of a JSONL file.

    Errors name the setting, file, line and field: a missing file (``FileNotFoundError``), invalid
    JSON, a row that is not an object or lacks one of the string ``fields`` (``ValueError``).
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{setting}: no such file {path!r}{hint}")
    with file.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: not valid JSON ({error.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: a row must be a JSON object")
            for field in fields:
                if not isinstance(row.get(field), str):
                    raise ValueError(f"{where}: missing string field {field!r}")
            yield where, row
