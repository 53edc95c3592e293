"""Rollout policies: who writes the completions that the KL is taken on.

* :class:`TeacherRollouts` - off-policy: online samples from the teacher at ``teacher_temperature``;
  :class:`TeacherDatasetRollouts` - the paper's OffPD, a fixed dataset of teacher responses;
  :class:`CachedTeacherRollouts` - that dataset with the teacher's cached top-k log-probs (no teacher
  in training).
* :class:`StudentRollouts` - on-policy (OnPD): samples from the current student at
  ``student_temperature``.
* :class:`~kdlab.rollouts.mixture.MixtureRollouts` - the paper's token-level spectrum pi_lambda between them,
  decoded jointly with both models' KV caches (its own module, :mod:`kdlab.rollouts.mixture`).

No gradient flows through sampling: every policy decodes under ``torch.no_grad`` with the models in
eval mode, and the parent module restores the student's training mode afterwards.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kdlab.components import Component
from kdlab.data import PromptBatch, Rollout, read_jsonl, right_pad
from kdlab.rollouts.decoding import (
    NextLogprobs,
    StopCheck,
    incremental_decoder,
    sample_tokens,
    top_p_logprobs,
)


@dataclass
class TeacherTokens:
    """The teacher's side of a run whose models use different tokenizers (``DistillModule(cross_tokenizer=...)``):
    its tokenizer, logit columns, end tokens and stop-string check. The context's own ``tokenizer``,
    ``token_columns`` and ``eos_token_ids`` are then the student's."""

    tokenizer: Any
    token_columns: int
    eos_token_ids: tuple[int, ...]
    stop: StopCheck | None = None

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.eos_token_ids[0])


def _text_tokens(tokenizer: Any, text: str, end: int | None, split_special_tokens: bool = False) -> list[int]:
    """``tokenizer``'s ids of ``text`` (and ``end``). ``split_special_tokens``: a special token's name written in the
    text (``'<|im_end|>'`` spelled with ordinary tokens) stays text, not the special token, which covers no bytes."""
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=split_special_tokens)["input_ids"]
    return ids + [end] if end is not None else ids


