"""Token-level divergences between the teacher's and the student's next-token distributions.

Every objective is called as ``objective(student_logits, teacher_logits, mask) -> scalar``:

* ``student_logits``, ``teacher_logits``: ``(B, T, V)``, already divided by each model's temperature
  and restricted to the shared tokenizer vocabulary; any float dtype. Teacher logits carry no grad.
* ``mask``: ``(B, T)`` bool, True at completion tokens. False positions contribute nothing, neither
  to the value nor to the gradient.

Reduction (``reduction="sequence"``, the paper's Eq. 1): the mean over each sequence's masked-in
tokens, then the mean over the sequences that have at least one. ``reduction="token"``: the mean
over all masked-in tokens of the batch.

Memory: full-vocabulary objectives never hold more than one chunk of ``(chunk_size, V)`` fp32
intermediates. The forward pass walks the masked-in tokens chunk by chunk, computes each chunk's
loss and its gradient with respect to the student logits at once, and keeps only that gradient
(one tensor of the student logits' size and dtype, which backward needs anyway); backward scales it
by the incoming gradient. So no ``(B, T, V)`` fp32 copy of either model's logits is ever built,
while a naive implementation peaks at about five (measured by ``benchmarks/kl_memory.py``).

Direction conventions (a frequent source of bugs): ``F.kl_div(input, target)`` computes
KL(target || input), with ``input`` in log space. kdlab never calls it; every formula below is
written out in the direction its docstring names.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator

import torch

from kdlab.components import Component

TokenLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(student_logits (n, V) fp32, teacher_logits (n, V) fp32) -> per-token loss (n,)``."""

REDUCTIONS = ("sequence", "token")
_LOG_FLOOR = -1e30


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


def iter_token_chunks(mask: torch.Tensor, chunk_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(batch_index, time_index)`` long tensors for the masked-in positions, ``chunk_size`` at a time."""
    positions = mask.nonzero(as_tuple=False)
    for start in range(0, positions.shape[0], chunk_size):
        chunk = positions[start : start + chunk_size]
        yield chunk[:, 0], chunk[:, 1]


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """fp32 for half-precision inputs (bf16/fp16 logits are upcast chunk by chunk), else the input's."""
    return torch.promote_types(tensor.dtype, torch.float32)


class LazyLogits:
    """Base class: a ``(B, T, V)`` logits (or log-probs) tensor that is never materialised; objectives,
    :func:`kl_diagnostics` and :func:`sampled_logprobs` ask it for one chunk of rows at a time.

    Subclasses give :meth:`rows`, ``shape``, ``dtype``, ``device`` and :meth:`detach`."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    def rows(self, b: torch.Tensor, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``(n, V)`` at positions ``(b[i], t[i])``, in ``dtype``."""
        raise NotImplementedError

    def detach(self) -> LazyLogits:
        raise NotImplementedError


class HeadLogits(LazyLogits):
    """Logits ``(B, T, V)`` that are never materialised: ``scale * hidden @ weight.T``, computed for one
    chunk of rows at a time (the fused hidden-state + LM-head path).

    ``hidden``: ``(B, T, H)`` final hidden states at the positions that predict the completion;
    ``weight``: ``(V, H)`` the LM head restricted to the shared vocabulary (no bias); ``scale``:
    ``1 / temperature``. Objectives and :func:`kl_diagnostics` accept it wherever they accept logits;
    the student's ``(B, T, V)`` logits and their gradient then never exist, only ``(chunk, V)`` pieces.
    """

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, scale: float = 1.0) -> None:
        if hidden.dim() != 3 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[-1]:
            raise ValueError(f"HeadLogits: hidden (B, T, H) and weight (V, H) do not fit: {tuple(hidden.shape)}, {tuple(weight.shape)}")
        self.hidden, self.weight, self.scale = hidden, weight, scale
        self._cast: dict[torch.dtype, torch.Tensor] = {}

    def weight_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The head in ``dtype``, cast once (not once per chunk)."""
        if dtype not in self._cast:
            self._cast[dtype] = self.weight.to(dtype)
        return self._cast[dtype]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.hidden.shape[:2], self.weight.shape[0]))

    @property
    def dtype(self) -> torch.dtype:
        return self.hidden.dtype

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def rows(self, b: torch.Tensor, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        logits = self.hidden[b, t].to(dtype) @ self.weight_as(dtype).T
        return logits * self.scale if self.scale != 1.0 else logits

    def detach(self) -> HeadLogits:
        return HeadLogits(self.hidden.detach(), self.weight.detach(), self.scale)


Logits = torch.Tensor | LazyLogits
"""A ``(B, T, V)`` logits tensor, or a :class:`LazyLogits` (:class:`HeadLogits`, a cached top-k teacher)
standing for one."""


def _rows(logits: Logits, b: torch.Tensor, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``(n, V)`` of ``logits`` at positions ``(b, t)``, in ``dtype``."""
    return logits.rows(b, t, dtype) if isinstance(logits, LazyLogits) else logits[b, t].to(dtype)


