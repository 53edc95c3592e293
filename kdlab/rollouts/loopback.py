"""A minimal server that answers the requests :class:`~kdlab.rollouts.served.ServedTeacher` sends the way
``vllm serve`` does, from a Hugging Face model in this process: for tests, benchmarks and laptops without vLLM.

    python -m kdlab.rollouts.loopback kdlab://tiny/teacher [--port 8000] [--name tiny-teacher] [--max-batch 64]

Endpoints and fields are vLLM's (``GET /v1/models``; ``POST /tokenize``; ``POST /v1/completions`` with
``prompt`` as token ids or a list of them (one ``choices[i]`` each), ``prompt_logprobs`` (K or -1), ``max_tokens``,
``temperature``, ``seed``, ``stop_token_ids``, ``return_token_ids``): prompt log-probs come from the raw logits, as vLLM's
(``logprobs_mode`` does not apply to prompt tokens), each position a ``{token id: {"logprob", "rank",
"decoded_token"}}`` dict of the K most likely tokens (ranks 1..K) plus the prompt's own token (its rank: the
tokens at least as likely), the first position ``None``, ``-inf`` written as -9999.0. HTTP/1.1, so a client
keeps its connections open, as with vLLM's server.

**Batching, as vLLM does.** One worker thread runs the model. The prompts of the scoring requests
(``max_tokens: 1``) that are waiting when it becomes free, up to ``max_batch`` requests, go through one
right-padded forward, as vLLM's scheduler batches a request's prompts and concurrent requests; sampling
runs one prompt at a time. A prompt's
log-probs may then differ in the last bits with the batch it shared (padding and batch size change the
kernels' summation order, in vLLM too); ``max_batch=1`` answers each request alone, deterministically. The
replies are written (JSON, by orjson when it is installed) by the requests' own threads while the worker
runs the next forward.

``faults`` makes it misbehave for tests: ``"timeout"`` (sleeps), ``"malformed"`` (not JSON), ``"error"``
(HTTP 500), ``"wrong_model"`` (another model name), each for the completions requests from ``fault_after`` on.
"""

from __future__ import annotations

import argparse
import gc
import json
import queue
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

try:  # writes the replies about seven times faster than json
    from orjson import dumps as json_dumps
except ImportError:  # pragma: no cover - orjson is optional

    def json_dumps(value: Any) -> bytes:
        return json.dumps(value).encode()

class _Job:
    """One completions request, answered by the worker thread."""

    def __init__(self, payload: dict[str, Any]) -> None:
        prompt = payload["prompt"]
        self.payload, self.listed = payload, bool(prompt) and isinstance(prompt[0], list)
        self.prompts = [[int(token) for token in one] for one in (prompt if self.listed else [prompt])]
        self.k = payload.get("prompt_logprobs")
        self.scores_only = self.k is not None and int(payload.get("max_tokens", 16)) <= 1
        self.done = threading.Event()
        self.results: list[dict[str, Any]] = []
        self.error: BaseException | None = None


