"""A teacher behind an HTTP endpoint that speaks vLLM's OpenAI-compatible API (``vllm serve``): its top-K
log-probs on each completion, from ``/v1/completions`` with ``prompt_logprobs``, feed the path of
:class:`~kdlab.rollouts.policies.CachedTeacherRollouts` (a :class:`~kdlab.rollouts.teacher_cache.TopKLogprobs`),
so every objective and diagnostic works unchanged and the teacher never sits in training memory.

What is sent and read (the names are checked against vLLM's source by ``scripts/check_vllm_api.py``):

* ``GET /v1/models`` -> ``data[].id``: the served model must be there (else the run stops, naming the endpoint
  and the models it serves);
* ``POST /tokenize`` ``{model, prompt, add_special_tokens}`` -> ``tokens``: a probe text must give the local
  teacher tokenizer's ids (the vocabulary check, before training);
* ``POST /v1/completions`` ``{model, prompt: [[token ids], ...], max_tokens: 1, prompt_logprobs: K, temperature}``
  (up to ``request_prompts`` completions after their prompts per request, one ``choices[i]`` each, by ``index``)
  -> ``choices[i].prompt_logprobs``: per prompt position ``None`` (the first) or ``{token id: {logprob, rank,
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

**Cost.** Connections are kept open (HTTP/1.1, one per request thread). A reply is decoded by ``orjson`` when
it is installed (``json`` otherwise; ``pip install orjson``: about three times faster) with the cyclic
garbage collector paused (:func:`collection_paused`), and its log-probs are ranked and cut to K for every
position at once (numpy, :func:`ranked_topk`), then tempered once per micro-batch. With ``prefetch``
(:func:`kdlab.stages.teachers.prefetch_served`) the next decode group's requests go out while the current
one trains; the results are the same as without.
"""

from __future__ import annotations

import contextlib
import gc
import http.client
import json
import math
import threading
import time
import urllib.parse
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import chain
from operator import itemgetter
from typing import Any, Callable

import numpy as np
import torch

try:  # decodes vLLM's replies about three times faster than json
    from orjson import loads as json_loads
except ImportError:  # pragma: no cover - orjson is optional
    json_loads = json.loads

COMPLETION_REQUEST_FIELDS = ("model", "prompt", "max_tokens", "prompt_logprobs", "temperature", "seed", "stop_token_ids",
                             "return_token_ids", "skip_special_tokens", "top_p", "top_k")