def _chunk_loss_and_grad(s_chunk, t_chunk, w_chunk, token_loss, loss_and_grad, need_grad):
    """One chunk's weighted loss (scalar) and its gradient w.r.t. the student rows (or None)."""
    if need_grad and loss_and_grad is not None:
        losses, chunk_grad = loss_and_grad(s_chunk, t_chunk)  # closed form, no autograd graph
        return (losses * w_chunk).sum(), chunk_grad.mul_(w_chunk[:, None])
    if need_grad:
        with torch.enable_grad():
            s_chunk.requires_grad_(True)
            chunk_loss = (token_loss(s_chunk, t_chunk) * w_chunk).sum()
            (chunk_grad,) = torch.autograd.grad(chunk_loss, s_chunk)
        return chunk_loss.detach(), chunk_grad
    return (token_loss(s_chunk, t_chunk) * w_chunk).sum(), None


class _ChunkedHeadLoss(torch.autograd.Function):
    """As :class:`_ChunkedWeightedLoss`, with the student given as hidden states and an LM head: each
    chunk's logits are ``scale * h W^T``; the gradients ``dL/dh = scale * g W`` and
    ``dL/dW = scale * g^T h`` are accumulated chunk by chunk, so no ``(B, T, V)`` tensor exists."""

    @staticmethod
    def forward(ctx, hidden, weight, scale, teacher_logits, weights, token_loss, chunk_size, loss_and_grad=None):  # type: ignore[override]
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        dtype = compute_dtype(hidden)
        grad_hidden = torch.zeros_like(hidden) if need_grad else None
        # a frozen head (LoRA elsewhere) needs no (V, H) gradient buffer
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if ctx.needs_input_grad[1] else None
        total = torch.zeros((), dtype=dtype, device=hidden.device)
        student = HeadLogits(hidden, weight, scale)
        weight_c = student.weight_as(dtype)
        for b, t in iter_token_chunks(weights > 0, chunk_size):
            h_chunk = hidden[b, t].to(dtype)
            s_chunk = student.rows(b, t, dtype)
            chunk_loss, chunk_grad = _chunk_loss_and_grad(
                s_chunk, _rows(teacher_logits, b, t, dtype), weights[b, t].to(dtype), token_loss, loss_and_grad, need_grad
            )
            if need_grad:
                chunk_grad = chunk_grad * scale if scale != 1.0 else chunk_grad
                grad_hidden[b, t] = (chunk_grad @ weight_c).to(grad_hidden.dtype)
                if grad_weight is not None:
                    grad_weight.addmm_(chunk_grad.T, h_chunk)
            total += chunk_loss.detach()
            del s_chunk, h_chunk, chunk_loss, chunk_grad
        ctx.grads = (grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None, need_grad)
        return total

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        (grad_hidden, grad_weight, computed), ctx.grads = ctx.grads, (None, None, False)
        if not computed:
            raise RuntimeError("backward through a chunked kdlab objective can run only once per forward")
        scale = grad_output.to(grad_hidden.dtype)
        grad_weight = grad_weight.mul_(scale.to(grad_weight.dtype)) if grad_weight is not None else None
        return grad_hidden.mul_(scale), grad_weight, None, None, None, None, None, None


