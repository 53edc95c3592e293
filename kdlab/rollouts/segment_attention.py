"""A variable-length attention for models without flash attention: packed sequences laid end to end in one row,
each sequence's attention computed on its own (per-sequence causal SDPA), so a packed forward pays attention
for ``sum(l_i^2)`` instead of the ``L^2`` of a block-diagonal mask over the whole row, and the row holds no padding.

:func:`segment_attention` is registered with Hugging Face's attention interfaces as ``"kdlab_segments"`` (and a mask
function that builds no mask); :func:`segment_attention_for` switches a model to it for the duration of a forward
(and its backward: the autograd graph keeps the functions it ran). Sequence boundaries come from the row's
position ids, which restart at 0 on each sequence (:class:`~kdlab.rollouts.packing.PackedBatch`), as Hugging Face's
flash-attention path reads them.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from collections.abc import Iterator

import torch

NAME = "kdlab_segments"
_WRAPPED: contextvars.ContextVar[str] = contextvars.ContextVar("kdlab_segments_wrapped", default="sdpa")
"""The implementation the model had (``sdpa`` or ``eager``): each sequence's attention is computed as it computes it."""


_LAST: list = [None, None, None]  # (weak reference, version, lengths) of the last row read: a forward's layers share it


def segment_lengths(position_ids: torch.Tensor) -> list[int]:
    """The lengths of the sequences laid end to end in a ``(1, T)`` row of position ids (each restarts at 0). Read
    from the device once per row (the layers of one forward get the same tensor), so a GPU syncs once a forward."""
    if position_ids.dim() != 2 or position_ids.shape[0] != 1:
        raise ValueError(f"segment attention reads one packed row of position ids (1, T), got {tuple(position_ids.shape)}")
    if _LAST[0] is not None and _LAST[0]() is position_ids and _LAST[1] == position_ids._version:
        return _LAST[2]
    starts = (position_ids[0] == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        raise ValueError("segment attention: a packed row must start with a sequence (position id 0)")
    lengths = [end - start for start, end in zip(starts, [*starts[1:], position_ids.shape[1]])]
    _LAST[:] = [weakref.ref(position_ids), position_ids._version, lengths]
    return lengths


def segment_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      position_ids: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Causal attention of each sequence of one packed row on its own: ``query`` ``(1, H, T, D)``, ``key`` and
    ``value`` ``(1, H_kv, T, D)`` (grouped heads repeated), ``position_ids`` ``(1, T)``; returns ``(1, T, H, D)`` as
    Hugging Face's attention functions do (and no weights). Each sequence's attention is computed as the model's own
    implementation computes it: causal SDPA for an ``sdpa`` model, scores + causal mask + fp32 softmax for ``eager``."""
    if position_ids is None:
        raise ValueError("segment attention needs the packed row's position ids")
    if attention_mask is not None:
        raise ValueError("segment attention takes no attention mask: the sequences' boundaries are its mask")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    eager = _WRAPPED.get() == "eager"
    outputs, start = [], 0
    for length in segment_lengths(position_ids):
        span = slice(start, start + length)
        if eager:  # as Hugging Face's eager attention computes it: scores, a causal additive mask, fp32 softmax
            scores = query[:, :, span] @ key[:, :, span].transpose(2, 3) * scale
            causal = torch.ones(length, length, dtype=torch.bool, device=query.device).triu(1)
            scores = scores.masked_fill(causal, torch.finfo(scores.dtype).min)
            weights = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
            weights = torch.nn.functional.dropout(weights, p=dropout, training=dropout > 0)
            outputs.append(weights @ value[:, :, span])
        else:
            outputs.append(torch.nn.functional.scaled_dot_product_attention(
                query[:, :, span], key[:, :, span], value[:, :, span], dropout_p=dropout, is_causal=True, scale=scale))
        start += length
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs) -> None:
    return None


@functools.cache
def register() -> str:
    """Registers :func:`segment_attention` (and a mask function that builds none) under :data:`NAME`; once."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(NAME, segment_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, _no_mask)
    return NAME


@contextlib.contextmanager
def segment_attention_for(model: torch.nn.Module) -> Iterator[None]:
    """``model`` (a Hugging Face model, or a module wrapping one) attends with :func:`segment_attention` inside the
    block: every config that names the attention implementation is switched and restored on leaving."""
    register()
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")}
    kept = {key: config._attn_implementation for key, config in configs.items()}
    wrapped = _WRAPPED.set("eager" if "eager" in kept.values() else "sdpa")
    try:
        for config in configs.values():
            config._attn_implementation = NAME
        yield
    finally:
        for key, config in configs.items():
            config._attn_implementation = kept[key]
        _WRAPPED.reset(wrapped)
