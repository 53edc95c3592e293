"""Rollout engines outside the training process, whose copy of the student's weights the trainer pushes
(:class:`SyncedEngine`): a ``vllm serve`` sampler (:class:`~kdlab.rollouts.served_sampler.ServedRollouts`), the
loopback server standing in for it.

**How and when weights reach the engine.** A push has two halves. :meth:`SyncedEngine.stage_weights` runs in the
training process's main thread at a point where the student's weights are whole and still (before a decode
group trains, never during a backward or an optimiser step): it takes a snapshot of them, in the engine's dtype
and Hugging Face names, every ``sync_every`` optimiser steps. :meth:`SyncedEngine.load_weights` hands that snapshot
to the engine, which from then on samples with it; it may run later, in another thread, as long as the engine's
work stays in order (a snapshot is loaded before the completions it is for are asked for, and after those of the
previous snapshot were written). Sampling synchronously (:meth:`SyncedEngine.sample`) does both at once;
:class:`~kdlab.rollouts.overlap.OverlappedRollouts` stages in the main thread and loads and samples in its
background thread. Every completion carries the engine's log-prob of each sampled token
(``Rollout.behaviour_logprobs``), so the importance weights correct whatever lag the weights have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kdlab.data import PromptBatch, Rollout
from kdlab.rollouts.policies import RolloutContext, RolloutPolicy


@dataclass
class StagedWeights:
    """A snapshot of the student's weights on its way to an engine: the optimiser steps they have taken
    (``step``) and what the engine loads (``payload``: engine-specific, e.g. a file path)."""

    step: int
    payload: Any


class SyncedEngine(RolloutPolicy):
    """Base of the rollout engines that hold their own copy of the student's weights (see the module docstring).

    Subclasses implement :meth:`snapshot`, :meth:`load_weights` and :meth:`generate`. ``weights_step`` is the step
    of the weights the engine holds (``-1`` before the first push); ``sync_every`` the optimiser steps between
    pushes."""

    sync_every: int = 1
    weights_step: int = -1

    def __init__(self) -> None:
        super().__init__()
        self._staged_step = -1

    def stage_weights(self, context: RolloutContext) -> StagedWeights | None:
        """A snapshot of ``context.student`` at ``context.step`` when ``sync_every`` steps have passed since the
        last one (or there was none), else ``None``. Main thread only: it reads the weights as they are now."""
        if not self.depends_on_student or (self._staged_step >= 0 and context.step - self._staged_step < self.sync_every):
            return None
        staged = StagedWeights(context.step, self.snapshot(context))
        self._staged_step = context.step
        return staged

    def snapshot(self, context: RolloutContext) -> Any:
        """What :meth:`load_weights` hands the engine of ``context.student``'s current weights."""
        raise NotImplementedError

    def load_weights(self, staged: StagedWeights) -> None:
        """The engine samples with ``staged`` from now on; sets ``weights_step``."""
        raise NotImplementedError

    def generate(self, prompts: PromptBatch, context: RolloutContext) -> Rollout:
        """Completions of ``prompts`` with the weights the engine holds now, ``behaviour_logprobs`` ``(B, C)`` set;
        any thread (it reads nothing of the student)."""
        raise NotImplementedError

    def sample(self, prompts: PromptBatch, context: RolloutContext) -> Rollout:
        """Synchronously: push the weights when due, then write the completions; records ``rollout_weights_step``
        and ``policy_lag`` (:meth:`record_lag`)."""
        staged = self.stage_weights(context)
        if staged is not None:
            self.load_weights(staged)
        rollout = self.generate(prompts, context)
        record_lag(self, context.step, self.weights_step)
        return rollout


def record_lag(component: RolloutPolicy, step: int, weights_step: int) -> None:
    """Records, for the step that trains on a rollout: ``rollout_weights_step``, the optimiser step of the weights
    that wrote it, and ``policy_lag``, how many optimiser steps those weights trail the ones training at ``step``."""
    component.record("rollout_weights_step", float(weights_step))
    component.record("policy_lag", float(step - weights_step))
