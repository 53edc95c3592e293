"""The loopback server's HTTP side (:mod:`kdlab.rollouts.loopback`): each connection's handler answers vLLM's
endpoints (``GET /v1/models``, ``GET /tokenizer_info``, ``POST /tokenize``, ``POST /v1/completions``, and a trainer's
``POST /collective_rpc`` and ``POST /reset_prefix_cache``), refuses as vLLM does (401 without the key, 400 for a body
past :data:`MAX_REQUEST_BYTES` or a request past the model's limits) and misbehaves at the transport as a test's fault
switches ask; the model's work is the server's worker's."""

from __future__ import annotations

import json
import socket
import time
from http.server import BaseHTTPRequestHandler
from typing import Any

from kdlab.rollouts.loopback_faults import other_prompts

MAX_REQUEST_BYTES = 64 << 20
"""The longest request body answered (a longer one is answered 400, as vLLM answers)."""


class LoopbackHandler(BaseHTTPRequestHandler):
    """One HTTP/1.1 connection to a :class:`~kdlab.rollouts.loopback.LoopbackServer` (``self.server.loopback``):
    vLLM's endpoints, its 401 without the key and 400 for what it refuses, and the transport faults of
    :data:`~kdlab.rollouts.loopback_faults.FAULTS` (a timeout, HTTP errors, a reply cut short, trickled or hung up)."""

    protocol_version = "HTTP/1.1"  # keep-alive: every reply carries its Content-Length

    @property
    def loopback(self) -> Any:
        return self.server.loopback  # type: ignore[attr-defined]

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

    def _allowed(self) -> bool:
        if self.loopback.api_key is None or self.headers.get("Authorization") == f"Bearer {self.loopback.api_key}":
            return True
        self._send(401, b'{"error": "Unauthorized"}')
        return False

    def do_GET(self) -> None:  # noqa: N802
        if not self._allowed():
            return
        if self.path.split("?")[0] == "/server_info":
            self._send(200, json.dumps({"vllm_config": self.loopback.server_config}).encode())
        elif self.path == "/tokenizer_info":
            self._send(200, json.dumps(self.loopback.tokenizer_info()).encode())
        elif self.path == "/v1/models":
            card = {"id": self.loopback.name, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                    "root": self.loopback.name, "parent": None, "max_model_len": self.loopback.max_model_len, "permission": []}
            self._send(200, json.dumps({"object": "list", "data": [card]}).encode())
        else:
            self._send(404, b'{"error": "not found"}')

    def do_POST(self) -> None:  # noqa: N802
        counted = self.path == "/v1/completions"  # arriving until its job is queued (or it is answered without one)
        self.queued = False
        if counted:
            self.loopback.arrival(+1)
        try:
            self._post()
        finally:
            if counted and not self.queued:
                self.loopback.arrival(-1)

    def _queued(self) -> None:
        self.queued = True
        self.loopback.arrival(-1)

    def _post(self) -> None:
        length = self.headers.get("Content-Length", "0")
        if not length.isdigit() or int(length) > MAX_REQUEST_BYTES:
            self.close_connection = True
            self._send(400, b'{"error": "Content-Length missing or too large"}')
            return
        if not self._allowed():
            self.rfile.read(int(length))
            return
        try:
            payload = json.loads(self.rfile.read(int(length)) or b"{}")
            self.loopback.check_request(self.path, payload)
        except (ValueError, TypeError, KeyError) as error:
            self._send(400, json.dumps({"error": f"{type(error).__name__}: {error}"}).encode())
            return
        if self.path in ("/collective_rpc", "/reset_prefix_cache"):
            try:
                self.loopback.weights.answer(self.path, payload)
            except (ValueError, KeyError, TypeError) as error:
                self._send(400, json.dumps({"error": f"{type(error).__name__}: {error}"}).encode())
                return
            self._send(200, b'{"results": [null]}' if self.path == "/collective_rpc" else b"")
            return
        if self.path == "/tokenize":
            tokens = self.loopback.tokenizer(payload["prompt"], add_special_tokens=payload.get("add_special_tokens", True))["input_ids"]
            self._send(200, json.dumps({"count": len(tokens), "max_model_len": self.loopback.max_model_len, "tokens": tokens}).encode())
            return
        if self.path != "/v1/completions":
            self._send(404, b'{"error": "not found"}')
            return
        self.loopback.completions += 1
        fault = self.loopback.faults if self.loopback.completions > self.loopback.fault_after else set()
        if "timeout" in fault:
            time.sleep(30)
        if "error" in fault:
            self._send(500, b'{"error": "internal"}')
            return
        if "malformed" in fault:
            self._send(200, b'{"choices": [')
            return
        for status in (429, 400):
            if f"status_{status}" in fault:
                self._send(status, b'{"error": "refused"}')
                return
        if "hang_up" in fault:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if "other_prompt" in fault:
            payload = other_prompts(payload, self.loopback.columns)
        try:
            body = self.loopback.answer(payload, "another-model" if "wrong_model" in fault else self.loopback.name, fault, self._queued)
        except Exception as error:  # noqa: BLE001 - the client sees a 500, as from vLLM
            self._send(500, json.dumps({"error": f"{type(error).__name__}: {error}"}).encode())
            return
        if "trickle" in fault:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            for byte in range(len(body)):
                self.wfile.write(body[byte : byte + 1])
                self.wfile.flush()
                time.sleep(0.2)
            return
        self._send(200, body)
