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
  ``{model, prompt, return_token_ids: true}`` with every sampling setting the in-process vLLM engine pins
  (:func:`~kdlab.rollouts.vllm_sampling.completion_fields` of :func:`~kdlab.rollouts.vllm_sampling.sampling_params`:
  ``max_tokens: C, temperature, seed, stop_token_ids, skip_special_tokens: false``, ``top_p: 1``, ``top_k: -1``,
  ``min_p: 0``, neutral penalties, a padded output layer's rows biased out: ``vllm serve`` fills a field left out
  from the model's ``generation_config.json``) -> ``choices[0].token_ids``, ``choices[0].finish_reason``.

**Temperature.** vLLM computes prompt log-probs from the raw logits: no temperature is applied to them
(``logprobs_mode`` raw or processed alike: prompt tokens skip the sampling processors). kdlab tempers them
itself: ``log pi_T(v) = l(v) / tau - log Z`` with ``Z = sum_v exp(l(v) / tau)``. With ``top_k`` equal to the
vocabulary (``-1``) this is exact. With K < V the tail's share of ``Z`` is unknown; kdlab uses its upper bound
(the tail mass ``m = 1 - sum_K p`` at the K-th probability ``p_K``: ``m * p_K ** (1/tau - 1)`` for ``tau <= 1``;
``(V - K) ** (1 - 1/tau) * m ** (1/tau)`` for ``tau > 1``, Hölder), so the tempered top-K probabilities are
lower bounds, exact when the tail is flat; the remaining tempered mass is spread over the other tokens as in a
top-k cache. ``tail_bounds`` gives both ends (tail share 0 and the bound) for tests and diagnostics.

**Padded output layers.** vLLM answers for every row of the model's output layer (its config's ``vocab_size``,
:meth:`ServedTeacher.head_rows`), which may have padding rows past the tokenizer's tokens (Qwen2.5: 151,936
rows, 151,665 tokens; ``kdlab://tiny-random/teacher``: 384 rows, 353 tokens): with ``top_k`` -1 every position
holds all of them. kdlab accepts ids below the row count, drops those past the tokenizer and leaves their mass
to the tail (:func:`kdlab.served_wire.ranked_topk`); with ``-1`` the tokens' log-probs are normalised over the
tokens, as the in-process teacher's softmax over the tokenizer's columns.

**Failures.** Each request attempt has a deadline for the whole exchange (``timeout_s``) and a byte limit
derived from the request, and is retried (``retries`` more times, with backoff and jitter) on a connection
error, a timeout, an HTTP 5xx, 408 or 429, or a response that is not the JSON vLLM returns; then the run stops
with a :class:`ServedTeacherError` naming the endpoint (its URL redacted), the attempts made and the last
error. Lightning then writes the exception checkpoint; the last periodic checkpoint is untouched.

**Every reply is checked** on the host before a tensor is made of it (:mod:`kdlab.served_replies`): choice
indices exactly ``0..n-1``, at most ``K + 1`` entries per position, ids in ``[0, V)`` and none twice at a
position, log-probs finite and ``<= 0`` and each position's probabilities summing to at most 1 (both up to
:data:`~kdlab.served_replies.LOGPROB_TOLERANCE`), each position holding the prompt's own token (a reply
scored on another prompt lacks it), sampled completions of at most ``max_tokens`` ids in
``[0, V)``; a reply that fails is a :class:`ServedTeacherError` naming the endpoint and the field, never a
device-side assert or a silently wrong loss.

**Keys.** ``api_key_env`` names the environment variable holding the server's key (``vllm serve --api-key``);
it is read at each request, stripped of surrounding whitespace and sent as a bearer token, never stored; a key
with a control or non-ASCII character inside is refused naming the variable, and no error quotes a header. A URL
with a user, password, query or fragment is refused.

