"""Token-level divergences between the teacher's and the student's next-token distributions.

Every objective is called as ``objective(student_logits, teacher_logits, mask) -> scalar``:

* ``student_logits``, ``teacher_logits``: ``(B, T, V)``, already divided by each model's temperature
  and restricted to the shared tokenizer vocabulary; any float dtype. Teacher logits carry no grad.
* ``mask``: ``(B, T)`` bool, True at completion tokens. False positions contribute nothing, neither
  to the value nor to the gradient.

Reduction and the one pass over chunks that gives the loss, its gradient and the diagnostics:
:mod:`kdlab.objectives.reduction`.

Direction conventions (a frequent source of bugs): ``F.kl_div(input, target)`` computes
KL(target || input), with ``input`` in log space. kdlab never calls it; every formula below is
written out in the direction its docstring names.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator

import torch

from kdlab.components import Component
from kdlab.objectives.kernels import (
    DIAGNOSTICS,
    LOG_FLOOR,
    RowsLossAndGrad,
    RowStatistics,
    chunked_pass,
    compute_dtype,
    iter_token_chunks,
    rowdot,
)
from kdlab.objectives.lazy import Logits, gather_rows
from kdlab.objectives.precision import full_precision
from kdlab.objectives.reduction import REDUCTIONS, chunked_token_loss, token_weights

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

    rows_loss_and_grad: RowsLossAndGrad | None = None
    """Optional closed form: ``(stats, grad) -> losses (k,)`` from a block's
    :class:`~kdlab.objectives.kernels.RowStatistics` (both softmaxes, log-normalisers, the exact KLs), writing
    ``d loss / d student logits`` ``(k, V)`` into ``grad`` when it is given. Computed from the same
    normalisation as the logged diagnostics, so the objective and its diagnostics cost one pass."""

    def closed_form(self) -> RowsLossAndGrad | None:
        """:attr:`rows_loss_and_grad` when it computes this class's :meth:`token_loss`: a subclass that overrides
        ``token_loss`` (and not the closed form) has its own loss taken by autograd, not its parent's formula."""
        closed = self.rows_loss_and_grad
        if closed is None or "rows_loss_and_grad" in vars(self):  # none, or one given to this object: used as given
            return closed
        mro = type(self).__mro__
        defines_closed = next((cls for cls in mro if "rows_loss_and_grad" in vars(cls)), None)
        defines_loss = next(cls for cls in mro if "token_loss" in vars(cls))
        return closed if defines_closed is None or issubclass(defines_closed, defines_loss) else None

    def reseed(self, seed: int) -> None:
        """Set the random stream for this step (only sampled objectives use one)."""

    TOKEN_REDUCTIONS = ("mean", "max", "min", "sum")

    def record_tokens(self, name: str, values: torch.Tensor, reduce: str = "mean") -> None:
        """Record a per-token statistic from :meth:`token_loss`: ``values`` ``(n,)``, one per row of the chunk.
        It is reduced (``mean``, ``max``, ``min`` or ``sum``) over every chunk of the :meth:`forward` call, so
        over all the batch's completion tokens, and logged as ``train/<name>``. (:meth:`record` inside
        ``token_loss`` keeps the last chunk's value only.) Outside a forward it records this chunk's reduction."""
        if reduce not in self.TOKEN_REDUCTIONS:
            raise ValueError(f"{type(self).__name__}.record_tokens({name!r}): reduce must be one of {self.TOKEN_REDUCTIONS}, got {reduce!r}")
        values = values.detach().flatten().double()
        extreme = reduce in ("max", "min")
        part = None if extreme and not values.numel() else getattr(values, reduce if extreme else "sum")()  # a sum, or this chunk's extreme
        pending = getattr(self, "_token_records", None)
        if pending is None:  # outside a forward: this chunk alone
            if part is not None:
                self.record(name, _reduced(part, values.numel(), reduce))
            return
        if name not in pending:
            if part is not None:
                pending[name] = (reduce, part, values.numel())
            return
        kept, total, count = pending[name]
        if kept != reduce:
            raise ValueError(f"{type(self).__name__}.record_tokens({name!r}): reduced with {kept!r} earlier in this call, now {reduce!r}")
        if part is not None:
            total = total + part if reduce in ("mean", "sum") else _REDUCE[reduce](total, part)
        pending[name] = (reduce, total, count + values.numel())

    @contextlib.contextmanager
    def recording_tokens(self) -> Iterator[None]:
        """One loss computation over chunks (:meth:`forward`, or the aligned objective's pass across tokenizers):
        :meth:`record_tokens` accumulates inside it and records each statistic once when it ends."""
        self._token_records: dict[str, tuple[str, torch.Tensor, int]] | None = {}
        try:
            yield
        finally:
            pending, self._token_records = self._token_records, None
            for name, (reduce, total, count) in (pending or {}).items():
                self.record(name, _reduced(total, count, reduce))

    def forward(
        self, student_logits: Logits, teacher_logits: Logits, mask: torch.Tensor, sequence_weights: torch.Tensor | None = None,
        *, consume: bool = False,
    ) -> torch.Tensor:
        """Reduced loss over the masked-in tokens (fp32 scalar). An empty mask warns and returns 0.
        The maths (loss, gradient, diagnostics) is fp32 whatever autocast region the caller runs in
        (Lightning's ``bf16-mixed`` runs ``training_step`` under one): the kernels switch it off.

        ``sequence_weights`` ``(B,)`` multiplies each completion's share of the reduced loss (e.g. the
        importance weights of rollouts from a lagging engine); ``None`` is all ones. The same pass
        computes the batch's exact ``kl_forward``, ``kl_reverse`` and both entropies, reduced like the
        loss but without ``sequence_weights``: :meth:`take_diagnostics` returns them. ``consume=True``
        lets the objective overwrite plain student logits with their gradient (no second ``(B, T, V)``
        tensor); the caller must not read them afterwards (``DistillModule`` does this)."""
        weights = token_weights(mask, self.reduction, compute_dtype(student_logits))
        diagnostic_weights = weights
        if sequence_weights is not None:
            weights = weights * sequence_weights.to(weights.dtype)[:, None]
        if not bool(mask.any()):
            warnings.warn(
                f"{type(self).__name__}: the completion mask selects no token in this batch; loss is 0",
                stacklevel=2,
            )
        self._diagnostics: dict[str, torch.Tensor] = {}
        closed = self.closed_form()
        with self.recording_tokens():
            return chunked_token_loss(
                None if closed is not None else self.token_loss, student_logits, teacher_logits, weights, self.chunk_size, closed,
                diagnostic_weights, self._diagnostics, consume=consume and isinstance(student_logits, torch.Tensor),
            )

    def take_diagnostics(self) -> dict[str, torch.Tensor]:
        """The diagnostics of the last :meth:`forward` (``{}`` if there was none since the last call):
        ``kl_forward`` = KL(pi_T||pi_S), ``kl_reverse`` = KL(pi_S||pi_T), ``student_entropy``,
        ``teacher_entropy`` (nats, fp32 scalars)."""
        diagnostics, self._diagnostics = getattr(self, "_diagnostics", {}), {}
        return diagnostics


