"""The wire side of a served teacher, without torch: HTTP to a vLLM-compatible server (kept-alive connections,
timeouts, retries) and the decoding of its ``prompt_logprobs`` replies into numpy arrays, in this process or in
helper processes (:class:`DecodeWorkers`).

    python -m kdlab.served_wire   (a helper process, started by ServedTeacher: pickles on stdin and stdout)

A micro-batch's scoring reply is large (K + 1 entries per position: about a megabyte for 8 completions of 64
tokens at K = 20). Decoding it (JSON, then ranking every position) holds the interpreter lock for about 15 ms
in the training process, time its training loop cannot run; a helper process decodes it beside the training
loop instead and sends back the arrays (160 kB). It imports ``kdlab`` (a few modules), numpy and, when
installed, orjson: it starts in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import gc
import http.client
import json
import math
import pickle
import queue
import subprocess
import sys
import threading
import time
import urllib.parse
from itertools import chain
from operator import itemgetter
from typing import Any, Callable

import numpy as np

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


class Wire:
    """JSON requests to the server at ``url``: each thread keeps its own HTTP/1.1 connection; a request that
    fails (connection error, timeout, HTTP 5xx, a reply that is not JSON) is retried ``retries`` times,
    ``backoff_s`` apart (doubled each time), then raises :class:`ServedTeacherError` naming the endpoint."""

    def __init__(self, url: str, timeout_s: float, retries: int, backoff_s: float) -> None:
        self.url, self.timeout_s, self.retries, self.backoff_s = url.rstrip("/"), timeout_s, retries, backoff_s
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:  # connections do not pickle
        return {key: value for key, value in self.__dict__.items() if key != "_local"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def _connection(self) -> http.client.HTTPConnection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            parts = urllib.parse.urlsplit(self.url)
            kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
            connection = self._local.connection = kind(parts.hostname, parts.port, timeout=self.timeout_s)
            self._local.base = parts.path
        return connection

    def exchange(self, path: str, data: bytes | None) -> tuple[int, bytes]:
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
        """One JSON request (GET without ``payload``), retried. ``read`` turns the decoded reply into what is
        returned, with the cyclic garbage collector paused (:func:`collection_paused`); a ``ValueError`` (or
        ``KeyError``, ...) from it is a reply vLLM would not give, which no retry mends."""
        endpoint = f"{self.url}{path}"
        data = None if payload is None else json.dumps(payload).encode("utf-8")
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                status, body = self.exchange(path, data)
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


def ranked_topk(rows: list[dict[str, Any]], top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids (n, K) int64, log-probs (n, K) float64)`` of ``prompt_logprobs`` positions ``rows`` (each ``{token
    id: {logprob, ...}}``: the server's K most likely tokens and the prompt's own): each position's K most
    likely, most likely first (ties in the server's order), so a prompt token outside the top K drops out;
    ``top_k`` -1 keeps them all (the fewest any position has). The entries are read by C-level iteration
    and every position is ranked at once, with no Python loop per entry."""
    width = max(top_k, 0)
    if not rows:
        return np.zeros((0, width), dtype=np.int64), np.zeros((0, width), dtype=np.float64)
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
    return np.take_along_axis(ids, order, 1), np.take_along_axis(values, order, 1)


def prompt_logprobs_many(wire: Wire, model: str, top_k: int, prompts: list[list[int]], starts: list[int]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """The server's untempered top-K ``(ids, log-probs)`` at positions ``starts[i]..`` of each of ``prompts``, from
    one ``/v1/completions`` request (``prompt_logprobs``): their rows one after another, and how many each has."""

    def read(reply: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, list[int]]:
        if reply.get("model") not in (None, model):
            raise ValueError(f"answered for model {reply.get('model')!r}, not {model!r}")
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
        ids, values = ranked_topk(rows, top_k)
        return ids, values, [len(prompt) - start for prompt, start in zip(prompts, starts)]

    return wire.request("/v1/completions", {"model": model, "prompt": prompts if len(prompts) > 1 else prompts[0], "max_tokens": 1,
                                            "prompt_logprobs": top_k, "temperature": 1.0}, read)


# ---- helper processes ------------------------------------------------------------------------------------
class DecodeWorkers:
    """``count`` helper processes (``python -m kdlab.served_wire``), each running :func:`prompt_logprobs_many`
    for one request at a time; started on first use, restarted if one dies, stopped by :meth:`close` (and at
    exit). :meth:`run` blocks its calling thread (without the interpreter lock) until a worker answers."""

    def __init__(self, count: int, wire: Wire, model: str, top_k: int) -> None:
        self.url, self.settings = wire.url, (wire.url, wire.timeout_s, wire.retries, wire.backoff_s, model, top_k)
        self.idle: queue.Queue[subprocess.Popen | None] = queue.Queue()
        for _ in range(count):
            self.idle.put(None)  # a slot: its process starts when first needed
        self.running: list[subprocess.Popen] = []

    def _start(self) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-m", "kdlab.served_wire"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        pickle.dump(self.settings, process.stdin, protocol=pickle.HIGHEST_PROTOCOL)
        process.stdin.flush()
        self.running.append(process)
        return process

    def run(self, prompts: list[list[int]], starts: list[int]) -> tuple[np.ndarray, np.ndarray, list[int]]:
        process = self.idle.get()
        try:
            if process is None or process.poll() is not None:
                process = self._start()
            pickle.dump((prompts, starts), process.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            process.stdin.flush()
            status, value = pickle.load(process.stdout)
        except (OSError, EOFError, pickle.UnpicklingError) as error:
            if process is not None:
                process.kill()
            process = None  # started afresh by the next request
            raise ServedTeacherError(f"served teacher {self.url}/v1/completions: its decoding process failed ({error!r})") from None
        finally:
            self.idle.put(process)
        if status != "ok":
            raise ServedTeacherError(value)
        return value

    def close(self) -> None:
        for process in self.running:
            if process.poll() is None:
                process.stdin.close()
                try:
                    process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    process.kill()
        self.running.clear()


def main() -> None:
    """A helper process: the settings, then one ``(prompts, starts)`` after another on stdin; for each,
    ``("ok", (ids, log-probs, counts))`` or ``("error", message)`` on stdout. Ends when stdin closes."""
    gc.disable()  # what it decodes holds no cycles
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write into the answers
    url, timeout_s, retries, backoff_s, model, top_k = pickle.load(source)
    wire = Wire(url, timeout_s, retries, backoff_s)
    while True:
        try:
            prompts, starts = pickle.load(source)
        except EOFError:
            return
        try:
            answer: tuple[str, Any] = ("ok", prompt_logprobs_many(wire, model, top_k, prompts, starts))
        except ServedTeacherError as error:
            answer = ("error", str(error))
        except Exception as error:  # noqa: BLE001 - the training process raises it, naming the endpoint
            answer = ("error", f"served teacher {wire.url}/v1/completions: {type(error).__name__}: {error}")
        pickle.dump(answer, sink, protocol=pickle.HIGHEST_PROTOCOL)
        sink.flush()


if __name__ == "__main__":
    from kdlab.served_wire import main as run  # the package's module, not __main__: one ServedTeacherError class

    run()
