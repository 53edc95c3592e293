"""A minimal server that answers the requests :class:`~kdlab.rollouts.served.ServedTeacher` sends the way
``vllm serve`` does, from a Hugging Face model in this process: for tests, benchmarks and laptops without vLLM.

    python -m kdlab.rollouts.loopback kdlab://tiny/teacher [--port 8000] [--name tiny-teacher] [--max-batch 64] [--gather-ms 5]

Endpoints and fields are vLLM's (``GET /v1/models``; ``POST /tokenize``; ``POST /v1/completions`` with
``prompt`` as token ids or a list of them (one ``choices[i]`` each), ``prompt_logprobs`` (K or -1), ``max_tokens``,
``temperature``, ``seed``, ``stop_token_ids``, ``return_token_ids``, ``logit_bias``; a request's other sampling settings,
which kdlab pins at their neutral values, are not applied): prompt log-probs come from the raw logits, as vLLM's
(``logprobs_mode`` does not apply to prompt tokens), each position a ``{token id: {"logprob", "rank",
"decoded_token"}}`` dict of the K most likely tokens (ranks 1..K) plus the prompt's own token (its rank: the
tokens at least as likely), the first position ``None``, ``-inf`` written as -9999.0. As vLLM's, they are over
every row of the model's output layer (its config's ``vocab_size``): a padded layer's rows past the tokenizer
(``kdlab://tiny-random/teacher``: 384 rows, 353 tokens) are among a position's top K when likely enough, and all
of them are there with ``prompt_logprobs: -1``. HTTP/1.1, so a client
keeps its connections open, as with vLLM's server; the HTTP side (each connection's handler) is
:mod:`kdlab.rollouts.loopback_http`, the model's work this module's worker thread.

**Batching, as vLLM does.** One worker thread runs the model. The prompts of the scoring requests
(``max_tokens: 1``) that are waiting when it becomes free, up to ``max_batch`` requests, go through one
right-padded forward, as vLLM's scheduler batches a request's prompts and concurrent requests; so do the
sampling requests waiting together at one temperature with the same stop tokens (left-padded, one forward per
token for all, each prompt drawing from its own seeded generator: :meth:`LoopbackServer.sample_many`). Requests
sent together reach the worker a little apart (each is parsed by its own thread), so the worker, having taken
one, keeps taking arrivals while they come less than ``gather_s`` apart or a request is still being read (at most
``10 * gather_s`` in all): a burst of one request per prompt (``ServedTeacher`` samples one prompt per request, each with its own seed)
decodes as one batch instead of a lone first request followed by the rest, which vLLM's continuous batching
would have merged. A lone request waits ``gather_s`` at most; ``gather_s=0`` takes only what already waits. A prompt's
log-probs may then differ in the last bits with the batch it shared (padding and batch size change the
kernels' summation order, in vLLM too); ``max_batch=1`` answers each request alone, deterministically. The
replies are written (JSON, by orjson when it is installed: :mod:`kdlab.rollouts.loopback_reply`) by the requests' own threads while the worker
runs the next forward.

``api_key`` (``--api-key``, or the environment variable ``VLLM_API_KEY``, as vLLM's) answers 401 to a request
without ``Authorization: Bearer <key>``. ``GET /tokenizer_info`` answers as ``vllm serve
--enable-tokenizer-info-endpoint`` does (the tokenizer's settings, ``added_tokens_decoder`` among them). A body
longer than ``MAX_REQUEST_BYTES``, a prompt longer than ``max_model_len`` or a ``max_tokens`` past it is
answered 400, as vLLM answers.

``faults`` makes it misbehave for tests, for the completions requests from ``fault_after`` on (:data:`FAULTS`).

**As a student's sampler** (:class:`~kdlab.rollouts.served_sampler.ServedRollouts`): a sampling request with
``logprobs: 0`` gets ``choices[i].logprobs.token_logprobs``, each sampled token's log-prob under the distribution
it was drawn from (tempered, as ``vllm serve --logprobs-mode processed_logprobs`` gives); ``POST /collective_rpc``
``{"method": "kdlab_load_weights_file", "args": [path]}`` loads a safetensors file of Hugging Face names into the
model between two forwards, as ``VLLM_SERVER_DEV_MODE=1 vllm serve --worker-extension-cls
kdlab.rollouts.vllm.WeightLoaderExtension`` does (:mod:`kdlab.rollouts.loopback_weights`); ``POST /reset_prefix_cache``
answers 200 (there is no cache); ``GET /server_info`` answers ``{"vllm_config": server_config}``, the two settings of
such a server (:data:`~kdlab.rollouts.served_sampler.SERVER_SETTINGS`) that the sampler checks.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import queue
import threading
import time
from collections import deque
from http.server import ThreadingHTTPServer
from collections.abc import Callable
from typing import Any

import torch

from kdlab.rollouts.loopback_faults import FAULTS  # noqa: F401 - the switches, by their old path too
from kdlab.rollouts.loopback_http import MAX_REQUEST_BYTES, LoopbackHandler  # noqa: F401 - the limit, by its old path too
from kdlab.rollouts.loopback_reply import completion_reply
from kdlab.rollouts.loopback_weights import WeightCall, WeightPushes
from kdlab.rollouts.served_sampler import SERVER_SETTINGS



def logit_bias(payload: dict[str, Any]) -> dict[int, float]:
    """A completions request's ``logit_bias`` (``{id as text: bias}``) as ``{id: bias}``, each bias clamped to
    [-100, 100] as vLLM clamps it."""
    return {int(row): min(100.0, max(-100.0, float(bias))) for row, bias in (payload.get("logit_bias") or {}).items()}


class _Job:
    """One completions request, answered by the worker thread."""

    def __init__(self, payload: dict[str, Any]) -> None:
        prompt = payload["prompt"]
        self.payload, self.listed = payload, bool(prompt) and isinstance(prompt[0], list)
        self.prompts = [[int(token) for token in one] for one in (prompt if self.listed else [prompt])]
        self.k = payload.get("prompt_logprobs")
        self.scores_only = self.k is not None and int(payload.get("max_tokens", 16)) <= 1
        self.sampling_key = (float(payload.get("temperature", 1.0)), tuple(int(t) for t in payload.get("stop_token_ids") or []),
                             tuple(sorted(logit_bias(payload).items())))
        self.done = threading.Event()
        self.results: list[dict[str, Any]] = []
        self.error: BaseException | None = None


class LoopbackServer:
    """Serves ``model`` (a ModelSpec path) under ``name`` on ``127.0.0.1:port`` (0: a free port) in a thread;
    up to ``max_batch`` waiting scoring requests share one forward, gathered while they arrive less than
    ``gather_s`` apart."""

    def __init__(self, model: str, name: str = "teacher", port: int = 0, max_model_len: int = 512, max_batch: int = 64,
                 api_key: str | None = None, host: str = "127.0.0.1", gather_s: float = 0.005) -> None:
        from kdlab.models.loading import ModelSpec, load_causal_lm, load_tokenizer, output_rows

        spec = ModelSpec(model)
        self.model, self.tokenizer = load_causal_lm(spec).eval(), load_tokenizer(spec)
        self.name, self.max_model_len, self.max_batch, self.api_key = name, max_model_len, max_batch, api_key
        if not gather_s >= 0:
            raise ValueError(f"LoopbackServer.gather_s must be >= 0, got {gather_s!r}")
        self.gather_s = float(gather_s)
        self.columns = len(self.tokenizer)  # the tokenizer's tokens
        self.rows = output_rows(self.model)  # the output layer's rows, which vLLM answers for: padding rows past the tokens too
        self.pieces = [self.tokenizer.decode([t]) for t in range(self.columns)] + [""] * (self.rows - self.columns)  # each row's text, once
        self.names = [str(t) for t in range(max(self.rows, self.columns))]  # each row's JSON key
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.worker = threading.Thread(target=self._serve_jobs, daemon=True)
        self.faults: set[str] = set()
        self.fault_after = 0
        self.completions = 0
        self.arriving = 0  # completions requests being read, not yet queued: a batch being gathered waits for them
        self.flight, self.in_flight, self.most_in_flight = threading.Lock(), 0, 0  # completions requests being answered at once (most: since reset)
        self.batches: list[int] = []  # prompts per forward batch the worker ran (scoring or sampling)
        self.weights = WeightPushes(self.model, self.jobs)  # /collective_rpc: a student's weights pushed by its trainer
        self.server_config: dict[str, dict[str, Any]] = {}  # /server_info: runs as `vllm serve` for a served sampler must
        for (section, field), (value, _) in SERVER_SETTINGS.items():
            self.server_config.setdefault(section, {})[field] = value
        self.httpd = ThreadingHTTPServer((host, port), LoopbackHandler)
        self.httpd.loopback = self  # what each request's handler answers from
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

    def check_request(self, path: str, payload: Any) -> None:
        """Refuse (``ValueError``) what vLLM refuses with 400: prompts past ``max_model_len``, ``max_tokens``
        that do not fit after them, prompt ids outside the vocabulary, a ``logit_bias`` for no row of the output layer."""
        if not isinstance(payload, dict):
            raise ValueError("the body is not a JSON object")
        if path != "/v1/completions":
            return
        prompt = payload["prompt"]
        prompts = prompt if prompt and isinstance(prompt[0], list) else [prompt]
        max_tokens = int(payload.get("max_tokens", 16))
        bias = payload.get("logit_bias") or {}
        if not isinstance(bias, dict) or not all(str(row).isdigit() and int(row) < self.rows and type(value) in (int, float)
                                                 for row, value in bias.items()):
            raise ValueError(f"logit_bias: not numbers for token ids in [0, {self.rows})")
        for one in prompts:
            if not all(type(t) is int and 0 <= t < self.columns for t in one):
                raise ValueError(f"a prompt token outside [0, {self.columns})")
            if not 0 <= max_tokens <= self.max_model_len - len(one):
                raise ValueError(f"max_tokens={max_tokens} and a {len(one)}-token prompt exceed max_model_len={self.max_model_len}")

    def tokenizer_info(self) -> dict[str, Any]:
        """What ``GET /tokenizer_info`` answers in vLLM: the tokenizer's settings, ``added_tokens_decoder`` as ``{id: text}``."""
        settings = {key: value for key, value in self.tokenizer.init_kwargs.items() if isinstance(value, (str, int, float, bool, type(None)))}
        settings.pop("vocab_file", None)
        settings.pop("merges_file", None)
        settings["added_tokens_decoder"] = {str(i): token.content for i, token in self.tokenizer.added_tokens_decoder.items()}
        settings["tokenizer_class"] = type(self.tokenizer).__name__
        return settings

    # ---- the worker: batched forwards -------------------------------------------------------------
    def arrival(self, change: int) -> None:
        """A completions request starts being read (+1) or is queued for the worker or answered without it (-1)."""
        with self.flight:
            self.arriving += change

    def answer(self, payload: dict[str, Any], model_name: str, faults: set[str] = frozenset(),
               queued: Callable[[], None] | None = None) -> bytes:
        """The JSON reply to one completions request (called by the request's thread; the worker computes),
        with the reply ``faults`` of :data:`FAULTS` injected; ``queued`` is called once the job waits for the worker."""
        job = _Job(payload)
        with self.flight:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:  # counted until its reply is written, so a request held in ``reply`` stays in flight
            self.jobs.put(job)
            if queued is not None:
                queued()
            job.done.wait()
            if job.error is not None:
                raise job.error
            return self.reply(job, model_name, faults)
        finally:
            with self.flight:
                self.in_flight -= 1

    def reply(self, job: _Job, model_name: str, faults: set[str] = frozenset()) -> bytes:
        """The JSON reply to ``job``, done (:func:`~kdlab.rollouts.loopback_reply.completion_reply`)."""
        return completion_reply(job.payload, job.prompts, job.results, model_name, self.tokenizer, self.pieces, self.names, faults)

    def _serve_jobs(self) -> None:
        pending: deque[_Job | None] = deque()  # taken from the queue, not yet run: first in line next time
        while True:
            job = pending.popleft() if pending else self.jobs.get()
            if job is None:
                return
            if isinstance(job, WeightCall):
                job.run()
                continue
            batch, passed = [job], deque()
            deadline = time.monotonic() + 10 * self.gather_s
            while len(batch) < max(self.max_batch, 1):  # whatever else waits, or arrives in the burst, and can share the forwards joins
                if pending:
                    waiting = pending.popleft()
                else:
                    try:
                        wait = min(self.gather_s, deadline - time.monotonic())
                        waiting = self.jobs.get(timeout=wait) if wait > 0 else self.jobs.get_nowait()
                    except queue.Empty:
                        if self.arriving > 0 and time.monotonic() < deadline:  # a request is being read: it may join
                            continue
                        break
                if waiting is not None and self._shares(job, waiting):
                    batch.append(waiting)
                else:  # runs later, in its turn (None: after what is before it)
                    passed.append(waiting)
                    if waiting is None:
                        break
            pending = passed + pending
            self._run(batch)

    @staticmethod
    def _shares(job: _Job, other: _Job) -> bool:
        """Whether ``other`` can join ``job``'s batch: both scoring, or both sampling (without prompt
        log-probs) at one temperature with the same stop tokens."""
        if isinstance(other, WeightCall):
            return False
        if job.scores_only or other.scores_only:
            return job.scores_only and other.scores_only
        return job.k is None and other.k is None and job.sampling_key == other.sampling_key

    def _run(self, jobs: list[_Job]) -> None:
        try:
            with torch.no_grad():
                if jobs[0].scores_only:
                    prompts = [prompt for job in jobs for prompt in job.prompts]
                    results = iter(self.scores(prompts, [job.k for job in jobs for _ in job.prompts], self.forward(prompts)))
                    for job in jobs:
                        job.results = [next(results) for _ in job.prompts]
                elif jobs[0].k is None:  # sampling: every prompt of every job in one batch, each row its own seed
                    temperature, stops, bias = jobs[0].sampling_key
                    stops = (*stops, self.tokenizer.eos_token_id)
                    rows = [(prompt, int(job.payload.get("max_tokens", 16)), job.payload.get("seed")) for job in jobs for prompt in job.prompts]
                    drawn: list[list[float]] = []
                    results = iter(zip(self.sample_many(rows, temperature, list(stops), drawn, dict(bias)), drawn))
                    for job in jobs:
                        asked = job.payload.get("logprobs") is not None  # (batch-mates' log-probs may differ in the last bits)
                        job.results = [{"new": new, "ended": ended, **({"token_logprobs": values} if asked else {})}
                                       for (new, ended), values in (next(results) for _ in job.prompts)]
                else:
                    (job,) = jobs
                    job.results = [self.complete(job, prompt) for prompt in job.prompts]
            self.batches.append(sum(len(job.prompts) for job in jobs))
        except Exception as error:  # noqa: BLE001 - each request gets it back
            for job in jobs:
                job.error = error
        for job in jobs:
            job.done.set()

    def forward(self, prompts: list[list[int]]) -> torch.Tensor:
        """The prompts' logits ``(B, T, R)`` over every row of the output layer (padding rows past the tokenizer's
        tokens included, as vLLM's) from one right-padded forward (causal: padding after a prompt does not change
        its positions)."""
        width = max(len(prompt) for prompt in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.tensor(prompt)
            mask[row, : len(prompt)] = 1
        return self.model(input_ids=ids, attention_mask=mask).logits[..., : self.rows].float()

    def scores(self, prompts: list[list[int]], ks: list[int | None], logits: torch.Tensor) -> list[dict[str, Any]]:
        """Each prompt's log-probs from the batch's ``logits``: at each position its top ``k`` rows of the output
        layer (-1: every row, padding rows included, as vLLM answers) and the prompt token's own with its rank;
        and the next token (greedy)."""
        lengths = torch.tensor([len(prompt) for prompt in prompts])
        new = logits[torch.arange(len(prompts)), lengths - 1].argmax(-1).tolist()
        wanted = [self.rows if k == -1 else min(int(k), self.rows) for k in ks if k is not None]
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
                k = self.rows if k == -1 else min(int(k), self.rows)
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
                                                     payload.get("seed"), stops, logit_bias(payload))
        return result

    def sample(self, prompt: list[int], max_tokens: int, temperature: float, seed: int | None, stops: list[int],
               bias: dict[int, float] | None = None) -> tuple[list[int], bool]:
        """One completion of ``prompt`` (:meth:`sample_many` of one row)."""
        return self.sample_many([(prompt, max_tokens, seed)], temperature, stops, logit_bias=bias)[0]

    def sample_many(self, rows: list[tuple[list[int], int, int | None]], temperature: float, stops: list[int],
                    drawn_logprobs: list[list[float]] | None = None, logit_bias: dict[int, float] | None = None) -> list[tuple[list[int], bool]]:
        """A completion of each ``(prompt, max_tokens, seed)`` of ``rows``, decoded together (left-padded, one
        forward per token for the whole batch, as vLLM batches concurrent requests); each row draws from its
        own generator seeded by its ``seed`` (a random one without), so a row's tokens depend on its seed
        alone, up to the last bits padding changes (``max_batch=1``: each request alone). As vLLM, it draws from
        every row of the output layer (a padded layer's rows past the tokenizer too), ``logit_bias`` (``{row:
        bias}``) added to the logits first. Returns each row's tokens (its end token included) and whether it
        ended; ``drawn_logprobs`` (a list) receives each row's log-probs of its tokens under the tempered (and
        biased) distribution they were drawn from (greedy: the untempered one)."""
        from kdlab.rollouts.decoding import incremental_decoder, sample_tokens

        width = max(len(prompt) for prompt, _, _ in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for row, (prompt, _, _) in enumerate(rows):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        generators = [torch.Generator().manual_seed(int(seed)) if seed is not None else torch.Generator() for _, _, seed in rows]
        for (_, _, seed), generator in zip(rows, generators):
            if seed is None:
                generator.seed()
        longest = max(max_tokens for _, max_tokens, _ in rows)
        decoder = incremental_decoder(self.model, ids, mask, self.rows, temperature, longest)
        bias = None
        if logit_bias:  # on the tempered log-probs, bias / T: the logits' bias
            bias = torch.zeros(self.rows).index_put_((torch.tensor(list(logit_bias)),), torch.tensor(list(logit_bias.values())))
            bias /= temperature if temperature > 0 else 1.0
        # each row's uniforms for every step, from its own generator: the t-th token of a row is its distribution's
        # inverse CDF at the t-th number of its seed's stream, whatever else shares the batch
        uniforms = torch.stack([torch.rand(longest, generator=generator, dtype=torch.float64) for generator in generators]) if temperature else None

        def drawn(previous: torch.Tensor | None) -> torch.Tensor:
            """The decoder's next-token log-probs with each row's token drawn by its own generator: that token
            at log-prob 0, the others at -inf (so the shared draw below takes it)."""
            logprobs = decoder(previous)
            if bias is not None:
                logprobs = torch.log_softmax(logprobs + bias, -1)
            if temperature == 0.0:
                history.append(torch.log_softmax(logprobs, -1).gather(1, logprobs.argmax(-1, keepdim=True))[:, 0])
                return logprobs
            cdf = logprobs.double().exp().cumsum(-1)  # (B, V); a token of probability 0 has no interval of its own
            point = uniforms[:, len(history), None] * cdf[:, -1:]
            tokens = torch.searchsorted(cdf, point, right=True)[:, 0].clamp_(max=logprobs.shape[1] - 1)
            history.append(logprobs.gather(1, tokens[:, None])[:, 0])
            return torch.full_like(logprobs, -math.inf).scatter_(1, tokens[:, None], 0.0)

        history: list[torch.Tensor] = []  # per decoding step, each row's log-prob of the token it takes

        limits = torch.tensor([max_tokens for _, max_tokens, _ in rows])
        out, kept, _ = sample_tokens(drawn, len(rows), limits, tuple(stops), int(self.tokenizer.pad_token_id or 0), torch.Generator().manual_seed(0),
                                     greedy=temperature == 0.0)
        results = []
        steps = torch.stack(history, 1) if history else torch.zeros(len(rows), 0)
        for row in range(len(rows)):
            tokens = out[row][kept[row]].tolist()
            results.append((tokens, bool(tokens) and tokens[-1] in stops))
            if drawn_logprobs is not None:
                drawn_logprobs.append(steps[row, : len(tokens)].tolist())
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--name", default="teacher")
    parser.add_argument("--max-batch", type=int, default=64, help="scoring requests one forward answers (1: each alone)")
    parser.add_argument("--gather-ms", type=float, default=5.0, help="keep gathering a batch while requests arrive less than this apart (0: only what waits)")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: this machine only)")
    parser.add_argument("--api-key", default=None, help="answer 401 without 'Authorization: Bearer <key>' (default: $VLLM_API_KEY)")
    args = parser.parse_args()
    server = LoopbackServer(args.model, args.name, args.port, max_batch=args.max_batch, api_key=args.api_key or os.environ.get("VLLM_API_KEY"),
                            host=args.host, gather_s=args.gather_ms / 1000)
    gc.freeze()  # what is loaded stays: the collector scans only what the requests allocate (no pauses of whole-process scans)
    server.worker.start()
    print(f"serving {args.model} as {args.name!r} at {server.url}", flush=True)
    server.httpd.serve_forever()


if __name__ == "__main__":
    main()
