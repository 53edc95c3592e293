"""vLLM back end for rollouts: ``VLLMRollouts`` samples the student's (or the teacher's) completions
with vLLM instead of kdlab's own KV-cache decoder.

Optional: ``pip install 'kdlab[vllm]'`` on a CUDA machine. Everything vLLM-specific goes through the
documented API (``vllm.LLM``, ``SamplingParams``, ``TokensPrompt``, ``LLM.generate``,
``LLM.collective_rpc`` with a ``worker_extension_cls``); what surrounds it is plain PyTorch and tested on
CPU: the translation of kdlab's sampling settings (:mod:`kdlab.rollouts.vllm_sampling`), the mapping of a trained
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

import contextlib
import os
import random
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from kdlab.data import PromptBatch, Rollout, right_pad
from kdlab.models.export import merged_weights
from kdlab.rollouts.engine_memory import (  # noqa: F401 - the engine's sizing, by its old names here too
    ENGINE_DTYPES,
    ENGINE_OVERHEAD_BYTES,
    MEMORY_FRACTION_RANGE,
    VLLM_PROFILE_SEQUENCES,
    VLLM_PROFILE_TOKENS,
    dense_decoder_parameters,
    engine_memory_fraction,
)
from kdlab.rollouts.policies import RolloutContext, RolloutPolicy
from kdlab.rollouts.vllm_sampling import checked_token_ids, padding_rows_bias, sampled_token_logprobs, sampling_params

INSTALL_HINT = "pip install 'kdlab[vllm]' (vLLM needs a CUDA machine)"
VLLM_VERSION = "0.33.0"
"""The vLLM release kdlab's use of vLLM is checked against (``python scripts/check_vllm_api.py``)."""
VLLM_API: dict[str, tuple[str, ...]] = {
    "SamplingParams": (  # keyword arguments (sampling_params)
        "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
        "max_tokens", "stop_token_ids", "ignore_eos", "skip_special_tokens", "detokenize", "seed", "stop",
        "include_stop_str_in_output", "logprobs", "logit_bias",
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


def import_vllm(setting: str = "VLLMRollouts", no_cuda: bool = False) -> Any:
    """The ``vllm`` package, or a one-line ImportError that names the setting and the extra to install
    (and, with ``no_cuda``, that this machine has no CUDA device either)."""
    try:
        import vllm
    except ImportError as error:
        cause = " ".join(str(error).split())
        where = "; this machine has no CUDA device" if no_cuda else ""
        raise ImportError(f"{setting} needs vLLM ({cause}); install it with {INSTALL_HINT}{where}") from error
    return vllm


def cuda_available() -> bool:  # (the CPU tests patch these two)
    return torch.cuda.is_available()


def device_memory_bytes() -> int:  # what gpu_memory_utilization is a fraction of
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


@contextlib.contextmanager
def outside_autocast() -> Iterator[None]:
    """Every active autocast region (Lightning's ``bf16-mixed`` wraps the training step in one) switched off:
    vLLM's engine, its profiling run and weight pushes run in the engine's own dtype."""
    with contextlib.ExitStack() as stack:
        for device_type in ("cuda", "cpu"):
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type=device_type, enabled=False))
        yield


@contextlib.contextmanager
def kept_random_state() -> Iterator[None]:
    """Python's, NumPy's and torch's (CPU, current CUDA device) global random states restored on exit: an
    in-process vLLM engine seeds them when it starts, which would change training's own random streams."""
    import numpy

    python, array = random.getstate(), numpy.random.get_state()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []):
        try:
            yield
        finally:
            random.setstate(python), numpy.random.set_state(array)


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
    bias = padding_rows_bias(spec, len(tokenizer))
    params = [
        vllm.SamplingParams(**sampling_params(temperature, max_new_tokens, end_ids, seed=seed + row, logprobs=False, stop=tuple(stop_strings),
                                              logit_bias=bias))
        for row in range(len(requests))
    ]
    outputs = llm.generate(requests, params, use_tqdm=False)
    ids, mask = right_pad(checked_token_ids(outputs, len(tokenizer), setting), int(tokenizer.pad_token_id))
    return completion_records(tokenizer, ids, mask, end_ids, stop_strings)


