"""Helper processes that send a served teacher's scoring requests and decode their replies
(:class:`DecodeWorkers`), over the wire of :mod:`kdlab.served_wire`; without torch.

    python -m kdlab.served_workers   (a helper process, started by ServedTeacher: pickles on stdin and stdout)

A micro-batch's scoring reply is large (K + 1 entries per position: about a megabyte for 8 completions of 64
tokens at K = 20). Decoding it (JSON, then ranking every position) holds the interpreter lock for about 15 ms
in the training process, time its training loop cannot run; a helper process decodes it beside the training
loop instead and sends back the arrays (160 kB). It imports ``kdlab`` (a few modules), numpy and, when
installed, orjson: it starts in a fraction of a second.
"""

from __future__ import annotations

import gc
import pickle
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from kdlab.served_wire import ServedTeacherError, Wire, prompt_logprobs_many

STARTUP_S = 60.0
"""The longest a helper process may take to start (its imports), apart from each request's deadline."""


class _Helper:
    """One helper process and the requests it is answering, by tag; a reader thread hands each answer to its
    waiting request, and fails them all when the process ends."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process, self.dead, self.load = process, False, 0  # load: requests given to it, not answered yet (DecodeWorkers.lock)
        self.writing, self.lock = threading.Lock(), threading.Lock()
        self.pending: dict[int, Future] = {}
        self.ready = threading.Event()  # its first message (tag -1): imports done, so starting does not eat a request's deadline
        threading.Thread(target=self._read, daemon=True, name="served-teacher-decoded").start()

    def _read(self) -> None:
        error: BaseException = EOFError("the decoding process ended")
        try:
            while True:
                tag, answer = pickle.load(self.process.stdout)
                if tag == -1:
                    self.ready.set()
                    continue
                with self.lock:
                    future = self.pending.pop(tag, None)
                if future is not None:
                    future.set_result(answer)
        except (OSError, EOFError, pickle.UnpicklingError, ValueError) as ended:
            error = ended
        with self.lock:
            self.dead, pending, self.pending = True, self.pending, {}
        self.ready.set()
        for future in pending.values():
            future.set_exception(error)

    def ask(self, tag: int, request: tuple) -> Future:
        if not self.ready.wait(STARTUP_S):
            raise EOFError(f"the decoding process did not start within {STARTUP_S:g} s")
        future: Future = Future()
        with self.lock:
            if self.dead:
                raise EOFError("the decoding process ended")
            self.pending[tag] = future
        with self.writing:
            pickle.dump((tag, *request), self.process.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.process.stdin.flush()
        return future


class DecodeWorkers:
    """``count`` helper processes (``python -m kdlab.served_workers``), each running :func:`prompt_logprobs_many` for
    up to ``ceil(in_flight / count)`` requests at once (threads, each with its own connection), so that
    ``in_flight`` scoring requests (a served teacher's ``concurrency``) are at the server together; started on
    first use, restarted if one dies, stopped by :meth:`close` (and at exit). :meth:`run` blocks its calling
    thread (without the interpreter lock) until its answer comes, at most the wire's whole budget (every
    attempt and backoff) and ``grace_s`` more (once its process has started, :data:`STARTUP_S`): a worker that has not answered by then is killed (the requests
    it held fail) and the request fails naming the endpoint."""

    def __init__(self, count: int, wire: Wire, model: str, top_k: int, grace_s: float = 30.0, in_flight: int = 1) -> None:
        if count < 1 or in_flight < 1:
            raise ValueError(f"DecodeWorkers: count and in_flight must be >= 1, got {count}, {in_flight}")
        self.url, self.per_process = wire.where, -(-in_flight // count)
        self.settings = (wire.url, wire.timeout_s, wire.retries, wire.backoff_s, model, top_k, wire.api_key_env, self.per_process)
        self.limit_s = wire.budget_s() + grace_s
        self.slots = threading.Semaphore(self.per_process * count)
        self.helpers: list[_Helper | None] = [None] * count  # a slot's process starts when first needed
        self.lock, self.tags = threading.Lock(), iter(range(1 << 62))
        self.running: list[subprocess.Popen] = []

    def _start(self) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-m", "kdlab.served_workers"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        pickle.dump(self.settings, process.stdin, protocol=pickle.HIGHEST_PROTOCOL)
        process.stdin.flush()
        self.running.append(process)
        return process

    def _helper(self) -> _Helper:
        """The live helper answering the fewest requests (a slot without one, or with a dead one, gets a new one)."""
        with self.lock:
            for index, helper in enumerate(self.helpers):
                if helper is None or helper.dead or helper.process.poll() is not None:
                    self.helpers[index] = _Helper(self._start())
            chosen = min(self.helpers, key=lambda helper: helper.load)  # type: ignore[union-attr]
            chosen.load += 1  # counted here, under the lock: requests asking together spread over the processes
            return chosen  # type: ignore[return-value]

    def run(self, prompts: list[list[int]], starts: list[int], vocabulary: int | None = None,
            head_rows: int | None = None) -> tuple[np.ndarray, np.ndarray, list[int]]:
        with self.slots:
            helper = None
            try:
                helper = self._helper()
                with self.lock:
                    tag = next(self.tags)
                status, value = helper.ask(tag, (prompts, starts, vocabulary, head_rows)).result(timeout=self.limit_s)
            except TimeoutError:
                self._kill(helper)
                raise ServedTeacherError(f"served teacher {self.url}/v1/completions: its decoding process gave no answer within {self.limit_s:g} s") from None
            except (OSError, EOFError, pickle.UnpicklingError, ValueError) as error:
                self._kill(helper)
                raise ServedTeacherError(f"served teacher {self.url}/v1/completions: its decoding process failed ({error!r})") from None
            finally:
                if helper is not None:
                    with self.lock:
                        helper.load -= 1
        if status != "ok":
            raise ServedTeacherError(value)
        return value

    def _kill(self, helper: _Helper | None) -> None:
        """Stop ``helper``'s process (the requests it held fail); the next request starts a fresh one."""
        if helper is None:
            return
        helper.process.kill()
        with helper.lock:
            helper.dead = True

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
    """A helper process: the settings, then one ``(tag, prompts, starts, vocabulary, head_rows)`` after another on stdin,
    answered by up to ``in_flight`` threads at once; for each, ``(tag, ("ok", (ids, log-probs, counts)))`` or
    ``(tag, ("error", message))`` on stdout, in the order they finish. Ends when stdin closes."""
    gc.disable()  # what it decodes holds no cycles
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write into the answers
    url, timeout_s, retries, backoff_s, model, top_k, api_key_env, in_flight = pickle.load(source)
    wire, writing = Wire(url, timeout_s, retries, backoff_s, api_key_env), threading.Lock()
    pickle.dump((-1, ("ready", None)), sink, protocol=pickle.HIGHEST_PROTOCOL)
    sink.flush()

    def answer(tag: int, prompts: list[list[int]], starts: list[int], vocabulary: int | None, head_rows: int | None) -> None:
        try:
            result: tuple[str, Any] = ("ok", prompt_logprobs_many(wire, model, top_k, prompts, starts, vocabulary, head_rows))
        except ServedTeacherError as error:
            result = ("error", str(error))
        except Exception as error:  # noqa: BLE001 - the training process raises it, naming the endpoint
            result = ("error", f"served teacher {wire.where}/v1/completions: {type(error).__name__}: {error}")
        with writing:
            pickle.dump((tag, result), sink, protocol=pickle.HIGHEST_PROTOCOL)
            sink.flush()

    with ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="served-teacher-decode") as pool:
        while True:
            try:
                request = pickle.load(source)
            except EOFError:
                return
            pool.submit(answer, *request)


if __name__ == "__main__":
    from kdlab.served_workers import (
        main as run,  # the package's module, not __main__: one ServedTeacherError class
    )

    run()