class _ChunkedWeightedLoss(torch.autograd.Function):
    """sum_{b,t} weights[b,t] * token_loss(s[b,t], t[b,t]), computed chunk by chunk.

    The gradient w.r.t. the student logits is computed per chunk in forward (in fp32, stored in the
    student logits' dtype) so that backward is a single in-place scale.
    """

    @staticmethod
    def forward(ctx, student_logits, teacher_logits, weights, token_loss, chunk_size, loss_and_grad=None):  # type: ignore[override]
        need_grad = ctx.needs_input_grad[0]
        grad = torch.zeros_like(student_logits) if need_grad else None
        dtype = compute_dtype(student_logits)
        total = torch.zeros((), dtype=dtype, device=student_logits.device)
        for b, t in iter_token_chunks(weights > 0, chunk_size):
            s_chunk = student_logits[b, t].to(dtype)
            chunk_loss, chunk_grad = _chunk_loss_and_grad(
                s_chunk, _rows(teacher_logits, b, t, dtype), weights[b, t].to(dtype), token_loss, loss_and_grad, need_grad
            )
            if need_grad:
                grad[b, t] = chunk_grad.to(grad.dtype)
            total += chunk_loss.detach()
            # free this chunk's (chunk, V) buffers before the next chunk allocates its own
            del s_chunk, chunk_loss, chunk_grad
        ctx.grad = grad
        return total

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        grad, ctx.grad = ctx.grad, None
        if grad is None:
            raise RuntimeError("backward through a chunked kdlab objective can run only once per forward")
        return grad.mul_(grad_output.to(grad.dtype)), None, None, None, None, None


def chunked_token_loss(
    token_loss: TokenLoss,
    student_logits: Logits,
    teacher_logits: Logits,
    weights: torch.Tensor,
    chunk_size: int = 256,
    loss_and_grad: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """``sum_{b,t} weights[b,t] * token_loss(student_logits[b,t], teacher_logits[b,t])`` as a scalar
    in :func:`compute_dtype` (fp32 for half-precision logits).

    Only positions with ``weights > 0`` are evaluated. Differentiable w.r.t. ``student_logits``
    only (teacher logits are treated as constants), or w.r.t. the hidden states and head weight when
    the student is :class:`HeadLogits` (either side may be). ``token_loss`` must be row-wise: each output
    depends on its own row only, which is what makes chunking exact. ``loss_and_grad``, when given,
    returns ``(token_loss(s, t), d token_loss / d s)`` in closed form and is used instead of
    autograd for the gradient; it must agree with ``token_loss`` (tests check each one that exists).
    """
    if weights.shape != student_logits.shape[:2]:
        raise ValueError(f"mask/weights {tuple(weights.shape)} must be (B, T) = {tuple(student_logits.shape[:2])}")
    teacher_logits = teacher_logits.detach()
    if isinstance(student_logits, HeadLogits):
        if tuple(student_logits.shape) != tuple(teacher_logits.shape):
            raise ValueError(f"student (B, T, V) {tuple(student_logits.shape)} and teacher {tuple(teacher_logits.shape)} differ")
        head = student_logits
        return _ChunkedHeadLoss.apply(head.hidden, head.weight, head.scale, teacher_logits, weights, token_loss, chunk_size, loss_and_grad)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student_logits {tuple(student_logits.shape)} and teacher_logits "
            f"{tuple(teacher_logits.shape)} must have the same (B, T, V) shape"
        )
    return _ChunkedWeightedLoss.apply(student_logits, teacher_logits, weights, token_loss, chunk_size, loss_and_grad)


