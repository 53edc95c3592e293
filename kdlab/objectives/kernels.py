"""The shared maths of the chunked objectives: both models' next-token distributions, normalised once
per row, and everything the objectives and the logged diagnostics need, from that one pass.

For a block of ``k`` student rows ``s`` and teacher rows ``t`` ``(k, V)`` (fp32, already tempered),
:func:`row_statistics` computes, with one exponential per element and model:

* ``p_s = softmax(s)``, ``p_t = softmax(t)`` ``(k, V)``, written into buffers reused from block to block;
* ``lse_s``, ``lse_t`` ``(k,)``: the log-normalisers, ``lse = max - log p[argmax]`` (no second exponential);
* four row-wise dot products ``p_s.s``, ``p_s.t``, ``p_t.s``, ``p_t.t`` ``(k,)``, and from them

  - ``kl_forward  = KL(p_t || p_s) = p_t.t - p_t.s - (lse_t - lse_s) sum(p_t)``
  - ``kl_reverse  = KL(p_s || p_t) = p_s.s - p_s.t + (lse_t - lse_s) sum(p_s)``
  - ``student_entropy = lse_s sum(p_s) - p_s.s``, ``teacher_entropy = lse_t sum(p_t) - p_t.t`` (nats),

  each ``sum(p)`` 1 in exact arithmetic; kept because a CPU's fp32 softmax rows of a real vocabulary do not
  sum to exactly 1, and that excess times a log-normaliser (which moves with any constant added to the
  logits) was the largest error.

A row holding ``-inf`` (a teacher that gives a token probability 0, a top-k cache) makes a dot product
``0 * -inf = nan``; only such rows are recomputed with ``-inf`` floored at ``-1e30`` (exactly what the
limit p log p -> 0 gives), so finite inputs pay nothing for it. What fp32 still loses against fp64 at V = 151,936 is bounded by
``tests/test_objectives.py::test_the_closed_form_statistics_hold_fp64s_values_at_a_real_vocabulary_whatever_the_logit_offset``.

Precision: all of it is fp32 (fp64 for fp64 inputs) whatever autocast region the caller runs in (a bf16
model's fused head products stay bf16, with or without autocast: :class:`~kdlab.objectives.lazy.HeadLogits`).
Lightning runs ``training_step`` under autocast for ``bf16-mixed``, where ``torch.bmm``, ``torch.mv`` and
matrix products would silently drop to bf16 (about 1e-3 relative on the KLs and entropies, 1-4% of the
gradient); :func:`full_precision` switches autocast off around every kernel (:func:`chunked_pass`, the
autograd Functions' forward and backward), and half-precision inputs are upcast one block at a time.

Why blocks: on a CPU at a real vocabulary (V = 151,936, 0.6 MB per fp32 row) every pass over a
``(chunk, V)`` tensor that is not in cache costs a trip to memory, and a fresh ``(chunk, V)`` allocation
costs page faults. Working one or a few rows at a time in buffers allocated once keeps every pass after
the first read in cache (:func:`block_rows` picks ``k``); on a GPU a block is the whole chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from kdlab.objectives.lazy import HeadLogits, LazyLogits, Logits
from kdlab.objectives.precision import full_precision, ieee_fp32

LOG_FLOOR = -1e30
"""Stands for ``-inf`` in the recomputation of rows whose dot products were not finite."""

CPU_BLOCK_ELEMENTS = 1 << 18
"""fp32 elements per CPU block and buffer (1 MiB): a row of a 151,936-token vocabulary is one block."""

DIAGNOSTICS = ("kl_forward", "kl_reverse", "student_entropy", "teacher_entropy")
"""The names, in order, of the columns of :attr:`RowStatistics.diagnostics`."""


def block_rows(columns: int, chunk_size: int, device: torch.device) -> int:
    """Rows per block: the whole chunk on an accelerator; on the CPU as many rows as fit
    :data:`CPU_BLOCK_ELEMENTS` (at least one, at most ``chunk_size``)."""
    if device.type != "cpu":
        return chunk_size
    return max(1, min(chunk_size, CPU_BLOCK_ELEMENTS // max(columns, 1)))


def rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise dot products ``(k,)`` of ``a``, ``b`` ``(k, V)``, in full fp32 whatever the TF32 setting
    (:func:`ieee_fp32`). A batched matrix product (no ``(k, V)`` product tensor) for one row or on an
    accelerator; ``vecdot`` for several rows on the CPU, where the batched product takes a slow path (about
    3x at k = 5, V = 49,152)."""
    with ieee_fp32():
        if a.shape[0] > 1 and a.device.type == "cpu":
            return torch.linalg.vecdot(a, b)
        return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(a.shape[0])


