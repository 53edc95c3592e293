"""Several teachers in one ``DistillModule``: ``teachers`` (named) and a ``teacher_choice`` that makes one
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

Teachers: ``model`` (in process, replicated or sharded by ``DistillModule.teacher_placement``; it can
write completions), ``served`` (a :class:`~kdlab.rollouts.served.ServedTeacher`; scores completions) or
``cache`` (a top-k file of ``kdlab generate --top_k`` on the run's teacher dataset; scores completions).
All share the student's vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kdlab.components import Component
from kdlab.errors import ConfigError
from kdlab.models.loading import ModelSpec, end_token_ids, load_causal_lm, load_config, load_tokenizer, shared_vocab_size
from kdlab.objectives.kernels import LazyLogits
from kdlab.objectives.kl import kl_diagnostics
from kdlab.objectives.logits import completion_logits
from kdlab.rollouts.decoding import IncrementalLM
from kdlab.rollouts.policies import CachedTeacherRollouts, MixtureRollouts, RolloutPolicy, TeacherRollouts
from kdlab.rollouts.served import ServedTeacher
from kdlab.rollouts.teacher_cache import TeacherCache, TopKLogprobs
from kdlab.tasks.base import Example


@dataclass
class TeacherEntry:
    """One named teacher of ``DistillModule(teachers=...)``: exactly one of

    Args:
        model: an in-process model (``{path: ..., dtype: ...}``).
        served: a teacher behind vLLM's HTTP API (``class_path: kdlab.rollouts.served.ServedTeacher``).
        cache: a top-k teacher cache (``<dataset>.topk.safetensors``) over the run's teacher dataset.
    """

    model: ModelSpec | None = None
    served: ServedTeacher | None = None
    cache: str | None = None


class TeacherChoice(Component):
    """How a run's named teachers make the teacher of each example: :meth:`weights` ``(B, n)`` (rows sum to
    1, in ``names`` order) and ``over`` (``probs`` or ``logprobs``, see the module docstring)."""

    over: str = "probs"

    def check(self, names: list[str]) -> None:
        """Raise naming the setting when the choice refers to a teacher not in ``names``."""

    def weights(self, examples: list[Example], names: list[str]) -> torch.Tensor:
        raise NotImplementedError


class ByField(TeacherChoice):
    """Route each example to one teacher by a field: ``routes[example[field]]`` (``default`` for values not in
    ``routes``; without one such an example is an error naming it).

    Args:
        routes: field value -> teacher name, e.g. ``{countdown: strong, addition: skills}``.
        field: the example field read (``MultiTask`` writes its task names to ``task``).
        default: the teacher of every other value (``None``: none).
    """

    def __init__(self, routes: dict[str, str], field: str = "task", default: str | None = None) -> None:
        super().__init__()
        self.routes, self.field, self.default = dict(routes), field, default

    def check(self, names: list[str]) -> None:
        for value, name in [*self.routes.items(), *([("default", self.default)] if self.default is not None else [])]:
            if name not in names:
                raise ConfigError(f"ByField.routes.{value}: {name!r} is not one of DistillModule.teachers {names}")

    def weights(self, examples: list[Example], names: list[str]) -> torch.Tensor:
        weights = torch.zeros(len(examples), len(names))
        for row, example in enumerate(examples):
            name = self.routes.get(str(example.get(self.field)), self.default)
            if name is None:
                raise KeyError(f"ByField: example {example.get('id')!r} has {self.field}={example.get(self.field)!r}, which "
                               f"ByField.routes {sorted(self.routes)} does not route and there is no default")
            weights[row, names.index(name)] = 1.0
        return weights


class Average(TeacherChoice):
    """Every example gets every teacher, averaged with ``weights`` (normalised; ``None``: equal).

    Args:
        weights: teacher name -> weight (> 0; teachers left out get 0).
        over: ``probs`` (mixture) or ``logprobs`` (product of experts), see the module docstring.
    """

    def __init__(self, weights: dict[str, float] | None = None, over: str = "probs") -> None:
        super().__init__()
        if over not in ("probs", "logprobs"):
            raise ValueError(f"Average.over must be 'probs' or 'logprobs', got {over!r}")
        if weights is not None and (not weights or min(weights.values()) <= 0):
            raise ValueError(f"Average.weights must be positive, got {weights}")
        self.named, self.over = weights, over

    def check(self, names: list[str]) -> None:
        unknown = sorted(set(self.named or {}) - set(names))
        if unknown:
            raise ConfigError(f"Average.weights: {unknown} are not among DistillModule.teachers {names}")

    def weights(self, examples: list[Example], names: list[str]) -> torch.Tensor:
        row = torch.tensor([1.0 if self.named is None else float(self.named.get(name, 0.0)) for name in names])
        return (row / row.sum()).expand(len(examples), -1).clone()


class RowSubset(LazyLogits):
    """Rows ``index`` of a lazy ``(B, T, V)`` logits object, as a ``(len(index), T, V)`` one."""

    def __init__(self, base: LazyLogits, index: torch.Tensor) -> None:
        self.base, self.index = base, index.to(base.device)
        self.shape, self.dtype, self.device = torch.Size((len(index), *base.shape[1:])), base.dtype, base.device

    def rows(self, b: torch.Tensor, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.base.rows(self.index[b.to(self.device)], t, dtype)

    def detach(self) -> RowSubset:
        return RowSubset(self.base.detach(), self.index)


def combine(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], shape: tuple[int, ...], over: str) -> torch.Tensor:
    """The combined teacher's log-probs ``shape`` = ``(B, C, V)`` from ``parts``: ``(rows (B_i,), weights (B_i,),
    logits or log-probs (B_i, C, V))`` per teacher (see the module docstring; rows no teacher serves are uniform).
    When every row has one teacher (routing), each row is that teacher's normalised log-probs, with no averaging pass."""
    device = parts[0][2].device
    if all(bool((weights == 1).all()) for _, weights, _ in parts):  # routing: each row is its one teacher's, as it is
        routed = torch.full(shape, -math.log(shape[-1]), device=device)
        for rows, _, logits in parts:
            routed[rows] = torch.log_softmax(logits.float(), dim=-1)
        return routed
    total = torch.full(shape, -math.inf if over == "probs" else 0.0, device=device)
    for rows, weights, logits in parts:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if over == "probs":
            total[rows] = torch.logaddexp(total[rows], logprobs + weights.log().to(device)[:, None, None])
        else:
            total[rows] += weights.to(device)[:, None, None] * logprobs
    if over == "probs":
        total = torch.where(torch.isinf(total).all(-1, keepdim=True), torch.zeros_like(total), total)
    return torch.log_softmax(total, dim=-1)


