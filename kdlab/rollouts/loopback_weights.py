"""The loopback server's weight pushes: how a trainer's student weights reach the model the server samples, as
``VLLM_SERVER_DEV_MODE=1 vllm serve STUDENT --worker-extension-cls kdlab.rollouts.vllm.WeightLoaderExtension`` takes
them (``POST /collective_rpc`` ``{"method": "kdlab_load_weights_file", "args": [path]}``: a safetensors file of
Hugging Face names that the server can read; ``POST /reset_prefix_cache``). A concept apart from answering like
``vllm serve``: only a student's sampler (:class:`~kdlab.rollouts.served_sampler.ServedRollouts`) sends them."""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import torch

METHOD = "kdlab_load_weights_file"


class WeightCall:
    """Work for the loopback's worker thread between two forwards (a weight load), never batched with a request."""

    def __init__(self, function: Callable[[], None]) -> None:
        self.function, self.done = function, threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with torch.no_grad():
                self.function()
        except Exception as error:  # noqa: BLE001 - the request that asked gets it back
            self.error = error
        self.done.set()


class WeightPushes:
    """Loads pushed weight files into ``model`` through the worker's ``jobs`` queue (so no forward sees half a
    push); :attr:`loaded` lists the files loaded, in order."""

    def __init__(self, model: torch.nn.Module, jobs: queue.Queue) -> None:
        self.model, self.jobs = model, jobs
        self.loaded: list[str] = []

    def answer(self, path: str, payload: dict[str, Any]) -> None:
        """``/reset_prefix_cache`` (nothing to reset) and ``/collective_rpc`` with ``kdlab_load_weights_file``: the
        file ``args[0]`` loaded into the model (each tensor copied into its parameter, cast to the served dtype, as
        vLLM's ``load_weights`` copies). A name the model lacks, another method or a missing file is a
        ``ValueError`` (answered 400) and nothing is loaded."""
        if path == "/reset_prefix_cache":
            return
        args = payload.get("args")
        if payload.get("method") != METHOD or not isinstance(args, list) or len(args) != 1:
            raise ValueError(f"collective_rpc: unknown call {payload.get('method')!r} (this server knows {METHOD}(path))")
        from safetensors.torch import load_file

        try:
            weights = load_file(str(args[0]))
        except (OSError, RuntimeError) as error:  # safetensors raises both for a missing or broken file
            raise ValueError(f"collective_rpc: cannot read {args[0]!r}: {error}") from None
        state = self.model.state_dict()
        unknown = sorted(set(weights) - set(state))
        if unknown:
            raise ValueError(f"collective_rpc: {len(unknown)} weight names the model lacks, e.g. {unknown[:3]}")

        def load() -> None:
            for name, tensor in weights.items():
                state[name].copy_(tensor)
            self.loaded.append(str(args[0]))

        call = WeightCall(load)
        self.jobs.put(call)
        call.done.wait()
        if call.error is not None:
            raise ValueError(f"collective_rpc: {call.error}")
