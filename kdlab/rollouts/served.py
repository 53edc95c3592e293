"""A teacher behind an HTTP endpoint that speaks vLLM's OpenAI-compatible API (``vllm serve``): its top-K
log-probs on each completion, from ``/v1/completions`` with ``prompt_logprobs``, feed the path of
:class:`~kdlab.rollouts.policies.CachedTeacherRollouts` (a :class:`~kdlab.rollouts.teacher_cache.TopKLogprobs`),
so every objective and diagnostic works unchanged and the teacher never sits in training memory.

What is sent and read (the names are checked against vLLM's source by ``scripts/check_vllm_api.py``):

* ``GET /v1/models`` -> ``data[].id``: the served model must be there (else the run stops, naming the endpoint
  and the models it serves);
* ``POST /tokenize`` ``{model, prompt, add_special_tokens}`` -> ``tokens``: a probe text must give the local
  teacher tokenizer's ids (the vocabulary check, before training);
* ``POST /v1/completions`` ``{model, prompt: [token ids], max_tokens: 1, prompt_logprobs: K, temperature}`` ->
  ``choices[0].prompt_logprobs``: per prompt position ``None`` (the first) or ``{token id: {logprob, rank,
  decoded_token}}``, the K most likely tokens plus the prompt's own; and, to sample (online off-policy),
  ``{..., max_tokens: C, temperature, seed, stop_token_ids, return_token_ids: true, skip_special_tokens: false}``
  -> ``choices[0].token_ids``, ``choices[0].finish_reason``.

**Temperature.** vLLM computes prompt log-probs from the raw logits: no temperature is applied to them
(``logprobs_mode`` raw or processed alike: prompt tokens skip the sampling processors). kdlab tempers them
itself: ``log pi_T(v) = l(v) / tau - log Z`` with ``Z = sum_v exp(l(v) / tau)``. With ``top_k`` equal to the
vocabulary (``-1``) this is exact. With K < V the tail's share of ``Z`` is unknown; kdlab uses its upper bound
(the tail mass ``m = 1 - sum_K p`` at the K-th probability ``p_K``: ``m * p_K ** (1/tau - 1)`` for ``tau <= 1``;
``(V - K) ** (1 - 1/tau) * m ** (1/tau)`` for ``tau > 1``, Hölder), so the tempered top-K probabilities are
lower bounds, exact when the tail is flat; the remaining tempered mass is spread over the other tokens as in a
top-k cache. ``tail_bounds`` gives both ends (tail share 0 and the bound) for tests and diagnostics.

**Failures.** Each request has a timeout and is retried (``retries`` more times, with backoff) on a connection
error, a timeout, an HTTP 5xx, or a response that is not the JSON vLLM returns; then the run stops with a
:class:`ServedTeacherError` naming the endpoint, the request and the last error. Lightning then writes the
exception checkpoint; the last periodic checkpoint is untouched.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

COMPLETION_REQUEST_FIELDS = ("model", "prompt", "max_tokens", "prompt_logprobs", "temperature", "seed", "stop_token_ids",
                             "return_token_ids", "skip_special_tokens", "top_p", "top_k")
"""The ``CompletionRequest`` fields kdlab sends."""
COMPLETION_RESPONSE_FIELDS = {"CompletionResponse": ("model", "choices"),
                              "CompletionResponseChoice": ("prompt_logprobs", "token_ids", "finish_reason", "text"),
                              "Logprob": ("logprob", "rank", "decoded_token")}
"""The response fields kdlab reads, by vLLM class."""
TOKENIZE_FIELDS = {"TokenizeCompletionRequest": ("model", "prompt", "add_special_tokens"), "TokenizeResponse": ("tokens",)}
MODEL_FIELDS = {"ModelCard": ("id",), "ModelList": ("data",)}
PROBE = "Using 3, 7, 25: 25 - 7 = 18, 18 * 3 = 54 <answer>54</answer> éñ 中文"


class ServedTeacherError(RuntimeError):
    """The served teacher failed (after its retries) or does not match the run; the message names the endpoint."""


class ServedTeacher:
    """A teacher served by ``vllm serve`` (or anything that answers the same requests), used by
    ``DistillModule(served_teacher=...)``.

    Args:
        url: the server's base URL (``http://host:8000``; ``/v1/...`` is appended).
        model: the served model's name (``--served-model-name``, by default the path ``vllm serve`` was given).
        tokenizer: the teacher's tokenizer (a local folder, ``kdlab://...`` or a hub id): renders the teacher's
            prompts with its chat template; checked against the server's ``/tokenize`` before training.
        top_k: K log-probs per position (``prompt_logprobs``; the server must allow it: ``vllm serve
            --max-logprobs K``); ``-1`` asks for the whole vocabulary (exact tempering).
        timeout_s: seconds per request; retries: further attempts after a failure; backoff_s: the wait before
            the first retry (doubled each time); concurrency: requests in flight at once (one per completion).
    """

    def __init__(self, url: str, model: str, tokenizer: str, top_k: int = 20, timeout_s: float = 60.0, retries: int = 3,
                 backoff_s: float = 1.0, concurrency: int = 8) -> None:
        if top_k == 0 or top_k < -1:
            raise ValueError(f"ServedTeacher.top_k must be >= 1 or -1 (the whole vocabulary), got {top_k}")
        for name, value in (("timeout_s", timeout_s), ("concurrency", concurrency)):
            if value <= 0:
                raise ValueError(f"ServedTeacher.{name} must be > 0, got {value}")
        if retries < 0 or backoff_s < 0:
            raise ValueError(f"ServedTeacher.retries and backoff_s must be >= 0, got {retries} and {backoff_s}")
        self.url, self.model, self.tokenizer = url.rstrip("/"), model, tokenizer
        self.top_k, self.timeout_s, self.retries, self.backoff_s, self.concurrency = top_k, timeout_s, retries, backoff_s, concurrency

    # ---- HTTP ------------------------------------------------------------------------------
    def request(self, path: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        """One JSON request (GET without ``payload``), retried; raises :class:`ServedTeacherError`."""
        endpoint = f"{self.url}{path}"
        data = None if payload is None else json.dumps(payload).encode("utf-8")
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                request = urllib.request.Request(endpoint, data=data, headers={"Content-Type": "application/json"},
                                                 method="GET" if data is None else "POST")
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    body = response.read()
                try:
                    parsed = json.loads(body)
                except (json.JSONDecodeError, UnicodeDecodeError) as error:
                    raise ValueError(f"not JSON ({error}): {body[:120]!r}") from None
                if not isinstance(parsed, dict):
                    raise ValueError(f"not a JSON object: {body[:120]!r}")
                return parsed
            except urllib.error.HTTPError as error:
                last = error
                if error.code < 500:  # the request is wrong: retrying cannot help
                    break
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError, ValueError) as error:
                last = error
        raise ServedTeacherError(f"served teacher {endpoint}: {last} (after {self.retries + 1} attempt(s) of {self.timeout_s:g} s)")

    def concurrently(self, function, items: list) -> list:
        """``[function(item) for item in items]``, up to ``concurrency`` at a time (threads: the requests wait on the server)."""
        if len(items) <= 1 or self.concurrency == 1:
            return [function(item) for item in items]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(items))) as pool:
            return list(pool.map(function, items))

    # ---- checks ------------------------------------------------------------------------------
    def check(self, tokenizer: Any) -> None:
        """Before training: the server serves ``model`` and tokenizes a probe text exactly as ``tokenizer``
        does (the same vocabulary); else :class:`ServedTeacherError` naming the endpoint."""
        models = self.request("/v1/models")
        served = [card.get("id") for card in models.get("data", []) if isinstance(card, dict)]
        if self.model not in served:
            raise ServedTeacherError(f"served teacher {self.url}/v1/models serves {served}, not ServedTeacher.model={self.model!r}")
        remote = self.request("/tokenize", {"model": self.model, "prompt": PROBE, "add_special_tokens": False}).get("tokens")
        local = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
        if remote != local:
            raise ServedTeacherError(
                f"served teacher {self.url}/tokenize: the server's tokenizer gives {str(remote)[:80]} for a probe text, "
                f"ServedTeacher.tokenizer={self.tokenizer!r} gives {str(local)[:80]}: not the same vocabulary"
            )

    # ---- log-probs ---------------------------------------------------------------------------
    def prompt_logprobs(self, prompt: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The server's untempered top-K ``(ids (n, K), log-probs (n, K))`` (fp64, most likely first) at the
        positions ``start..`` of ``prompt``: each the distribution of that position's token given the tokens
        before it. With ``top_k`` -1, K is every token the server returned (the vocabulary)."""
        reply = self.request("/v1/completions", {"model": self.model, "prompt": prompt, "max_tokens": 1,
                                                 "prompt_logprobs": self.top_k, "temperature": 1.0})
        endpoint = f"{self.url}/v1/completions"
        try:
            if reply.get("model") not in (None, self.model):
                raise ValueError(f"answered for model {reply.get('model')!r}, not {self.model!r}")
            rows = reply["choices"][0]["prompt_logprobs"]
            if not isinstance(rows, list) or len(rows) != len(prompt):
                raise ValueError(f"prompt_logprobs has {len(rows) if isinstance(rows, list) else rows!r} entries for a {len(prompt)}-token prompt")
            ids, values = [], []
            for row in rows[start:]:
                # the K most likely by the server's rank; the prompt's own token may come on top as a K+1-th entry
                ranked = sorted(row.items(), key=lambda item: (item[1].get("rank") or math.inf, -item[1]["logprob"]))
                ranked = ranked[: self.top_k] if self.top_k > 0 else ranked
                ids.append([int(token) for token, _ in ranked])
                values.append([float(value["logprob"]) for _, value in ranked])
            width = min((len(row) for row in ids), default=0)
            if self.top_k > 0 and width < self.top_k:
                raise ValueError(f"{width} log-probs at a position, fewer than top_k={self.top_k}")
            return torch.tensor([row[:width] for row in ids], dtype=torch.long).reshape(-1, width), \
                torch.tensor([row[:width] for row in values], dtype=torch.float64).reshape(-1, width)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as error:
            raise ServedTeacherError(f"served teacher {endpoint}: a reply vLLM would not give ({error})") from None

    def sample(self, prompt: list[int], max_tokens: int, temperature: float, seed: int, stop_token_ids: list[int]) -> list[int]:
        """A completion sampled by the server at ``temperature`` (``seed`` fixes it), end token included when it ended."""
        reply = self.request("/v1/completions", {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                                                 "temperature": temperature, "seed": seed, "top_p": 1.0, "top_k": -1,
                                                 "stop_token_ids": stop_token_ids, "return_token_ids": True,
                                                 "skip_special_tokens": False})
        try:
            return [int(token) for token in reply["choices"][0]["token_ids"]]
        except (KeyError, IndexError, TypeError, ValueError) as error:
            raise ServedTeacherError(f"served teacher {self.url}/v1/completions: a reply vLLM would not give ({error})") from None