class KLObjective(Component):
    """Base class: a per-token divergence, reduced over completion tokens.

    Subclasses implement :meth:`token_loss`, a plain differentiable function of one chunk of rows;
    the base class handles chunking, masking, reduction and fp32 accumulation. A subclass may
    instead override :meth:`forward` entirely.

    Args:
        reduction: ``"sequence"`` (the paper's per-completion mean, then mean over completions) or
            ``"token"`` (mean over all completion tokens of the batch).
        chunk_size: tokens per chunk; bounds the fp32 intermediates to ``(chunk_size, V)``. 256 was
            the fastest and leanest on CPU in ``benchmarks/kl_memory.py`` (large chunks pay for fresh pages).
    """

    def __init__(self, reduction: str = "sequence", chunk_size: int = 256) -> None:
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"{type(self).__name__}.reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if chunk_size < 1:
            raise ValueError(f"{type(self).__name__}.chunk_size must be >= 1, got {chunk_size}")
        self.reduction = reduction
        self.chunk_size = chunk_size

    def token_loss(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        """Per-token loss ``(n,)`` from fp32 ``(n, V)`` student and teacher logits."""
        raise NotImplementedError

    token_loss_and_grad: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    """Optional closed form ``(losses (n,), d losses / d student_logits (n, V))`` that saves memory."""

    def reseed(self, seed: int) -> None:
        """Set the random stream for this step (only sampled objectives use one)."""

    def forward(
        self, student_logits: Logits, teacher_logits: Logits, mask: torch.Tensor, sequence_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Reduced loss over the masked-in tokens (fp32 scalar). An empty mask warns and returns 0.

        ``sequence_weights`` ``(B,)`` multiplies each completion's share of the reduced loss (e.g. the
        importance weights of rollouts from a lagging engine); ``None`` is all ones."""
        weights = token_weights(mask, self.reduction, compute_dtype(student_logits))
        if sequence_weights is not None:
            weights = weights * sequence_weights.to(weights.dtype)[:, None]
        if not bool(mask.any()):
            warnings.warn(
                f"{type(self).__name__}: the completion mask selects no token in this batch; loss is 0",
                stacklevel=2,
            )
        return chunked_token_loss(
            self.token_loss, student_logits, teacher_logits, weights, self.chunk_size, self.token_loss_and_grad
        )


def _log_softmax_pair(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.log_softmax(student_logits, dim=-1), torch.log_softmax(teacher_logits, dim=-1)


def _kl_rows(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum_v p(v) (log p(v) - log q(v)) per row, from normalised log-probs ``(n, V)``.

    ``log_p`` is floored at a finite value so that a token with p = 0 contributes exactly 0 (and a
    zero gradient) instead of ``0 * inf = nan``; finite logits never reach the floor.
    """
    log_p = log_p.clamp(min=_LOG_FLOOR)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def forward_kl_per_token(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(pi_T || pi_S) = sum_v pi_T(v) (log pi_T(v) - log pi_S(v)), per row. ``(n, V) -> (n,)``."""
    log_s, log_t = _log_softmax_pair(student_logits, teacher_logits)
    return _kl_rows(log_t, log_s)


def reverse_kl_per_token(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(pi_S || pi_T) = sum_v pi_S(v) (log pi_S(v) - log pi_T(v)), per row. ``(n, V) -> (n,)``."""
    log_s, log_t = _log_softmax_pair(student_logits, teacher_logits)
    return _kl_rows(log_s, log_t)


class ForwardKL(KLObjective):
    """Forward KL(pi_T || pi_S) over the full vocabulary: mode-covering, the SFT-like direction.

    Its gradient w.r.t. student logit v is ``pi_S(v) - pi_T(v)`` (times the token weight), bounded
    in [-1, 1].
    """

    def token_loss(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        return forward_kl_per_token(student_logits, teacher_logits)

    def token_loss_and_grad(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """KL(pi_T || pi_S) and its gradient pi_S - pi_T, reusing the chunk's buffers in place."""
        log_s = torch.log_softmax(student_logits, dim=-1)
        log_t = torch.log_softmax(teacher_logits, dim=-1).clamp_(min=_LOG_FLOOR)
        p_t = log_t.exp()
        losses = (p_t * (log_t - log_s)).sum(-1)
        return losses, log_s.exp_().sub_(p_t)


class ReverseKL(KLObjective):
    """Reverse KL(pi_S || pi_T) over the full vocabulary: mode-seeking; its gradient carries an
    unbounded log-ratio term weighted by pi_S."""

    def token_loss(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        return reverse_kl_per_token(student_logits, teacher_logits)

    def token_loss_and_grad(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """KL(pi_S || pi_T) and its gradient pi_S * (log pi_S - log pi_T - KL), in place."""
        log_s = torch.log_softmax(student_logits, dim=-1).clamp_(min=_LOG_FLOOR)
        ratio = torch.log_softmax(teacher_logits, dim=-1).neg_().add_(log_s)  # log pi_S - log pi_T
        p_s = log_s.exp_()
        losses = (p_s * ratio).sum(-1)
        return losses, ratio.sub_(losses[:, None]).mul_(p_s)


class GeneralizedJSD(KLObjective):
    """Skew Jensen-Shannon divergence rescaled so that both endpoints are the KLs.

    With P = pi_T, Q = pi_S and M = beta P + (1 - beta) Q:

        D_beta = [beta KL(P || M) + (1 - beta) KL(Q || M)] / (beta (1 - beta))
               = KL(P || M) / (1 - beta) + KL(Q || M) / beta

    ``D_0 = KL(pi_T || pi_S)`` (ForwardKL) and ``D_1 = KL(pi_S || pi_T)`` (ReverseKL), and D is
    continuous in beta on [0, 1]; ``D_0.5`` is 4 x the usual JSD. The unscaled JSD that peers use
    tends to 0 at both ends, so their endpoints are special cases that do not match the interior.
    Near an endpoint (beta < ~1e-3) the small term is a ratio of two small numbers and loses fp32
    precision; exactly 0 and 1 are computed as the KLs directly.
    """

    def __init__(self, beta: float = 0.5, reduction: str = "sequence", chunk_size: int = 256) -> None:
        super().__init__(reduction=reduction, chunk_size=chunk_size)
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"GeneralizedJSD.beta must be in [0, 1], got {beta}")
        self.beta = float(beta)

    def token_loss(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        beta = self.beta
        if beta == 0.0:
            return forward_kl_per_token(student_logits, teacher_logits)
        if beta == 1.0:
            return reverse_kl_per_token(student_logits, teacher_logits)
        log_q, log_p = _log_softmax_pair(student_logits, teacher_logits)
        log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
        return _kl_rows(log_p, log_m) / (1.0 - beta) + _kl_rows(log_q, log_m) / beta


class TotalVariation(KLObjective):
    """Total-variation distance 0.5 * sum_v |pi_T(v) - pi_S(v)| per token, in [0, 1]."""

    def token_loss(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        return 0.5 * (torch.softmax(student_logits, -1) - torch.softmax(teacher_logits, -1)).abs().sum(-1)


class _SampledKL(KLObjective):
    """Shared seeding for the Monte-Carlo estimators: one token is drawn per position, independent of
    the rollout token. ``seed`` fixes the stream; :meth:`reseed` (called by DistillModule with a
    per-step seed) makes every step reproducible and resumable. The draw order follows the chunks,
    so a different ``chunk_size`` gives a different (equally valid) draw."""

    def __init__(self, seed: int = 0, reduction: str = "sequence", chunk_size: int = 256) -> None:
        super().__init__(reduction=reduction, chunk_size=chunk_size)
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def reseed(self, seed: int) -> None:
        self.seed = seed
        self._generators.clear()

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        """One token per row from softmax(logits) ``(n, V) -> (n,)``, using this objective's stream."""
        generator = self._generators.get(logits.device)
        if generator is None:
            generator = torch.Generator(device=logits.device).manual_seed(self.seed)
            self._generators[logits.device] = generator
        probs = torch.softmax(logits.detach(), dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class SampledForwardKL(_SampledKL):
    """Monte-Carlo forward KL: y ~ pi_T per position, loss -log pi_S(y).

    Unbiased for the gradient of KL(pi_T || pi_S): E_y[-grad log pi_S(y)] = pi_S - pi_T.
    """

    def token_loss(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        drawn = self.draw(teacher_logits)
        return -torch.log_softmax(student_logits, dim=-1).gather(-1, drawn[:, None]).squeeze(-1)


class SampledReverseKL(_SampledKL):
    """Monte-Carlo reverse KL: y ~ pi_S per position, surrogate
    ``stopgrad[log pi_S(y) - log pi_T(y)] * log pi_S(y)``.

    Its gradient is the score-function estimate of grad KL(pi_S || pi_T) (unbiased since
    E_y[grad log pi_S(y)] = 0). Its *value* is not the KL; the exact KL is logged beside it.
    """

    def token_loss(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        drawn = self.draw(student_logits)[:, None]
        log_s = torch.log_softmax(student_logits, dim=-1).gather(-1, drawn).squeeze(-1)
        log_t = torch.log_softmax(teacher_logits, dim=-1).gather(-1, drawn).squeeze(-1)
        return (log_s - log_t).detach() * log_s


@torch.no_grad()
def sampled_logprobs(logits: Logits, ids: torch.Tensor, chunk_size: int = 256) -> torch.Tensor:
    """``log_softmax(logits)[b, t, ids[b, t]]`` ``(B, T)`` in fp32, without grad, chunk by chunk
    (a :class:`HeadLogits` is never materialised)."""
    out = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    for b, t in iter_token_chunks(torch.ones_like(ids, dtype=torch.bool), chunk_size):
        out[b, t] = torch.log_softmax(_rows(logits, b, t, torch.float32), -1).gather(-1, ids[b, t, None]).squeeze(-1)
    return out


@torch.no_grad()
def kl_diagnostics(
    student_logits: Logits,
    teacher_logits: Logits,
    mask: torch.Tensor,
    reduction: str = "sequence",
    chunk_size: int = 256,
) -> dict[str, torch.Tensor]:
    """Exact full-vocabulary ``kl_forward`` = KL(pi_T||pi_S), ``kl_reverse`` = KL(pi_S||pi_T) and
    ``student_entropy`` / ``teacher_entropy`` (nats), reduced like the objectives, without grad,
    in one chunked pass. Shapes as for the objectives."""
    dtype = compute_dtype(student_logits)
    weights = token_weights(mask, reduction, dtype)
    totals = torch.zeros(4, dtype=dtype, device=student_logits.device)
    for b, t in iter_token_chunks(weights > 0, chunk_size):
        log_s, log_t = _log_softmax_pair(_rows(student_logits, b, t, dtype), _rows(teacher_logits, b, t, dtype))
        rows = torch.stack(
            [
                _kl_rows(log_t, log_s),
                _kl_rows(log_s, log_t),
                -_kl_rows(log_s, torch.zeros_like(log_s)),  # entropy = -sum p log p
                -_kl_rows(log_t, torch.zeros_like(log_t)),
            ]
        )
        totals += (rows * weights[b, t].to(dtype)).sum(-1)
    return dict(zip(("kl_forward", "kl_reverse", "student_entropy", "teacher_entropy"), totals.unbind()))
