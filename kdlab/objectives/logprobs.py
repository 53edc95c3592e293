"""Chunked token log-probabilities ``log p(y_t)`` of the sampled tokens (``[B, T]``) from full logits or a
lazy head: the policy term of GRPO and the sampled KL estimators, without holding a ``[B, T, V]``
softmax (the backward recomputes each chunk). fp32 maths, forward and backward, whatever the caller's
autocast (:func:`~kdlab.objectives.precision.full_precision` switches it off)."""

from __future__ import annotations

import torch

from kdlab.objectives.kernels import iter_token_chunks
from kdlab.objectives.lazy import HeadLogits, Logits
from kdlab.objectives.precision import full_precision


def _chunk_logprobs(scaled: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From one chunk's tempered logits ``(n, V)`` fp32 (overwritten): the log-normalisers, the chosen
    tokens' log-probs and the entropies, each ``(n,)``."""
    normaliser = torch.logsumexp(scaled, dim=-1)
    logprobs = scaled.sub_(normaliser[:, None])
    chosen = logprobs.gather(-1, ids[:, None]).squeeze(-1)
    return normaliser, chosen, -(logprobs.exp() * logprobs).sum(-1)


def _chunk_logit_grad(scaled: torch.Tensor, normaliser: torch.Tensor, ids: torch.Tensor, g: torch.Tensor, scale: float) -> torch.Tensor:
    """``d sum_i g_i log p(ids_i) / d z`` ``(n, V)`` for raw logits ``z`` with ``scaled = scale * z`` (fp32,
    overwritten): ``scale * g * (onehot(ids) - p)``."""
    grad = scaled.sub_(normaliser[:, None]).exp_().mul_(-g[:, None])
    grad.scatter_add_(-1, ids[:, None], g[:, None])
    return grad.mul_(scale)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """``log_softmax(scale * logits)[..., ids]`` and the entropy, one chunk of positions at a time: the
    ``(B, C, V)`` fp32 log-softmax that autograd would keep for backward never exists. Backward
    recomputes each chunk's softmax from the saved logits and log-normalisers ``(B, C)``:
    ``d logp_y / d z = scale * (onehot(y) - p)``."""

    @staticmethod
    def forward(ctx, logits, ids, mask, scale, chunk_size):  # type: ignore[override]
        chosen, entropy, log_normaliser = (torch.zeros(ids.shape, dtype=torch.float32, device=logits.device) for _ in range(3))
        with full_precision(logits):
            for b, t in iter_token_chunks(mask, chunk_size):
                log_normaliser[b, t], chosen[b, t], entropy[b, t] = _chunk_logprobs(logits[b, t].float().mul_(scale), ids[b, t])
        ctx.save_for_backward(logits, ids, mask, log_normaliser)
        ctx.scale, ctx.chunk_size = scale, chunk_size
        ctx.mark_non_differentiable(entropy)
        return chosen, entropy

    @staticmethod
    def backward(ctx, grad_chosen, grad_entropy):  # type: ignore[override]
        logits, ids, mask, log_normaliser = ctx.saved_tensors
        grad = torch.zeros_like(logits)
        with full_precision(logits):
            for b, t in iter_token_chunks(mask, ctx.chunk_size):
                scaled = logits[b, t].float().mul_(ctx.scale)
                grad[b, t] = _chunk_logit_grad(scaled, log_normaliser[b, t], ids[b, t], grad_chosen[b, t].float(), ctx.scale).to(grad.dtype)
        return grad, None, None, None, None


class _ChunkedHeadTokenLogprobs(torch.autograd.Function):
    """As :class:`_ChunkedTokenLogprobs` with the logits given as hidden states ``(B, C, H)`` and an LM
    head ``(V, H)`` (``z = h W^T``): no ``(B, C, V)`` tensor exists, forward or backward. Backward
    recomputes each chunk's logits and accumulates ``dL/dh = dz W`` and ``dL/dW = dz^T h``. Every matrix
    product is fp32 (bf16 hidden states or head are upcast chunk by chunk, the head once), whatever the
    caller's autocast."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, mask, scale, chunk_size):  # type: ignore[override]
        chosen, entropy, log_normaliser = (torch.zeros(ids.shape, dtype=torch.float32, device=hidden.device) for _ in range(3))
        with full_precision(hidden):
            head = weight.float()
            for b, t in iter_token_chunks(mask, chunk_size):
                scaled = (hidden[b, t].float() @ head.T).mul_(scale)
                log_normaliser[b, t], chosen[b, t], entropy[b, t] = _chunk_logprobs(scaled, ids[b, t])
        ctx.save_for_backward(hidden, weight, ids, mask, log_normaliser)
        ctx.scale, ctx.chunk_size = scale, chunk_size
        ctx.mark_non_differentiable(entropy)
        return chosen, entropy

    @staticmethod
    def backward(ctx, grad_chosen, grad_entropy):  # type: ignore[override]
        hidden, weight, ids, mask, log_normaliser = ctx.saved_tensors
        with full_precision(hidden):
            return _ChunkedHeadTokenLogprobs._backward(ctx, hidden, weight, ids, mask, log_normaliser, grad_chosen)

    @staticmethod
    def _backward(ctx, hidden, weight, ids, mask, log_normaliser, grad_chosen):
        head = weight.float()
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(head) if ctx.needs_input_grad[1] else None  # a frozen head needs none
        for b, t in iter_token_chunks(mask, ctx.chunk_size):
            h = hidden[b, t].float()
            scaled = (h @ head.T).mul_(ctx.scale)
            dz = _chunk_logit_grad(scaled, log_normaliser[b, t], ids[b, t], grad_chosen[b, t].float(), ctx.scale)
            if grad_hidden is not None:
                grad_hidden[b, t] = (dz @ head).to(grad_hidden.dtype)
            if grad_weight is not None:
                grad_weight.addmm_(dz.T, h)
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None, None


def token_logprobs(
    logits: Logits, ids: torch.Tensor, mask: torch.Tensor | None = None, temperature: float = 1.0, chunk_size: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob ``(B, C)`` of each token ``ids`` under ``softmax(logits / temperature)`` (``logits``
    ``(B, C, V)``, any float dtype, or :class:`~kdlab.objectives.lazy.HeadLogits` whose ``scale`` is then used
    instead of ``temperature``) and the entropy ``(B, C)`` of each position's distribution (detached),
    in fp32; differentiable w.r.t. the logits (or the hidden states and head). Only positions where
    ``mask`` ``(B, C)`` is True are computed (others are 0); fp32 intermediates never exceed
    ``(chunk_size, V)``."""
    mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    if isinstance(logits, HeadLogits):
        return _ChunkedHeadTokenLogprobs.apply(logits.hidden, logits.weight, ids, mask, logits.scale, chunk_size)
    return _ChunkedTokenLogprobs.apply(logits, ids, mask, 1.0 / temperature, chunk_size)
