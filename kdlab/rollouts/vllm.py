"""vLLM back end for rollouts: ``VLLMRollouts`` samples the student's (or the teacher's) completions
with vLLM instead of kdlab's own KV-cache decoder.

Optional: ``pip install 'kdlab[vllm]'`` on a CUDA machine. Everything vLLM-specific goes through the
documented API (``vllm.LLM``, ``SamplingParams``, ``TokensPrompt``, ``LLM.generate``,
``LLM.collective_rpc`` with a ``worker_extension_cls``); what surrounds it is plain PyTorch and tested on
CPU: the translation of kdlab's sampling settings (:func:`sampling_params`), the mapping of a trained
(FSDP/DDP/LoRA/compile-wrapped) student's parameter names to the Hugging Face names vLLM loads
(:func:`kdlab.models.export.hf_weight_name`, :func:`kdlab.models.export.merged_weights`), and the importance weight that
corrects for a stale sampler (:func:`kdlab.rollouts.policies.importance_weights`).

On-policy use: the student's current weights are pushed into the engine every ``sync_every`` optimiser
steps. Between pushes the engine samples from a slightly older policy q. In distillation every
completion's loss (at every step, also right after a push, where w differs from 1 only by vLLM-vs-HF
numerics) is weighted by ``w = mean_t min(cap, exp(log p_theta(y_t) - log q(y_t)))`` (the paper's MATH run:
cap 2), computed by :class:`~kdlab.stages.distill.DistillModule` from the log-probs vLLM returns for the sampled
tokens; GRPO (:class:`~kdlab.stages.grpo.GRPOModule`) weights each token by ``min(cap, pi_old / q)`` instead.
Both log how far q is from the trained policy (``train/engine_kl``, ``rlvr/engine_kl``).

Every vLLM argument, value and output field kdlab uses is listed in :data:`VLLM_API` and
:data:`VLLM_SETTING_VALUES`. The CPU tests' stand-in for ``vllm`` accepts only those names, and
``python scripts/check_vllm_api.py`` (``pytest -m slow tests/test_vllm_engine.py``) checks each against the
real classes of vLLM :data:`VLLM_VERSION`, installed without its dependencies into a side environment.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kdlab.data import PromptBatch, Rollout, right_pad
from kdlab.models.export import merged_weights
from kdlab.rollouts.policies import RolloutContext, RolloutPolicy

INSTALL_HINT = "pip install 'kdlab[vllm]' (vLLM needs a CUDA machine)"
VLLM_VERSION = "0.33.0"
"""The vLLM release kdlab's use of vLLM is checked against (``python scripts/check_vllm_api.py``)."""
VLLM_TEMPERATURES = (0.01, 2.0)
"""The non-zero sampling temperatures vLLM honours exactly (checked against vLLM's ``SamplingParams``)."""
VLLM_API: dict[str, tuple[str, ...]] = {
    "SamplingParams": (  # keyword arguments (sampling_params)
        "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
        "max_tokens", "stop_token_ids", "ignore_eos", "skip_special_tokens", "detokenize", "seed", "stop",
        "include_stop_str_in_output", "logprobs",
    ),
    "LLM": (  # keyword arguments of vllm.LLM, its own or passed on to EngineArgs
        "model", "dtype", "seed", "revision", "trust_remote_code", "worker_extension_cls", "logprobs_mode",
        "gpu_memory_utilization", "tensor_parallel_size", "enforce_eager", "max_model_len", "distributed_executor_backend",
    ),
    "LLM.generate": ("prompts", "sampling_params", "use_tqdm"),  # called as generate(requests, params, use_tqdm=False)
    "LLM.collective_rpc": ("method", "args"),  # collective_rpc(name, args=(weights,))
    "LLM.reset_prefix_cache": (),
    "TokensPrompt": ("prompt_token_ids",),
    "RequestOutput": ("outputs",),  # fields read from generate's results
    "CompletionOutput": ("token_ids", "logprobs"),
    "Logprob": ("logprob",),
}
"""Every vLLM name kdlab uses: the tests' stand-in for vLLM accepts exactly these, and
``scripts/check_vllm_api.py`` checks each against the real classes of :data:`VLLM_VERSION`."""
VLLM_SETTING_VALUES = {"logprobs_mode": "processed_logprobs", "distributed_executor_backend": "external_launcher"}
"""Values kdlab passes to ``vllm.LLM`` that must be among the values vLLM accepts (checked the same way)."""