"""The ``CompletionRequest`` fields kdlab sends."""
COMPLETION_RESPONSE_FIELDS = {"CompletionResponse": ("model", "choices"),
                              "CompletionResponseChoice": ("index", "prompt_logprobs", "token_ids", "finish_reason", "text"),
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
            the first retry (doubled each time); concurrency: requests in flight at once.
        request_prompts: completions scored per request (``prompt`` as a list of token lists, which vLLM
            schedules as one batch); a sampling request carries one prompt (each has its own seed).
        prefetch: while a micro-batch trains, ask the server for the next decode group's teacher work
            (its scores, and its samples for ``TeacherRollouts``) when that work does not depend on the student
            (teacher-written completions); the results are the same with and without it.
    """

    def __init__(self, url: str, model: str, tokenizer: str, top_k: int = 20, timeout_s: float = 60.0, retries: int = 3,
                 backoff_s: float = 1.0, concurrency: int = 8, request_prompts: int = 8, prefetch: bool = True) -> None:
        if top_k == 0 or top_k < -1:
            raise ValueError(f"ServedTeacher.top_k must be >= 1 or -1 (the whole vocabulary), got {top_k}")
        for name, value in (("timeout_s", timeout_s), ("concurrency", concurrency), ("request_prompts", request_prompts)):
            if value <= 0:
                raise ValueError(f"ServedTeacher.{name} must be > 0, got {value}")
        if retries < 0 or backoff_s < 0:
            raise ValueError(f"ServedTeacher.retries and backoff_s must be >= 0, got {retries} and {backoff_s}")
        self.url, self.model, self.tokenizer = url.rstrip("/"), model, tokenizer
        self.top_k, self.timeout_s, self.retries, self.backoff_s, self.concurrency = top_k, timeout_s, retries, backoff_s, concurrency
        self.request_prompts, self.prefetch = request_prompts, prefetch
        self._start_threads()

    def _start_threads(self) -> None:
        """The request threads (``concurrency``; each keeps its connection) and the prefetch thread: made
        here, started by their first task."""
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="served-teacher")
        self._ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="served-teacher-prefetch")

    def __getstate__(self) -> dict[str, Any]:  # threads and connections do not pickle
        return {key: value for key, value in self.__dict__.items() if key not in ("_local", "_pool", "_ahead")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._start_threads()

    # ---- HTTP ------------------------------------------------------------------------------
    def _connection(self) -> http.client.HTTPConnection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            parts = urllib.parse.urlsplit(self.url)
            kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
            connection = self._local.connection = kind(parts.hostname, parts.port, timeout=self.timeout_s)
            self._local.base = parts.path
        return connection

    def _exchange(self, path: str, data: bytes | None) -> tuple[int, bytes]:
        """One HTTP exchange on this thread's kept-alive connection: ``(status, body)``. A connection the
        server closed while idle is reopened once, at no retry's cost."""
        for again in (False, True):
            connection = self._connection()
            reused = connection.sock is not None
            try:
                connection.request("GET" if data is None else "POST", self._local.base + path, body=data,
                                   headers={"Content-Type": "application/json"})
                response = connection.getresponse()
                body = response.read()
            except Exception as error:
                connection.close()  # a late reply must not be read as the next request's
                if reused and not again and isinstance(error, (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)):
                    continue
                raise
            if response.will_close:
                connection.close()
            return response.status, body
        raise AssertionError("unreachable")

    def request(self, path: str, payload: dict[str, Any] | None = None, read: Callable[[dict[str, Any]], Any] | None = None) -> Any:
        """One JSON request (GET without ``payload``), retried; raises :class:`ServedTeacherError`. ``read``
        turns the decoded reply into what is returned, with the cyclic garbage collector paused
        (:func:`collection_paused`): a reply of many log-probs is freed before it can be promoted; a
        ``ValueError`` from it is a reply vLLM would not give, which no retry mends."""
        endpoint = f"{self.url}{path}"
        data = None if payload is None else json.dumps(payload).encode("utf-8")
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                status, body = self._exchange(path, data)
                if status >= 400:
                    last = ServedTeacherError(f"HTTP {status}: {body[:120]!r}")
                    if status < 500:  # the request is wrong: retrying cannot help
                        break
                    continue
                with collection_paused():
                    try:
                        parsed = json_loads(body)
                    except (ValueError, UnicodeDecodeError) as error:
                        raise ValueError(f"not JSON ({error}): {body[:120]!r}") from None
                    if not isinstance(parsed, dict):
                        raise ValueError(f"not a JSON object: {body[:120]!r}")
                    if read is None:
                        return parsed
                    try:
                        result = read(parsed)
                    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as error:
                        raise ServedTeacherError(f"served teacher {endpoint}: a reply vLLM would not give ({error})") from None
                    del parsed  # freed by refcounting while the collector is still off
                return result
            except (OSError, http.client.HTTPException, ValueError) as error:
                last = error
        raise ServedTeacherError(f"served teacher {endpoint}: {last} (after {self.retries + 1} attempt(s) of {self.timeout_s:g} s)")

    def concurrently(self, function: Callable[[Any], Any], items: list) -> list:
        """``[function(item) for item in items]``, up to ``concurrency`` at a time (threads: the requests wait on the server)."""
        items = list(items)
        if len(items) <= 1 or self.concurrency == 1:
            return [function(item) for item in items]
        return list(self._pool.map(function, items))

    def in_background(self, function: Callable[[], Any]) -> Future:
        """``function()`` in the prefetch thread (one at a time, in order); its requests go through the request threads."""
        return self._ahead.submit(function)

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
        ids, values, _ = self.prompt_logprobs_many([prompt], [start])
        return ids, values

    def prompt_logprobs_many(self, prompts: list[list[int]], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """:meth:`prompt_logprobs` of several prompts in one request: their rows one after another, and how
        many each has."""
        return self.request("/v1/completions", {"model": self.model, "prompt": prompts if len(prompts) > 1 else prompts[0],
                                                "max_tokens": 1, "prompt_logprobs": self.top_k, "temperature": 1.0},
                            lambda reply: self._read_prompt_logprobs(reply, prompts, starts))

    def _read_prompt_logprobs(self, reply: dict[str, Any], prompts: list[list[int]], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        if reply.get("model") not in (None, self.model):
            raise ValueError(f"answered for model {reply.get('model')!r}, not {self.model!r}")
        choices = sorted(reply["choices"], key=lambda choice: choice.get("index", 0))
        if len(choices) != len(prompts):
            raise ValueError(f"{len(choices)} choices for {len(prompts)} prompts")
        rows: list[Any] = []
        for choice, prompt, start in zip(choices, prompts, starts):
            positions = choice["prompt_logprobs"]
            if not isinstance(positions, list) or len(positions) != len(prompt):
                raise ValueError(f"prompt_logprobs has {len(positions) if isinstance(positions, list) else positions!r} entries "
                                 f"for a {len(prompt)}-token prompt")
            rows += positions[start:]
        ids, values = ranked_topk(rows, self.top_k)
        return ids, values, [len(prompt) - start for prompt, start in zip(prompts, starts)]

    def score(self, prompts: list[list[int]], completions: list[list[int]], temperature: float, columns: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each completion's tempered top-K ``(ids (n_i, K), log-probs (n_i, K) fp32)`` (:func:`tempered_topk`)
        after its prompt: requests of up to ``request_prompts`` completions, ``concurrency`` at once, then one
        tempering for every position."""
        size = self.request_prompts
        parts = self.concurrently(lambda first: self.prompt_logprobs_many([p + c for p, c in zip(prompts[first : first + size], completions[first : first + size])],
                                                                          [len(p) for p in prompts[first : first + size]]),
                                  list(range(0, len(prompts), size)))
        if not parts:
            return []
        ids, values = tempered_topk(torch.cat([part[0] for part in parts]), torch.cat([part[1] for part in parts]), temperature, columns)
        lengths = [n for part in parts for n in part[2]]
        return list(zip(ids.split(lengths), values.split(lengths)))

    def sample(self, prompt: list[int], max_tokens: int, temperature: float, seed: int, stop_token_ids: list[int]) -> list[int]:
        """A completion sampled by the server at ``temperature`` (``seed`` fixes it), end token included when it ended."""
        return self.request("/v1/completions", {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                                                "temperature": temperature, "seed": seed, "top_p": 1.0, "top_k": -1,
                                                "stop_token_ids": stop_token_ids, "return_token_ids": True, "skip_special_tokens": False},
                            lambda reply: [int(token) for token in reply["choices"][0]["token_ids"]])


_paused = threading.Lock()
_pausing = [0, False]  # requests decoding now; whether the collector was on before the first of them


@contextlib.contextmanager
def collection_paused():
    """The cyclic garbage collector off while any thread is in this block (re-enabled by the last one out,
    if it was on). A reply's decoded tree (about a hundred thousand objects for a micro-batch's log-probs)
    holds no cycles: refcounting frees it at the block's end. With the collector on, its allocations would
    trigger young collections that promote it, and in time full collections of the whole training process
    (every module torch and Lightning loaded), a pause of a few hundred milliseconds."""
    with _paused:
        if _pausing[0] == 0:
            _pausing[1] = gc.isenabled()
            gc.disable()
        _pausing[0] += 1
    try:
        yield
    finally:
        with _paused:
            _pausing[0] -= 1
            if _pausing[0] == 0 and _pausing[1]:
                gc.enable()


def ranked_topk(rows: list[dict[str, Any]], top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids (n, K) int64, log-probs (n, K) fp64)`` of ``prompt_logprobs`` positions ``rows`` (each ``{token
    id: {logprob, ...}}``: the server's K most likely tokens and the prompt's own): each position's K most
    likely, most likely first (ties in the server's order), so a prompt token outside the top K drops out;
    ``top_k`` -1 keeps them all (the fewest any position has). The entries are read by C-level iteration
    and every position is ranked at once (numpy), with no Python loop per entry."""
    width = max(top_k, 0)
    if not rows:
        return torch.zeros(0, width, dtype=torch.long), torch.zeros(0, width, dtype=torch.float64)
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    shortest, longest, total = int(lengths.min()), int(lengths.max()), int(lengths.sum())
    if top_k > 0 and shortest < top_k:
        raise ValueError(f"{shortest} log-probs at a position, fewer than top_k={top_k}")
    ids = np.fromiter(map(int, chain.from_iterable(rows)), dtype=np.int64, count=total)
    values = np.fromiter(map(itemgetter("logprob"), chain.from_iterable(map(dict.values, rows))), dtype=np.float64, count=total)
    if shortest != longest:  # pad the shorter positions with -inf, which sorts last
        column = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        at = (np.repeat(np.arange(len(rows)), lengths), column)
        padded_ids, padded_values = np.zeros((len(rows), longest), dtype=np.int64), np.full((len(rows), longest), -np.inf)
        padded_ids[at], padded_values[at] = ids, values
        ids, values = padded_ids, padded_values
    ids, values = ids.reshape(len(rows), longest), values.reshape(len(rows), longest)
    order = np.argsort(-values, axis=1, kind="stable")[:, : top_k if top_k > 0 else shortest]
    return torch.from_numpy(np.take_along_axis(ids, order, 1)), torch.from_numpy(np.take_along_axis(values, order, 1))


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