def check_teachers_run(teachers: dict[str, TeacherEntry], choice: TeacherChoice | None, rollout: RolloutPolicy, **single: Any) -> None:
    """``teachers`` replaces ``teacher``, ``served_teacher``, ``base_teacher``, a rollout's ``teacher_cache``
    and ``cross_tokenizer`` (all given in ``single``): refuse them, entries with not exactly one source, a choice
    naming unknown teachers, and teacher-written rollouts from teachers that cannot decode."""
    if not teachers:
        raise ConfigError("DistillModule.teachers: give at least one name -> {model | served | cache}")
    given = [name for name, value in single.items() if value not in (None, False)]
    if given or isinstance(rollout, CachedTeacherRollouts):
        raise ConfigError(f"DistillModule.teachers replaces {given or ['a CachedTeacherRollouts cache']}: give each teacher as an "
                          "entry of teachers (model, served or cache) and leave the single-teacher settings unset")
    for name, entry in teachers.items():
        sources = [key for key in ("model", "served", "cache") if getattr(entry, key) is not None]
        if len(sources) != 1:
            raise ConfigError(f"DistillModule.teachers.{name}: give exactly one of model, served, cache (got {sources or 'none'})")
    if len(teachers) > 1 and choice is None:
        raise ConfigError("DistillModule.teacher_choice is required with several teachers (ByField to route, Average to combine)")
    (choice or Average()).check(list(teachers))
    decodes = type(rollout) is TeacherRollouts or isinstance(rollout, MixtureRollouts) or type(rollout).__name__ == "VLLMRollouts"
    scorers = [name for name, entry in teachers.items() if entry.model is None]
    if decodes and scorers:
        raise ConfigError(f"DistillModule.rollout: {type(rollout).__name__} decodes with the teachers, and teachers {scorers} (served or "
                          "cached) can only score completions; use StudentRollouts or TeacherDatasetRollouts")