class Workspace:
    """Buffers ``(rows, V)`` in one dtype and device, allocated on first use and reused by every block
    of one objective call (a fresh large allocation per block would pay page faults each time)."""

    def __init__(self, rows: int, columns: int, dtype: torch.dtype, device: torch.device) -> None:
        self.rows, self.columns, self.dtype, self.device = rows, columns, dtype, device
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get(self, name: str, k: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Buffer ``name`` cut to ``(k, V)`` (``k <= rows``), in ``dtype`` (default: the workspace's);
        contents are whatever was left there."""
        dtype = dtype or self.dtype
        buffer = self._buffers.get((name, dtype))
        if buffer is None:
            buffer = torch.empty(self.rows, self.columns, dtype=dtype, device=self.device)
            self._buffers[(name, dtype)] = buffer
        return buffer[:k]


@dataclass
class RowStatistics:
    """One block's normalised distributions and their diagnostics (see the module docstring).

    ``s``, ``t``: the input rows ``(k, V)`` (read only); ``p_s``, ``p_t``: their softmaxes ``(k, V)``;
    ``lse_s``, ``lse_t``: log-normalisers ``(k,)``; ``diagnostics``: ``(k, 4)`` in the order of
    :data:`DIAGNOSTICS`; ``scratch``: a ``(k, V)`` buffer an objective may overwrite."""

    s: torch.Tensor
    t: torch.Tensor
    p_s: torch.Tensor
    p_t: torch.Tensor
    lse_s: torch.Tensor
    lse_t: torch.Tensor
    diagnostics: torch.Tensor
    scratch: torch.Tensor

    @property
    def kl_forward(self) -> torch.Tensor:
        return self.diagnostics[:, 0]

    @property
    def kl_reverse(self) -> torch.Tensor:
        return self.diagnostics[:, 1]


def _normalise(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Softmax of ``x`` into ``out`` and the log-normaliser ``(k,)``: ``max(x) - log(max(p))``."""
    peak = x.amax(-1)
    torch.softmax(x, -1, out=out)
    return peak - out.amax(-1).log()


def _dots(p_s, p_t, s, t) -> torch.Tensor:
    return torch.stack((rowdot(p_s, s), rowdot(p_s, t), rowdot(p_t, s), rowdot(p_t, t)), dim=1)


def row_statistics(s: torch.Tensor, t: torch.Tensor, workspace: Workspace) -> RowStatistics:
    """:class:`RowStatistics` of student rows ``s`` and teacher rows ``t`` ``(k, V)`` (fp32)."""
    k = s.shape[0]
    p_s, p_t = workspace.get("p_s", k), workspace.get("p_t", k)
    lse_s, lse_t = _normalise(s, p_s), _normalise(t, p_t)
    dots = _dots(p_s, p_t, s, t)
    bad = ~torch.isfinite(dots).all(dim=1)
    if bad.any():  # rows holding -inf: 0 * -inf; floor them and recompute those rows only
        rows = bad.nonzero().squeeze(1)
        dots[rows] = _dots(p_s[rows], p_t[rows], s[rows].clamp(min=LOG_FLOOR), t[rows].clamp(min=LOG_FLOOR))
    ss, st, ts, tt = dots.unbind(1)
    mass_s, mass_t = p_s.sum(-1), p_t.sum(-1)  # 1 in exact arithmetic; see the module's docstring
    shift = lse_t - lse_s
    diagnostics = torch.stack((tt - ts - shift * mass_t, ss - st + shift * mass_s, lse_s * mass_s - ss, lse_t * mass_t - tt), dim=1)
    return RowStatistics(s, t, p_s, p_t, lse_s, lse_t, diagnostics, workspace.get("scratch", k))


def iter_token_chunks(mask: torch.Tensor, chunk_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(batch_index, time_index)`` long tensors for the masked-in positions, ``chunk_size`` at a time."""
    positions = mask.nonzero(as_tuple=False)
    for start in range(0, positions.shape[0], chunk_size):
        chunk = positions[start : start + chunk_size]
        yield chunk[:, 0], chunk[:, 1]


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """fp32 for half-precision inputs (bf16/fp16 logits are upcast chunk by chunk), else the input's."""
    return torch.promote_types(tensor.dtype, torch.float32)


TokenLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(student_logits (n, V) fp32, teacher_logits (n, V) fp32) -> per-token loss (n,)``."""

RowsLossAndGrad = Callable[[RowStatistics, "torch.Tensor | None"], torch.Tensor]
"""``(statistics of a block, gradient buffer (k, V) or None) -> per-token loss (k,)``; when a buffer is
given, ``d loss / d student logits`` is written into it (unweighted)."""


def _materialise(logits: LazyLogits, b: torch.Tensor, t: torch.Tensor, dtype: torch.dtype, chunk_ws: Workspace, name: str) -> torch.Tensor:
    """Rows ``(n, V)`` of a lazy source. A :class:`HeadLogits` is computed straight into a reused buffer,
    in the model's own dtype (bf16 hidden states and head give bf16 logits, as the model's LM head would,
    at the speed of a bf16 matrix product); blocks are upcast to ``dtype`` as they are read."""
    if isinstance(logits, HeadLogits):
        native = logits.hidden.dtype
        buffer = chunk_ws.get(name, b.shape[0], native)
        torch.matmul(logits.hidden[b, t], logits.weight_as(native).T, out=buffer)
        return buffer.mul_(logits.scale) if logits.scale != 1.0 else buffer
    return logits.rows(b, t, dtype)


class _Plan:
    """The covered positions ``(P, 2)`` of a ``(B, T)`` grid, in chunks of ``chunk_size`` positions and
    blocks of ``k`` rows. A block of consecutive positions of one sequence carries ``run = (b, t0)``, so
    a plain tensor's rows are read (and its gradient written) in place."""

    def __init__(self, positions: torch.Tensor, chunk_size: int, k: int) -> None:
        self.positions, self.chunk_size, self.k = positions, chunk_size, k
        self.listed = positions.tolist()

    def chunks(self) -> Iterator[tuple[int, int]]:
        for start in range(0, len(self.listed), self.chunk_size):
            yield start, min(start + self.chunk_size, len(self.listed))

    def blocks(self, start: int, stop: int) -> Iterator[tuple[int, int, tuple[int, int] | None]]:
        for i0 in range(start, stop, self.k):
            i1 = min(i0 + self.k, stop)
            (b0, t0), (b1, t1) = self.listed[i0], self.listed[i1 - 1]
            yield i0, i1, ((b0, t0) if b0 == b1 and t1 - t0 == i1 - 1 - i0 else None)


class _Side:
    """One model's rows over one chunk, a block at a time: a plain tensor's consecutive rows in the
    compute dtype are views; other rows are copied into a reused buffer; a :class:`LazyLogits` is
    materialised once for the chunk (into a reused buffer for :class:`HeadLogits`)."""

    def __init__(self, logits: Logits, positions: torch.Tensor, dtype: torch.dtype, chunk_ws: Workspace, block_ws: Workspace, name: str) -> None:
        self.logits, self.positions, self.dtype, self.block_ws, self.name = logits, positions, dtype, block_ws, name
        b, t = positions[:, 0], positions[:, 1]
        self.chunk = _materialise(logits, b, t, dtype, chunk_ws, name) if isinstance(logits, LazyLogits) else None

    def whole(self) -> torch.Tensor:
        """The chunk's rows ``(n, V)`` in the compute dtype (a copy for a plain tensor)."""
        if self.chunk is not None:
            return self.chunk.to(self.dtype)
        return self.logits[self.positions[:, 0], self.positions[:, 1]].to(self.dtype)

    def block(self, j0: int, j1: int, run: tuple[int, int] | None) -> torch.Tensor:
        if self.chunk is not None:
            if self.chunk.dtype == self.dtype:
                return self.chunk[j0:j1]
            return self.block_ws.get(self.name, j1 - j0).copy_(self.chunk[j0:j1])
        if run is not None:
            view = self.logits[run[0], run[1] : run[1] + j1 - j0]
            if view.dtype == self.dtype:
                return view
        else:
            view = self.logits[self.positions[j0:j1, 0], self.positions[j0:j1, 1]]
        return self.block_ws.get(self.name, j1 - j0).copy_(view)


class LogitsGradient:
    """The gradient ``(B, T, V)`` w.r.t. plain student logits, in their dtype; rows no chunk covers are
    zero. Blocks of consecutive positions in the compute dtype are written in place.

    ``consume``: the gradient overwrites the student logits themselves (their storage becomes the
    gradient), so no second ``(B, T, V)`` tensor exists; each block is computed in a buffer and copied in
    after its rows were read. Only for callers that never read those logits again (``DistillModule``);
    an autograd node that saved them would raise at backward (version counter), not compute garbage."""

    chunked = False

    def __init__(self, student: torch.Tensor, covered: torch.Tensor, dtype: torch.dtype, consume: bool = False) -> None:
        self.grad = student.detach() if consume else torch.empty(student.shape, dtype=student.dtype, device=student.device)
        if not bool(covered.all()):
            self.grad[~covered] = 0
        self.dtype, self.in_place = dtype, not consume and student.dtype == dtype

    def target(self, run: tuple[int, int] | None, k: int, block_ws: Workspace) -> torch.Tensor:
        """Where a block's gradient ``(k, V)`` is computed (then scaled in place by the token weights)."""
        if run is not None and self.in_place:
            return self.grad[run[0], run[1] : run[1] + k]
        return block_ws.get("grad", k)

    def commit(self, positions: torch.Tensor, run: tuple[int, int] | None, target: torch.Tensor) -> None:
        if run is not None and self.in_place:
            return  # already in place
        if run is not None:
            self.grad[run[0], run[1] : run[1] + target.shape[0]].copy_(target)
        else:
            self.grad[positions[:, 0], positions[:, 1]] = target.to(self.grad.dtype)

    def add_chunk(self, positions: torch.Tensor, chunk_grad: torch.Tensor) -> None:
        self.grad[positions[:, 0], positions[:, 1]] = chunk_grad.to(self.grad.dtype)


class HeadGradient:
    """The gradients w.r.t. the hidden states ``(B, T, H)`` and the head ``(V, H)`` of a
    :class:`HeadLogits` student: each chunk's logits gradient ``g`` ``(n, V)`` gives
    ``dL/dh = scale * g W`` and ``dL/dW += scale * g^T h``; no ``(B, T, V)`` tensor exists."""

    chunked = True

    def __init__(self, student: HeadLogits, need_hidden: bool, need_weight: bool, dtype: torch.dtype) -> None:
        self.student, self.dtype = student, dtype
        self.hidden = torch.zeros_like(student.hidden) if need_hidden else None
        # a frozen head (LoRA elsewhere) needs no (V, H) gradient buffer; it accumulates in fp32
        self.weight = torch.zeros(student.weight.shape, dtype=dtype, device=student.weight.device) if need_weight else None

    def add_chunk(self, positions: torch.Tensor, chunk_grad: torch.Tensor) -> None:
        """Both products in the model's dtype (bf16 models: bf16 matrix products, as autograd does on the
        logits path), the head's gradient accumulated over chunks in fp32."""
        b, t = positions[:, 0], positions[:, 1]
        native = self.student.hidden.dtype
        if self.student.scale != 1.0:
            chunk_grad = chunk_grad.mul_(self.student.scale)
        grad = chunk_grad.to(native)
        hidden = self.student.hidden[b, t]
        if self.hidden is not None:
            self.hidden[b, t] = grad @ self.student.weight_as(native)
        if self.weight is not None:
            if native == self.weight.dtype:
                self.weight.addmm_(grad.T, hidden)
            else:
                self.weight.add_(grad.T @ hidden)


def taken_gradient(ctx, what: str) -> LogitsGradient | HeadGradient:
    """The gradient a chunked objective's forward left on ``ctx``, taken off it (backward runs once)."""
    gradient, ctx.gradient = ctx.gradient, None
    if gradient is None:
        raise RuntimeError(f"backward through {what} can run only once per forward")
    return gradient


def scaled_gradients(gradient: LogitsGradient | HeadGradient, grad_output: torch.Tensor, weight_dtype: torch.dtype | None
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(d logits, d hidden, d head weight)`` of a chunked objective's backward: the gradient its forward
    computed, scaled in place by the incoming ``grad_output`` (untouched when that is 1); the head's in
    ``weight_dtype``. Plain logits give ``(grad, None, None)``, a :class:`HeadLogits` student ``(None, ...)``."""
    unit = bool(grad_output == 1)  # the usual case: no pass over the (B, T, V) gradient at all
    if isinstance(gradient, LogitsGradient):
        return (gradient.grad if unit else gradient.grad.mul_(grad_output.to(gradient.grad.dtype))), None, None
    grad_hidden, grad_weight = gradient.hidden, gradient.weight
    if not unit:
        grad_hidden = grad_hidden.mul_(grad_output.to(grad_hidden.dtype)) if grad_hidden is not None else None
        grad_weight = grad_weight.mul_(grad_output.to(grad_weight.dtype)) if grad_weight is not None else None
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight_dtype)
    return None, grad_hidden, grad_weight


def chunked_pass(
    student: Logits,
    teacher: Logits,
    weights: torch.Tensor,
    diagnostic_weights: torch.Tensor,
    chunk_size: int,
    token_loss: TokenLoss | None = None,
    rows_loss_and_grad: RowsLossAndGrad | None = None,
    gradient: LogitsGradient | HeadGradient | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one pass behind every chunked objective and :func:`kl_diagnostics`.

    Walks the positions where ``weights`` or ``diagnostic_weights`` ``(B, T)`` are positive, chunk by
    chunk and block by block, normalises each row of both models once (:func:`row_statistics`) and
    returns ``(sum weights * loss, sum diagnostic_weights * [kl_forward, kl_reverse, student_entropy,
    teacher_entropy])`` as a scalar and a ``(4,)`` tensor in :func:`compute_dtype`. The loss comes from
    ``rows_loss_and_grad`` (closed form, from the same statistics) or else ``token_loss`` (autograd on the
    chunk's rows); with neither, only the diagnostics. The gradient of the weighted loss w.r.t. the
    student goes to ``gradient``. Autocast is off throughout (:func:`full_precision`)."""
    with full_precision(student, teacher):
        return _chunked_pass(student, teacher, weights, diagnostic_weights, chunk_size, token_loss, rows_loss_and_grad, gradient)


def _chunked_pass(student, teacher, weights, diagnostic_weights, chunk_size, token_loss, rows_loss_and_grad, gradient):
    dtype = compute_dtype(student)
    device = student.device
    vocab = student.shape[-1]
    covered = (weights > 0) | (diagnostic_weights > 0)
    positions = covered.nonzero()
    k = block_rows(vocab, chunk_size, device)
    block_ws = Workspace(k, vocab, dtype, device)
    chunk_ws = Workspace(max(1, min(chunk_size, positions.shape[0])), vocab, dtype, device)
    w_all, d_all = weights[covered].to(dtype), diagnostic_weights[covered].to(dtype)
    total = torch.zeros((), dtype=dtype, device=device)
    diagnostics = torch.zeros(4, dtype=dtype, device=device)
    plan = _Plan(positions, chunk_size, k)
    for start, stop in plan.chunks():
        chunk_positions = positions[start:stop]
        s_side = _Side(student, chunk_positions, dtype, chunk_ws, block_ws, "s")
        t_side = _Side(teacher, chunk_positions, dtype, chunk_ws, block_ws, "t")
        if rows_loss_and_grad is None and token_loss is not None:  # autograd on the chunk's rows
            s_chunk, t_chunk = s_side.whole(), t_side.whole()
            chunk_loss, chunk_grad = _autograd_chunk(token_loss, s_chunk, t_chunk, w_all[start:stop], gradient is not None)
            total += chunk_loss
            for i0, i1, _ in plan.blocks(start, stop):
                j0, j1 = i0 - start, i1 - start
                stats = row_statistics(s_chunk[j0:j1].detach(), t_chunk[j0:j1], block_ws)
                diagnostics += torch.mv(stats.diagnostics.T, d_all[i0:i1])
            if gradient is not None:
                gradient.add_chunk(chunk_positions, chunk_grad)
            continue
        chunk_grad = chunk_ws.get("grad", stop - start) if gradient is not None and gradient.chunked else None
        for i0, i1, run in plan.blocks(start, stop):
            j0, j1 = i0 - start, i1 - start
            stats = row_statistics(s_side.block(j0, j1, run), t_side.block(j0, j1, run), block_ws)
            diagnostics += torch.mv(stats.diagnostics.T, d_all[i0:i1])
            if rows_loss_and_grad is None:
                continue
            target = None
            if chunk_grad is not None:
                target = chunk_grad[j0:j1]
            elif gradient is not None:
                target = gradient.target(run, i1 - i0, block_ws)
            losses = rows_loss_and_grad(stats, target)
            total += rowdot(losses[None], w_all[None, i0:i1])[0]
            if target is not None:
                target.mul_(w_all[i0:i1, None])
                if chunk_grad is None:
                    gradient.commit(chunk_positions[j0:j1], run, target)
        if chunk_grad is not None:
            gradient.add_chunk(chunk_positions, chunk_grad)
    return total, diagnostics


def _autograd_chunk(token_loss: TokenLoss, s_chunk, t_chunk, w_chunk, need_grad: bool):
    """One chunk's weighted loss (scalar, detached) and its gradient w.r.t. the student rows (or None)."""
    if not need_grad:
        return (token_loss(s_chunk, t_chunk) * w_chunk).sum(), None
    with torch.enable_grad():
        s_chunk = s_chunk.detach().requires_grad_(True)
        chunk_loss = (token_loss(s_chunk, t_chunk) * w_chunk).sum()
        (chunk_grad,) = torch.autograd.grad(chunk_loss, s_chunk)
    return chunk_loss.detach(), chunk_grad
