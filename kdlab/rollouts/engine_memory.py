"""How much of a GPU a vLLM engine takes (:func:`engine_memory_fraction`, the default ``gpu_memory_utilization`` of
:class:`~kdlab.rollouts.vllm.VLLMRollouts`, also counted by ``kdlab estimate``), from a Hugging Face config alone."""

from __future__ import annotations

import math
from typing import Any

import torch

ENGINE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16, "float32": torch.float32, "float": torch.float32}
"""``VLLMRollouts.dtype`` values: vLLM's names for the engine's weights (its ``ModelDType`` less ``auto``, whose
result depends on the checkpoint) and the torch dtype pushed weights are cast to."""
VLLM_PROFILE_TOKENS, VLLM_PROFILE_SEQUENCES = 16384, 1024
"""vLLM's largest default ``max_num_batched_tokens`` and ``max_num_seqs`` for ``vllm.LLM`` (H100/H200 and up): the
batches of the profiling step whose activation peak it reserves (checked by ``scripts/check_vllm_api.py``)."""
ENGINE_OVERHEAD_BYTES, MEMORY_FRACTION_RANGE = 2 * 2**30, (0.05, 0.9)
"""An engine's memory beyond weights, KV cache and profiled activations (CUDA graphs, NCCL/cuBLAS workspaces,
fragmentation), and the floor and cap of the computed ``gpu_memory_utilization`` (0.9: vLLM's default)."""


def _shape(config: Any) -> tuple[Any, int, int, int, int, int]:
    """(text config, hidden, heads, kv_heads, head_dim, intermediate) of a Hugging Face decoder config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, heads = int(text.hidden_size), int(text.num_attention_heads)
    kv_heads, head_dim = int(getattr(text, "num_key_value_heads", None) or heads), int(getattr(text, "head_dim", None) or hidden // heads)
    return text, hidden, heads, kv_heads, head_dim, int(getattr(text, "intermediate_size", None) or 4 * hidden)


def dense_decoder_parameters(config: Any) -> int:
    """Parameters of a dense decoder-only transformer (Llama, Qwen2, Mistral, ...) from its Hugging Face config:
    embeddings (twice when the head is untied), per layer q/o (``hidden x heads x head_dim`` each), k/v
    (``hidden x kv_heads x head_dim`` each), gate/up/down (``hidden x intermediate`` each), two norms; the final
    norm. Biases are left out (under 0.1%)."""
    text, hidden, heads, kv_heads, head_dim, intermediate = _shape(config)
    tied = bool(getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False)))
    layer = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * intermediate + 2 * hidden
    return int(text.vocab_size) * hidden * (1 if tied else 2) + int(text.num_hidden_layers) * layer + hidden


def engine_memory_fraction(
    config: Any, dtype: str, sequences: int, sequence_tokens: int, device_bytes: int, max_model_len: int | None = None
) -> float:
    """The ``gpu_memory_utilization`` a vLLM engine for the model of Hugging Face ``config`` needs to sample
    ``sequences`` completions of at most ``sequence_tokens`` (prompt + completion) tokens at once, as a
    fraction of a device of ``device_bytes``. With ``b`` the bytes per element of ``dtype``::

        weights     = P x b                                  P: dense_decoder_parameters(config)
        kv/token    = 2 x layers x kv_heads x head_dim x b   (K and V of every layer; vLLM's KV cache is in the model dtype)
        tokens      = max(sequences x sequence_tokens, max_model_len or config.max_position_embeddings)
                                                             (vLLM refuses to start unless one longest sequence fits)
        activations = 16384 x (2 x intermediate + 4 x hidden) x b + 1024 x vocab x 4 B x 3
                      (vLLM's profiling step: its largest default token batch through an MLP, and the
                       sampler's fp32 logits, probabilities and sort buffer for its largest sequence batch)
        need        = weights + 1.25 x kv/token x tokens + activations + 2 GiB
                      (1.25: KV block rounding; 2 GiB: CUDA graphs, NCCL/cuBLAS workspaces, fragmentation)
        fraction    = need / device_bytes, rounded up to 0.01, kept within [0.05, 0.9]

    Qwen2.5-1.5B (P = 1.54e9, 28 layers x 2 KV heads x 128, context 32768), bf16, H200 (140.4 GiB): 3.09 +
    1.17 + 2.66 + 2.15 = 9.1 GB, 0.07 (``max_model_len: 6144``: 0.06). Llama-3.1-8B (P = 8.03e9, 32 x 8 x 128,
    context 131072): 16.1 + 21.5 + 3.05 + 2.15 = 42.7 GB, 0.29 (``max_model_len: 6144``: 0.15). A dense-decoder
    estimate: for mixture-of-experts or multimodal models set ``gpu_memory_utilization`` yourself.
    """
    text, hidden, _, kv_heads, head_dim, intermediate = _shape(config)
    size = ENGINE_DTYPES[dtype].itemsize
    weights = dense_decoder_parameters(config) * size
    kv_per_token = 2 * int(text.num_hidden_layers) * kv_heads * head_dim * size
    longest = max_model_len or int(getattr(text, "max_position_embeddings", 0) or 0) or sequence_tokens
    tokens = max(sequences * sequence_tokens, longest)
    activations = VLLM_PROFILE_TOKENS * (2 * intermediate + 4 * hidden) * size + VLLM_PROFILE_SEQUENCES * int(text.vocab_size) * 4 * 3
    need = weights + 1.25 * kv_per_token * tokens + activations + ENGINE_OVERHEAD_BYTES
    low, high = MEMORY_FRACTION_RANGE
    return min(max(math.ceil(100 * need / device_bytes) / 100, low), high)
