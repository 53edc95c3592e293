"""Several teachers as one teacher source (:class:`Several`): named member sources and a ``choice`` that makes one
teacher per example from them, either by routing each example to one teacher (:class:`ByField`, e.g. by
its task in a :class:`~kdlab.tasks.mixture.MultiTask`) or by averaging them (:class:`Average`).

Per example ``x`` the choice gives weights ``w_i(x) >= 0`` summing to 1 over the teachers; the teacher that
the objective, the diagnostics and teacher-written rollouts see is, at every completion position,

* ``over: probs``: ``pi_T = sum_i w_i pi_i`` (a mixture: mass where any teacher puts it), or
* ``over: logprobs``: ``pi_T ∝ exp(sum_i w_i log pi_i)`` (a product of experts: mass where all agree),

each ``pi_i = softmax(z_i / teacher_temperature)`` (one temperature for all). Routing (one weight 1) gives
that teacher's distribution exactly under both. Only the teachers an example needs run on it. The teacher
of a multi-teacher step is materialised as ``(B, C, V)`` log-probs (the fused LM-head path is the
student's only). ``train/kl_forward/<name>`` (and ``kl_reverse``) is the student's divergence from each
teacher over the rows that teacher serves.

Members are any teacher sources sharing the student's vocabulary: in-process models (replicated or sharded by
``DistillModule.teacher_placement``; they can write completions), served teachers or top-k caches (they score
completions). Teacher-written rollouts need every member to decode in this process. Routing (:class:`ByField`) gives
ranks different teachers, so with any sharded in-process member (even one, beside a served or cached member) it is
refused before any weights load (a sharded member must run on every rank to enter its collectives together). A scoring member's top-k rows are
expanded to ``(B, C, V)`` on the training device.

``TeacherEntry`` (``model``/``served``/``cache``) is the spelling of ``DistillModule(teachers=...)``, kept for old
configs (:mod:`kdlab.teachers.legacy`).
"""

from __future__ import annotations

from typing import Any

import torch

from kdlab.objectives.lazy import LazyLogits
from kdlab.objectives.kl import kl_diagnostics
from kdlab.rollouts.teacher_cache import TopKLogprobs
from kdlab.tasks.base import Example
from kdlab.teachers.base import DECODES, SCORES, WRITES, TeacherRun, TeacherSource
from kdlab.teachers.choice import Average, RowSubset, TeacherChoice, combine


