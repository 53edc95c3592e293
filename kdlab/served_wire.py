"""The wire side of a served teacher, without torch: HTTP to a vLLM-compatible server (kept-alive connections,
a deadline per exchange, a byte limit per reply, retries, a key from the environment) and the decoding of its
``prompt_logprobs`` replies into numpy arrays, each checked first (:mod:`kdlab.served_replies`), in this process
or in helper processes (:mod:`kdlab.served_workers`).
"""

from __future__ import annotations

import contextlib
import gc
import http.client
import json
import os
import random
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from itertools import chain
from operator import itemgetter
from typing import Any

import numpy as np

from kdlab.served_replies import check_entries, check_own_tokens, check_values, ordered_choices

try:  # decodes vLLM's replies about three times faster than json
    from orjson import loads as json_loads
except ImportError:  # pragma: no cover - orjson is optional
    json_loads = json.loads


class ServedTeacherError(RuntimeError):
    """The served teacher failed (after its retries) or does not match the run; the message names the endpoint."""


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


RETRIED_STATUSES = (408, 429)
"""HTTP statuses below 500 that are retried (timeout, too many requests) like a 5xx; any other 4xx is not."""
BYTES_PER_ENTRY = 512
"""The most bytes one ``{id: {logprob, rank, decoded_token}}`` entry of a reply may take (with the token's text)."""
BYTES_PER_REPLY = 1 << 16
"""Bytes a reply may take besides its entries and tokens (ids, usage, ...)."""


def redact(url: str) -> str:
    """``url`` without what must not reach a message or a file: ``scheme://host[:port]/path`` (any user,
    password, query and fragment dropped)."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:
        return "<an unreadable URL>"
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}{port}{parts.path}".rstrip("/")


def check_url(url: Any, setting: str = "ServedTeacher.url") -> str:
    """``url`` without a trailing ``/``, refused (``ValueError`` naming ``setting`` and the redacted URL)
    unless it is ``http(s)://host[:port][/path]``: a user, password, query or fragment is refused, since the
    URL is written to the run's config and logs (give a key with ``api_key_env``)."""
    if not isinstance(url, str):
        raise ValueError(f"{setting} must be a URL string, got {type(url).__name__}")
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as error:
        raise ValueError(f"{setting}={redact(url)!r} is not a URL ({error})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{setting}={redact(url)!r} must be http://host[:port] or https://host[:port]")
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment or "@" in parts.netloc:
        raise ValueError(f"{setting}={redact(url)!r}: a URL with a user, password, query or fragment is refused (it is written "
                         "to the run's config and logs); give the server's key with ServedTeacher.api_key_env")
    return url.rstrip("/")


class ReplyTooLarge(ValueError):
    """A reply past the byte limit derived from its request: no retry mends it."""


class UnsendableRequest(ValueError):
    """A request http.client refuses to send (a header value or the path holding a character HTTP forbids): no
    retry mends it, and its message never quotes the header, which may carry the key."""


