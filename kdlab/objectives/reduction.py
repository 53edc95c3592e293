"""How a per-token loss becomes one objective value, its gradient and the diagnostics, in one pass.

Reduction (``reduction="sequence"``, the paper's Eq. 1): the mean over each sequence's masked-in
tokens, then the mean over the sequences that have at least one. ``reduction="token"``: the mean
over all masked-in tokens of the batch.

One pass: the forward walks the masked-in tokens chunk by chunk (and, on the CPU, block by block in
reused buffers, see :mod:`kdlab.objectives.kernels`), normalises each row of both models once and takes from
that one normalisation the loss, its gradient with respect to the student logits and the exact
diagnostics ``kl_forward``, ``kl_reverse`` and both entropies (:meth:`KLObjective.take_diagnostics`).
Only the gradient is kept (one tensor of the student logits' size and dtype, which backward needs
anyway, or the logits' own storage with ``consume=True``); backward scales it by the incoming gradient,
or hands it on untouched when that is 1. So no ``(B, T, V)`` fp32 copy of either model's logits is ever
built, while a naive implementation peaks at about five (measured by ``benchmarks/kl_memory.py``).

:func:`chunked_token_loss` is that pass for any per-token loss (a :class:`~kdlab.objectives.kl.KLObjective`'s
``token_loss`` or closed form); :func:`token_weights` are the reduction's per-token weights.
"""

from __future__ import annotations

import torch

from kdlab.objectives.kernels import (
    DIAGNOSTICS,
    HeadGradient,
    LogitsGradient,
    RowsLossAndGrad,
    TokenLoss,
    chunked_pass,
    compute_dtype,
    scaled_gradients,
    taken_gradient,
)
from kdlab.objectives.lazy import HeadLogits, Logits
from kdlab.objectives.precision import full_precision

REDUCTIONS = ("sequence", "token")