def colocated_engine_args() -> dict[str, Any]:
    """Prepares this process for a vLLM engine colocated with training (any :class:`VLLMRollouts` engine,
    student's or teacher's): its engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set
    before any engine starts; pushes hand the worker a generator of tensors, which an engine process would
    msgpack-encode as lists, and the ``external_launcher`` executor asserts it). Returns the ``vllm.LLM``
    settings: in a multi-process job one engine per rank on its own GPU, joining the job's process group
    (``external_launcher``, reading ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``: set here where the launcher did
    not); none for one process."""
    import torch.distributed as dist

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {}
    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    os.environ.setdefault("LOCAL_RANK", str(torch.cuda.current_device() if torch.cuda.is_available() else dist.get_rank()))
    return {"distributed_executor_backend": "external_launcher"}


def streamed_weights(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """``(Hugging Face name, tensor)`` of ``model`` one at a time (:func:`kdlab.models.export.merged_weights`: sharded
    parameters gathered one by one with ``full_tensor``, LoRA merged), floating-point ones cast to ``dtype`` as
    they go: never a whole copy of the weights. Consume it fully on every rank (gathering is a collective)."""
    with torch.no_grad():
        for name, tensor in merged_weights(model):
            yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor


class WeightLoaderExtension:
    """Mixed into vLLM's GPU worker (``LLM(worker_extension_cls="kdlab.rollouts.vllm.WeightLoaderExtension")``):
    ``llm.collective_rpc("kdlab_load_weights", args=(weights,))`` streams ``(name, tensor)`` pairs (the generator
    :func:`streamed_weights`, handed over as it is by the in-process engine) into the model's own ``load_weights``
    (vLLM's fused q/k/v and gate/up; it copies into the parameters, so captured CUDA graphs stay valid)."""

    def kdlab_load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        runner = self.model_runner  # type: ignore[attr-defined]  (set by vLLM on the worker)
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model  # unwrapped from CUDA graphs
        device, stream = next(model.parameters()).device, iter(weights)
        model.load_weights((name, tensor.to(device)) for name, tensor in stream)
        for _ in stream:  # whatever load_weights left unread is still gathered: collectives stay in step across ranks
            pass

    def kdlab_load_weights_file(self, path: str) -> None:
        """What a served sampler's push asks for over ``vllm serve``'s ``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``;
        :class:`~kdlab.rollouts.served_sampler.ServedRollouts`): the safetensors file ``path`` (Hugging Face names),
        which this worker's machine reads, loaded as :meth:`kdlab_load_weights` loads a stream."""
        from safetensors.torch import load_file

        self.kdlab_load_weights(load_file(str(path)).items())


class VLLMRollouts(RolloutPolicy):
    """Completions sampled by a vLLM engine from the student (on-policy) or the teacher.

    Args:
        model: ``student`` (its current weights are pushed every ``sync_every`` steps) or ``teacher``.
        sync_every: optimiser steps between weight pushes (1: every step, so the sampling policy is the
            current student up to vLLM-vs-HF numerics).
        importance_cap: the per-token ratio cap of the importance weights: distillation weights every
            completion by ``w = mean_t min(cap, p_theta / q)`` (paper: cap 2); GRPO weights every token by
            ``min(cap, pi_old / q)``.
        gpu_memory_utilization: the fraction of the GPU's memory the engine may take; default (``null``)
            sized from the model when the engine starts (:func:`engine_memory_fraction`: weights in the
            engine's dtype + the KV cache of one batch of prompts and completions, 0.05 to 0.9).
        tensor_parallel_size, max_model_len: passed to ``vllm.LLM``. ``max_model_len`` (e.g.
            ``max_prompt_tokens + max_completion_tokens``) also shrinks the computed memory budget, which
            otherwise keeps room for one sequence of the model's whole context length.
        enforce_eager: ``false`` (default) lets vLLM capture CUDA graphs (pushes copy into the captured
            parameters, so graphs stay valid); ``true`` runs eagerly (slower decoding, faster start, less memory).
        dtype: the engine's weights and KV cache, one of :data:`ENGINE_DTYPES`; default ``bfloat16``,
            whatever dtype the model trains in (an fp32 student is sampled in bf16; pushed weights are cast
            tensor by tensor). The importance weights absorb the numerical difference.

    Without a CUDA device or vLLM, construction fails at once in one line naming the extra (``pip install
    'kdlab[vllm]'``). The engine is built on first use on the module's device from ``student.path`` or
    ``teacher.path``, in the training process (:func:`colocated_engine_args`), outside autocast, keeping the
    process's random states. ``model: student`` needs ``tensor_parallel_size: 1`` (pushes reach the in-process
    worker); each push resets vLLM's prefix cache. Under multi-process training each rank has its own engine.
    """

    def needs(self) -> frozenset[str]:  # one vocabulary's ids; the teacher's path for model: teacher
        return frozenset({"one_vocabulary", "teacher_scores"} | ({"teacher_weights"} if self.model == "teacher" else set()))

    @property
    def depends_on_student(self) -> bool:
        return self.model == "student"

    def __init__(
        self,
        model: str = "student",
        sync_every: int = 1,
        importance_cap: float = 2.0,
        gpu_memory_utilization: float | None = None,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
        max_model_len: int | None = None,
        dtype: str = "bfloat16",
    ) -> None:
        super().__init__()
        if model not in ("student", "teacher"):
            raise ValueError(f"VLLMRollouts.model must be 'student' or 'teacher', got {model!r}")
        if sync_every < 1:
            raise ValueError(f"VLLMRollouts.sync_every must be >= 1, got {sync_every}")
        if not importance_cap > 0:
            raise ValueError(f"VLLMRollouts.importance_cap must be > 0, got {importance_cap}")
        if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"VLLMRollouts.gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if dtype not in ENGINE_DTYPES:
            raise ValueError(f"VLLMRollouts.dtype must be one of {sorted(ENGINE_DTYPES)}, got {dtype!r}")
        if model == "student" and tensor_parallel_size != 1:
            raise ValueError(
                "VLLMRollouts.tensor_parallel_size must be 1 for model: student (weight pushes need vLLM's in-process "
                f"engine, one worker per training rank), got {tensor_parallel_size}"
            )
        # fail now, in one line naming the extra, rather than at the first step
        cuda = cuda_available()
        import_vllm(no_cuda=not cuda)
        if not cuda:
            raise ImportError("VLLMRollouts needs a CUDA GPU and vLLM (pip install 'kdlab[vllm]'); this machine has no CUDA device")
        self.model, self.sync_every, self.importance_cap = model, sync_every, importance_cap
        self.engine_dtype = dtype  # (`dtype` is the LightningModule's own attribute)
        self.engine_args = {
            "gpu_memory_utilization": gpu_memory_utilization,
            "tensor_parallel_size": tensor_parallel_size,
            "enforce_eager": enforce_eager,
            "max_model_len": max_model_len,
        }
        self._llm: Any = None
        self._synced_step = -1
        self._padding_bias: dict[str, dict[int, float] | None] = {}  # the engine's model -> its padding rows' logit bias

    def memory_fraction(self, spec: Any, sequences: int, sequence_tokens: int) -> float:
        """``gpu_memory_utilization`` as set, else :func:`engine_memory_fraction` for ``spec``'s config."""
        if self.engine_args["gpu_memory_utilization"] is not None:
            return float(self.engine_args["gpu_memory_utilization"])
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(spec.resolved, revision=spec.revision, trust_remote_code=spec.trust_remote_code)
        return engine_memory_fraction(config, self.engine_dtype, sequences, sequence_tokens, device_memory_bytes(), self.engine_args["max_model_len"])

    def engine(self, spec: Any, seed: int, sequences: int = 1, sequence_tokens: int = 0) -> Any:
        """The engine, built on the first call for batches of ``sequences`` requests of up to
        ``sequence_tokens`` prompt + completion tokens (what the default memory budget is sized for)."""
        if self._llm is None:
            vllm = import_vllm()
            settings = {  # logprobs_mode: log-probs of the distribution actually sampled from (vLLM >= 0.10)
                **engine_settings(spec, seed), "worker_extension_cls": "kdlab.rollouts.vllm.WeightLoaderExtension",
                "logprobs_mode": "processed_logprobs", "dtype": self.engine_dtype,  # the engine's dtype, not the training one
            }
            settings.update({k: v for k, v in self.engine_args.items() if v is not None})
            colocated = colocated_engine_args()  # in-process engine, set before any engine starts
            if colocated and settings["tensor_parallel_size"] != 1:
                raise ValueError(
                    "VLLMRollouts.tensor_parallel_size must be 1 under multi-process training: every rank samples "
                    f"its own prompts with its own engine, got {settings['tensor_parallel_size']}"
                )
            settings["gpu_memory_utilization"] = self.memory_fraction(spec, sequences, sequence_tokens)
            with outside_autocast(), kept_random_state():
                self._llm = vllm.LLM(**settings, **colocated)
        return self._llm

    def push_weights(self, student: torch.nn.Module, step: int) -> bool:
        """Push the student's weights if ``sync_every`` steps have passed; returns whether it pushed. The
        weights stream into the worker one tensor at a time in the engine's dtype (:func:`streamed_weights`)."""
        if self.model != "student" or (self._synced_step >= 0 and step - self._synced_step < self.sync_every):
            return False
        with outside_autocast():
            self._llm.collective_rpc("kdlab_load_weights", args=(streamed_weights(student, ENGINE_DTYPES[self.engine_dtype]),))
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
        generator = context.generator
        # drawn on the generator's own device (a CUDA generator cannot fill a CPU tensor), then read back
        seed = None if generator is None else int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=generator.device).item())
        ids = getattr(prompts, f"{self.model}_ids")
        mask = getattr(prompts, f"{self.model}_mask").tolist()
        requests = [vllm.TokensPrompt(prompt_token_ids=[t for t, m in zip(row, keep) if m]) for row, keep in zip(ids.tolist(), mask)]
        llm = self.engine(spec, seed or 0, sequences=len(requests), sequence_tokens=ids.shape[1] + context.max_new_tokens)
        if self.model == "student":
            self.push_weights(context.student, context.step)
        temperature = context.student_temperature if self.model == "student" else context.teacher_temperature
        if spec.resolved not in self._padding_bias:
            self._padding_bias[spec.resolved] = padding_rows_bias(spec, context.token_columns)
        # one seed per request: vLLM seeds requests separately, and repeated prompts (a GRPO group) must differ
        params = [
            vllm.SamplingParams(**sampling_params(temperature, context.max_new_tokens, context.eos_token_ids, context.top_p,
                                                  None if seed is None else seed + row, stop=context.stop_strings,
                                                  logit_bias=self._padding_bias[spec.resolved]))
            for row in range(len(requests))
        ]
        with outside_autocast():
            outputs = llm.generate(requests, params, use_tqdm=False)
        tokens = checked_token_ids(outputs, context.token_columns, f"VLLMRollouts(model={self.model!r})")
        logprobs = [sampled_token_logprobs(output.outputs[0]) for output in outputs]
        completion_ids, completion_mask = right_pad(tokens, context.pad_token_id)
        behaviour = torch.zeros(completion_ids.shape, dtype=torch.float32)
        for row, values in enumerate(logprobs):
            behaviour[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
        device = prompts.student_ids.device
        return Rollout(
            prompts, completion_ids.to(device), completion_mask.to(device), None,
            behaviour_logprobs=behaviour.to(device) if self.model == "student" else None, importance_cap=self.importance_cap,
        )