_REDUCE = {"max": torch.maximum, "min": torch.minimum}


def _reduced(total: torch.Tensor, count: int, reduce: str) -> torch.Tensor:
    """A :meth:`KLObjective.record_tokens` statistic from its running ``total`` over ``count`` tokens (fp32)."""
    return (total / max(count, 1) if reduce == "mean" else total).float()


def _log_softmax_pair(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.log_softmax(student_logits, dim=-1), torch.log_softmax(teacher_logits, dim=-1)


def _kl_rows(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum_v p(v) (log p(v) - log q(v)) per row, from normalised log-probs ``(n, V)``.

    ``log_p`` is floored at a finite value so that a token with p = 0 contributes exactly 0 (and a
    zero gradient) instead of ``0 * inf = nan``; finite logits never reach the floor.
    """
    log_p = log_p.clamp(min=LOG_FLOOR)
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

    def rows_loss_and_grad(self, stats: RowStatistics, grad: torch.Tensor | None) -> torch.Tensor:
        """KL(pi_T || pi_S) and its gradient pi_S - pi_T."""
        if grad is not None:
            torch.sub(stats.p_s, stats.p_t, out=grad)
        return stats.kl_forward


class ReverseKL(KLObjective):
    """Reverse KL(pi_S || pi_T) over the full vocabulary: mode-seeking; its gradient carries an
    unbounded log-ratio term weighted by pi_S."""

    def token_loss(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        return reverse_kl_per_token(student_logits, teacher_logits)

    def rows_loss_and_grad(self, stats: RowStatistics, grad: torch.Tensor | None) -> torch.Tensor:
        """KL(pi_S || pi_T) and its gradient pi_S * (log pi_S - log pi_T - KL)."""
        if grad is not None:
            # log pi_S - log pi_T - KL = (s - t) - (lse_s - lse_t + KL), one shift per row
            ratio = torch.sub(stats.s, stats.t, out=stats.scratch)
            ratio.sub_((stats.lse_s - stats.lse_t + stats.kl_reverse)[:, None])
            torch.mul(ratio, stats.p_s, out=grad)
        return stats.kl_reverse


class GeneralizedJSD(KLObjective):
    """Skew Jensen-Shannon divergence rescaled so that both endpoints are the KLs.

    With P = pi_T, Q = pi_S and M = beta P + (1 - beta) Q:

        D_beta = [beta KL(P || M) + (1 - beta) KL(Q || M)] / (beta (1 - beta))
               = KL(P || M) / (1 - beta) + KL(Q || M) / beta

    ``D_0 = KL(pi_T || pi_S)`` (ForwardKL) and ``D_1 = KL(pi_S || pi_T)`` (ReverseKL), and D is
    continuous in beta on [0, 1]; ``D_0.5`` is 4 x the usual JSD. The unscaled JSD that peers use
    tends to 0 at both ends, so their endpoints are special cases that do not match the interior.
    Near an endpoint the small term is a ratio of two small numbers and loses fp32 precision (teacher and
    student logits a little apart, against fp64: loss and gradient off by ~0.2% at beta = 1e-3, 0.4% at 1e-4,
    up to 3% at 1e-5 and 30% at 1e-6), so a beta within :data:`BETA_EDGE` of 0 or 1 is refused; exactly 0 and
    1 are computed as the KLs directly.
    """

    BETA_EDGE = 1e-3
    """The nearest to 0 or 1 (other than 0 and 1 themselves) that beta may be."""

    def __init__(self, beta: float = 0.5, reduction: str = "sequence", chunk_size: int = 256) -> None:
        super().__init__(reduction=reduction, chunk_size=chunk_size)
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"GeneralizedJSD.beta must be in [0, 1], got {beta}")
        if 0.0 < min(beta, 1.0 - beta) < self.BETA_EDGE:
            raise ValueError(f"GeneralizedJSD.beta={beta} is within {self.BETA_EDGE:g} of {'0' if beta < 0.5 else '1'}, where its fp32 "
                             f"loss divides a vanishing KL by {'beta' if beta < 0.5 else '1 - beta'} and loses its precision; use "
                             f"{'0 (ForwardKL exactly)' if beta < 0.5 else '1 (ReverseKL exactly)'} or a beta at least {self.BETA_EDGE:g} from it")
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

    def rows_loss_and_grad(self, stats: RowStatistics, grad: torch.Tensor | None) -> torch.Tensor:
        """TV and its gradient: with u = sign(pi_S - pi_T) / 2, d TV / d s_v = pi_S(v) (u_v - sum_w pi_S(w) u_w)."""
        diff = torch.sub(stats.p_s, stats.p_t, out=stats.scratch)
        if grad is None:
            return 0.5 * diff.abs_().sum(-1)  # a plain sum: vector_norm(ord=1) loses ~100x more on a CPU in fp32
        losses = 0.5 * torch.abs(diff, out=grad).sum(-1)  # grad's buffer as scratch (a row dot rounds more than sum)
        u = torch.sign(diff, out=grad)
        u.mul_(0.5)
        u.sub_(rowdot(stats.p_s, u)[:, None])
        u.mul_(stats.p_s)  # grad, written in place
        return losses


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
    (a :class:`HeadLogits` is never materialised), whatever the caller's autocast."""
    out = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    with full_precision(logits):
        for b, t in iter_token_chunks(torch.ones_like(ids, dtype=torch.bool), chunk_size):
            out[b, t] = torch.log_softmax(gather_rows(logits, b, t, torch.float32), -1).gather(-1, ids[b, t, None]).squeeze(-1)
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
    ``student_entropy`` / ``teacher_entropy`` (nats), reduced like the objectives, without grad, in one
    chunked pass, in fp32 whatever the caller's autocast. Shapes as for the objectives. Objectives compute
    the same numbers in their own pass (:meth:`KLObjective.take_diagnostics`); this is for objectives that
    override ``forward``."""
    weights = token_weights(mask, reduction, compute_dtype(student_logits))
    _, totals = chunked_pass(student_logits, teacher_logits.detach(), torch.zeros_like(weights), weights, chunk_size)
    return dict(zip(DIAGNOSTICS, totals.unbind()))