class LoopbackServer:
    """Serves ``model`` (a ModelSpec path) under ``name`` on ``127.0.0.1:port`` (0: a free port) in a thread;
    up to ``max_batch`` waiting scoring requests share one forward."""

    def __init__(self, model: str, name: str = "teacher", port: int = 0, max_model_len: int = 512, max_batch: int = 64) -> None:
        from kdlab.models.loading import ModelSpec, load_causal_lm, load_tokenizer

        spec = ModelSpec(model)
        self.model, self.tokenizer = load_causal_lm(spec).eval(), load_tokenizer(spec)
        self.name, self.max_model_len, self.max_batch = name, max_model_len, max_batch
        self.columns = len(self.tokenizer)
        self.pieces = [self.tokenizer.decode([t]) for t in range(self.columns)]  # each token's text, once
        self.names = [str(t) for t in range(self.columns)]  # each token's JSON key
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.worker = threading.Thread(target=self._serve_jobs, daemon=True)
        self.faults: set[str] = set()
        self.fault_after = 0
        self.completions = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: every reply carries its Content-Length

            def setup(self) -> None:
                super().setup()
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a reply's body does not wait for an ACK

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/v1/models":
                    card = {"id": server.name, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                            "root": server.name, "parent": None, "max_model_len": server.max_model_len, "permission": []}
                    self._send(200, json.dumps({"object": "list", "data": [card]}).encode())
                else:
                    self._send(404, b'{"error": "not found"}')

            def do_POST(self) -> None:  # noqa: N802
                payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path == "/tokenize":
                    tokens = server.tokenizer(payload["prompt"], add_special_tokens=payload.get("add_special_tokens", True))["input_ids"]
                    self._send(200, json.dumps({"count": len(tokens), "max_model_len": server.max_model_len, "tokens": tokens}).encode())
                    return
                if self.path != "/v1/completions":
                    self._send(404, b'{"error": "not found"}')
                    return
                server.completions += 1
                fault = server.faults if server.completions > server.fault_after else set()
                if "timeout" in fault:
                    time.sleep(30)
                if "error" in fault:
                    self._send(500, b'{"error": "internal"}')
                    return
                if "malformed" in fault:
                    self._send(200, b'{"choices": [')
                    return
                try:
                    body = server.answer(payload, "another-model" if "wrong_model" in fault else server.name)
                except Exception as error:  # noqa: BLE001 - the client sees a 500, as from vLLM
                    self._send(500, json.dumps({"error": f"{type(error).__name__}: {error}"}).encode())
                    return
                self._send(200, body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> LoopbackServer:
        self.worker.start()
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.jobs.put(None)

    # ---- the worker: batched forwards -------------------------------------------------------------
    def answer(self, payload: dict[str, Any], model_name: str) -> bytes:
        """The JSON reply to one completions request (called by the request's thread; the worker computes)."""
        job = _Job(payload)
        self.jobs.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return self.reply(job, model_name)

    def _serve_jobs(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            batch = [job]
            while len(batch) < max(self.max_batch, 1) and job.scores_only:  # whatever else waits joins its forward
                try:
                    waiting = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if waiting is None:
                    self.jobs.put(None)
                    break
                if not waiting.scores_only:  # a sampling request runs after this batch
                    self._run([waiting])
                    continue
                batch.append(waiting)
            self._run(batch)

    def _run(self, jobs: list[_Job]) -> None:
        try:
            with torch.no_grad():
                if jobs[0].scores_only:
                    prompts = [prompt for job in jobs for prompt in job.prompts]
                    results = iter(self.scores(prompts, [job.k for job in jobs for _ in job.prompts], self.forward(prompts)))
                    for job in jobs:
                        job.results = [next(results) for _ in job.prompts]
                else:
                    (job,) = jobs
                    job.results = [self.complete(job, prompt) for prompt in job.prompts]
        except Exception as error:  # noqa: BLE001 - each request gets it back
            for job in jobs:
                job.error = error
        for job in jobs:
            job.done.set()

    def forward(self, prompts: list[list[int]]) -> torch.Tensor:
        """The prompts' logits ``(B, T, V)`` from one right-padded forward (causal: padding after a prompt
        does not change its positions)."""
        width = max(len(prompt) for prompt in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.tensor(prompt)
            mask[row, : len(prompt)] = 1
        return self.model(input_ids=ids, attention_mask=mask).logits[..., : self.columns].float()

    def scores(self, prompts: list[list[int]], ks: list[int | None], logits: torch.Tensor) -> list[dict[str, Any]]:
        """Each prompt's log-probs from the batch's ``logits``: at each position its top ``k`` (-1: every
        token) and the prompt token's own with its rank; and the next token (greedy)."""
        lengths = torch.tensor([len(prompt) for prompt in prompts])
        new = logits[torch.arange(len(prompts)), lengths - 1].argmax(-1).tolist()
        wanted = [self.columns if k == -1 else min(int(k), self.columns) for k in ks if k is not None]
        if not wanted:
            return [{"new": [token], "ended": False} for token in new]
        logprobs = torch.log_softmax(logits[:, :-1], -1).clamp(min=-9999.0)  # raw: no temperature, as vLLM's prompt log-probs
        values, ids = logprobs.topk(max(wanted), dim=-1)
        targets = torch.zeros(logprobs.shape[:2], dtype=torch.long)
        for row, prompt in enumerate(prompts):
            targets[row, : len(prompt) - 1] = torch.tensor(prompt[1:], dtype=torch.long)
        own = logprobs.gather(2, targets[..., None])
        ranks = (logprobs >= own).sum(2)  # vLLM's rank: how many tokens are at least as likely
        ids, values, own, ranks = ids.tolist(), values.tolist(), own[..., 0].tolist(), ranks.tolist()
        results = []
        for row, (prompt, k) in enumerate(zip(prompts, ks)):
            n = len(prompt) - 1
            result: dict[str, Any] = {"new": [new[row]], "ended": False}
            if k is not None:
                k = self.columns if k == -1 else min(int(k), self.columns)
                top_ids, top_values = ids[row][:n], values[row][:n]
                if k < max(wanted):  # another request in the batch asked for more
                    top_ids, top_values = [r[:k] for r in top_ids], [r[:k] for r in top_values]
                result.update(ids=top_ids, values=top_values, own=own[row][:n], ranks=ranks[row][:n])
            results.append(result)
        return results

    def complete(self, job: _Job, prompt: list[int]) -> dict[str, Any]:
        """A sampled completion of ``prompt`` (and its prompt log-probs when asked for with ``max_tokens > 1``)."""
        payload = job.payload
        result = self.scores([prompt], [job.k], self.forward([prompt]))[0] if job.k is not None else {}
        stops = [int(t) for t in payload.get("stop_token_ids") or []] + [self.tokenizer.eos_token_id]
        result["new"], result["ended"] = self.sample(prompt, int(payload.get("max_tokens", 16)), float(payload.get("temperature", 1.0)),
                                                     payload.get("seed"), stops)
        return result

    def sample(self, prompt: list[int], max_tokens: int, temperature: float, seed: int | None, stops: list[int]) -> tuple[list[int], bool]:
        from kdlab.rollouts.decoding import IncrementalLM, sample_tokens

        generator = torch.Generator().manual_seed(int(seed)) if seed is not None else None
        decoder = IncrementalLM(self.model, torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long), self.columns, temperature)
        ids, mask, _ = sample_tokens(decoder, 1, max_tokens, tuple(stops), int(self.tokenizer.pad_token_id or 0), generator,
                                     greedy=temperature == 0.0)
        tokens = ids[0][mask[0]].tolist()
        return tokens, bool(tokens) and tokens[-1] in stops

    # ---- the reply: vLLM's JSON -------------------------------------------------------------------
    def prompt_logprobs(self, prompt: list[int], result: dict[str, Any]) -> list[Any]:
        """``choices[i].prompt_logprobs`` as vLLM gives it: ``None``, then per position ``{id: {logprob, rank,
        decoded_token}}``, the prompt's own token first when it is not among the top K (as vLLM's dict holds it)."""
        names, pieces = self.names, self.pieces
        rows: list[Any] = [None]
        for token, ids, values, own, rank in zip(prompt[1:], result["ids"], result["values"], result["own"], result["ranks"]):
            row = {} if token in ids else {names[token]: {"logprob": own, "rank": rank, "decoded_token": pieces[token]}}
            row.update({names[t]: {"logprob": v, "rank": r, "decoded_token": pieces[t]} for r, t, v in zip(range(1, len(ids) + 1), ids, values)})
            rows.append(row)
        return rows

    def reply(self, job: _Job, model_name: str) -> bytes:
        """vLLM's ``CompletionResponse``, one choice per prompt (written by orjson when installed)."""
        payload, choices = job.payload, []
        for index, (prompt, result) in enumerate(zip(job.prompts, job.results)):
            new = result["new"]
            text = self.tokenizer.decode(new, skip_special_tokens=payload.get("skip_special_tokens", True) is not False)
            choice: dict[str, Any] = {"index": index, "text": text, "logprobs": None, "finish_reason": "stop" if result["ended"] else "length",
                                      "stop_reason": None, "token_ids": None,
                                      "prompt_logprobs": None if job.k is None else self.prompt_logprobs(prompt, result), "prompt_token_ids": None}
            if payload.get("return_token_ids"):
                choice["token_ids"], choice["prompt_token_ids"] = new, prompt
            choices.append(choice)
        prompt_tokens, completion_tokens = sum(map(len, job.prompts)), sum(len(result["new"]) for result in job.results)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}
        return json_dumps({"id": f"cmpl-{time.time_ns()}", "object": "text_completion", "created": int(time.time()), "model": model_name,
                           "choices": choices, "usage": usage})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--name", default="teacher")
    parser.add_argument("--max-batch", type=int, default=64, help="scoring requests one forward answers (1: each alone)")
    args = parser.parse_args()
    server = LoopbackServer(args.model, args.name, args.port, max_batch=args.max_batch)
    gc.freeze()  # what is loaded stays: the collector scans only what the requests allocate (no pauses of whole-process scans)
    server.worker.start()
    print(f"serving {args.model} as {args.name!r} at {server.url}", flush=True)
    server.httpd.serve_forever()


if __name__ == "__main__":
    main()
