"""The student sampled by a server that speaks vLLM's OpenAI-compatible API (:class:`ServedRollouts`), on other
GPUs or another machine: on-policy rollouts written outside the training process, with the student's weights
pushed to the server every ``sync_every`` optimiser steps (:mod:`kdlab.rollouts.engines`).

What is sent (vLLM's names; the server runs ``VLLM_SERVER_DEV_MODE=1 vllm serve STUDENT --worker-extension-cls
kdlab.rollouts.vllm.WeightLoaderExtension --logprobs-mode processed_logprobs``, or kdlab's loopback server):

* ``GET /v1/models`` -> ``data[].id``: the served model must be there (checked before the first push);
* ``GET /server_info?config_format=json`` (``VLLM_SERVER_DEV_MODE=1``) -> ``vllm_config``: the server must run with
  :data:`SERVER_SETTINGS` (checked before the first push): ``--logprobs-mode processed_logprobs``, without which vLLM
  returns the log-probs of the untempered, unfiltered distribution and every importance weight at ``T != 1`` or
  ``top_p < 1`` is wrong without any error, and the weight loader extension the pushes call;
* a push: the weights written to ``weights_dir`` as one safetensors file of Hugging Face names (in the
  engine's ``dtype``), then ``POST /collective_rpc`` ``{"method": "kdlab_load_weights_file", "args": [path]}``
  and ``POST /reset_prefix_cache`` (cached prompt blocks were computed with the old weights); the file is deleted
  once loaded. ``weights_dir`` must be a folder the server reads at the same path (a shared file system when the
  server runs on another machine);
* one ``POST /v1/completions`` per prompt ``{model, prompt: [ids], return_token_ids: true}`` and the sampling
  settings of the in-process vLLM engine (:func:`~kdlab.rollouts.vllm_sampling.completion_fields`: ``max_tokens``,
  ``temperature``, ``top_p``, ``top_k: -1``, ``min_p: 0``, neutral penalties, ``seed: <rollout seed + row>``,
  ``stop_token_ids``, ``skip_special_tokens: false``, ``logprobs: 0``, a bias on a padded head's rows) (``concurrency`` at once) -> ``choices[0].token_ids`` and ``choices[0].logprobs.token_logprobs``: the log-prob of
  each sampled token under the distribution it was drawn from, the behaviour log-probs of the importance weights.
"""

from __future__ import annotations

import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kdlab.data import PromptBatch, Rollout, right_pad
from kdlab.rollouts.engines import StagedWeights, SyncedEngine
from kdlab.rollouts.policies import RolloutContext
from kdlab.served_replies import sampled_logprobs, sampled_tokens
from kdlab.served_wire import BYTES_PER_ENTRY, BYTES_PER_REPLY, ServedTeacherError, Wire, check_url, redact

ENGINE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

SERVER_SETTINGS: dict[tuple[str, str], tuple[str, str]] = {
    # (VllmConfig field, its field): (the value a served sampler needs, the `vllm serve` flag that sets it)
    ("model_config", "logprobs_mode"): ("processed_logprobs", "--logprobs-mode processed_logprobs"),
    ("parallel_config", "worker_extension_cls"): ("kdlab.rollouts.vllm.WeightLoaderExtension",
                                                  "--worker-extension-cls kdlab.rollouts.vllm.WeightLoaderExtension"),
}
"""The settings ``GET /server_info?config_format=json`` must report under ``vllm_config`` before the first push."""
SERVER_INFO_PATH = "/server_info?config_format=json"


def on_this_machine(url: str) -> bool:
    """Whether ``url``'s host is this machine by its address: ``localhost``, a loopback address (127.0.0.0/8, ::1), or
    the unspecified address ``0.0.0.0`` / ``::`` that ``vllm serve`` prints (a client reaching it reaches this machine)."""
    import ipaddress
    import urllib.parse

    host = (urllib.parse.urlsplit(url).hostname or "").rstrip(".")
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # a name: it may resolve to this machine or not
        return False
    return address.is_loopback or address.is_unspecified


