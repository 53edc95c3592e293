"""A teacher behind an HTTP endpoint that speaks vLLM's OpenAI-compatible API (:class:`Served`, over the client
:class:`~kdlab.rollouts.served.ServedTeacher`): the server's tempered top-K log-probs on every completion take the
place of a teacher forward, so the teacher never sits in training memory. Teacher-written completions are sampled
by the server (each prompt seeded by the step's seed and its row); completions written here (the student's, a
teacher dataset's) are scored by it. A decode group's completions are scored in one go when its rollout is made,
and, with ``prefetch``, the next group's work goes out while this one trains when it does not depend on the student.
"""

from __future__ import annotations

from typing import Any

import torch

from kdlab.models.loading import ModelSpec, load_tokenizer
from kdlab.rollouts.served import ServedTeacher
from kdlab.rollouts.teacher_cache import TopKLogprobs
from kdlab.teachers.base import SCORES, WRITES, TeacherRun, TeacherSource, tokenizer_end_ids
from kdlab.teachers.model import teacher_columns


class Pending:
    """A served rollout on its way, computed in the prefetch thread: the examples, policy, seed and settings it is
    for, and its future."""

    def __init__(self, examples: list[Any], policy: Any, seed: int, settings: tuple, future: Any) -> None:
        self.examples, self.policy, self.seed, self.settings, self.future = examples, policy, seed, settings, future

    def matches(self, examples: list[Any], policy: Any, seed: int, settings: tuple) -> bool:
        return policy is self.policy and seed == self.seed and settings == self.settings and examples == self.examples


class Served(TeacherSource):
    """The teacher behind a vLLM-compatible server.

    Args:
        server: the endpoint and its settings (:class:`~kdlab.rollouts.served.ServedTeacher`: url, model, tokenizer,
            top_k, timeouts, concurrency, prefetch...).
    """

    def __init__(self, server: ServedTeacher) -> None:
        super().__init__()
        self.server = server
        self.ahead: Pending | None = None

    def bind(self, run: TeacherRun, setting: str = "DistillModule.teacher") -> None:
        from kdlab.errors import ConfigError

        self._run, self.setting = run, setting
        if run.cross_tokenizer:
            raise ConfigError(f"{setting}: a served teacher does not support cross_tokenizer yet: serve a teacher with the student's tokenizer")
        self.tokenizer = load_tokenizer(ModelSpec(self.server.tokenizer), f"{setting.removeprefix('DistillModule.')}.server.tokenizer")
        self.token_columns = teacher_columns(run, self.tokenizer, run.student_config, setting)

    def offers(self, run: TeacherRun) -> frozenset[str]:
        return super().offers(run) | {WRITES, SCORES}

    def load(self) -> None:
        self.end_ids = tokenizer_end_ids(self.tokenizer)

    def ready(self) -> None:
        self.server.check(self.tokenizer)

    # ---- per step -------------------------------------------------------------------------------------
    def write(self, prompts: Any, context: Any) -> Any:
        """Completions sampled by the server at the teacher's temperature, one request per prompt seeded by
        ``context.seed + row``, stopping at ``context.eos_token_ids``."""
        from kdlab.data import Rollout, right_pad

        length, temperature, ends = context.max_new_tokens, context.teacher_temperature, list(context.eos_token_ids)
        seed = context.seed if context.seed is not None else 0
        written = self.server.concurrently(lambda item: self.server.sample(item[1], length, temperature, seed + item[0], ends)[:length],
                                           list(enumerate(prompts.prompt_tokens("teacher"))))
        ids, mask = right_pad(written, context.pad_token_id)
        device = prompts.student_ids.device
        return Rollout(prompts, ids.to(device), mask.to(device))

    def rows_logprobs(self, rollout: Any, rows: torch.Tensor | list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The server's tempered top-K ``(ids, log-probs)`` on rows ``rows`` of ``rollout``."""
        prompts, rows = rollout.prompts.prompt_tokens("teacher"), list(map(int, rows))
        ids, mask = rollout.completion("teacher")
        return self.server.score([prompts[row] for row in rows], [ids[row][mask[row]].tolist() for row in rows],
                                 self.run.teacher_temperature, self.token_columns)

    def scored(self, rollout: Any) -> Any:
        """``rollout`` with the server's scores on all its completions as ``teacher_logprobs`` (one go)."""
        scored = self.rows_logprobs(rollout, list(range(len(rollout.prompts))))
        k = max((ids.shape[1] for ids, _ in scored), default=max(self.server.top_k, 1))
        length = rollout.completion_ids.shape[1]
        rollout.teacher_logprobs = TopKLogprobs.from_rows(scored, length, k, self.token_columns).to(rollout.completion_ids.device)
        return rollout

    def rollout(self, policy: Any, prompts: Any, context: Any) -> Any:
        """The prefetched rollout of these examples, policy and seed, or one made now: written by ``policy``
        (the server samples teacher-written completions) and scored by the server."""
        settings = self.settings(context)
        ahead = self.ahead
        if ahead is not None and ahead.matches(list(prompts.examples), policy, context.seed, settings):
            self.ahead = None
            return ahead.future.result()
        return self.scored(policy.sample(prompts, context))  # a prefetch for other examples stays for its own step

    def prefetch(self, policy: Any, prompts: Any, seed: int, context: Any) -> None:
        """With ``server.prefetch``, start the rollout of the next decode group in the prefetch thread when it does not
        depend on the student (teacher-written completions: sampled by the server, or a teacher dataset)."""
        if not self.server.prefetch or policy.depends_on_student:
            return
        try:
            with torch.no_grad():
                batch, made = prompts(), context()
        except Exception:  # noqa: BLE001 - the step that needs these examples meets the error itself
            return
        future = self.server.in_background(lambda: self.scored(policy.sample(batch, made)))
        self.ahead = Pending(list(batch.examples), policy, seed, self.settings(made), future)

    def settings(self, context: Any) -> tuple:
        """What a served rollout depends on besides its examples, policy and seed."""
        return (self.run.teacher_temperature, context.max_new_tokens, tuple(context.eos_token_ids), context.pad_token_id)

    @torch.no_grad()
    def completion_logprobs(self, rollout: Any, student: Any = None) -> Any:
        return rollout.teacher_logprobs if rollout.teacher_logprobs is not None else self.scored(rollout).teacher_logprobs

    def texts(self, task: Any, examples: list[Any], device: torch.device, **settings: Any) -> list[str]:
        """Completions sampled by the server, prompted as the teacher (seeded by ``seed`` and the row)."""
        from kdlab.data import encode_prompts

        temperature, budget = settings.get("temperature", 0.0), settings.get("max_new_tokens", 256)
        seed = int(settings["generator"].initial_seed()) if settings.get("generator") is not None else 0
        prompts = encode_prompts(task, examples, self.tokenizer, self.tokenizer, settings.get("max_prompt_tokens", 2048), int(self.tokenizer.pad_token_id))
        written = self.server.concurrently(lambda item: self.server.sample(item[1], budget, temperature, seed + item[0], list(self.end_ids)),
                                           list(enumerate(prompts.prompt_tokens("teacher"))))
        return [self.tokenizer.decode([t for t in tokens if t not in self.end_ids], skip_special_tokens=False) for tokens in written]