def tempered_topk(ids: torch.Tensor, raw: torch.Tensor, temperature: float, columns: int, tail: str = "bound") -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids (n, k), log-probs (n, k) fp32)`` at ``temperature`` from the server's untempered top-k ``ids`` and
    log-probs ``raw`` ``(n, k)`` (most likely first).

    ``tail``: ``"bound"`` counts the unseen tokens' share of the tempered normaliser at its upper bound (see the
    module docstring), ``"none"`` as zero; the two bracket the exact values, and agree with them (and each
    other) when ``k`` is the whole vocabulary or ``temperature`` is 1."""
    k = raw.shape[1]
    if temperature == 1.0:  # the server's log-probs are normalised already
        return ids, raw.float()
    scaled = raw / temperature
    normaliser = torch.logsumexp(scaled, dim=1)
    if tail == "bound" and k < columns:
        mass = (1.0 - raw.exp().sum(1)).clamp(min=0.0)
        p_k = raw[:, -1].exp()
        if temperature < 1.0:
            share = mass * p_k ** (1.0 / temperature - 1.0)
        else:
            share = (columns - k) ** (1.0 - 1.0 / temperature) * mass ** (1.0 / temperature)
        normaliser = torch.logaddexp(normaliser, share.clamp(min=1e-300).log())
    return ids, (scaled - normaliser[:, None]).float()
