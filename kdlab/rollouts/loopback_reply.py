"""The loopback server's replies (:mod:`kdlab.rollouts.loopback`) in vLLM's JSON: a ``CompletionResponse`` with one
choice per prompt, its ``prompt_logprobs`` as vLLM writes them and, for a student's sampler, its sampled tokens'
``logprobs``; written by orjson when it is installed, with the defects of :data:`~kdlab.rollouts.loopback_faults.FAULTS`
when a test asks for them."""

from __future__ import annotations

import json
import time
from typing import Any

from kdlab.rollouts.loopback_faults import faulty_reply

try:  # writes the replies about seven times faster than json
    from orjson import dumps as json_dumps
except ImportError:  # pragma: no cover - orjson is optional

    def json_dumps(value: Any) -> bytes:
        return json.dumps(value).encode()


def prompt_logprobs(prompt: list[int], result: dict[str, Any], pieces: list[str], names: list[str]) -> list[Any]:
    """``choices[i].prompt_logprobs`` as vLLM gives it: ``None``, then per position ``{id: {logprob, rank,
    decoded_token}}``, the prompt's own token first when it is not among the top K (as vLLM's dict holds it).
    ``result`` holds, per position after the first, the top ``ids`` and their ``values``, the prompt token's log-prob
    ``own`` and its ``ranks``; ``pieces[t]`` is token t's text and ``names[t]`` its JSON key."""
    rows: list[Any] = [None]
    for token, ids, values, own, rank in zip(prompt[1:], result["ids"], result["values"], result["own"], result["ranks"]):
        row = {} if token in ids else {names[token]: {"logprob": own, "rank": rank, "decoded_token": pieces[token]}}
        row.update({names[t]: {"logprob": v, "rank": r, "decoded_token": pieces[t]} for r, t, v in zip(range(1, len(ids) + 1), ids, values)})
        rows.append(row)
    return rows


def completion_reply(payload: dict[str, Any], prompts: list[list[int]], results: list[dict[str, Any]], model_name: str, tokenizer: Any,
                     pieces: list[str], names: list[str], faults: set[str] = frozenset()) -> bytes:
    """vLLM's ``CompletionResponse`` to the request ``payload``: one choice per prompt of ``prompts``, from the
    worker's ``results`` (each with its ``new`` tokens, whether it ``ended``, and the prompt's log-probs when the
    request asked for ``prompt_logprobs``), with the reply ``faults`` injected."""
    choices = []
    asked_prompt_logprobs = payload.get("prompt_logprobs") is not None
    for index, (prompt, result) in enumerate(zip(prompts, results)):
        new = result["new"]
        text = tokenizer.decode(new, skip_special_tokens=payload.get("skip_special_tokens", True) is not False)
        choice: dict[str, Any] = {"index": index, "text": text, "logprobs": None, "finish_reason": "stop" if result["ended"] else "length",
                                  "stop_reason": None, "token_ids": None,
                                  "prompt_logprobs": prompt_logprobs(prompt, result, pieces, names) if asked_prompt_logprobs else None,
                                  "prompt_token_ids": None}
        if payload.get("return_token_ids"):
            choice["token_ids"], choice["prompt_token_ids"] = new, prompt
        if payload.get("logprobs") is not None and "token_logprobs" in result:  # vLLM's CompletionLogProbs
            texts = [pieces[t] for t in new]
            choice["logprobs"] = {"text_offset": [sum(map(len, texts[:i])) for i in range(len(texts))], "token_logprobs": result["token_logprobs"],
                                  "tokens": texts, "top_logprobs": [{piece: value} for piece, value in zip(texts, result["token_logprobs"])]}
        choices.append(choice)
    prompt_tokens, completion_tokens = sum(map(len, prompts)), sum(len(result["new"]) for result in results)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}
    if faults:
        return faulty_reply(faults, len(pieces), {"id": "cmpl-fault", "object": "text_completion", "created": int(time.time()), "model": model_name,
                                                  "choices": choices, "usage": usage}, int(payload.get("max_tokens", 16)))
    return json_dumps({"id": f"cmpl-{time.time_ns()}", "object": "text_completion", "created": int(time.time()), "model": model_name,
                       "choices": choices, "usage": usage})
