"""How the student's and the teacher's tokens meet in the loss (:class:`TokenPairing`): one shared vocabulary
(:class:`SharedVocabulary`, position by position, column by column) or two tokenizers aligned by bytes
(:class:`~kdlab.objectives.aligned.CrossTokenizer`). ``DistillModule`` holds one pairing and its training step reads
the same whatever the pair: ``loss, diagnostics = pairing.rollout_loss(objective, rollout, student, teacher)``."""

from __future__ import annotations

from typing import Any

import torch

from kdlab.components import Component
from kdlab.objectives.kl import KLObjective, kl_diagnostics


class TokenPairing(Component):
    """The objective over a rollout's completion, read by both models in their own tokens.

    ``student``: the student's tempered ``(B, C, V_s)`` logits (or a lazy head); ``teacher``: the teacher's tempered
    ``(B, C_t, V_t)`` distribution as a tensor, ``HeadLogits`` or ``TopKLogprobs``; ``sequence_weights``: ``(B,)``
    importance weights or ``None``."""

    def rollout_loss(self, objective: KLObjective, rollout: Any, student: Any, teacher: Any,
                     sequence_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The training loss and the same pass's diagnostics (``kl_forward``, ``kl_reverse``, entropies...)."""
        raise NotImplementedError

    def divergences(self, objective: KLObjective, rollout: Any, student: Any, teacher: Any, reduction: str) -> dict[str, torch.Tensor]:
        """Exact ``kl_forward``, ``kl_reverse`` and entropies (no grad), reduced per token or per sequence."""
        raise NotImplementedError


class SharedVocabulary(TokenPairing):
    """One vocabulary: the objective compares the two distributions at every completion position directly."""

    def rollout_loss(self, objective, rollout, student, teacher, sequence_weights=None):
        mask = rollout.completion_mask
        extra: dict[str, Any] = {} if sequence_weights is None else {"sequence_weights": sequence_weights}  # overridden forwards need not take them
        if isinstance(student, torch.Tensor) and type(objective).forward is KLObjective.forward:
            extra["consume"] = True  # nothing reads the student logits again: their storage becomes the gradient
        loss = objective(student, teacher, mask, **extra)
        # the objective's own pass computed them; a subclass that overrides forward gets a second pass
        diagnostics = objective.take_diagnostics() or kl_diagnostics(student.detach(), teacher, mask, objective.reduction, objective.chunk_size)
        return loss, diagnostics

    def divergences(self, objective, rollout, student, teacher, reduction):
        return kl_diagnostics(student, teacher, rollout.completion_mask, reduction, objective.chunk_size)