@dataclass
class RolloutContext:
    """What a policy may use to write completions for one batch."""

    student: torch.nn.Module
    teacher: torch.nn.Module
    tokenizer: Any
    token_columns: int  # len(tokenizer): the logit columns sampled from (the head may have padding rows)
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    student_temperature: float
    teacher_temperature: float
    generator: torch.Generator | None
    all_done: Callable[[bool], bool] | None = None
    """Collective stopping decision under sharded training (see :func:`kdlab.rollouts.decoding.sample_tokens`)."""
    step: int = 0
    """The optimiser step the rollouts are for (engines that sync weights use it)."""
    student_spec: Any = None
    teacher_spec: Any = None
    """Where the models come from (:class:`~kdlab.models.loading.ModelSpec`), for engines that load them themselves."""
    stop: StopCheck | None = None
    """Ends a row when it completes a stop string (:func:`kdlab.rollouts.decoding.stop_strings_check`)."""
    stop_strings: tuple[str, ...] = ()
    """The stop strings behind ``stop``, for engines that check them themselves (vLLM)."""
    top_p: float = 1.0
    """Nucleus sampling: each token is drawn from the policy's distribution restricted to its top-p set
    (:func:`kdlab.rollouts.decoding.top_p_logprobs`); 1 samples from the whole distribution (distillation)."""
    teacher_tokens: TeacherTokens | None = None
    """The teacher's tokenizer when it is not the student's (``None``: one shared vocabulary)."""
    teacher_source: Any = None
    """Where the teacher's distribution comes from (a :class:`~kdlab.teachers.base.TeacherSource`): it decodes and
    writes teacher completions. ``None``: ``teacher`` is the teacher model itself."""
    seed: int | None = None
    """The seed of this rollout's random streams (a served teacher seeds each prompt's sample with it and its row)."""

    def decoder(self, model: str, prompts: PromptBatch) -> NextLogprobs:
        """An incremental decoder for ``"student"`` or ``"teacher"`` at that model's temperature, over that
        model's own token columns (the teacher's from its source)."""
        if model == "teacher" and self.teacher_source is not None:
            return self.teacher_source.decoder(prompts, self.teacher_temperature)
        ids = getattr(prompts, f"{model}_ids")
        mask = getattr(prompts, f"{model}_mask")
        columns = self.teacher_tokens.token_columns if model == "teacher" and self.teacher_tokens is not None else self.token_columns
        return incremental_decoder(getattr(self, model), ids, mask, columns, getattr(self, f"{model}_temperature"), self.max_new_tokens)

    def teacher_writes(self, prompts: PromptBatch) -> Rollout:
        """Teacher-written completions of ``prompts``: the teacher source writes them (token by token here, or sampled
        by a server); without a source, sampled from the teacher model."""
        if self.teacher_source is not None:
            return self.teacher_source.write(prompts, self)
        return self.sample(self.decoder("teacher", prompts), prompts, writer="teacher")

    def sample(self, next_logprobs: NextLogprobs, prompts: PromptBatch, writer: str = "student") -> Rollout:
        """Completions drawn token by token from ``next_logprobs``, in ``writer``'s tokens (``"student"`` or
        ``"teacher"``: only matters across tokenizers, where the text is then re-tokenised for the other model)."""
        if self.top_p < 1.0:
            policy, top_p = next_logprobs, self.top_p
            next_logprobs = lambda previous: top_p_logprobs(policy(previous), top_p)  # noqa: E731
            if hasattr(policy, "keep_rows"):
                next_logprobs.keep_rows = policy.keep_rows  # finished rows still leave the policy's batch
        teacher_writes = writer == "teacher" and self.teacher_tokens is not None
        ids, mask, entropy = sample_tokens(
            next_logprobs,
            batch_size=len(prompts),
            max_new_tokens=self.max_new_tokens,
            eos_token_ids=self.teacher_tokens.eos_token_ids if teacher_writes else self.eos_token_ids,
            pad_token_id=self.teacher_tokens.pad_token_id if teacher_writes else self.pad_token_id,
            generator=self.generator,
            device=prompts.student_ids.device,
            all_done=self.all_done,
            stop=self.teacher_tokens.stop if teacher_writes else self.stop,
        )
        if self.teacher_tokens is None:
            return Rollout(prompts, ids, mask, entropy)
        return self.retokenized(prompts, ids, mask, writer, entropy)

    def retokenized(self, prompts: PromptBatch, ids: torch.Tensor, mask: torch.Tensor, writer: str,
                    entropy: torch.Tensor | None = None) -> Rollout:
        """Across tokenizers: the rollout of completions ``ids``/``mask`` ``(B, C)`` written in ``writer``'s tokens,
        with both models' tokens. The writer's tokens are kept as written (when their bytes are valid UTF-8;
        else both sides are re-tokenised from the decoded text); the other model's are its tokenizer's
        encoding of the same text, followed by its end token when the writer ended. A special token's name
        written as text (``'<|im_end|>'`` in ordinary tokens) is read as text (``split_special_tokens``), never
        as the special token, which covers no bytes. ``sampling_entropy``
        is kept when the student wrote (it is per student token), dropped otherwise."""
        from kdlab.alignment import token_bytes

        other = self.teacher_tokens
        assert other is not None
        tokenizers = {"student": self.tokenizer, "teacher": other.tokenizer}
        ends = {"student": self.eos_token_ids, "teacher": other.eos_token_ids}
        reader = "teacher" if writer == "student" else "student"
        rows: dict[str, list[list[int]]] = {"student": [], "teacher": []}
        for row_ids, row_mask in zip(ids.tolist(), mask.tolist()):
            tokens = [token for token, keep in zip(row_ids, row_mask) if keep]
            ended = bool(tokens) and tokens[-1] in ends[writer]
            body = tokens[:-1] if ended else tokens
            raw = b"".join(token_bytes(tokenizers[writer], body))
            text = raw.decode("utf-8", errors="replace")
            if text.encode("utf-8") != raw:  # a completion cut inside a multi-byte character
                body = _text_tokens(tokenizers[writer], text, None, split_special_tokens=True)
            rows[writer].append(body + ([tokens[-1]] if ended else []))
            # the text is the writer's bytes: a special token's name in it was written as text, and stays text
            rows[reader].append(_text_tokens(tokenizers[reader], text, ends[reader][0] if ended else None, split_special_tokens=True))
        device = ids.device
        student_ids, student_mask = right_pad(rows["student"], self.pad_token_id)
        teacher_ids, teacher_mask = right_pad(rows["teacher"], other.pad_token_id)
        keep_entropy = entropy if writer == "student" and student_ids.shape == ids.shape and torch.equal(student_ids.to(device)[student_mask.to(device)], ids[mask]) else None
        return Rollout(prompts, student_ids.to(device), student_mask.to(device), keep_entropy,
                       teacher_completion_ids=teacher_ids.to(device), teacher_completion_mask=teacher_mask.to(device))


