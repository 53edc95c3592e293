"""What a served teacher's replies may hold, checked in the training process before any array or tensor is
made of them (:mod:`kdlab.served_wire` reads the replies): ids in ``[0, R)`` (``R`` the rows of the served model's
output layer: its tokenizer's ``V`` tokens and any padding rows) and none twice at a position,
log-probs finite and at most 0, each position's probabilities summing to at most 1 (both up to
:data:`LOGPROB_TOLERANCE`), at most ``top_k + 1`` entries per position, each position holding the prompt's own
token, choice indices exactly ``0..n-1``, sampled completions of at most ``max_tokens`` ids in ``[0, V)``. Each
check raises ``ValueError`` naming the field, which the wire turns into a
:class:`~kdlab.served_wire.ServedTeacherError` naming the endpoint. No torch.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

import numpy as np

LOGPROB_TOLERANCE = 1e-3
"""How far above 0 a served log-prob, and above 1 a position's total probability, may lie (fp32 rounding of
a softmax, and of the server's JSON); anything past it is a reply no model gives."""


def check_entries(rows: list[dict[str, Any]], top_k: int, head_rows: int | None) -> np.ndarray:
    """The entry count of each of a reply's ``prompt_logprobs`` positions ``rows``, after checking that
    each is a dict of at most ``top_k + 1`` entries (with ``top_k`` -1, ``head_rows``: the rows of the served
    model's output layer, for which vLLM answers) before any array is sized from them. Raises ``ValueError``
    naming the field."""
    if not all(type(row) is dict for row in rows):
        raise ValueError("prompt_logprobs: a position after the first is not an object of log-probs")
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    most = top_k + 1 if top_k > 0 else head_rows
    if most is not None and lengths.size and int(lengths.max()) > most:
        asked = (f"the {most} asked for (top_k + 1 = {top_k + 1})" if top_k > 0
                 else f"the {most} rows of the served model's output layer (the vocab_size of ServedTeacher.tokenizer's config; "
                      "without a config, the tokenizer's tokens)")
        raise ValueError(f"prompt_logprobs: a position has {int(lengths.max())} entries, more than {asked}")
    return lengths


def check_values(ids: np.ndarray, values: np.ndarray, lengths: np.ndarray, head_rows: int | None) -> None:
    """The checks of a reply's entries (``ids``, ``values``: every position's, one after another; ``lengths``:
    how many each position has): ids in ``[0, head_rows)`` (the rows of the served model's output layer), none
    twice in a position, log-probs finite and at most ``LOGPROB_TOLERANCE``, each position's probabilities
    summing to at most ``1 + LOGPROB_TOLERANCE``. Raises ``ValueError`` naming the field."""
    if not ids.size:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (head_rows is not None and high >= head_rows):
        raise ValueError(f"prompt_logprobs: token id {low if low < 0 else high} outside the rows of the served model's output layer "
                         f"[0, {head_rows})")
    row = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
    keyed = np.sort(row * (high + 1) + ids)
    if bool((np.diff(keyed) == 0).any()):
        repeated = int(keyed[1:][np.diff(keyed) == 0][0] % (high + 1))
        raise ValueError(f"prompt_logprobs: token id {repeated} appears twice at one position")
    if not bool(np.isfinite(values).all()):
        raise ValueError("prompt_logprobs: a logprob is not finite (NaN or infinite)")
    if float(values.max()) > LOGPROB_TOLERANCE:
        raise ValueError(f"prompt_logprobs: a logprob of {float(values.max()):g} > 0, a probability above 1")
    mass = np.zeros(lengths.size)
    np.add.at(mass, row, np.exp(values))
    if float(mass.max()) > 1.0 + LOGPROB_TOLERANCE:
        raise ValueError(f"prompt_logprobs: a position's probabilities sum to {float(mass.max()):.6g} > 1")