class Several(TeacherSource):
    """Several named teachers made into one per example (see the module docstring).

    Args:
        teachers: name -> teacher source (each any source; in-process ones are held as ``teachers/<name>``).
        choice: how each example's teacher is made (:class:`~kdlab.teachers.choice.ByField` routes,
            :class:`~kdlab.teachers.choice.Average` combines); optional with one teacher.
    """

    def __init__(self, teachers: dict[str, TeacherSource], choice: TeacherChoice | None = None) -> None:
        from kdlab.errors import ConfigError

        super().__init__()
        if not teachers:
            raise ConfigError("DistillModule.teachers: give at least one name -> teacher")
        if len(teachers) > 1 and choice is None:
            raise ConfigError("DistillModule.teacher_choice is required with several teachers (ByField to route, Average to combine)")
        self.members = torch.nn.ModuleDict(teachers)
        self.names = list(teachers)
        self.choice = choice if choice is not None else Average()
        self.choice.check(self.names)
        for name, member in teachers.items():
            if hasattr(member, "name"):
                member.name = f"teachers/{name}"
        self.diagnostics: dict[str, torch.Tensor] = {}

    def offers(self, run: TeacherRun) -> frozenset[str]:
        """Decoding and writing when every member decodes in this process (the combined next-token distribution);
        scoring any completion when every member does."""
        offers = super().offers(run)
        members = [member.offers(run) for member in self.members.values()]
        if all(DECODES in offered for offered in members):
            offers |= {DECODES, WRITES}
        if all(SCORES in offered for offered in members):
            offers |= {SCORES}
        return offers

    def bind(self, run: TeacherRun, setting: str = "DistillModule.teacher") -> None:
        from kdlab.errors import ConfigError

        self._run, self.setting = run, setting
        if run.cross_tokenizer:
            raise ConfigError(f"{setting}: several teachers share the student's vocabulary; remove cross_tokenizer")
        in_process = [name for name, member in self.members.items() if DECODES in member.offers(run)]
        # a sharded teacher's forward is a collective: a rank with no row routed to it would skip the forward that
        # other ranks enter, so even one sharded member among several is refused (a one-member set serves every row)
        if self.choice.one_teacher_per_example and run.placement == "shard" and in_process and len(self.members) > 1:
            raise ConfigError(
                f"{setting}: routing each example to one teacher ({type(self.choice).__name__}) with teacher_placement: shard and "
                f"in-process teachers {in_process}: a rank holding no example of a sharded teacher would skip the collectives "
                "its forward enters on the other ranks; use teacher_placement: replicate, or Average"
            )
        for name, member in self.members.items():
            member.bind(run, f"{setting}.teachers.{name}")
        self.tokenizer, self.token_columns = run.student_tokenizer, run.student_columns

    @classmethod
    def config_models(cls, init_args, visit):
        specs, cached = [], False
        for member in (init_args.get("teachers") or {}).values():
            found, member_cached = visit(member)
            specs, cached = specs + found, cached or member_cached
        return specs, cached

    def model_specs(self) -> list[Any]:
        return [spec for member in self.members.values() for spec in member.model_specs()]

    def load(self) -> None:
        for member in self.members.values():
            member.load()
        self.end_ids = tuple(dict.fromkeys(token for member in self.members.values() for token in member.end_ids))

    def models(self) -> dict[str, torch.nn.Module]:
        return {name: model for member in self.members.values() for name, model in member.models().items()}

    def ready(self) -> None:
        for member in self.members.values():
            member.ready()

    def _parts(self, examples: list[Example]) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        weights = self.choice.weights(examples, self.names)
        parts = []
        for column, name in enumerate(self.names):
            rows = (weights[:, column] > 0).nonzero().flatten()
            if len(rows):
                parts.append((name, rows, weights[rows, column]))
        return parts

    @property
    def only(self) -> TeacherSource | None:
        """The one member of a one-teacher set (which is that teacher exactly), else ``None``."""
        return next(iter(self.members.values())) if len(self.members) == 1 else None

    @property
    def model(self) -> torch.nn.Module:
        return self.only.model if self.only is not None else super().model

    def texts(self, task: Any, examples: list[Any], device: torch.device, **settings: Any) -> list[str]:
        if self.only is not None:
            return self.only.texts(task, examples, device, **settings)
        raise NotImplementedError("several teachers write no evaluation completions of their own: give the callback its own teacher")

    def rollout(self, policy: Any, prompts: Any, context: Any) -> Any:
        return self.only.rollout(policy, prompts, context) if self.only is not None else super().rollout(policy, prompts, context)

    def prefetch(self, policy: Any, prompts: Any, seed: int, context: Any) -> None:
        if self.only is not None:
            self.only.prefetch(policy, prompts, seed, context)

    def decoder(self, prompts: Any, temperature: float) -> Any:
        """Next-token log-probs ``(B, V)`` of the combined teacher on ``prompts``' teacher prompts (each member
        decodes only the rows it serves, with its KV cache)."""
        from kdlab.data import PromptBatch

        if self.only is not None:
            return self.only.decoder(prompts, temperature)
        device = prompts.teacher_ids.device
        decoders = []
        for name, rows, weights in self._parts(prompts.examples):
            rows = rows.to(device)
            part = PromptBatch([prompts.examples[row] for row in rows.tolist()], prompts.student_ids[rows], prompts.student_mask[rows],
                               prompts.teacher_ids[rows], prompts.teacher_mask[rows])
            decoders.append((rows, weights, self.members[name].decoder(part, temperature)))
        shape = (len(prompts), 1, self.token_columns)

        def next_logprobs(previous: torch.Tensor | None) -> torch.Tensor:
            parts = [(rows, weights, decode(None if previous is None else previous[rows])[:, None]) for rows, weights, decode in decoders]
            return combine(parts, shape, self.choice.over)[:, 0]

        return next_logprobs

    def rows_logprobs(self, rollout: Any, rows: torch.Tensor) -> Any:
        raise NotImplementedError("several teachers cannot be a member of several teachers")

    @torch.no_grad()
    def completion_logprobs(self, rollout: Any, student: Any = None) -> torch.Tensor:
        """The combined teacher's log-probs ``(B, C, V)`` on ``rollout``; per member, ``kl_forward/<name>`` and
        ``kl_reverse/<name>`` of ``student`` (logits or lazy, ``(B, C, V)``) over the rows it serves, kept for
        :meth:`named_diagnostics`."""
        if self.only is not None:
            return self.only.completion_logprobs(rollout, student)
        mask, device = rollout.completion_mask, rollout.completion_ids.device
        parts, diagnostics = [], {}
        for name, rows, weights in self._parts(rollout.prompts.examples):
            logits = self.members[name].rows_logprobs(rollout, rows)
            if isinstance(logits, list):  # a scoring member's top-k rows: expanded on the training device
                logits = TopKLogprobs.from_rows(logits, rollout.completion_ids.shape[1], logits[0][0].shape[1], self.token_columns).to(device).dense()
            parts.append((rows.to(logits.device), weights, logits))
            if student is not None:
                index = rows.to(mask.device)
                own = RowSubset(student, index) if isinstance(student, LazyLogits) else student.detach()[index]
                kls = kl_diagnostics(own, logits, mask[index], self.run.reduction, self.run.chunk_size)
                diagnostics[f"kl_forward/{name}"], diagnostics[f"kl_reverse/{name}"] = kls["kl_forward"], kls["kl_reverse"]
        self.diagnostics = diagnostics
        return combine(parts, (*rollout.completion_ids.shape, self.token_columns), self.choice.over)

    def named_diagnostics(self, diagnostics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each member's ``kl_forward/<name>`` and ``kl_reverse/<name>`` (one teacher's are the step's own)."""
        if self.only is not None:
            return {f"{kind}/{self.names[0]}": diagnostics[kind] for kind in ("kl_forward", "kl_reverse")}
        return dict(self.diagnostics)
