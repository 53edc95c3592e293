"""The loopback server's fault switches (:data:`FAULTS`): defects of a reply that a client of ``vllm serve`` must
refuse, naming them, and :func:`faulty_reply`, which writes them into a reply (tests of kdlab's served teacher)."""

from __future__ import annotations

import json
from typing import Any

FAULTS = {
    "timeout": "sleeps 30 s before answering", "malformed": "a reply that is not JSON", "error": "HTTP 500",
    "wrong_model": "answers for another model", "status_429": "HTTP 429 (too many requests)", "status_400": "HTTP 400",
    "id_out_of_range": "a log-prob entry's id is the output layer's row count", "negative_id": "a log-prob entry's id is -1",
    "repeated_id": "one id twice at a position (keys '5' and '05')", "positive_logprob": "a log-prob of +0.5",
    "nan_logprob": "a log-prob that is NaN", "mass_over_one": "a position whose probabilities sum to about 2",
    "missing_index": "a choice without its index", "duplicate_index": "two choices with index 0",
    "too_many_entries": "a position with K + 2 entries", "long_sample": "a sample one token past max_tokens",
    "sample_out_of_range": "a sampled id the output layer's row count", "huge_reply": "a reply past the request's byte limit",
    "trickle": "the reply one byte every 0.2 s", "hang_up": "closes the connection without a reply",
    "other_prompt": "scores another prompt of the same length (each token id + 1)",
}
"""The fault switches (``LoopbackServer.faults``), each a defect of a reply the client must refuse, naming it."""


def faulty_reply(faults: set[str], columns: int, reply: dict[str, Any], max_tokens: int) -> bytes:
    """``reply`` (a completion reply as a dict) with the defects ``faults`` (:data:`FAULTS`) written in, for an
    output layer of ``columns`` rows."""
    choices = reply["choices"]
    rows = [row for choice in choices for row in (choice["prompt_logprobs"] or [])[1:]]
    row = rows[-1] if rows else None  # the last position: a completion's, which every client reads
    if row is not None:
        first = next(iter(row))
        if "id_out_of_range" in faults:
            row[str(columns)] = row.pop(first)
        if "negative_id" in faults:
            row["-1"] = row.pop(first)
        if "repeated_id" in faults:  # in place of another entry: the count stays K + 1
            row.pop(list(row)[-1])
            row["0" + first] = dict(row[first])
        if "positive_logprob" in faults:
            row[first]["logprob"] = 0.5
        if "mass_over_one" in faults:
            for entry in row.values():
                entry["logprob"] = -0.05
        if "too_many_entries" in faults:
            spare = [t for t in range(columns) if str(t) not in row][:2]
            row.update({str(t): {"logprob": -50.0, "rank": 9999, "decoded_token": ""} for t in spare})
        if "nan_logprob" in faults:
            row[first]["logprob"] = float("nan")  # written NaN by json, which is not JSON
    if "missing_index" in faults:
        del choices[-1]["index"]
    if "duplicate_index" in faults:
        choices[-1]["index"] = 0
    for choice in choices:
        if choice["token_ids"] is not None:
            if "long_sample" in faults:
                choice["token_ids"] = list(choice["token_ids"]) + [0] * (max_tokens + 1 - len(choice["token_ids"]))
            if "sample_out_of_range" in faults:
                choice["token_ids"] = [columns]
    if "huge_reply" in faults:
        reply["padding"] = "x" * (8 << 20)
    return json.dumps(reply).encode()


def other_prompts(payload: dict[str, Any], columns: int) -> dict[str, Any]:
    """``payload`` with each prompt token ``t`` replaced by ``(t + 1) % columns``: a completions request for other
    prompts of the same lengths (the ``other_prompt`` fault: a server or proxy that mixed up its requests)."""
    prompt = payload["prompt"]
    listed = bool(prompt) and isinstance(prompt[0], list)
    shifted = [[(int(t) + 1) % columns for t in one] for one in (prompt if listed else [prompt])]
    return {**payload, "prompt": shifted if listed else shifted[0]}
