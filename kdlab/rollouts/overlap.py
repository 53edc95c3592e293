"""Generation overlapped with training (:class:`OverlappedRollouts`): while a decode group trains, an engine
outside the training process (a :class:`~kdlab.rollouts.engines.SyncedEngine`) writes the next groups' completions.

The price is policy lag. Completions written while step ``k`` trains come from the weights of step ``k`` (the
last ones the engine was given), and are trained on at a later step: with the default ``max_lag`` 1, step
``k + 1`` trains on completions its weights' predecessor wrote. The engine's log-probs of the sampled tokens
travel with every completion, so distillation weights each completion's loss by ``w = mean_t min(cap, p_theta /
q)`` as for any engine whose weights lag (``train/importance_weight``, ``train/engine_kl``). Each step records
``train/rollout_weights_step`` (the optimiser step of the weights that wrote its completions) and
``train/policy_lag`` (how many steps those trail the weights that train on them: at most ``max_lag``, plus
``sync_every - 1`` when the engine skips pushes).

How it runs. :class:`~kdlab.stages.distill.DistillModule` asks for a group's rollout (:meth:`OverlappedRollouts.sample`)
and then offers the groups after it (:meth:`OverlappedRollouts.prefetch`, with :class:`Upcoming` items). For each
upcoming group at most ``max_lag`` optimiser steps ahead that is not on its way yet, the student's current weights
are staged in the calling (main) thread, where they are whole and still, and one background thread loads them
into the engine and writes that group's completions; its jobs run one at a time in the order given, so each
group's completions come from the weights staged with it. A group asked for that is not on its way (the first,
one after an epoch's end or a resume) is written now, through the same thread, from the current weights.
``max_lag`` 0 overlaps only groups of the current optimiser step (several decode groups per step), whose weights
are the ones training: the completions, losses and weights equal those of the engine sampling synchronously.
No group is written for a step past the trainer's ``max_steps``, and the thread ends with the fit
(:meth:`OverlappedRollouts.close`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kdlab.data import PromptBatch, Rollout
from kdlab.rollouts.engines import SyncedEngine, record_lag
from kdlab.rollouts.policies import RolloutContext, RolloutPolicy


@dataclass
class Upcoming:
    """A decode group after the one being trained: how many optimiser steps after it it trains (0: the same step),
    its examples and rollout seed, and makers of its prompt batch and rollout context (called in the main thread)."""

    steps_ahead: int
    examples: list[Any]
    seed: int
    prompts: Callable[[], PromptBatch]
    context: Callable[[], RolloutContext]


class _Job:
    """A group's completions on their way: its examples and seed, and a future of ``(rollout, weights step)``."""

    def __init__(self, examples: list[Any], seed: int | None, future: Future) -> None:
        self.examples, self.seed, self.future = examples, seed, future

    def matches(self, examples: list[Any], seed: int | None) -> bool:
        return seed == self.seed and examples == self.examples


class OverlappedRollouts(RolloutPolicy):
    """The completions of ``policy``, an engine outside the training process, written up to ``max_lag`` optimiser
    steps ahead while the student trains (see the module docstring).

    Args:
        policy: the engine (:class:`~kdlab.rollouts.engines.SyncedEngine`: ``ServedRollouts``).
        max_lag: the most optimiser steps a group's completions are written ahead of the step that trains on them
            (>= 0; 1: the next step's while this one trains; 0: only the current step's later decode groups).
    """

    def __init__(self, policy: RolloutPolicy, max_lag: int = 1) -> None:
        super().__init__()
        if not isinstance(policy, SyncedEngine):
            raise ValueError(f"OverlappedRollouts.policy must be a rollout engine outside the training process (kdlab.rollouts.ServedRollouts), "
                             f"got {type(policy).__name__}, which writes in the training process")
        if isinstance(max_lag, bool) or not isinstance(max_lag, int) or max_lag < 0:
            raise ValueError(f"OverlappedRollouts.max_lag must be an integer >= 0 (optimiser steps), got {max_lag!r}")
        self.policy, self.max_lag = policy, max_lag
        self._pending: list[_Job] = []
        self._start_thread()

    def _start_thread(self) -> None:
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollouts-ahead")

    def __getstate__(self) -> dict[str, Any]:  # a thread and its futures do not pickle
        state = super().__getstate__()
        return {key: value for key, value in state.items() if key not in ("_worker", "_pending")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._pending = []
        self._start_thread()

    @property
    def depends_on_student(self) -> bool:  # type: ignore[override]
        return self.policy.depends_on_student

    def needs(self) -> frozenset[str]:
        return self.policy.needs()

    def covers(self, example: dict[str, Any]) -> bool:
        return self.policy.covers(example)

    def next_token_logprobs(self, student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
        return self.policy.next_token_logprobs(student_logprobs, teacher_logprobs)

    def pop_records(self) -> dict[str, float | torch.Tensor]:
        return {**self.policy.pop_records(), **super().pop_records()}

    def sample(self, prompts: PromptBatch, context: RolloutContext) -> Rollout:
        """The completions written ahead for these examples and seed, or written now from the current weights;
        records ``rollout_weights_step`` and ``policy_lag`` for the step that trains on them."""
        examples = list(prompts.examples)
        job = next((job for job in self._pending if job.matches(examples, context.seed)), None)
        if job is not None:
            self._pending.remove(job)
        else:
            job = self._submit(prompts, context)
        rollout, weights_step = job.future.result()
        record_lag(self, context.step, weights_step)
        return rollout

    def prefetch(self, upcoming: Iterable[Upcoming]) -> None:
        """Start the groups of ``upcoming`` (in order) that train at most ``max_lag`` steps ahead and are not on
        their way yet; a group further ahead ends the walk (nothing after it is drawn). What stays on its way is
        exactly the walk's groups: a job of a group not in it (passed without being asked for: an epoch's end, a
        resume) is forgotten, and still runs in its turn, so the weights it loads reach the engine in order."""
        ahead: list[_Job] = []
        for item in upcoming:
            if item.steps_ahead > self.max_lag:
                break
            job = next((job for job in self._pending if job.matches(item.examples, item.seed)), None)
            ahead.append(job if job is not None else self._submit(item.prompts(), item.context()))
        self._pending = ahead

    def close(self) -> None:
        """Wait for the jobs on their way and end the background thread (a later :meth:`sample` or :meth:`prefetch`
        starts a new one); the engine's own :meth:`close` follows."""
        self._worker.shutdown(wait=True)
        self._pending = []
        self._start_thread()
        self.policy.close()

    def _submit(self, prompts: PromptBatch, context: RolloutContext) -> _Job:
        """Stage the weights now (main thread) when a push is due; load and write in the background thread."""
        staged = self.policy.stage_weights(context)
        engine = self.policy

        def work() -> tuple[Rollout, int]:
            if staged is not None:
                engine.load_weights(staged)
            return engine.generate(prompts, context), engine.weights_step

        return _Job(list(prompts.examples), context.seed, self._worker.submit(work))