class TeacherSet:
    """The loaded teachers of a multi-teacher ``DistillModule`` (``module``), in-process ones held frozen by it
    (``teachers/<name>``), and the per-step work: the combined decoder and the combined completion log-probs."""

    def __init__(self, teachers: dict[str, TeacherEntry], choice: TeacherChoice | None, module: Any) -> None:
        self.entries, self.names, self.module = teachers, list(teachers), module
        self.choice = choice if choice is not None else Average()
        self.caches: dict[str, TeacherCache] = {}
        self.diagnostics: dict[str, torch.Tensor] = {}
        student_config = load_config(module.student_spec, "student")
        for name, entry in teachers.items():
            setting = f"DistillModule.teachers.{name}"
            if entry.model is not None:
                tokenizer, config = load_tokenizer(entry.model, f"teachers.{name}"), load_config(entry.model, f"teachers.{name}")
                try:
                    columns = shared_vocab_size(module.student_tokenizer, tokenizer, student_config, config)
                except ValueError as error:
                    raise ConfigError(f"{setting}: {error}") from None
                if columns != module.token_columns:
                    raise ConfigError(f"{setting}: shares {columns} token columns with the student, not its {module.token_columns}")
                module.hold_frozen(f"teachers/{name}", load_causal_lm(entry.model, f"teachers.{name}", config=config))
            elif entry.cache is not None:
                cache = self.caches[name] = TeacherCache(entry.cache, f"{setting}.cache")
                if cache.token_columns != module.token_columns or not math.isclose(cache.temperature, module.teacher_temperature):
                    raise ConfigError(f"{setting}.cache {entry.cache!r}: {cache.token_columns} columns at teacher temperature "
                                      f"{cache.temperature}, the run {module.token_columns} at {module.teacher_temperature}")

    def models(self) -> dict[str, torch.nn.Module]:
        """The in-process teachers by name."""
        return {name: self.module._frozen[f"teachers/{name}"] for name in self.names if self.entries[name].model is not None}

    def end_ids(self) -> tuple[int, ...]:
        return tuple(token for model in self.models().values() for token in end_token_ids(self.module.student_tokenizer, model))

    def check_served(self) -> None:
        for entry in self.entries.values():
            if entry.served is not None:
                entry.served.check(self.module.student_tokenizer)

    def _parts(self, examples: list[Example]) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        weights = self.choice.weights(examples, self.names)
        parts = []
        for column, name in enumerate(self.names):
            rows = (weights[:, column] > 0).nonzero().flatten()
            if len(rows):
                parts.append((name, rows, weights[rows, column]))
        return parts

    def decoder(self, prompts: Any) -> Any:
        """Next-token log-probs ``(B, V)`` of the combined teacher on ``prompts``' teacher prompts (each teacher
        decodes only the rows it serves, with its KV cache)."""
        module, models = self.module, self.models()
        device = prompts.teacher_ids.device
        decoders = []
        for name, rows, weights in self._parts(prompts.examples):
            rows = rows.to(device)
            decoders.append((rows, weights, IncrementalLM(models[name], prompts.teacher_ids[rows], prompts.teacher_mask[rows],
                                                          module.token_columns, module.teacher_temperature)))
        shape = (len(prompts), 1, module.token_columns)

        def next_logprobs(previous: torch.Tensor | None) -> torch.Tensor:
            parts = [(rows, weights, decode(None if previous is None else previous[rows])[:, None]) for rows, weights, decode in decoders]
            return combine(parts, shape, self.choice.over)[:, 0]

        return next_logprobs

    def _logits(self, name: str, rollout: Any, rows: torch.Tensor) -> torch.Tensor:
        """Teacher ``name``'s tempered logits (or log-probs) ``(len(rows), C, V)`` on ``rollout``'s completions."""
        module, entry = self.module, self.entries[name]
        length, columns = rollout.completion_ids.shape[1], module.token_columns
        if entry.model is not None:
            inputs = {key: value[rows.to(value.device)] for key, value in rollout.model_inputs("teacher").items()}
            return completion_logits(self.models()[name], inputs, length, columns) / module.teacher_temperature
        prompts, completions = rollout.prompts, []
        for row in rows.tolist():
            completions.append((prompts.teacher_ids[row][prompts.teacher_mask[row].bool()].tolist(),
                                rollout.completion_ids[row][rollout.completion_mask[row]].tolist(), prompts.examples[row]["id"]))
        if entry.served is not None:
            topk = entry.served.score([prompt for prompt, _, _ in completions], [completion for _, completion, _ in completions],
                                      module.teacher_temperature, columns)
        else:
            topk = [self.caches[name].row(example_id, completion) for _, completion, example_id in completions]
        k = topk[0][0].shape[1]
        return TopKLogprobs.from_rows(topk, length, k, columns).dense().to(rollout.completion_ids.device)

    @torch.no_grad()
    def completion_logprobs(self, rollout: Any, student: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The combined teacher's log-probs ``(B, C, V)`` on ``rollout`` and, per teacher, ``kl_forward/<name>``
        and ``kl_reverse/<name>`` of ``student`` (logits or lazy, ``(B, C, V)``) over the rows it serves."""
        module, mask = self.module, rollout.completion_mask
        parts, diagnostics = [], {}
        for name, rows, weights in self._parts(rollout.prompts.examples):
            logits = self._logits(name, rollout, rows)
            parts.append((rows.to(logits.device), weights, logits))
            index = rows.to(mask.device)
            own = RowSubset(student, index) if isinstance(student, LazyLogits) else student.detach()[index]
            kls = kl_diagnostics(own, logits, mask[index], module.objective.reduction, module.objective.chunk_size)
            diagnostics[f"kl_forward/{name}"], diagnostics[f"kl_reverse/{name}"] = kls["kl_forward"], kls["kl_reverse"]
        shape = (*rollout.completion_ids.shape, module.token_columns)
        return combine(parts, shape, self.choice.over), diagnostics