class Wire:
    """JSON requests to the server at ``url``: each thread keeps its own HTTP/1.1 connection; a request that
    fails (connection error, its deadline of ``timeout_s`` for the whole exchange passed, HTTP 5xx, 408 or
    429, a reply that is not JSON) is retried ``retries`` times, ``backoff_s`` apart (doubled each time,
    with random jitter of up to half), then raises :class:`ServedTeacherError` naming the endpoint (redacted)
    and the attempts made. ``api_key_env`` names the environment variable holding the server's key, read at
    each request and sent as ``Authorization: Bearer`` (:meth:`_headers`); the key itself is never stored, and a
    request http.client refuses to send is neither retried nor quoted (:class:`UnsendableRequest`)."""

    def __init__(self, url: str, timeout_s: float, retries: int, backoff_s: float, api_key_env: str | None = None) -> None:
        self.url, self.timeout_s, self.retries, self.backoff_s = check_url(url), timeout_s, retries, backoff_s
        self.api_key_env = api_key_env
        self.where = redact(self.url)
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:  # connections do not pickle
        return {key: value for key, value in self.__dict__.items() if key != "_local"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def budget_s(self) -> float:
        """The longest a :meth:`request` can take: every attempt's deadline and the longest backoffs."""
        return (self.retries + 1) * self.timeout_s + sum(1.5 * self.backoff_s * 2**i for i in range(self.retries))

    def _connection(self) -> http.client.HTTPConnection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            parts = urllib.parse.urlsplit(self.url)
            kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
            connection = self._local.connection = kind(parts.hostname, parts.port, timeout=self.timeout_s)
            self._local.base = parts.path
        return connection

    def _headers(self) -> dict[str, str]:
        """The request's headers, with ``Authorization: Bearer <key>`` when ``api_key_env`` is set: the variable's
        value without surrounding whitespace (a key file with Windows line endings ends in ``\r``). A key still
        holding a control or non-ASCII character is refused (:class:`ServedTeacherError` naming the variable,
        never its value): http.client would refuse the header and quote it in its error."""
        headers = {"Content-Type": "application/json"}
        if self.api_key_env:
            key = (os.environ.get(self.api_key_env) or "").strip()
            if not key:
                raise ServedTeacherError(f"served teacher {self.where}: ServedTeacher.api_key_env={self.api_key_env!r} names an "
                                         "environment variable that is not set (or empty); export the server's key there")
            if not (key.isascii() and key.isprintable()):
                raise ServedTeacherError(f"served teacher {self.where}: the environment variable ServedTeacher.api_key_env={self.api_key_env!r} "
                                         "names holds a control or non-ASCII character inside the key (not shown here); put the key "
                                         "alone in it, on one line")
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def exchange(self, path: str, data: bytes | None, max_bytes: int | None = None) -> tuple[int, bytes]:
        """One HTTP exchange on this thread's kept-alive connection: ``(status, body)``, all of it within
        ``timeout_s`` (a watchdog closes the socket at the deadline, so a server that trickles its bytes
        cannot hold it longer), the body at most ``max_bytes`` (:class:`ReplyTooLarge`). A connection the
        server closed while idle is reopened once, at no retry's cost."""
        headers = self._headers()
        for again in (False, True):
            connection = self._connection()
            reused = connection.sock is not None
            expired = threading.Event()
            deadline = time.monotonic() + self.timeout_s

            def expire(connection: http.client.HTTPConnection = connection) -> None:
                expired.set()
                with contextlib.suppress(OSError, AttributeError):
                    connection.sock.shutdown(socket.SHUT_RDWR)

            watchdog = threading.Timer(self.timeout_s, expire)
            watchdog.daemon = True
            try:
                connection.timeout = self.timeout_s
                if connection.sock is not None:
                    connection.sock.settimeout(self.timeout_s)
                watchdog.start()
                self._local.sent = getattr(self._local, "sent", 0) + 1
                try:
                    connection.request("GET" if data is None else "POST", self._local.base + path, body=data, headers=headers)
                except ValueError:  # http.client's message quotes the refused header, which may be the key
                    raise UnsendableRequest("http.client refused to send the request: a header or the path holds a character "
                                            "HTTP does not allow (not shown: a header may carry the key)") from None
                response = connection.getresponse()
                body = self._read(response, max_bytes, deadline)
                if expired.is_set():
                    raise TimeoutError("the deadline passed")
            except Exception as error:
                connection.close()  # a late reply must not be read as the next request's
                if expired.is_set() and not isinstance(error, ReplyTooLarge):
                    raise TimeoutError(f"timed out: no complete reply within {self.timeout_s:g} s") from None
                if reused and not again and isinstance(error, (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)):
                    continue
                raise
            finally:
                watchdog.cancel()
            if response.will_close:
                connection.close()
            return response.status, body
        raise AssertionError("unreachable")

    @staticmethod
    def _read(response: http.client.HTTPResponse, max_bytes: int | None, deadline: float) -> bytes:
        length = response.getheader("Content-Length")
        if max_bytes is not None and length is not None and length.strip().isdigit() and int(length) > max_bytes:
            raise ReplyTooLarge(f"a reply of {int(length)} bytes, more than the {max_bytes} this request can need")
        chunks, size = [], 0
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError("timed out while reading the reply")
            chunk = response.read1(1 << 20)
            if not chunk:
                if response.length:  # the connection ended before the Content-Length it announced
                    raise http.client.IncompleteRead(b"".join(chunks), response.length)
                response.close()  # read1 leaves a response whose length it used up open; the connection is kept
                return b"".join(chunks)
            chunks.append(chunk)
            size += len(chunk)
            if max_bytes is not None and size > max_bytes:
                raise ReplyTooLarge(f"a reply of more than {max_bytes} bytes, the most this request can need")

    def request(self, path: str, payload: dict[str, Any] | None = None, read: Callable[[dict[str, Any]], Any] | None = None,
                max_bytes: int | None = None) -> Any:
        """One JSON request (GET without ``payload``), retried. ``read`` turns the decoded reply into what is
        returned, with the cyclic garbage collector paused (:func:`collection_paused`); a ``ValueError`` (or
        ``KeyError``, ...) from it is a reply vLLM would not give, which no retry mends. ``max_bytes``: the
        largest reply accepted."""
        endpoint = f"{self.where}{path}"
        data = None if payload is None else json.dumps(payload).encode("utf-8")
        last: Exception | None = None
        self._local.sent = 0  # requests sent, counted by exchange (a connection reopened once included)
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1) * random.uniform(1.0, 1.5))
            try:
                status, body = self.exchange(path, data, max_bytes)
                if status >= 400:
                    last = ServedTeacherError(f"HTTP {status}: {body[:120]!r}" + (" (the server wants a key: set ServedTeacher.api_key_env "
                                                                                   "to the variable holding it)" if status in (401, 403) else ""))
                    if status < 500 and status not in RETRIED_STATUSES:  # the request is wrong: retrying cannot help
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
                    except (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError) as error:
                        raise ServedTeacherError(f"served teacher {endpoint}: a reply vLLM would not give ({error})") from None
                    del parsed  # freed by refcounting while the collector is still off
                return result
            except ReplyTooLarge as error:
                last = error
                break
            except UnsendableRequest as error:
                raise ServedTeacherError(f"served teacher {endpoint}: {error}; not sent, not retried") from None
            except (OSError, http.client.HTTPException, ValueError) as error:
                last = error
        attempts = max(self._local.sent, 1)
        raise ServedTeacherError(f"served teacher {endpoint}: {last} (after {attempts} attempt(s) of at most {self.timeout_s:g} s)")