def token_weights(mask: torch.Tensor, reduction: str = "sequence", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-token weights ``(B, T)`` in ``dtype`` whose weighted sum of token losses is the reduced loss.

    ``sequence``: ``1 / (L_b * n)`` for the ``L_b`` masked-in tokens of sequence b and the ``n``
    sequences with ``L_b > 0``; ``token``: ``1 / sum(mask)``. Masked-out positions get 0. An
    all-False mask gives all zeros (the caller decides what an empty batch means).
    """
    if mask.dim() != 2:
        raise ValueError(f"mask must be (B, T), got shape {tuple(mask.shape)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    mask = mask.bool()
    weights = mask.to(dtype)
    if reduction == "token":
        return weights / weights.sum().clamp(min=1.0)
    lengths = weights.sum(dim=1, keepdim=True)
    n_sequences = (lengths > 0).sum().clamp(min=1)
    return weights / (lengths.clamp(min=1.0) * n_sequences)


class _ChunkedObjective(torch.autograd.Function):
    """``sum_{b,t} weights[b,t] * loss(student[b,t], teacher[b,t])`` by :func:`~kdlab.objectives.kernels.chunked_pass`,
    its gradient computed in forward (so backward is one in-place scale) and the diagnostics of the same
    pass kept in ``out["diagnostics"]``. The student is plain logits ``(B, T, V)`` or a :class:`HeadLogits`
    given as its hidden states and head (either may need grad). Forward and backward run with autocast
    off (:func:`~kdlab.objectives.precision.full_precision`): fp32 maths whatever the caller's autocast."""

    @staticmethod
    def forward(ctx, student_logits, hidden, weight, head, teacher_logits, weights, diagnostic_weights, chunk_size, token_loss, rows_loss_and_grad, out, consume):  # type: ignore[override]
        with full_precision(head if head is not None else student_logits, teacher_logits):
            return _ChunkedObjective._forward(ctx, student_logits, hidden, weight, head, teacher_logits, weights, diagnostic_weights, chunk_size, token_loss, rows_loss_and_grad, out, consume)

    @staticmethod
    def _forward(ctx, student_logits, hidden, weight, head, teacher_logits, weights, diagnostic_weights, chunk_size, token_loss, rows_loss_and_grad, out, consume):
        dtype = compute_dtype(hidden if head is not None else student_logits)
        if head is not None:
            need = (ctx.needs_input_grad[1], ctx.needs_input_grad[2])
            gradient = HeadGradient(head, need[0], need[1], dtype) if any(need) else None
            student = head
        else:
            student = student_logits
            covered = (weights > 0) | (diagnostic_weights > 0)
            gradient = LogitsGradient(student_logits, covered, dtype, consume) if ctx.needs_input_grad[0] else None
        total, out["diagnostics"] = chunked_pass(
            student, teacher_logits, weights, diagnostic_weights, chunk_size, token_loss, rows_loss_and_grad, gradient
        )
        ctx.gradient = gradient
        ctx.weight_dtype = weight.dtype if weight is not None else None
        return total

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        gradient = taken_gradient(ctx, "a chunked kdlab objective")
        with full_precision(grad_output):
            return _ChunkedObjective._backward(ctx, gradient, grad_output)

    @staticmethod
    def _backward(ctx, gradient, grad_output):
        return (*scaled_gradients(gradient, grad_output, ctx.weight_dtype), None, None, None, None, None, None, None, None, None)


def chunked_token_loss(
    token_loss: TokenLoss | None,
    student_logits: Logits,
    teacher_logits: Logits,
    weights: torch.Tensor,
    chunk_size: int = 256,
    rows_loss_and_grad: RowsLossAndGrad | None = None,
    diagnostic_weights: torch.Tensor | None = None,
    diagnostics: dict[str, torch.Tensor] | None = None,
    consume: bool = False,
) -> torch.Tensor:
    """``sum_{b,t} weights[b,t] * token_loss(student_logits[b,t], teacher_logits[b,t])`` as a scalar
    in :func:`compute_dtype` (fp32 for half-precision logits).

    Only positions with ``weights > 0`` (or ``diagnostic_weights > 0``) are evaluated. Differentiable
    w.r.t. ``student_logits`` only (teacher logits are treated as constants), or w.r.t. the hidden states
    and head weight when the student is :class:`HeadLogits` (either side may be). ``token_loss`` must be
    row-wise: each output depends on its own row only, which is what makes chunking exact.
    ``rows_loss_and_grad``, when given, computes the loss and its gradient in closed form from the
    block's :class:`~kdlab.objectives.kernels.RowStatistics` and is used instead of ``token_loss`` and autograd;
    it must agree with ``token_loss`` (tests check each one that exists). When ``diagnostics`` is a dict,
    it receives the same pass's ``kl_forward``, ``kl_reverse``, ``student_entropy`` and
    ``teacher_entropy``, reduced with ``diagnostic_weights`` (default: ``weights``). ``consume``: plain
    student logits are overwritten with their gradient instead of a new ``(B, T, V)`` tensor being
    allocated (:class:`~kdlab.objectives.kernels.LogitsGradient`); the caller must not read them afterwards."""
    if weights.shape != student_logits.shape[:2]:
        raise ValueError(f"mask/weights {tuple(weights.shape)} must be (B, T) = {tuple(student_logits.shape[:2])}")
    if tuple(student_logits.shape) != tuple(teacher_logits.shape):
        raise ValueError(
            f"student_logits {tuple(student_logits.shape)} and teacher_logits "
            f"{tuple(teacher_logits.shape)} must have the same (B, T, V) shape"
        )
    teacher_logits = teacher_logits.detach()
    diagnostic_weights = weights if diagnostic_weights is None else diagnostic_weights
    out: dict[str, torch.Tensor] = {}
    if isinstance(student_logits, HeadLogits):
        head = student_logits
        total = _ChunkedObjective.apply(
            None, head.hidden, head.weight, head, teacher_logits, weights, diagnostic_weights, chunk_size, token_loss, rows_loss_and_grad, out, False
        )
    else:
        total = _ChunkedObjective.apply(
            student_logits, None, None, None, teacher_logits, weights, diagnostic_weights, chunk_size, token_loss, rows_loss_and_grad, out, consume
        )
    if diagnostics is not None:
        diagnostics.update(zip(DIAGNOSTICS, out["diagnostics"].unbind()))
    return total
