"""A variable-length attention for models without flash attention: packed sequences laid end to end in one row
with no padding, each sequence attending only to itself.

Everything but attention (projections, MLPs, norms, the head: nearly all of a forward's FLOPs) then runs on the
real tokens only. For attention the sequences are gathered into one ``(S, H, M, D)`` batch (``S`` sequences, ``M``
the longest), attend in one call under a causal mask over each one's real keys, and are scattered back: attention
costs what it costs in the padded layout (``S x M^2``), never the ``L^2`` of a block-diagonal mask over a long row.

:func:`segment_attention` is registered with Hugging Face's attention interfaces as ``"kdlab_segments"`` (and a mask
function that builds no mask); :func:`segment_attention_for` switches a model to it for the duration of a forward
(the backward replays the recorded graph, so it needs no switch; a recompute under activation checkpointing would,
which is why :func:`~kdlab.rollouts.packing.segments_apply` leaves such models on the mask). Sequence boundaries come
from the row's position ids, which restart at 0 on each sequence (:class:`~kdlab.rollouts.packing.PackedBatch`), as
Hugging Face's flash-attention path reads them. A layer with a sliding window (:func:`attention_window`) attends
within each sequence to the window's keys only, as Hugging Face's masks do.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kdlab.models.loading import attention_windows

NAME = "kdlab_segments"
_WRAPPED: contextvars.ContextVar[str] = contextvars.ContextVar("kdlab_segments_wrapped", default="sdpa")
"""The implementation the model had (``sdpa`` or ``eager``): each sequence's attention is computed as it computes it."""


_LAST: list = [None, None, None]  # (weak reference, version, layout) of the last row read: a forward's layers share it


@dataclass(frozen=True)
class Segments:
    """Where the sequences of one packed row ``(1, T)`` sit in a ``(S, M)`` batch of them (``S`` sequences, ``M`` the
    longest): ``lengths``; ``index`` ``(S, M)``, the row position of each slot (padding slots repeat the sequence's
    last position); ``slots`` ``(T,)``, the flat slot of each row position; ``mask`` ``(1, 1, M, M)``, causal, True
    where a slot may attend. Each sequence fills its first slots and its padding slots come after them, so a real
    slot's causal keys are all real: causal alone is each sequence's own mask (the padding slots' outputs are
    dropped, so what they see, their sequence and the padding before them, never reaches the row)."""

    lengths: list[int]
    index: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor

    def windowed(self, window: int | None) -> torch.Tensor | None:
        """``(1, 1, M, M)``: :attr:`mask` with slot ``i`` attending to the ``window`` slots ``i - window + 1 .. i`` only
        (a sequence's slots are its positions); ``None`` when the window holds every causal key (``window >= M``)."""
        longest = self.mask.shape[-1]
        if window is None or window >= longest:
            return None
        column = torch.arange(longest, device=self.mask.device)
        return self.mask & ((column[:, None] - column[None, :]) < window)[None, None]