def check_own_tokens(positions: list[Any], prompt: list[int], start: int, which: int) -> None:
    """A ``prompt_logprobs`` reply's ``positions`` (one per token of ``prompt``, the first ``None``) for prompt number
    ``which`` of its request: each position ``j >= max(start, 1)`` must hold an entry for the prompt's own token ``j``,
    which vLLM always includes, besides the K most likely. Else ``ValueError`` naming the first position without
    it: a reply computed on another prompt (a server or proxy that mixed up its requests). With ``top_k`` -1 every
    token is at every position, so a reply for another prompt of the same length passes this check."""
    first = max(start, 1)
    rows, names = positions[first:], [str(token) for token in prompt[first:]]
    if all(type(row) is dict for row in rows) and all(map(dict.__contains__, rows, names)):
        return
    for j, (row, name) in enumerate(zip(rows, names), first):
        if type(row) is not dict or name not in row:
            raise ValueError(f"prompt_logprobs of prompt {which}: position {j} holds no entry for the prompt's own token {name} "
                             "(vLLM always sends it): a reply for another prompt")


def ordered_choices(reply: dict[str, Any], count: int) -> list[dict[str, Any]]:
    """``reply["choices"]`` in ``index`` order, checked: ``count`` of them, indices exactly ``0..count-1``."""
    choices = reply["choices"]
    if not isinstance(choices, list) or not all(isinstance(choice, dict) for choice in choices):
        raise ValueError("choices is not a list of objects")
    indices = [choice.get("index") for choice in choices]
    if any(type(index) is not int for index in indices):
        raise ValueError(f"choices: an index is missing or not an integer ({indices[:8]})")
    if sorted(indices) != list(range(count)):
        raise ValueError(f"choices: indices {sorted(indices)[:8]} are not exactly 0..{count - 1} for {count} prompt(s)")
    return sorted(choices, key=itemgetter("index"))


def sampled_tokens(reply: dict[str, Any], model: str, max_tokens: int, vocabulary: int | None) -> list[int]:
    """The token ids of a sampling reply's one choice, checked: the model, ``choices`` exactly index 0,
    ``token_ids`` a list of at most ``max_tokens`` integers in ``[0, vocabulary)``."""
    if reply.get("model") not in (None, model):
        raise ValueError(f"answered for model {reply.get('model')!r}, not {model!r}")
    (choice,) = ordered_choices(reply, 1)
    tokens = choice["token_ids"]
    if not isinstance(tokens, list) or any(type(token) is not int for token in tokens):
        raise ValueError("token_ids is not a list of integers")
    if len(tokens) > max_tokens:
        raise ValueError(f"token_ids: {len(tokens)} tokens sampled, more than max_tokens={max_tokens}")
    if tokens and (min(tokens) < 0 or (vocabulary is not None and max(tokens) >= vocabulary)):
        raise ValueError(f"token_ids: token id {min(tokens) if min(tokens) < 0 else max(tokens)} outside the vocabulary [0, {vocabulary})")
    return tokens


def sampled_logprobs(reply: dict[str, Any], count: int) -> list[float]:
    """The log-prob of each of the ``count`` tokens a sampling reply's one choice holds (asked for with
    ``logprobs: 0``: ``choices[0].logprobs.token_logprobs``, vLLM's ``CompletionLogProbs``), checked: ``count`` of
    them, each finite and at most ``LOGPROB_TOLERANCE``."""
    (choice,) = ordered_choices(reply, 1)
    logprobs = choice.get("logprobs")
    values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    if not isinstance(values, list) or len(values) != count:
        have = f"{len(values)} values" if isinstance(values, list) else repr(values)[:40]
        raise ValueError(f"logprobs.token_logprobs: {have} for {count} sampled tokens (is the server asked with logprobs: 0?)")
    if any(type(value) not in (int, float) or not np.isfinite(value) or value > LOGPROB_TOLERANCE for value in values):
        raise ValueError("logprobs.token_logprobs: a value is not a finite log-prob at most 0")
    return [float(value) for value in values]