def import_vllm(setting: str = "VLLMRollouts") -> Any:
    """The ``vllm`` package, or an ImportError that names the setting and the extra to install."""
    try:
        import vllm
    except ImportError as error:
        raise ImportError(f"{setting} needs vLLM ({error}); install it with {INSTALL_HINT}") from error
    return vllm


def sampling_params(
    temperature: float,
    max_new_tokens: int,
    stop_token_ids: tuple[int, ...],
    top_p: float = 1.0,
    seed: int | None = None,
    logprobs: bool = True,
    stop: tuple[str, ...] = (),
) -> dict[str, Any]:
    """``vllm.SamplingParams`` keyword arguments equivalent to kdlab's sampling.

    kdlab samples from ``softmax(logits / temperature)`` (optionally top-p), stops at any of the end
    tokens and keeps that end token in the completion; it never adds penalties. ``temperature`` 0 is
    greedy. ``logprobs=True`` asks for the log-prob of each sampled token (``logprobs=0``: the sampled
    token only), which the importance weight needs. vLLM reports the raw model's log-probs by default;
    ``VLLMRollouts`` builds its engine with ``logprobs_mode="processed_logprobs"`` (vLLM >= 0.10) so
    they are those of the distribution it sampled from (tempered, and top-p truncated when
    ``top_p < 1``).

    ``stop`` strings end a completion like kdlab's decoder does (:func:`kdlab.rollouts.decoding.stop_strings_check`):
    the tokens up to and including the one that completes the string are kept. vLLM checks them on the
    detokenised text, so they switch detokenisation on (vLLM refuses stop strings without it), and
    ``include_stop_str_in_output`` keeps the returned text whole. vLLM keeps the token ids up to and
    including the completing one (it drops only surplus tokens of the same step, e.g. speculative ones).
    """
    if temperature != 0 and not VLLM_TEMPERATURES[0] <= temperature <= VLLM_TEMPERATURES[1]:
        # vLLM rejects T > 2 and silently raises T < 0.01 to 0.01, which would make its q differ from kdlab's
        raise ValueError(f"sampling_params: vLLM samples at temperature 0 or in {list(VLLM_TEMPERATURES)}, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"sampling_params: top_p must be in (0, 1], got {top_p}")
    params: dict[str, Any] = {
        "n": 1,
        "temperature": float(temperature),
        "top_p": float(top_p) if temperature > 0 else 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "max_tokens": int(max_new_tokens),
        "stop_token_ids": [int(t) for t in stop_token_ids],
        "ignore_eos": False,
        "skip_special_tokens": False,
        "detokenize": bool(stop),
        "seed": seed,
    }
    if stop:
        params["stop"] = [text for text in stop]
        params["include_stop_str_in_output"] = True
    if logprobs:
        params["logprobs"] = 0
    return params


def sampled_token_logprobs(sample: Any) -> list[float]:
    """The log-prob of each sampled token of a vLLM ``CompletionOutput`` (requested with ``logprobs=0``).

    ``sample.logprobs`` holds one ``{token id: Logprob}`` mapping per position (a list of dicts, or vLLM's
    ``FlatLogprobs``, which reads the same); the sampled token is always among its keys."""
    return [float(entry[token].logprob) for token, entry in zip(sample.token_ids, sample.logprobs or [])]


def engine_end_ids(spec: Any, tokenizer: Any) -> tuple[int, ...]:
    """The end tokens kdlab uses for ``spec`` (:func:`kdlab.models.loading.end_token_ids`), read from the
    tokenizer and the checkpoint's generation config without loading the weights."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from kdlab.models.loading import end_token_ids

    try:
        config = GenerationConfig.from_pretrained(spec.resolved, revision=spec.revision)
    except OSError:  # no generation_config.json: the tokenizer's EOS alone
        config = None
    return end_token_ids(tokenizer, SimpleNamespace(generation_config=config))


def engine_settings(spec: Any, seed: int) -> dict[str, Any]:
    """``vllm.LLM`` arguments that load the model a :class:`~kdlab.models.loading.ModelSpec` names. A spec vLLM
    would load as a different model than kdlab does is refused before any engine starts: a depth-pruned
    one (``layers``: vLLM would load every layer, then receive pruned weights) or a GGUF file (kdlab
    dequantises it; write a Hugging Face folder first, e.g. with ``kdlab prune``)."""
    if getattr(spec, "layers", None) is not None:
        raise ValueError(f"VLLMRollouts: the model {spec.path!r} is pruned (layers: {spec.layers!r}), which vLLM would load whole; "
                         "write the pruned model to a folder with `kdlab prune ... --output DIR` and give that folder as its path")
    if getattr(spec, "is_gguf", False):
        raise ValueError(f"VLLMRollouts: the model {spec.path!r} is a GGUF file, which kdlab dequantises and vLLM would not load the same way; "
                         "write it to a Hugging Face folder with `kdlab prune --model ... --layers every:1 --output DIR` and give that folder")
    return {"model": spec.resolved, "dtype": spec.dtype, "seed": seed, "revision": spec.revision, "trust_remote_code": spec.trust_remote_code}


def vllm_sample_completions(
    spec: Any,
    tokenizer: Any,
    task: Any,
    examples: list[dict[str, Any]],
    *,
    role: str = "teacher",
    temperature: float = 0.5,
    max_new_tokens: int = 512,
    max_prompt_tokens: int = 2048,
    seed: int = 0,
    stop_strings: tuple[str, ...] = (),
    engine_args: dict[str, Any] | None = None,
    setting: str = "generate.engine",
) -> list[tuple[str, bool]]:
    """:func:`kdlab.rollouts.decoding.sample_completions` with vLLM: ``(text, ended)`` per example, prompted as
    ``role`` with kdlab's own prompt tokens, the same end tokens, text decoding and ``ended`` rule.
    Request ``i`` is seeded ``seed + i`` (repeated prompts get different samples). ``engine_args`` go to
    ``vllm.LLM`` (e.g. ``tensor_parallel_size``, ``gpu_memory_utilization``)."""
    from kdlab.data import prompt_token_ids
    from kdlab.rollouts.decoding import completion_records

    vllm = import_vllm(setting)
    if getattr(spec, "checkpoint", None) is not None:
        raise ValueError(f"{setting}: vLLM loads {role}.path and cannot apply {role}.checkpoint; export the model to a folder")
    end_ids = engine_end_ids(spec, tokenizer)
    requests = [vllm.TokensPrompt(prompt_token_ids=prompt_token_ids(task, tokenizer, ex, role, max_prompt_tokens)) for ex in examples]
    llm = vllm.LLM(**{**engine_settings(spec, seed), **(engine_args or {})})  # engine_args win (e.g. dtype: bfloat16)
    params = [
        vllm.SamplingParams(**sampling_params(temperature, max_new_tokens, end_ids, seed=seed + row, logprobs=False, stop=tuple(stop_strings)))
        for row in range(len(requests))
    ]
    outputs = llm.generate(requests, params, use_tqdm=False)
    ids, mask = right_pad([list(output.outputs[0].token_ids) for output in outputs], int(tokenizer.pad_token_id))
    return completion_records(tokenizer, ids, mask, end_ids, stop_strings)


def colocated_engine_args() -> dict[str, Any]:
    """``vllm.LLM`` settings for an engine inside a multi-process training job: one engine per rank on
    that rank's own GPU, joining the job's process group (vLLM's ``external_launcher``, which reads
    ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``; set here from the process group where the launcher did
    not). Empty for a single process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {}
    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    os.environ.setdefault("LOCAL_RANK", str(torch.cuda.current_device() if torch.cuda.is_available() else dist.get_rank()))
    return {"distributed_executor_backend": "external_launcher"}


class WeightLoaderExtension:
    """Mixed into vLLM's GPU worker (``LLM(worker_extension_cls="kdlab.rollouts.vllm.WeightLoaderExtension")``):
    ``llm.collective_rpc("kdlab_load_weights", args=(weights,))`` loads ``[(name, tensor), ...]`` into the
    worker's model with the model's own ``load_weights`` (which handles vLLM's fused q/k/v and gate/up)."""

    def kdlab_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        runner = self.model_runner  # type: ignore[attr-defined]  (set by vLLM on the worker)
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model  # unwrapped from CUDA graphs
        device = next(model.parameters()).device
        model.load_weights((name, tensor.to(device)) for name, tensor in weights)
        return len(weights)  # (load_weights reports vLLM's own fused parameter names, not these)


class VLLMRollouts(RolloutPolicy):
    """Completions sampled by a vLLM engine from the student (on-policy) or the teacher.

    Args:
        model: ``student`` (its current weights are pushed every ``sync_every`` steps) or ``teacher``.
        sync_every: optimiser steps between weight pushes (1: every step, so the sampling policy is the
            current student up to vLLM-vs-HF numerics).
        importance_cap: the per-token ratio cap of the importance weights: distillation weights every
            completion by ``w = mean_t min(cap, p_theta / q)`` (paper: cap 2); GRPO weights every token by
            ``min(cap, pi_old / q)``.
        gpu_memory_utilization, tensor_parallel_size, enforce_eager, max_model_len: passed to ``vllm.LLM``.
        dtype: the engine's weights (e.g. ``bfloat16`` while training in fp32); default the model's own. The
            importance weights absorb the numerical difference.

    The engine is built on first use on the module's device, from the model's path (``student.path`` or
    ``teacher.path``) and dtype. With ``model: student`` it runs in-process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so pushed weights reach the worker as tensors, which needs
    ``tensor_parallel_size: 1``; after each push vLLM's prefix cache is reset (its KV blocks came from the
    old weights). Under multi-process training every rank builds its own engine on its own GPU
    (:func:`colocated_engine_args`), with ``tensor_parallel_size: 1``.
    """

    def __init__(
        self,
        model: str = "student",
        sync_every: int = 1,
        importance_cap: float = 2.0,
        gpu_memory_utilization: float = 0.3,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = True,
        max_model_len: int | None = None,
        dtype: str | None = None,
    ) -> None:
        super().__init__()
        if model not in ("student", "teacher"):
            raise ValueError(f"VLLMRollouts.model must be 'student' or 'teacher', got {model!r}")
        if sync_every < 1:
            raise ValueError(f"VLLMRollouts.sync_every must be >= 1, got {sync_every}")
        if not importance_cap > 0:
            raise ValueError(f"VLLMRollouts.importance_cap must be > 0, got {importance_cap}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"VLLMRollouts.gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if model == "student" and tensor_parallel_size != 1:
            raise ValueError(
                "VLLMRollouts.tensor_parallel_size must be 1 for model: student (weight pushes need vLLM's in-process "
                f"engine, one worker per training rank), got {tensor_parallel_size}"
            )
        import_vllm()  # fails now, naming the extra, rather than at the first step
        self.model, self.sync_every, self.importance_cap = model, sync_every, importance_cap
        self.engine_args = {
            "gpu_memory_utilization": gpu_memory_utilization,
            "tensor_parallel_size": tensor_parallel_size,
            "enforce_eager": enforce_eager,
            "max_model_len": max_model_len,
            "dtype": dtype,
        }
        self._llm: Any = None
        self._synced_step = -1

    def engine(self, spec: Any, seed: int) -> Any:
        if self._llm is None:
            vllm = import_vllm()
            if self.model == "student":
                # Weight pushes hand tensors to the worker through collective_rpc. With vLLM's default
                # engine process they would be msgpack-encoded as plain lists and lost; the in-process
                # engine (one worker, tensor_parallel_size 1) receives them as tensors.
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            settings = {
                **engine_settings(spec, seed), "worker_extension_cls": "kdlab.rollouts.vllm.WeightLoaderExtension",
                # log-probs of the distribution actually sampled from (vLLM >= 0.10)
                "logprobs_mode": "processed_logprobs",
            }
            settings.update({k: v for k, v in self.engine_args.items() if v is not None})
            colocated = colocated_engine_args()
            if colocated and settings["tensor_parallel_size"] != 1:
                raise ValueError(
                    "VLLMRollouts.tensor_parallel_size must be 1 under multi-process training: every rank samples "
                    f"its own prompts with its own engine, got {settings['tensor_parallel_size']}"
                )
            self._llm = vllm.LLM(**settings, **colocated)
        return self._llm

    def push_weights(self, student: torch.nn.Module, step: int) -> bool:
        """Push the student's weights if ``sync_every`` steps have passed; returns whether it pushed."""
        if self.model != "student" or (self._synced_step >= 0 and step - self._synced_step < self.sync_every):
            return False
        self._llm.collective_rpc("kdlab_load_weights", args=(list(merged_weights(student)),))
        self._llm.reset_prefix_cache()  # cached prompt KV blocks were computed with the old weights
        self._synced_step = step
        return True

    def sample(self, prompts: PromptBatch, context: RolloutContext) -> Rollout:
        vllm = import_vllm()
        spec = context.student_spec if self.model == "student" else context.teacher_spec
        if spec is None:
            raise ValueError("VLLMRollouts needs the model's spec in the rollout context (DistillModule provides it)")
        if self.model == "teacher" and spec.checkpoint is not None:
            raise ValueError("VLLMRollouts(model='teacher') loads teacher.path and cannot apply teacher.checkpoint; export the teacher to a folder")
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=context.generator).item()) if context.generator is not None else None
        llm = self.engine(spec, seed or 0)
        if self.model == "student":
            self.push_weights(context.student, context.step)
        temperature = context.student_temperature if self.model == "student" else context.teacher_temperature
        ids = getattr(prompts, f"{self.model}_ids").tolist()
        mask = getattr(prompts, f"{self.model}_mask").tolist()
        requests = [vllm.TokensPrompt(prompt_token_ids=[t for t, m in zip(row, keep) if m]) for row, keep in zip(ids, mask)]
        # one seed per request: vLLM seeds requests separately, and repeated prompts (a GRPO group) must differ
        params = [
            vllm.SamplingParams(**sampling_params(temperature, context.max_new_tokens, context.eos_token_ids, context.top_p,
                                                  None if seed is None else seed + row, stop=context.stop_strings))
            for row in range(len(requests))
        ]
        outputs = llm.generate(requests, params, use_tqdm=False)
        tokens, logprobs = [], []
        for output in outputs:
            sample = output.outputs[0]
            tokens.append(list(sample.token_ids))
            logprobs.append(sampled_token_logprobs(sample))
        completion_ids, completion_mask = right_pad(tokens, context.pad_token_id)
        behaviour = torch.zeros(completion_ids.shape, dtype=torch.float32)
        for row, values in enumerate(logprobs):
            behaviour[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
        device = prompts.student_ids.device
        return Rollout(
            prompts, completion_ids.to(device), completion_mask.to(device), None,
            behaviour_logprobs=behaviour.to(device) if self.model == "student" else None, importance_cap=self.importance_cap,
        )