def segments(position_ids: torch.Tensor) -> Segments:
    """The :class:`Segments` of a ``(1, T)`` row of position ids (each sequence restarts at 0), read from the device
    once per row (the layers of one forward get the same tensor, so a GPU syncs once a forward)."""
    if position_ids.dim() != 2 or position_ids.shape[0] != 1:
        raise ValueError(f"segment attention reads one packed row of position ids (1, T), got {tuple(position_ids.shape)}")
    if _LAST[0] is not None and _LAST[0]() is position_ids and _LAST[1] == position_ids._version:
        return _LAST[2]
    starts = (position_ids[0] == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        raise ValueError("segment attention: a packed row must start with a sequence (position id 0)")
    lengths = [end - start for start, end in zip(starts, [*starts[1:], position_ids.shape[1]])]
    device, longest = position_ids.device, max(lengths)
    start = torch.tensor(starts, device=device)[:, None]
    size = torch.tensor(lengths, device=device)[:, None]
    column = torch.arange(longest, device=device)[None, :]
    index = start + torch.minimum(column, size - 1)
    real = column < size
    slots = (torch.arange(len(lengths), device=device)[:, None] * longest + column)[real]
    mask = column[0, :, None] >= column[0, None, :]
    layout = Segments(lengths, index, slots, mask[None, None])
    _LAST[:] = [weakref.ref(position_ids), position_ids._version, layout]
    return layout


def segment_lengths(position_ids: torch.Tensor) -> list[int]:
    """The lengths of the sequences laid end to end in a ``(1, T)`` row of position ids (each restarts at 0)."""
    return segments(position_ids).lengths


def attention_window(module: torch.nn.Module, passed: int | None) -> int | None:
    """The sliding window of attention ``module`` (``None``: every earlier key), read as Hugging Face's masks read it
    (:func:`~kdlab.models.loading.attention_windows` of ``module.config`` at ``module.layer_idx``: some models, Qwen2-MoE's
    and PhiMoE's, slide through their mask only and pass the attention no window); ``passed``, the ``sliding_window``
    the model passed, where the module has no config or layer index. A window the model passed that differs from its
    config's is an error, naming both."""
    config, layer = getattr(module, "config", None), getattr(module, "layer_idx", None)
    if config is None or layer is None:
        return passed
    window = attention_windows(config)[layer]
    if passed is not None and passed != window:
        raise ValueError(f"segment attention: layer {layer} ({type(module).__name__}) passed sliding_window={passed}, "
                         f"its config's layers give {window}")
    return window


def segment_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      position_ids: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Causal attention of each sequence of one packed row on its own: ``query`` ``(1, H, T, D)``, ``key`` and
    ``value`` ``(1, H_kv, T, D)`` (grouped heads repeated), ``position_ids`` ``(1, T)``; returns ``(1, T, H, D)`` as
    Hugging Face's attention functions do (and no weights). The sequences are gathered into one ``(S, H, M, D)``
    batch and attend in one call, causally (:attr:`Segments.mask`), computed as the model's own implementation computes
    it (SDPA with ``is_causal`` for an ``sdpa`` model; scores, an additive mask and an fp32 softmax for ``eager``), then scattered
    back: the projections around it ran on the real tokens only. A sliding-window layer (:func:`attention_window`) attends
    to the window's last keys of its own sequence (:meth:`Segments.windowed`). A ``softcap`` the model passes (Gemma2's
    ``attn_logit_softcapping``) caps the scores, ``tanh(s / softcap) softcap``, before the mask, as eager attention does."""
    if position_ids is None:
        raise ValueError("segment attention needs the packed row's position ids")
    if attention_mask is not None:
        raise ValueError("segment attention takes no attention mask: the sequences' boundaries are its mask")
    if kwargs.get("s_aux") is not None:  # GPT-OSS's attention sinks: an extra logit column per head
        raise ValueError(f"segment attention does not apply {type(module).__name__}'s attention sinks (s_aux); "
                         "use padded rows (max_tokens_per_row: null)")
    layout = segments(position_ids)
    windowed = layout.windowed(attention_window(module, kwargs.get("sliding_window")))
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (tensor[0][:, layout.index].transpose(0, 1) for tensor in (query, key, value))  # (S, H, M, D)
    softcap = kwargs.get("softcap")  # Gemma2's attn_logit_softcapping, which sdpa cannot apply
    if _WRAPPED.get() == "eager" or softcap is not None:  # as Hugging Face's eager attention computes it
        scores = (q @ k.transpose(2, 3)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~(layout.mask if windowed is None else windowed), torch.finfo(scores.dtype).min)
        weights = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.nn.functional.dropout(weights, p=dropout, training=dropout > 0) @ v
    elif windowed is not None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=windowed, dropout_p=dropout, scale=scale)
    else:
        # is_causal: no (S, 1, M, M) mask built or read (Segments: causal is each sequence's mask)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scale, is_causal=True)
    heads, dim = out.shape[1], out.shape[3]
    out = out.transpose(1, 2).reshape(-1, heads, dim)[layout.slots]  # (T, H, D), the row's order
    return out[None], None


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