def ranked_topk(rows: list[dict[str, Any]], top_k: int, vocabulary: int | None = None,
                head_rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(ids (n, K) int64, log-probs (n, K) float64)`` of ``prompt_logprobs`` positions ``rows`` (each ``{token
    id: {logprob, ...}}``: the server's K most likely rows of the model's output layer and the prompt's own
    token): each position's K most likely, most likely first (ties in the server's order), so a prompt token
    outside the top K drops out; ``top_k`` -1 keeps them all (the fewest any position has).

    **Padded output layers.** vLLM answers for every row of the model's output layer (its config's
    ``vocab_size``, ``head_rows``), which may hold padding rows past the tokenizer's ``vocabulary`` tokens
    (Qwen2.5: 151,936 rows, 151,665 tokens). Ids in ``[vocabulary, head_rows)`` are dropped after the ranking:
    their probability stays out of the kept entries, in the mass ``1 - sum`` that a top-K teacher leaves to
    its other tokens (:func:`kdlab.rollouts.served.tempered_topk`), and each position keeps as many entries as
    the one with the fewest tokens of the tokenizer among its K (a position whose K are all padding is refused).
    With ``top_k`` -1 that is every token, whose log-probs the in-process teacher's softmax over the tokenizer's
    columns matches once normalised over them.

    The entries are read by C-level iteration and every position is ranked at once, with no Python loop per
    entry. Every entry is checked first (:func:`check_entries`, :func:`check_values`; ids below ``head_rows``,
    ``vocabulary`` when it is not given): ``ValueError``."""
    width = max(top_k, 0)
    if not rows:
        return np.zeros((0, width), dtype=np.int64), np.zeros((0, width), dtype=np.float64)
    limit = head_rows if head_rows is not None else vocabulary
    lengths = check_entries(rows, top_k, limit)
    shortest, longest, total = int(lengths.min()), int(lengths.max()), int(lengths.sum())
    if top_k > 0 and shortest < top_k:
        raise ValueError(f"{shortest} log-probs at a position, fewer than top_k={top_k}")
    ids = np.fromiter(map(int, chain.from_iterable(rows)), dtype=np.int64, count=total)
    values = np.fromiter(map(float, map(itemgetter("logprob"), chain.from_iterable(map(dict.values, rows)))), dtype=np.float64, count=total)
    check_values(ids, values, lengths, limit)
    if shortest != longest:  # pad the shorter positions with -inf, which sorts last
        column = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        at = (np.repeat(np.arange(len(rows)), lengths), column)
        padded_ids, padded_values = np.zeros((len(rows), longest), dtype=np.int64), np.full((len(rows), longest), -np.inf)
        padded_ids[at], padded_values[at] = ids, values
        ids, values = padded_ids, padded_values
    ids, values = ids.reshape(len(rows), longest), values.reshape(len(rows), longest)
    order = np.argsort(-values, axis=1, kind="stable")[:, : top_k if top_k > 0 else shortest]
    ids, values = np.take_along_axis(ids, order, 1), np.take_along_axis(values, order, 1)
    if vocabulary is not None and limit is not None and limit > vocabulary:
        tokens = ids < vocabulary  # the padding rows' entries drop out; the tokens keep their order
        kept = int(tokens.sum(1).min())
        if kept == 0:
            raise ValueError(f"prompt_logprobs: a position's {ids.shape[1]} most likely rows are all padding rows of the model's "
                             f"output layer (ids >= {vocabulary}, the tokenizer's tokens): ask for a larger top_k")
        order = np.argsort(~tokens, axis=1, kind="stable")[:, :kept]
        ids, values = np.take_along_axis(ids, order, 1), np.take_along_axis(values, order, 1)
    return ids, values


def scoring_bytes(prompts: list[list[int]], top_k: int, head_rows: int | None) -> int:
    """The most bytes a scoring reply for ``prompts`` can need (``BYTES_PER_ENTRY`` per entry, ``top_k + 1``
    entries per position, or the output layer's ``head_rows`` with ``top_k`` -1, and each prompt's ids echoed)."""
    entries = top_k + 1 if top_k > 0 else (head_rows or 1 << 18)
    tokens = sum(map(len, prompts))
    return BYTES_PER_REPLY + tokens * (entries * BYTES_PER_ENTRY + 32) + len(prompts) * BYTES_PER_ENTRY


def prompt_logprobs_many(wire: Wire, model: str, top_k: int, prompts: list[list[int]], starts: list[int],
                         vocabulary: int | None = None, head_rows: int | None = None) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """The server's untempered top-K ``(ids, log-probs)`` at positions ``starts[i]..`` of each of ``prompts``, from
    one ``/v1/completions`` request (``prompt_logprobs``): their rows one after another, and how many each has.
    Every reply is checked before use (:func:`ranked_topk`, :func:`ordered_choices`; ids below ``head_rows``, the
    output layer's rows, and those past the tokenizer's ``vocabulary`` tokens dropped; each position holding the
    prompt's own token: :func:`~kdlab.served_replies.check_own_tokens`)."""

    def read(reply: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, list[int]]:
        if reply.get("model") not in (None, model):
            raise ValueError(f"answered for model {reply.get('model')!r}, not {model!r}")
        choices = ordered_choices(reply, len(prompts))
        rows: list[Any] = []
        for choice, prompt, start in zip(choices, prompts, starts):
            positions = choice["prompt_logprobs"]
            if not isinstance(positions, list) or len(positions) != len(prompt):
                raise ValueError(f"prompt_logprobs has {len(positions) if isinstance(positions, list) else positions!r} entries "
                                 f"for a {len(prompt)}-token prompt")
            rows += positions[start:]
        ids, values = ranked_topk(rows, top_k, vocabulary, head_rows)
        for which, (choice, prompt, start) in enumerate(zip(choices, prompts, starts)):
            check_own_tokens(choice["prompt_logprobs"], prompt, start, which)
        return ids, values, [len(prompt) - start for prompt, start in zip(prompts, starts)]

    return wire.request("/v1/completions", {"model": model, "prompt": prompts if len(prompts) > 1 else prompts[0], "max_tokens": 1,
                                            "prompt_logprobs": top_k, "temperature": 1.0}, read,
                        max_bytes=scoring_bytes(prompts, top_k, head_rows or vocabulary))
