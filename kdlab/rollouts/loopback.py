"""A minimal server that answers the requests :class:`~kdlab.rollouts.served.ServedTeacher` sends the way
``vllm serve`` does, from a Hugging Face model in this process: for tests, benchmarks and laptops without vLLM.

    python -m kdlab.rollouts.loopback kdlab://tiny/teacher [--port 8000] [--name tiny-teacher]

Endpoints and fields are vLLM's (``GET /v1/models``; ``POST /tokenize``; ``POST /v1/completions`` with
``prompt`` as token ids, ``prompt_logprobs`` (K or -1), ``max_tokens``, ``temperature``, ``seed``,
``stop_token_ids``, ``return_token_ids``): prompt log-probs come from the raw logits, as vLLM's
(``logprobs_mode`` does not apply to prompt tokens), each position a ``{token id: {"logprob", "rank",
"decoded_token"}}`` dict of the K most likely tokens plus the prompt's own token, the first position
``None``, ``-inf`` written as -9999.0. ``faults`` makes it misbehave for tests: ``"timeout"`` (sleeps),
``"malformed"`` (not JSON), ``"error"`` (HTTP 500), ``"wrong_model"`` (another model name), each for the
completions requests from ``fault_after`` on.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch


class LoopbackServer:
    """Serves ``model`` (a ModelSpec path) under ``name`` on ``127.0.0.1:port`` (0: a free port) in a thread."""

    def __init__(self, model: str, name: str = "teacher", port: int = 0, max_model_len: int = 512) -> None:
        from kdlab.models.loading import ModelSpec, load_causal_lm, load_tokenizer

        spec = ModelSpec(model)
        self.model, self.tokenizer = load_causal_lm(spec).eval(), load_tokenizer(spec)
        self.name, self.max_model_len = name, max_model_len
        self.pieces = [self.tokenizer.decode([t]) for t in range(len(self.tokenizer))]  # each token's text, once
        self.lock = threading.Lock()  # one forward at a time: torch models are not re-entrant on the CPU
        self.faults: set[str] = set()
        self.fault_after = 0
        self.completions = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
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
                reply = server.complete(payload)
                if "wrong_model" in fault:
                    reply["model"] = "another-model"
                self._send(200, json.dumps(reply).encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> LoopbackServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    @torch.no_grad()
    def complete(self, payload: dict[str, Any]) -> dict[str, Any]:
        prompt = [int(token) for token in payload["prompt"]]
        columns = len(self.tokenizer)
        with self.lock:
            choice: dict[str, Any] = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                                      "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None}
            k = payload.get("prompt_logprobs")
            every = self.model(input_ids=torch.tensor([prompt])).logits[0, :, :columns].float()  # one forward for both uses
            if k is not None:
                logprobs = torch.log_softmax(every[:-1], -1).clamp(min=-9999.0)  # raw: no temperature, as vLLM's prompt log-probs
                order = torch.argsort(logprobs, dim=-1, descending=True)
                ranks = torch.empty_like(order).scatter_(1, order, torch.arange(1, columns + 1).expand_as(order))
                keep = order[:, : columns if k == -1 else k].tolist()
                values, rank_rows = logprobs.tolist(), ranks.tolist()
                rows: list[Any] = [None]
                for position, top in enumerate(keep, start=1):
                    token = prompt[position]
                    ids = top if token in top else [*top, token]
                    row, rank = values[position - 1], rank_rows[position - 1]
                    rows.append({str(t): {"logprob": row[t], "rank": rank[t], "decoded_token": self.pieces[t]} for t in ids})
                choice["prompt_logprobs"] = rows
            new: list[int] = []
            max_tokens = int(payload.get("max_tokens", 16))
            if max_tokens > 1 or k is None:
                new, ended = self.sample(prompt, max_tokens, float(payload.get("temperature", 1.0)), payload.get("seed"),
                                         [int(t) for t in payload.get("stop_token_ids") or []] + [self.tokenizer.eos_token_id])
                choice["finish_reason"] = "stop" if ended else "length"
            else:
                new = [int(torch.argmax(every[-1]))]
            choice["text"] = self.tokenizer.decode(new, skip_special_tokens=payload.get("skip_special_tokens", True) is not False)
            if payload.get("return_token_ids"):
                choice["token_ids"], choice["prompt_token_ids"] = new, prompt
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(new), "total_tokens": len(prompt) + len(new)}
        return {"id": f"cmpl-{time.time_ns()}", "object": "text_completion", "created": int(time.time()), "model": self.name,
                "choices": [choice], "usage": usage}

    def sample(self, prompt: list[int], max_tokens: int, temperature: float, seed: int | None, stops: list[int]) -> tuple[list[int], bool]:
        from kdlab.rollouts.decoding import IncrementalLM, sample_tokens

        generator = torch.Generator().manual_seed(int(seed)) if seed is not None else None
        decoder = IncrementalLM(self.model, torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long), len(self.tokenizer), temperature)
        ids, mask, _ = sample_tokens(decoder, 1, max_tokens, tuple(stops), int(self.tokenizer.pad_token_id or 0), generator,
                                     greedy=temperature == 0.0)
        tokens = ids[0][mask[0]].tolist()
        return tokens, bool(tokens) and tokens[-1] in stops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--name", default="teacher")
    args = parser.parse_args()
    server = LoopbackServer(args.model, args.name, args.port)
    print(f"serving {args.model} as {args.name!r} at {server.url}", flush=True)
    server.httpd.serve_forever()


if __name__ == "__main__":
    main()