class ServedRollouts(SyncedEngine):
    """On-policy completions sampled by a vLLM-compatible server from the student's pushed weights.

    Args:
        url: the server's base URL (``http://host:8000``); model: the served model's name (``--served-model-name``).
        weights_dir: where pushes are written for the server to read (default: a new folder under the system's
            temporary folder, which only a server on this machine can read: without it, a URL whose host is not
            ``localhost`` or a loopback address is refused at construction).
        sync_every: optimiser steps between weight pushes (1: every step).
        importance_cap: the per-token ratio cap of the importance weights ``w = mean_t min(cap, p_theta / q)``.
        dtype: the pushed weights' dtype (the server's own: vLLM's ``--dtype``), one of ``bfloat16``, ``float16``,
            ``float32``.
        timeout_s, retries, backoff_s, concurrency, api_key_env: as :class:`~kdlab.rollouts.served.ServedTeacher`'s.

    One training process only (a push from each rank would race for one server). Stop strings are refused.
    """

    def __init__(self, url: str, model: str, weights_dir: str | None = None, sync_every: int = 1, importance_cap: float = 2.0,
                 dtype: str = "bfloat16", timeout_s: float = 60.0, retries: int = 3, backoff_s: float = 1.0, concurrency: int = 8,
                 api_key_env: str | None = None) -> None:
        super().__init__()
        url = check_url(url, "ServedRollouts.url")
        if sync_every < 1:
            raise ValueError(f"ServedRollouts.sync_every must be >= 1, got {sync_every}")
        if not importance_cap > 0:
            raise ValueError(f"ServedRollouts.importance_cap must be > 0, got {importance_cap}")
        if dtype not in ENGINE_DTYPES:
            raise ValueError(f"ServedRollouts.dtype must be one of {sorted(ENGINE_DTYPES)}, got {dtype!r}")
        for name, value in (("timeout_s", timeout_s), ("concurrency", concurrency)):
            if not value > 0:
                raise ValueError(f"ServedRollouts.{name} must be > 0, got {value}")
        if retries < 0 or backoff_s < 0:
            raise ValueError(f"ServedRollouts.retries and backoff_s must be >= 0, got {retries}, {backoff_s}")
        if weights_dir is not None and not os.path.isdir(weights_dir):
            raise ValueError(f"ServedRollouts.weights_dir {weights_dir!r} is not a folder")
        if weights_dir is None and not on_this_machine(url):
            raise ValueError(f"ServedRollouts.weights_dir: the server at {redact(url)} is not addressed as this machine, and the default "
                             "folder (this machine's temporary folder) is one it cannot read; name a folder the server reads at the same "
                             "path (a shared file system), or address a server on this machine as localhost")
        self.url, self.served_model, self.weights_dir = url.rstrip("/"), model, weights_dir
        self.sync_every, self.importance_cap, self.engine_dtype = sync_every, importance_cap, dtype
        self.timeout_s, self.retries, self.backoff_s, self.concurrency, self.api_key_env = timeout_s, retries, backoff_s, concurrency, api_key_env
        self._checked = False
        self._start_threads()

    def _start_threads(self) -> None:
        self._wire = Wire(self.url, self.timeout_s, self.retries, self.backoff_s, self.api_key_env)
        self._pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="served-sampler")

    def __getstate__(self) -> dict[str, Any]:  # threads and connections do not pickle
        state = super().__getstate__()
        return {key: value for key, value in state.items() if key not in ("_wire", "_pool")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._start_threads()

    def needs(self) -> frozenset[str]:
        return frozenset({"one_vocabulary", "teacher_scores"})  # the student's ids, which no cache holds

    def next_token_logprobs(self, student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
        return student_logprobs

    # ---- the push --------------------------------------------------------------------------------
    def check(self) -> None:
        """Once, before the first push: one training process, the server serves ``model``, and it runs with
        :data:`SERVER_SETTINGS` (its ``/server_info``)."""
        if self._checked:
            return
        if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            raise ValueError("ServedRollouts runs in one training process: every rank would push its weights to one server")
        models = self._wire.request("/v1/models", max_bytes=1 << 20)
        served = [card.get("id") for card in models.get("data", []) if isinstance(card, dict)]
        if self.served_model not in served:
            raise ServedTeacherError(f"served sampler {self._wire.where}/v1/models serves {served[:8]}, not ServedRollouts.model={self.served_model!r}")
        self.check_server_settings()
        if self.weights_dir is None:
            self.weights_dir = tempfile.mkdtemp(prefix="kdlab-pushed-weights-")
        self._checked = True

    def check_server_settings(self) -> None:
        """Refuses a server whose ``/server_info`` lacks or contradicts :data:`SERVER_SETTINGS`, naming each flag."""
        try:
            info = self._wire.request(SERVER_INFO_PATH, max_bytes=1 << 24)
        except ServedTeacherError as error:
            raise ServedTeacherError(f"served sampler {self._wire.where}{SERVER_INFO_PATH}: {error} (run the server with "
                                     "VLLM_SERVER_DEV_MODE=1, which the weight pushes need as well)") from None
        config = info.get("vllm_config")
        wrong = []
        for (section, field), (wanted, flag) in SERVER_SETTINGS.items():
            found = (config.get(section) or {}).get(field) if isinstance(config, dict) else None
            if found != wanted:
                wrong.append(f"{section}.{field} is {found!r}, not {wanted!r}: run vllm serve with {flag}")
        if wrong:
            raise ServedTeacherError(f"served sampler {self._wire.where}: " + "; ".join(wrong)
                                     + " (the behaviour log-probs of the importance weights must be those of the distribution sampled from)")

    def snapshot(self, context: RolloutContext) -> str:
        """The student's weights written to a safetensors file under ``weights_dir`` (Hugging Face names, LoRA
        merged, in ``dtype``): its path."""
        from safetensors.torch import save_file

        from kdlab.rollouts.vllm import streamed_weights

        self.check()
        dtype = ENGINE_DTYPES[self.engine_dtype]
        # cloned: tied weights share storage, which safetensors refuses; the file is the snapshot
        tensors = {name: tensor.detach().to("cpu", dtype if tensor.is_floating_point() else tensor.dtype).contiguous().clone()
                   for name, tensor in streamed_weights(context.student, dtype)}
        path = os.path.join(str(self.weights_dir), f"student-{os.getpid()}-{id(self):x}-step{context.step}.safetensors")
        save_file(tensors, path)
        return path

    def load_weights(self, staged: StagedWeights) -> None:
        """The server loads the file ``staged.payload`` and drops its prefix cache; the file is then deleted."""
        try:
            for path, payload in (("/collective_rpc", {"method": "kdlab_load_weights_file", "args": [staged.payload]}), ("/reset_prefix_cache", None)):
                status, body = self._wire.exchange(path, b"{}" if payload is None else json.dumps(payload).encode(), 1 << 20)
                if status != 200:
                    raise ServedTeacherError(f"served sampler {self._wire.where}{path}: HTTP {status} {body[:200]!r} (is the server run with "
                                             "VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls kdlab.rollouts.vllm.WeightLoaderExtension?)")
        except OSError as error:
            raise ServedTeacherError(f"served sampler {self._wire.where}: a weight push failed ({error!r})") from None
        finally:
            if os.path.exists(staged.payload):
                os.remove(staged.payload)
        self.weights_step = staged.step

    # ---- sampling --------------------------------------------------------------------------------
    def generate(self, prompts: PromptBatch, context: RolloutContext) -> Rollout:
        """One request per prompt, seeded ``context.seed + row``: the completions (end token included when they
        ended) and each token's log-prob under the distribution it was drawn from."""
        from kdlab.models.loading import output_rows
        from kdlab.rollouts.vllm_sampling import check_temperature, completion_fields, padding_bias, sampling_params

        if context.stop_strings:
            raise ValueError("ServedRollouts does not send stop strings yet: remove DistillModule.stop_strings or use StudentRollouts")
        temperature = context.student_temperature
        check_temperature(temperature, "ServedRollouts (DistillModule.student_temperature)")
        self.check()
        seed, length, ends = context.seed if context.seed is not None else 0, context.max_new_tokens, tuple(int(t) for t in context.eos_token_ids)
        rows = prompts.prompt_tokens("student")
        bias = padding_bias(output_rows(context.student), context.token_columns)

        def one(item: tuple[int, list[int]]) -> tuple[list[int], list[float]]:
            row, prompt = item
            params = sampling_params(temperature, length, ends, context.top_p, seed=seed + row, logprobs=True, logit_bias=bias)
            payload = {"model": self.served_model, "prompt": prompt, "return_token_ids": True, **completion_fields(params)}

            def read(reply: dict[str, Any]) -> tuple[list[int], list[float]]:
                tokens = sampled_tokens(reply, self.served_model, length, context.token_columns)
                return tokens, sampled_logprobs(reply, len(tokens))

            return self._wire.request("/v1/completions", payload, read, max_bytes=BYTES_PER_REPLY + (length + len(prompt)) * 4 * BYTES_PER_ENTRY)

        written = list(self._pool.map(one, enumerate(rows))) if len(rows) > 1 else [one(item) for item in enumerate(rows)]
        ids, mask = right_pad([tokens for tokens, _ in written], context.pad_token_id)
        behaviour = torch.zeros(ids.shape, dtype=torch.float32)
        for row, (_, values) in enumerate(written):
            behaviour[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
        device = prompts.student_ids.device
        return Rollout(prompts, ids.to(device), mask.to(device), None, behaviour_logprobs=behaviour.to(device), importance_cap=self.importance_cap)