**Cost.** Connections are kept open (HTTP/1.1, one per request thread). Scoring replies are received and
decoded by a helper process (``decode_workers``, :mod:`kdlab.served_workers`): by ``orjson`` when it is installed
(``json`` otherwise; ``pip install 'kdlab[served]'``: about three times faster), their log-probs ranked and
cut to K for every position at once (numpy, :func:`ranked_topk`); the training process receives the arrays and
tempers them once per micro-batch. With ``prefetch``
(:meth:`kdlab.teachers.served.Served.prefetch`) the next decode group's requests go out while the current
one trains; the results are the same as without.
"""

from __future__ import annotations

import http.client
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kdlab.served_replies import sampled_tokens
from kdlab.served_wire import (
    BYTES_PER_ENTRY,
    BYTES_PER_REPLY,
    ServedTeacherError,
    Wire,
    check_url,
    collection_paused,
    json_loads,
    prompt_logprobs_many,
    redact,
)
from kdlab.served_wire import ranked_topk as ranked_topk_arrays
from kdlab.rollouts.vllm_sampling import PADDING_BIAS, check_temperature, completion_fields, padding_bias, sampling_params
from kdlab.served_workers import DecodeWorkers

__all__ = ["ServedTeacher", "ServedTeacherError", "collection_paused", "json_loads", "ranked_topk", "tempered_topk"]

COMPLETION_REQUEST_FIELDS = ("model", "prompt", "prompt_logprobs", "return_token_ids",
                             *completion_fields(sampling_params(1.0, 1, (0,), seed=0, stop=("</answer>",), logit_bias={1: PADDING_BIAS})))
"""The ``CompletionRequest`` fields kdlab sends: a scoring request's, and every sampling setting
(:func:`~kdlab.rollouts.vllm_sampling.completion_fields`)."""
COMPLETION_RESPONSE_FIELDS = {"CompletionResponse": ("model", "choices"),
                              "CompletionResponseChoice": ("index", "prompt_logprobs", "token_ids", "finish_reason", "text"),
                              "Logprob": ("logprob", "rank", "decoded_token")}
"""The response fields kdlab reads, by vLLM class."""
TOKENIZE_FIELDS = {"TokenizeCompletionRequest": ("model", "prompt", "add_special_tokens"), "TokenizeResponse": ("tokens",)}
MODEL_FIELDS = {"ModelCard": ("id",), "ModelList": ("data",)}
PROBE = "Using 3, 7, 25: 25 - 7 = 18, 18 * 3 = 54 <answer>54</answer> éñ 中文"


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
        timeout_s: seconds per request attempt, for the whole exchange (a server that trickles its reply
            is cut off there); retries: further attempts after a failure; backoff_s: the wait before the first
            retry (doubled each time, with up to half again of random jitter); concurrency: requests in flight at once.
        request_prompts: completions scored per request (``prompt`` as a list of token lists, which vLLM
            schedules as one batch); a sampling request carries one prompt (each has its own seed).
        decode_workers: helper processes that send the scoring requests and decode their replies
            (:class:`kdlab.served_workers.DecodeWorkers`), so the training process's interpreter lock stays free
            for its training loop; each takes up to ``concurrency / decode_workers`` (rounded up) scoring requests at
            once, so ``concurrency`` are in flight. 0: the request threads of this process do it.
        prefetch: while a micro-batch trains, ask the server for the next decode group's teacher work
            (its scores, and its samples for ``TeacherRollouts``) when that work does not depend on the student
            (teacher-written completions); the results are the same with and without it.
        api_key_env: the name of an environment variable holding the server's key (``vllm serve --api-key``),
            read at each request and sent as ``Authorization: Bearer``; the key itself is never stored, so it
            reaches no config, log or checkpoint. ``url`` may hold no user, password, query or fragment.
    """

    def __init__(self, url: str, model: str, tokenizer: str, top_k: int = 20, timeout_s: float = 60.0, retries: int = 3,
                 backoff_s: float = 1.0, concurrency: int = 8, request_prompts: int = 8, decode_workers: int = 1,
                 prefetch: bool = True, api_key_env: str | None = None) -> None:
        url = check_url(url)
        if api_key_env is not None and not (isinstance(api_key_env, str) and api_key_env.isidentifier() and api_key_env.isascii()):
            raise ValueError("ServedTeacher.api_key_env must be the NAME of an environment variable (letters, digits, _), "
                             "not the key itself")
        if top_k == 0 or top_k < -1:
            raise ValueError(f"ServedTeacher.top_k must be >= 1 or -1 (the whole vocabulary), got {top_k}")
        for name, value in (("timeout_s", timeout_s), ("concurrency", concurrency), ("request_prompts", request_prompts)):
            if value <= 0:
                raise ValueError(f"ServedTeacher.{name} must be > 0, got {value}")
        if retries < 0 or backoff_s < 0 or decode_workers < 0:
            raise ValueError(f"ServedTeacher.retries, backoff_s and decode_workers must be >= 0, got {retries}, {backoff_s}, {decode_workers}")
        self.url, self.model, self.tokenizer = url.rstrip("/"), model, tokenizer
        self.top_k, self.timeout_s, self.retries, self.backoff_s, self.concurrency = top_k, timeout_s, retries, backoff_s, concurrency
        self.request_prompts, self.decode_workers, self.prefetch = request_prompts, decode_workers, prefetch
        self.api_key_env = api_key_env
        self.vocabulary: int | None = None  # len(tokenizer), set by check(): every id the server scores or samples past it is no token
        self._start_threads()

    def _start_threads(self) -> None:
        """The request threads (``concurrency``; each keeps its connection), the prefetch thread and the decoding
        processes: made here, started by their first task; the processes stop when this object goes."""
        self._wire = Wire(self.url, self.timeout_s, self.retries, self.backoff_s, self.api_key_env)
        self._pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="served-teacher")
        self._ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="served-teacher-prefetch")
        self._workers = (DecodeWorkers(self.decode_workers, self._wire, self.model, self.top_k, in_flight=self.concurrency)
                         if self.decode_workers else None)
        if self._workers is not None:
            weakref.finalize(self, self._workers.close)

    def __getstate__(self) -> dict[str, Any]:  # threads, connections and processes do not pickle
        return {key: value for key, value in self.__dict__.items() if key not in ("_wire", "_pool", "_ahead", "_workers")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._start_threads()

    # ---- HTTP ------------------------------------------------------------------------------
    def request(self, path: str, payload: dict[str, Any] | None = None, read: Callable[[dict[str, Any]], Any] | None = None,
                max_bytes: int | None = None) -> Any:
        """One JSON request (GET without ``payload``), retried (:meth:`kdlab.served_wire.Wire.request`); raises
        :class:`ServedTeacherError`. ``max_bytes``: the largest reply accepted."""
        return self._wire.request(path, payload, read, max_bytes)

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
        """Before training: the server serves ``model``, tokenizes a probe text and every added token of
        ``tokenizer`` exactly as ``tokenizer`` does, and, when it answers ``GET /tokenizer_info`` (``vllm serve
        --enable-tokenizer-info-endpoint``; kdlab's loopback server), lists no added token (id and text) that
        ``tokenizer`` lacks: else :class:`ServedTeacherError` naming the endpoint. Then every id the server scores
        past ``len(tokenizer)`` (a padded output layer's row, below :meth:`head_rows`) is dropped, and every id it
        samples must lie below it."""
        where = redact(self.url)
        models = self.request("/v1/models", max_bytes=1 << 20)
        served = [card.get("id") for card in models.get("data", []) if isinstance(card, dict)]
        if self.model not in served:
            raise ServedTeacherError(f"served teacher {where}/v1/models serves {served[:8]}, not ServedTeacher.model={self.model!r}")
        added = {int(i): str(getattr(token, "content", token)) for i, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
        probe = PROBE + "".join(f" {text}" for text in added.values())
        remote = self.request("/tokenize", {"model": self.model, "prompt": probe, "add_special_tokens": False},
                              max_bytes=1 << 20).get("tokens")
        local = tokenizer(probe, add_special_tokens=False)["input_ids"]
        if remote != local:
            raise ServedTeacherError(
                f"served teacher {where}/tokenize: the server's tokenizer gives {str(remote)[:80]} for a probe text, "
                f"ServedTeacher.tokenizer={self.tokenizer!r} gives {str(local)[:80]}: not the same vocabulary"
            )
        try:  # one attempt: a server without the endpoint answers 404, and the check is skipped
            status, body = self._wire.exchange("/tokenizer_info", None, 16 << 20)
        except (OSError, http.client.HTTPException, ValueError) as error:
            raise ServedTeacherError(f"served teacher {where}/tokenizer_info: {error}") from None
        if status == 200:
            try:
                info = json_loads(body)
                theirs = {int(i): str(t.get("content") if isinstance(t, dict) else t) for i, t in (info.get("added_tokens_decoder") or {}).items()}
            except (ValueError, TypeError, AttributeError) as error:
                raise ServedTeacherError(f"served teacher {where}/tokenizer_info: a reply vLLM would not give ({error})") from None
            extra = sorted(set(theirs.items()) - set(added.items()))  # the local ones the probe above has shown the server to have
            if extra:
                raise ServedTeacherError(f"served teacher {where}/tokenizer_info: the server's added tokens differ from "
                                         f"ServedTeacher.tokenizer={self.tokenizer!r}'s (e.g. {extra[:4]}): not the same vocabulary")
        self.vocabulary = len(tokenizer)

    # ---- log-probs ---------------------------------------------------------------------------
    def head_rows(self) -> int | None:
        """The rows of the served model's output layer, which vLLM answers for: the ``vocab_size`` of the config
        found with ``ServedTeacher.tokenizer`` (a model's folder or hub id holds it), read once; ``None`` where
        there is none (a tokenizer alone), and then every served id must be a token of the tokenizer."""
        if "_head_rows" not in self.__dict__:
            from kdlab.models.loading import ModelSpec, load_config, output_rows

            try:
                self._head_rows = output_rows(load_config(ModelSpec(self.tokenizer), "ServedTeacher.tokenizer"))
            except (OSError, ValueError):  # no config there
                self._head_rows = None
        return self._head_rows

    def prompt_logprobs(self, prompt: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The server's untempered top-K ``(ids (n, K), log-probs (n, K))`` (fp64, most likely first) at the
        positions ``start..`` of ``prompt``: each the distribution of that position's token given the tokens
        before it. With ``top_k`` -1, K is every token the server returned (the vocabulary)."""
        ids, values, _ = self.prompt_logprobs_many([prompt], [start])
        return ids, values

    def prompt_logprobs_many(self, prompts: list[list[int]], starts: list[int], vocabulary: int | None = None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """:meth:`prompt_logprobs` of several prompts in one request (by a decoding process when there are
        ``decode_workers``): their rows one after another, and how many each has. Every id is checked below the
        output layer's :meth:`head_rows`; those at or past ``vocabulary`` (and :attr:`vocabulary`, once
        :meth:`check` has run), a padded layer's rows, are dropped (:func:`kdlab.served_wire.ranked_topk`)."""
        bounds = [bound for bound in (vocabulary, self.vocabulary) if bound is not None]
        vocabulary = min(bounds) if bounds else None
        if self._workers is not None:
            ids, values, counts = self._workers.run(prompts, starts, vocabulary, self.head_rows())
        else:
            ids, values, counts = prompt_logprobs_many(self._wire, self.model, self.top_k, prompts, starts, vocabulary, self.head_rows())
        return torch.from_numpy(ids), torch.from_numpy(values), counts

    def score(self, prompts: list[list[int]], completions: list[list[int]], temperature: float, columns: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each completion's tempered top-K ``(ids (n_i, K), log-probs (n_i, K) fp32)`` (:func:`tempered_topk`)
        after its prompt: requests of up to ``request_prompts`` completions, ``concurrency`` at once, then one
        tempering for every position. K is the fewest any request kept (a padded output layer's rows among a
        position's top K drop out: :func:`kdlab.served_wire.ranked_topk`)."""
        size = self.request_prompts
        parts = self.concurrently(lambda first: self.prompt_logprobs_many([p + c for p, c in zip(prompts[first : first + size], completions[first : first + size])],
                                                                          [len(p) for p in prompts[first : first + size]], columns),
                                  list(range(0, len(prompts), size)))
        if not parts:
            return []
        k = min(part[0].shape[1] for part in parts)  # most likely first: the first k of each are its k most likely
        ids, values = tempered_topk(torch.cat([part[0][:, :k] for part in parts]), torch.cat([part[1][:, :k] for part in parts]), temperature, columns)
        lengths = [n for part in parts for n in part[2]]
        return list(zip(ids.split(lengths), values.split(lengths)))

    def padding_bias(self) -> dict[int, float] | None:
        """The logit bias that keeps the served model's padding rows (its output layer's :meth:`head_rows` past the
        tokenizer's tokens) out of its samples (:func:`~kdlab.rollouts.vllm_sampling.padding_bias`), read once;
        ``None`` when there are none, or no config gives the row count."""
        if "_padding_bias" not in self.__dict__:
            from kdlab.models.loading import ModelSpec, load_tokenizer

            rows, tokens = self.head_rows(), self.vocabulary
            if rows is not None and tokens is None:  # check() not run: the tokenizer's own length
                tokens = len(load_tokenizer(ModelSpec(self.tokenizer), "ServedTeacher.tokenizer"))
            self._padding_bias = padding_bias(rows, tokens) if rows is not None else None
        return self._padding_bias

    def sample(self, prompt: list[int], max_tokens: int, temperature: float, seed: int, stop_token_ids: list[int]) -> list[int]:
        """A completion sampled by the server at ``temperature`` (0 or in :data:`~kdlab.rollouts.vllm_sampling.VLLM_TEMPERATURES`,
        else ``ValueError``; ``seed`` fixes it), with every sampling setting pinned as the in-process vLLM engine's
        (:func:`~kdlab.rollouts.vllm_sampling.sampling_params`, :func:`~kdlab.rollouts.vllm_sampling.completion_fields`:
        no penalty, no top-k, top-p or min-p cut, the padding rows biased out), end token included when it ended;
        checked (:func:`kdlab.served_replies.sampled_tokens`: at most ``max_tokens`` ids, each below :attr:`vocabulary`)."""
        check_temperature(temperature, "ServedTeacher.sample")
        params = sampling_params(temperature, max_tokens, tuple(stop_token_ids), seed=seed, logprobs=False, logit_bias=self.padding_bias())
        return self.request("/v1/completions", {"model": self.model, "prompt": prompt, "return_token_ids": True, **completion_fields(params)},
                            lambda reply: sampled_tokens(reply, self.model, max_tokens, self.vocabulary),
                            max_bytes=BYTES_PER_REPLY + (max_tokens + len(prompt)) * BYTES_PER_ENTRY)


def ranked_topk(rows: list[dict[str, Any]], top_k: int, vocabulary: int | None = None, head_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kdlab.served_wire.ranked_topk` as tensors: ``(ids (n, K) int64, log-probs (n, K) fp64)``, each
    position's K most likely, most likely first (a padded output layer's rows past ``vocabulary`` dropped)."""
    ids, values = ranked_topk_arrays(rows, top_k, vocabulary, head_rows)
    return torch.from_numpy(ids), torch.from_numpy(values)


def tempered_topk(ids: torch.Tensor, raw: torch.Tensor, temperature: float, columns: int, tail: str = "bound") -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids (n, k), log-probs (n, k) fp32)`` at ``temperature`` from the server's untempered top-k ``ids`` and
    log-probs ``raw`` ``(n, k)`` (most likely first) over ``columns`` tokens.

    ``tail``: ``"bound"`` counts the unseen tokens' share of the tempered normaliser at its upper bound (see the
    module docstring), ``"none"`` as zero; the two bracket the exact values. With ``k`` the whole vocabulary
    (``k = columns``) they are normalised over it: exact, as the in-process teacher's softmax over the
    tokenizer's columns (the server's normaliser also counts a padded output layer's rows, which that softmax
    leaves out). Else, at ``temperature`` 1, ``"bound"`` gives the server's log-probs: exact when the output layer
    has no padding rows, or they hold no mass, and otherwise lower bounds, those rows' mass counted in the tail."""
    k = raw.shape[1]
    if k >= columns:  # the whole vocabulary
        scaled = raw / temperature
        return ids, (scaled - torch.logsumexp(scaled, dim=1, keepdim=True)).float()
    if temperature == 1.0 and tail == "bound":  # the tail's share is its mass: the server's log-probs, as they are
        return ids, raw.float()
    scaled = raw / temperature
    normaliser = torch.logsumexp(scaled, dim=1)
    if tail == "bound":
        mass = (1.0 - raw.exp().sum(1)).clamp(min=0.0)
        p_k = raw[:, -1].exp()
        if temperature < 1.0:
            share = mass * p_k ** (1.0 / temperature - 1.0)
        else:
            share = (columns - k) ** (1.0 - 1.0 / temperature) * mass ** (1.0 / temperature)
        normaliser = torch.logaddexp(normaliser, share.clamp(min=1e-300).log())
    return ids, (scaled - normaliser[:, None]).float()
