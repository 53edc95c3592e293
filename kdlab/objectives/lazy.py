"""Logits that are never materialised: a ``(B, T, V)`` tensor stood for by what it is computed from, asked for
one chunk of rows at a time by the chunked objectives (:mod:`kdlab.objectives.kernels`).

:class:`LazyLogits` is the interface; :class:`HeadLogits` (final hidden states and the LM head: the fused path)
and :class:`~kdlab.rollouts.teacher_cache.TopKLogprobs` (a top-k teacher) implement it. :data:`Logits` is what an
objective accepts: a tensor or one of these.
"""

from __future__ import annotations

import torch

from kdlab.objectives.precision import full_precision


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

    def summary(self, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """What this stand-in leaves out, over the positions ``mask`` ``(B, C)`` selects, as named scalars to log
        (none by default; a top-k teacher: the mass it spreads evenly)."""
        return {}


class HeadLogits(LazyLogits):
    """Logits ``(B, T, V)`` that are never materialised: ``scale * hidden @ weight.T``, computed for one
    chunk of rows at a time (the fused hidden-state + LM-head path).

    ``hidden``: ``(B, T, H)`` final hidden states at the positions that predict the completion;
    ``weight``: ``(V, H)`` the LM head restricted to the shared vocabulary (no bias); ``scale``:
    ``1 / temperature``. Objectives and :func:`kl_diagnostics` accept it wherever they accept logits;
    the student's ``(B, T, V)`` logits and their gradient then never exist, only ``(chunk, V)`` pieces.

    Precision, whatever the caller's autocast (the kernels switch it off, :func:`full_precision`): the
    matrix products ``hidden @ weight.T``, ``g @ weight`` and ``g.T @ hidden`` run in the hidden states'
    dtype, so fp32 hidden states (a model trained under ``bf16-mixed`` keeps fp32 weights) give fp32
    logits and gradients, exactly as without autocast, and a model held in bf16 gives bf16 products, as
    its own LM head would; everything after the product (softmaxes, KLs, entropies, the loss, the head's
    accumulated gradient) is fp32. :meth:`rows` computes in the ``dtype`` it is asked for.
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
        with full_precision(self.hidden):
            logits = self.hidden[b, t].to(dtype) @ self.weight_as(dtype).T
            return logits * self.scale if self.scale != 1.0 else logits

    def detach(self) -> HeadLogits:
        return HeadLogits(self.hidden.detach(), self.weight.detach(), self.scale)


Logits = torch.Tensor | LazyLogits
"""A ``(B, T, V)`` logits tensor, or a :class:`LazyLogits` (:class:`HeadLogits`, a cached top-k teacher)
standing for one."""


def gather_rows(logits: Logits, b: torch.Tensor, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``(n, V)`` of ``logits`` at positions ``(b, t)``, in ``dtype``."""
    return logits.rows(b, t, dtype) if isinstance(logits, LazyLogits) else logits[b, t].to(dtype)