class RolloutPolicy(Component):
    """Base class: turn a batch of prompts into completions.

    Subclasses implement :meth:`sample`. A policy that reads completions from elsewhere returns a
    :class:`~kdlab.data.Rollout` with ``sampling_entropy=None``.
    """

    def sample(self, prompts: PromptBatch, context: RolloutContext) -> Rollout:
        raise NotImplementedError

    depends_on_student: bool = True
    """Whether its completions depend on the student's current weights (a teacher source may prefetch those that do not)."""

    def needs(self) -> frozenset[str]:
        """What it needs of the teacher source (capability names of :mod:`kdlab.teachers.base`: ``teacher_decodes``,
        ``teacher_writes``, ``teacher_scores``, ``teacher_weights``, ``one_vocabulary``); compared with what the source offers before any
        weights load (:func:`kdlab.teachers.base.check_needs`)."""
        return frozenset()

    def covers(self, example: dict[str, Any]) -> bool:
        """Whether this policy can write a completion for ``example`` (training skips prompts it cannot)."""
        return True

    def prefetch(self, upcoming: Any) -> None:
        """Offered, after each decode group's rollout, the groups that follow it (an iterable of
        :class:`~kdlab.rollouts.overlap.Upcoming`, drawn as it is walked): a policy may start writing them now
        (:class:`~kdlab.rollouts.overlap.OverlappedRollouts`). No-op by default."""

    def close(self) -> None:
        """Releases what it runs outside the module's tensors (threads) when a fit, validation or test ends
        (:meth:`DistillModule.teardown <kdlab.stages.distill.DistillModule.teardown>`); it may be used again after.
        No-op by default."""

    def next_token_logprobs(self, student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
        """The policy's next-token log-probs ``(..., V)`` given the two models' tempered ones at the same
        prefix; used by diagnostics (e.g. total variation to each model along a rollout)."""
        raise NotImplementedError(f"{type(self).__name__} does not define its next-token distribution")


class StudentRollouts(RolloutPolicy):
    """On-policy: the current student samples each completion at ``student_temperature``."""

    def needs(self) -> frozenset[str]:
        return frozenset({"teacher_scores"})  # completions no cache holds

    def sample(self, prompts: PromptBatch, context: RolloutContext) -> Rollout:
        return context.sample(context.decoder("student", prompts), prompts)

    def next_token_logprobs(self, student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
        return student_logprobs


class TeacherRollouts(RolloutPolicy):
    """Off-policy, online: the teacher samples each completion at ``teacher_temperature``, with
    the teacher's own prompt.

    Completions written by the teacher beforehand are :class:`TeacherDatasetRollouts` (the paper's
    OffPD, a fixed dataset) and :class:`CachedTeacherRollouts` (that dataset and the teacher's cached
    top-k log-probs); both are subclasses, so they count as teacher rollouts everywhere.

    ``TeacherRollouts(dataset=..., teacher_cache=...)`` is kdlab 0.1's spelling of those two classes, kept
    for old configs (``class_path: kdlab.rollouts.TeacherRollouts`` with ``init_args: {dataset: ...}``): it
    warns (``FutureWarning``) and returns an object of the new class (see :meth:`__new__`).
    """

    def __new__(cls, dataset: str | None = None, teacher_cache: str | None = None, *args: Any, **kwargs: Any) -> TeacherRollouts:
        """Picks the class: kdlab 0.1's ``dataset`` (and ``teacher_cache``) give the subclass they stand for.

        jsonargparse reads a class's settings from its own ``__new__`` where it has one: this signature is
        TeacherRollouts'; a subclass's come from its ``__init__`` (its arguments pass through here unread).

        Args:
            dataset: deprecated; ``TeacherRollouts(dataset=...)`` returns a :class:`TeacherDatasetRollouts`.
            teacher_cache: deprecated; ``TeacherRollouts(dataset=..., teacher_cache=...)`` returns a
                :class:`CachedTeacherRollouts`.
        """
        chosen = _legacy_class(dataset, teacher_cache) if cls is TeacherRollouts else cls
        return super().__new__(chosen)  # object.__new__ takes no settings: __init__ reads them

    depends_on_student = False

    def __init__(self, dataset: str | None = None, teacher_cache: str | None = None) -> None:
        super().__init__()  # dataset and teacher_cache were read by __new__ (None here)

    def needs(self) -> frozenset[str]:
        return frozenset({"teacher_writes", "teacher_scores"})

    def next_token_logprobs(self, student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
        """The teacher's distribution (for a dataset, the one it was sampled from at that temperature)."""
        return teacher_logprobs

    def sample(self, prompts: PromptBatch, context: RolloutContext) -> Rollout:
        return context.teacher_writes(prompts)


def _legacy_class(dataset: str | None, teacher_cache: str | None) -> type[TeacherRollouts]:
    """The class that ``TeacherRollouts(dataset, teacher_cache)`` stands for: with kdlab 0.1's ``dataset``
    (and ``teacher_cache``), one of the subclasses, with a ``FutureWarning``; else ``TeacherRollouts``
    (whose ``__init__`` then rejects any other argument)."""
    if dataset is None:
        if teacher_cache is not None:
            raise ValueError(
                "TeacherRollouts.teacher_cache needs TeacherRollouts.dataset (the completions it was computed on): "
                "use kdlab.rollouts.CachedTeacherRollouts with both dataset and teacher_cache"
            )
        return TeacherRollouts
    new = CachedTeacherRollouts if teacher_cache is not None else TeacherDatasetRollouts
    spelling = "dataset=..., teacher_cache=..." if teacher_cache is not None else "dataset=..."
    warnings.warn(
        f"TeacherRollouts({spelling}) is deprecated: use kdlab.rollouts.{new.__name__}({spelling}) "
        f"(in YAML, class_path: kdlab.rollouts.{new.__name__}); TeacherRollouts() is the teacher sampling online",
        FutureWarning,
        stacklevel=3,  # the line that called TeacherRollouts(...): past this function and __new__
    )
    return new


class TeacherDatasetRollouts(TeacherRollouts):
    """The paper's OffPD: each prompt's teacher response is fixed, read from a file.

    Args:
        dataset: a JSONL file with one ``{"id": <example id>, "completion": <text>}`` object per line (as
            written by ``kdlab generate``). The first line for an id is used; training skips prompts
            without one (:meth:`covers`). The end token is appended unless the row says
            ``"ended": false`` (a response cut by the generation budget).
    """

    def __init__(self, dataset: str, **legacy: None) -> None:
        # ``legacy``: only the ``teacher_cache=None`` that ``TeacherRollouts(dataset=..., teacher_cache=None)``
        # passes on (Python gives __init__ the arguments __new__ got)
        if any(key != "teacher_cache" or value is not None for key, value in legacy.items()):
            hint = " (a teacher cache is CachedTeacherRollouts' setting)" if "teacher_cache" in legacy else ""
            raise TypeError(f"{type(self).__name__} got unexpected keyword arguments {sorted(legacy)}{hint}")
        super().__init__()
        self.dataset = dataset
        self._completions = read_completions(dataset, f"{type(self).__name__}.dataset")

    def needs(self) -> frozenset[str]:
        return frozenset()  # the completions are read; any source scores them

    def covers(self, example: dict[str, Any]) -> bool:
        return example["id"] in self._completions

    def sample(self, prompts: PromptBatch, context: RolloutContext) -> Rollout:
        device = prompts.student_ids.device
        if context.teacher_tokens is not None:  # across tokenizers: the teacher's tokens of the same text
            rows = self.completion_tokens(prompts, context, "teacher")
            ids, mask = right_pad(rows, context.teacher_tokens.pad_token_id)
            return context.retokenized(prompts, ids.to(device), mask.to(device), "teacher")
        ids, mask = right_pad(self.completion_tokens(prompts, context), context.pad_token_id)
        return Rollout(prompts, ids.to(device), mask.to(device), None)

    def completion_tokens(self, prompts: PromptBatch, context: RolloutContext, model: str = "student") -> list[list[int]]:
        """Each example's completion tokens in ``model``'s tokenizer (the student's, or across tokenizers the
        teacher's), end token included when the response ended, cut to ``max_new_tokens``."""
        teacher = context.teacher_tokens if model == "teacher" else None
        tokenizer = teacher.tokenizer if teacher is not None else context.tokenizer
        end = (teacher.eos_token_ids if teacher is not None else context.eos_token_ids)[0]
        rows = []
        for example in prompts.examples:
            if example["id"] not in self._completions:
                raise KeyError(f"{type(self).__name__}.dataset {self.dataset}: no completion for example id {example['id']!r}")
            text, ended = self._completions[example["id"]]
            # a response cut by the generation budget must not teach the student to stop there
            rows.append(_text_tokens(tokenizer, text, end if ended else None)[: context.max_new_tokens])
        return rows


class CachedTeacherRollouts(TeacherDatasetRollouts):
    """A teacher dataset (as :class:`TeacherDatasetRollouts`) whose teacher is a top-k cache of its log-probs on the
    dataset's completions: the earlier spelling of ``rollout: TeacherDatasetRollouts`` with ``teacher:
    {class_path: kdlab.teachers.CachedTeacher, init_args: {path: <cache>}}``, which ``DistillModule`` turns it into
    (with a ``FutureWarning``; :func:`kdlab.teachers.legacy.teacher_source`). The cache is opened here, so a missing or
    corrupt file fails at construction.

    Args:
        dataset: the teacher completions, as for :class:`TeacherDatasetRollouts`.
        teacher_cache: the teacher's top-k log-probs on ``dataset``'s completions (``kdlab generate ...
            --top_k K`` writes ``<dataset>.topk.safetensors``).
    """

    def __init__(self, dataset: str, teacher_cache: str) -> None:
        from kdlab.rollouts.teacher_cache import TeacherCache

        super().__init__(dataset)
        self.teacher_cache = teacher_cache
        self.cache = TeacherCache(teacher_cache, f"{type(self).__name__}.teacher_cache")


def read_completions(path: str, setting: str = "TeacherDatasetRollouts.dataset") -> dict[str, tuple[str, bool]]:
    """``{example id: (completion text, ended)}`` from a JSONL file (``ended`` defaults to true: the
    response ended with an end token); errors name ``setting``, the file, line and field."""
    completions: dict[str, tuple[str, bool]] = {}
    rows = read_jsonl(path, setting, ("id", "completion"), " (write one with `kdlab generate`)")
    for where, row in rows:
        ended = row.get("ended", True)
        if not isinstance(ended, bool):
            raise ValueError(f"{where}: field 'ended' must be true or false, got {ended!r}")
        completions.setdefault(row["id"], (row["completion"], ended))
    if not completions:
        raise ValueError(f"{setting} {path!r} holds no completions")
    return completions


def importance_weights(
    logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, cap: float = 2.0
) -> torch.Tensor:
    """Per-sequence weights ``(B,)``: ``w = mean_t min(cap, exp(logp_t - logq_t))`` over each completion's
    masked-in tokens (detached; 1 for an empty completion).

    ``logprobs``: ``(B, C)`` log p_theta of the sampled tokens under the policy being trained;
    ``behaviour_logprobs``: ``(B, C)`` log q under the engine that sampled them; ``mask``: ``(B, C)`` bool.
    Truncating each token ratio at ``cap`` bounds the weight by ``cap`` (the paper: 2).
    """
    if not cap > 0:
        raise ValueError(f"importance_weights: cap must be > 0, got {cap}")
    mask = mask.bool()
    ratio = torch.exp((logprobs.detach().float() - behaviour_logprobs.float()).masked_fill(~mask, 0.0)).clamp(max=cap)
    counts = mask.sum(dim=1)
    weights = (ratio * mask).sum(dim=1) / counts.clamp(min=1)
    return torch.where(counts > 0, weights, torch.ones_like(weights))
