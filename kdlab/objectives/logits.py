"""The logits an objective reads: the model's forward pass over prompt + completion, cut to the
completion positions.

:func:`completion_logits` materialises them (``[B, T, V]``); :func:`completion_head_logits` returns a
lazy :class:`~kdlab.objectives.lazy.HeadLogits` (hidden states ``[B, T, H]`` plus the output head),
so the fused KL kernels compute ``[chunk, V]`` blocks on the fly and never hold ``[B, T, V]``.
:func:`fused_head_unsupported` says why a model cannot take the fused path."""

from __future__ import annotations

import functools
import inspect

import torch


@functools.cache
def _class_forward_parameters(model_class: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_class.forward).parameters)


def innermost_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside training wrappers (FSDP1, DDP, ``torch.compile``, peft), whose ``forward``
    signature says which arguments it takes (the wrappers' own take ``*args, **kwargs``)."""
    for _ in range(8):  # wrappers nest a few levels at most
        inner = getattr(model, "_fsdp_wrapped_module", None) or getattr(model, "_orig_mod", None)
        if inner is None and isinstance(getattr(model, "module", None), torch.nn.Module):
            inner = model.module
        if inner is None and callable(getattr(model, "get_base_model", None)):
            inner = model.get_base_model()
        if not isinstance(inner, torch.nn.Module) or inner is model:
            return model
        model = inner
    return model


def forward_parameters(model: torch.nn.Module) -> frozenset[str]:
    return _class_forward_parameters(type(innermost_model(model)))


def cache_argument(model: torch.nn.Module) -> str:
    # transformers 5.x renamed ``past_key_values`` to ``cache``; accept both.
    return "cache" if "cache" in forward_parameters(model) else "past_key_values"


def completion_logits(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    completion_length: int,
    token_columns: int,
) -> torch.Tensor:
    """Logits ``(B, C, token_columns)`` that predict the last ``C = completion_length`` tokens of ``inputs``.

    Asks the model for only those ``C`` positions (``logits_to_keep`` as a position tensor), so the
    prompt's logits are never computed and the result is contiguous, and drops embedding rows beyond the
    tokenizer's vocabulary (padded embeddings, e.g. Qwen2.5's 151,936 vs 152,064).
    """
    if "logits_to_keep" in forward_parameters(model):
        # exactly the C positions that predict the completion, so the logits (and the gradient an
        # objective hands back) are one contiguous (B, C, V) tensor, with no slice to undo in backward
        length = inputs["input_ids"].shape[1]
        keep = torch.arange(length - completion_length - 1, length - 1, device=inputs["input_ids"].device)
        logits = model(**inputs, use_cache=False, logits_to_keep=keep).logits
    else:
        logits = model(**inputs, use_cache=False).logits
    if logits.shape[1] != completion_length:
        logits = logits[:, -(completion_length + 1) : -1]
    return logits if logits.shape[-1] == token_columns else logits[..., :token_columns]


def completion_head_logits(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    completion_length: int,
    token_columns: int,
    temperature: float = 1.0,
):
    """:class:`~kdlab.objectives.lazy.HeadLogits` standing for ``completion_logits(...) / temperature`` without
    computing them: the final hidden states ``(B, C, H)`` at the positions that predict the completion
    and the LM head's first ``token_columns`` rows. Only one position's logits are computed by the model
    (``logits_to_keep=1``). The head must have no bias."""
    from kdlab.objectives.lazy import HeadLogits

    reason = fused_head_unsupported(model)
    if reason:
        raise ValueError(f"fused_lm_head: {reason}; use the logits path (fused_lm_head: false)")
    head = model.get_output_embeddings()
    keep = {"logits_to_keep": 1} if "logits_to_keep" in forward_parameters(model) else {}
    outputs = model(**inputs, use_cache=False, output_hidden_states=True, **keep)
    hidden = outputs.hidden_states[-1][:, -(completion_length + 1) : -1]
    return HeadLogits(hidden, full_head_weight(head)[:token_columns], 1.0 / temperature)


def fused_head_unsupported(model: torch.nn.Module) -> str | None:
    """Why the fused hidden-state + LM-head path cannot stand for ``model``'s logits, or ``None``: a head
    with a bias or with adapters (peft's LoRA on ``lm_head``), logits transformed after the head (soft-capping,
    scaling), a head that is not a plain weight (FSDP1's flat parameters), or no head at all."""
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        return "the model has no LM head with a weight"
    if getattr(head, "bias", None) is not None:
        return "the LM head has a bias"
    if hasattr(head, "base_layer"):  # peft's adapter layer: its weight is the base's, without the adapter's term
        return "the LM head carries adapters (LoRA on lm_head), which its weight leaves out"
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", 1.0) not in (None, 1.0):
        return "this model transforms its logits after the LM head (soft-capping or scaling)"
    if getattr(model, "_fsdp_wrapped_module", None) is not None or head.weight.dim() != 2:
        return "the LM head is flattened and sharded by FSDP1 (strategy: fsdp)"
    return None


def full_head_weight(head: torch.nn.Module) -> torch.Tensor:
    """The LM head's whole ``(V, H)`` weight, read after the model's forward. Under FSDP2 the root's
    parameters (embeddings, final norm, head) are still gathered then (a root unit does not reshard
    after forward), so this is the unsharded parameter and its gradient is reduce-scattered by FSDP2
    after backward as usual; a head still sharded (a ``DTensor``) is all-gathered with ``full_tensor()``,
    whose backward reduce-scatters the gradient into the shards. FSDP1 flattens parameters and is refused
    before training (``TaskStage``)."""
    weight = head.weight
    return weight.full_tensor() if hasattr(weight, "full_tensor") else weight
