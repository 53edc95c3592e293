"""Token-level divergences between a teacher and a student that use different tokenizers (#27).

Both models read the same completion text, each tokenised by its own tokenizer; :mod:`kdlab.alignment`
pairs the two token sequences into the finest groups that cover the same bytes. A group starts at a byte
offset where both sides have a token boundary, so there both models predict what comes next after the
same text: their next-token distributions there are comparable, once put on one event space.

**The events of a group** ``k`` (student tokens ``s_a..s_b``, teacher tokens ``t_c..t_d``, text ``x_k``):

* the *vocabulary map* ``M``: pairs ``(teacher id, student id)`` of tokens with the same bytes (special
  tokens: the same content), and one *end* pair: every end id of each side (its tokenizer's EOS and its
  generation config's EOS ids, any of which ends a completion) is one event, "the completion ends here",
  whose probability is the sum over that side's end ids. Event
  ``v in M``: "the next token is v". The pairs of the group's first tokens (``s_a``'s and ``t_c``'s) are
  left out, because
* ``x_k``: "the next tokens spell the group's text as this model's tokens do", with the chain-rule
  probability ``p(x_k) = prod_i p(s_i | ...)`` over the group's tokens (teacher: over its own), and
* ``rest``: everything else: tokens outside the map, the left-out pair's token, and the first token not
  followed by the rest of the group (``p(s_a) - p(x_k)``).

Where one model's ``rest`` holds no token (every student token is in the map and the group is one token), the
rest is dropped on both sides and both distributions renormalised over the other events
(:func:`drop_impossible_rest`): otherwise the teacher's mass on tokens the student cannot write as *one* token
would make forward KL infinite. That mass is not text the student cannot write (the teacher's ``' strawberry'``
is the student's ``' straw'`` + ``'berry'``), so the objective's optimum is then the teacher conditioned on the
single shared tokens, not a student that matches the teacher's distribution over text (which would put the
``' strawberry'`` mass on ``' straw'``): an approximation, kept because committed results were trained with it. Each model's event probabilities sum to one, so any :class:`~kdlab.objectives.kl.KLObjective`'s
``token_loss`` (forward or reverse KL, the JSD family, TV, the sampled estimators) compares two proper
distributions on the same ``|M| + 2`` events. In a one-to-one group ``x_k`` is the shared token itself and
the events are the map and ``rest``; with identical tokenizers ``M`` is the whole vocabulary, ``rest`` is
empty and the loss *is* the full-vocabulary objective (to float rounding, loss and gradient).

**What is exact and what is not.** Exact: the byte alignment, one-to-one groups over the map, the
chain-rule group probability of the text actually written. Approximate: a model's probability of ``x_k``
counts one tokenisation of it (its own), not every way of spelling those bytes; ``rest`` lumps together
different events on the two sides (each side's unmapped tokens). ``uld_weight`` mixes in the ULD distance
(the L1 distance between the two sorted next-token probability vectors at each group start, which needs no
map; each side's end ids are one entry, their summed probability, as for the end event: :meth:`VocabularyMap.merged_ends`): ``loss = (1 - w) * divergence + w * ULD``, GOLD's hybrid.

Memory: groups are taken about ``chunk_size`` student rows at a time; every intermediate (each model's rows,
their normalised log-probs, the events) is ``(rows, V)``-sized, none is ``(B, T, V)``, and the gradient of
each chunk goes straight into the student's gradient buffer (as :mod:`kdlab.objectives.kernels` does for one
vocabulary).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kdlab.objectives.pairing import TokenPairing
from kdlab.objectives.kernels import (
    HeadGradient,
    LogitsGradient,
    compute_dtype,
    scaled_gradients,
    taken_gradient,
)
from kdlab.objectives.lazy import HeadLogits, Logits, gather_rows
from kdlab.objectives.precision import full_precision
from kdlab.objectives.groups import AlignedGroups, ChunkSide, VocabularyMap

FLOOR = -1e4
"""Log-probability of an event that cannot happen (``exp`` underflows to exactly 0 in fp32)."""

DIAGNOSTICS = ("kl_forward", "kl_reverse", "student_entropy", "teacher_entropy", "teacher_unmapped_mass")


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, accurate at both ends."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


@dataclass
class EventLayout:
    """Where one side's tokens go on the event axis ``[student columns (V_S)..., x_k, rest]``: a pair's
    event sits in its student token's column, so the student's own log-probs need no gather.

    ``source``/``target``: ``(M,)`` this side's ids of the map and the student columns they go to;
    ``unmapped``: ``(U,)`` this side's ids outside the map; ``width``: ``V_S``; ``identity``: the map
    covers every column of this side in place (the student's side with one shared vocabulary)."""

    source: torch.Tensor
    target: torch.Tensor
    unmapped: torch.Tensor
    mapped_columns: torch.Tensor
    width: int
    identity: bool

    @classmethod
    def of(cls, vocabulary: VocabularyMap, side: str) -> EventLayout:
        source = getattr(vocabulary, f"{side}_ids")
        pair = getattr(vocabulary, f"{side}_pair")
        width = int(vocabulary.student_pair.numel())
        mapped_columns = torch.zeros(width, dtype=torch.bool, device=source.device)
        mapped_columns[vocabulary.student_ids] = True
        identity = side == "student" and bool(mapped_columns.all())
        return cls(source, vocabulary.student_ids, (pair < 0).nonzero().flatten(), mapped_columns, width, identity)


def side_logprobs(rows: torch.Tensor, ids: torch.Tensor, first_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start, realized)``: normalised log-probs ``(G, V)`` at each group's first row and the log-prob
    ``(n,)`` of the token written at every row, from one side's logits ``rows`` ``(n, V)`` (one
    normaliser per row; the full log-softmax only where a group starts)."""
    lse = torch.logsumexp(rows, dim=-1)
    realized = rows.gather(1, ids[:, None]).squeeze(1) - lse
    start = rows if first_rows.numel() == rows.shape[0] else rows[first_rows]
    return start - lse[first_rows, None], realized


def event_logprobs(start: torch.Tensor, realized: torch.Tensor, owner: torch.Tensor, first_rows: torch.Tensor,
                   first_ids: torch.Tensor, layout: EventLayout, removed: torch.Tensor) -> torch.Tensor:
    """One side's log-probabilities ``(G, V_S + 2)`` of a chunk's groups on the events
    ``[map in student columns..., x_k, rest]`` (columns of unmapped student tokens and of left-out pairs
    hold :data:`FLOOR`).

    ``start``: ``(G, V)`` normalised log-probs where each group starts; ``realized``: ``(n,)`` the log-prob of
    the token written at every row of the chunk's groups; ``owner``: ``(n,)`` the group of each row;
    ``first_rows``: ``(G,)`` each group's first row; ``first_ids``: ``(G,)`` the token written there;
    ``removed``: ``(G, 2)`` pair indices left out of each group's map (-1: none).
    """
    groups = first_rows.numel()
    is_first = torch.zeros(owner.numel(), dtype=torch.bool, device=owner.device)
    is_first[first_rows] = True
    continuation = torch.zeros(groups, dtype=start.dtype, device=start.device).index_add(0, owner, torch.where(is_first, 0.0, realized))
    single = torch.bincount(owner, minlength=groups) == 1
    first = realized[first_rows]
    # rest: unmapped tokens, the left-out pairs' own tokens but the first (each pair once), and the first
    # token without the rest of the group
    kept = removed >= 0
    own = torch.where(kept, layout.source[removed.clamp(min=0)], first_ids[:, None])
    counted = kept & (own != first_ids[:, None])
    counted[:, 1] &= removed[:, 1] != removed[:, 0]
    parts = [torch.where(counted, start.gather(1, own), FLOOR),
             torch.where(single, FLOOR, first + _log1mexp(continuation.clamp(max=-1e-7)))[:, None]]
    if layout.unmapped.numel():  # the first token, when unmapped, is in x_k and first_rest already
        parts.append(torch.where(layout.unmapped[None, :] == first_ids[:, None], FLOOR, start.index_select(1, layout.unmapped)))
    x_k = first + continuation
    rest = torch.logsumexp(torch.cat(parts, dim=1), dim=-1)
    # the map, in student columns, without the left-out pairs
    if layout.identity:
        mapped = start
    elif start.shape[1] == layout.width and torch.equal(layout.source, layout.target):  # same ids, same width
        mapped = start.masked_fill(~layout.mapped_columns, FLOOR)
    else:
        mapped = start.new_full((groups, layout.width), FLOOR).index_copy(1, layout.target, start.index_select(1, layout.source))
    events = torch.cat([mapped, x_k[:, None], rest[:, None]], dim=1)
    for column in range(removed.shape[1]):
        rows = kept[:, column].nonzero().flatten()
        events[rows, layout.target[removed[rows, column]]] = FLOOR
    return events


def side_events(rows: torch.Tensor, side: ChunkSide, layout: EventLayout, removed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start log-probs (G, V), event log-probs (G, V_S + 2))`` of one side of a chunk from its logits ``rows``."""
    start, realized = side_logprobs(rows, side.ids, side.first)
    return start, event_logprobs(start, realized, side.owner, side.first, side.ids[side.first], layout, removed)


class _AlignedObjective(torch.autograd.Function):
    """``sum_g weights[g] * loss_g`` over aligned groups; gradient computed in forward, chunk by chunk."""

    @staticmethod
    def forward(ctx, student_logits, hidden, weight, head, compute):  # type: ignore[override]
        with full_precision(head if head is not None else student_logits):
            source = head if head is not None else student_logits
            dtype = compute_dtype(hidden if head is not None else student_logits)
            gradient = None
            if head is not None and (ctx.needs_input_grad[1] or ctx.needs_input_grad[2]):
                gradient = HeadGradient(head, ctx.needs_input_grad[1], ctx.needs_input_grad[2], dtype)
            elif head is None and ctx.needs_input_grad[0]:
                gradient = LogitsGradient(student_logits, compute.covered, dtype)
            total = compute(source, dtype, gradient)
            ctx.gradient = gradient
            ctx.weight_dtype = weight.dtype if weight is not None else None
            return total

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        gradient = taken_gradient(ctx, "the aligned objective")
        with full_precision(grad_output):
            return (*scaled_gradients(gradient, grad_output, ctx.weight_dtype), None, None)


def drop_impossible_rest(student: torch.Tensor, teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where one model's ``rest`` event holds no token (a student whose every token is in the map, at a
    one-token group), the other's rest mass is on tokens the first cannot write as one token: compared as it
    is, forward or reverse KL would be infinite (``p log(p / 0)``). There the rest event is dropped on both sides
    and each distribution renormalised over the remaining events: both are conditioned on the next token being
    one both vocabularies hold, and the dropped teacher mass is what ``teacher_unmapped_mass`` reports. This is
    an approximation, not a restriction to text the student can write: the dropped tokens' text is often
    writable in several student tokens (``' strawberry'`` as ``' straw'`` + ``'berry'``), and a student matching
    the teacher's distribution over that text (its ``' straw'`` holding the teacher's ``' strawberry'`` too) is
    not the optimum. Rows whose rests are both
    possible are returned unchanged; where both are empty (one vocabulary) dropping changes nothing."""
    empty = (student[:, -1] < FLOOR / 2) | (teacher[:, -1] < FLOOR / 2)
    if not bool(empty.any()):
        return student, teacher

    def renormalised(events: torch.Tensor) -> torch.Tensor:
        dropped = torch.cat([events[:, :-1], torch.full_like(events[:, -1:], FLOOR)], dim=1)
        return torch.where(empty[:, None], dropped - torch.logsumexp(dropped, dim=-1, keepdim=True), events)

    return renormalised(student), renormalised(teacher)


def event_statistics(student: torch.Tensor, teacher: torch.Tensor, gradient_of: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(G, 4)``: KL(T || S), KL(S || T) and both entropies of normalised event log-probs ``(G, E)``
    (a :data:`FLOOR` entry has probability exactly 0 and adds nothing); and, for ``gradient_of`` =
    ``"kl_forward"`` or ``"kl_reverse"``, that KL's gradient ``(G, E)`` with respect to the student's
    event log-probs (``-p_T``, or ``p_S (log p_S - log p_T + 1)``), else ``None``."""
    p_s, p_t = student.exp(), teacher.exp()
    diff = teacher - student
    stats = torch.stack([(p_t * diff).sum(-1), -(p_s * diff).sum(-1), -(p_s * student).sum(-1), -(p_t * teacher).sum(-1)], dim=1)
    if gradient_of == "kl_forward":
        return stats, p_t.neg_()
    if gradient_of == "kl_reverse":
        return stats, diff.neg_().add_(1.0).mul_(p_s)
    return stats, None


def closed_form(objective: Any) -> str | None:
    """``"kl_forward"`` / ``"kl_reverse"`` when ``objective``'s per-token loss is exactly ForwardKL's /
    ReverseKL's (then loss and gradient come from :func:`event_statistics`), else ``None``."""
    from kdlab.objectives.kl import ForwardKL, ReverseKL

    token_loss = type(objective).token_loss
    return "kl_forward" if token_loss is ForwardKL.token_loss else "kl_reverse" if token_loss is ReverseKL.token_loss else None


def event_loss(objective: Any, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """``objective``'s per-group loss ``(G,)`` on event log-probs: forward and reverse KL in closed form on
    the normalised events (one pass), any other objective through its own ``token_loss``."""
    from kdlab.objectives.kl import ForwardKL, ReverseKL

    token_loss = type(objective).token_loss
    if token_loss is ForwardKL.token_loss:
        return (teacher.exp() * (teacher - student)).sum(-1)
    if token_loss is ReverseKL.token_loss:
        return (student.exp() * (student - teacher)).sum(-1)
    return objective.token_loss(student, teacher)


def sorted_probability_distance(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """ULD's distance per row: ``sum_i |sort(p_S)_i - sort(p_T)_i|`` (both sorted descending, the shorter
    vocabulary padded with zeros). ``(n, V_S)``, ``(n, V_T)`` log-probs -> ``(n,)``."""
    p_s = student_logprobs.exp().sort(dim=-1, descending=True).values
    p_t = teacher_logprobs.exp().sort(dim=-1, descending=True).values
    width = max(p_s.shape[-1], p_t.shape[-1])
    p_s = torch.nn.functional.pad(p_s, (0, width - p_s.shape[-1]))
    p_t = torch.nn.functional.pad(p_t, (0, width - p_t.shape[-1]))
    return (p_s - p_t).abs().sum(-1)


class CrossTokenizer(TokenPairing):
    """Distillation between models with different tokenizers: the settings of the aligned objective.

    Give it to :class:`~kdlab.stages.distill.DistillModule` as ``cross_tokenizer`` (in YAML,
    ``cross_tokenizer: {uld_weight: 0.0}``); the module's ``objective`` (forward or reverse KL, JSD, TV,
    sampled) is then taken over aligned groups (this module's docstring says how).

    Args:
        uld_weight: ``w`` in ``(1 - w) * divergence + w * ULD``: 0 (default) is the vocabulary map alone
            (exact where groups are one to one); 1 is ULD's sorted-probability distance alone.
        check_examples: how many examples of each of the train and val splits :meth:`check_texts` reads before any
            weight loads: ``None`` (default) every one; a number, the first that many (a task too large to
            tokenize whole at setup; a later example that does not reproduce is then only met in training).
    """

    def __init__(self, uld_weight: float = 0.0, check_examples: int | None = None) -> None:
        super().__init__()
        if not 0.0 <= uld_weight <= 1.0:
            raise ValueError(f"CrossTokenizer.uld_weight must be in [0, 1], got {uld_weight}")
        if check_examples is not None and (isinstance(check_examples, bool) or not isinstance(check_examples, int) or check_examples < 1):
            raise ValueError(f"CrossTokenizer.check_examples must be a positive integer or None (every example), got {check_examples!r}")
        self.uld_weight = float(uld_weight)
        self.check_examples = check_examples
        self.vocabulary: VocabularyMap | None = None
        self._on_device: dict[torch.device, tuple[VocabularyMap, tuple[EventLayout, EventLayout]]] = {}

    def rollout_loss(self, objective, rollout, student, teacher, sequence_weights=None, reduction: str | None = None):
        """The objective over the byte-aligned groups of ``rollout``'s student and teacher tokens, and the same pass's
        diagnostics (:meth:`loss`)."""
        teacher_ids, teacher_mask = rollout.completion("teacher")
        groups = self.groups(rollout.completion_ids, rollout.completion_mask, teacher_ids, teacher_mask)
        return self.loss(objective, student, teacher, groups, rollout.completion_ids, teacher_ids, rollout.completion_mask,
                         sequence_weights, reduction)

    def divergences(self, objective, rollout, student, teacher, reduction):
        return self.rollout_loss(objective, rollout, student.detach(), teacher, reduction=reduction)[1]

    def check_texts(self, task: Any, student_tokenizer: Any, teacher_tokenizer: Any) -> None:
        """Before any weight loads: refuse tokenizers that do not reproduce the task's text byte for byte, over every
        example of the train and val splits (the first :attr:`check_examples` of each when set; each prompt message and
        reference completion; one batched encoding per tokenizer, :func:`kdlab.alignment.first_unreproduced`). The
        error names the model, the split and id of the first example whose text fails and the first differing
        character (:func:`kdlab.alignment.check_reproduces`)."""
        from kdlab.alignment import check_reproduces, first_unreproduced
        from kdlab.errors import ConfigError

        where: dict[str, str] = {}  # each distinct text -> the first example it comes from
        for split in ("train", "val"):
            for index, example in enumerate(list(task.examples(split))[: self.check_examples]):
                name = f"{split} example {example.get('id', index)!r}"
                reference = task.reference_completion(example)
                for message in task.student_messages(example) + task.teacher_messages(example) + ([{"content": reference}] if reference else []):
                    where.setdefault(message["content"], name)
        texts = list(where)
        for role, tokenizer in (("student", student_tokenizer), ("teacher", teacher_tokenizer)):
            failing = first_unreproduced(tokenizer, texts)
            if failing is None:
                continue
            text = texts[failing]
            try:
                check_reproduces(tokenizer, text, tokenizer(text, add_special_tokens=False)["input_ids"], f"DistillModule.{role}'s")
            except ConfigError as error:
                raise ConfigError(f"{error} (in the {where[text]}: {text[:60]!r}; cross_tokenizer aligns the two models' "
                                  "tokens by bytes)") from None
            raise AssertionError(f"first_unreproduced and check_reproduces disagree on {text[:60]!r}")  # pragma: no cover

    def bind(self, teacher_tokenizer: Any, student_tokenizer: Any, teacher_columns: int, student_columns: int,
             teacher_end_ids: Sequence[int] | None = None, student_end_ids: Sequence[int] | None = None) -> None:
        """Build the vocabulary map of the two tokenizers (once, when the module is built). ``*_end_ids``: every id
        that ends a completion on that side (default: its tokenizer's EOS); they make one shared end event."""
        self.vocabulary = VocabularyMap.build(teacher_tokenizer, student_tokenizer, teacher_columns, student_columns,
                                              teacher_end_ids, student_end_ids)
        self._on_device: dict[torch.device, tuple[VocabularyMap, tuple[EventLayout, EventLayout]]] = {}

    def on_device(self, device: torch.device) -> tuple[VocabularyMap, tuple[EventLayout, EventLayout]]:
        """The vocabulary map and both sides' event layouts on ``device``, built once per device (not per step)."""
        if self.vocabulary is None:
            raise RuntimeError("CrossTokenizer.bind(...) must be called before use (DistillModule does it)")
        cache = self._on_device
        if device not in cache:
            vocabulary = self.vocabulary.to(device)
            cache[device] = vocabulary, (EventLayout.of(vocabulary, "student"), EventLayout.of(vocabulary, "teacher"))
        return cache[device]

    def groups(self, student_ids: torch.Tensor, student_mask: torch.Tensor, teacher_ids: torch.Tensor, teacher_mask: torch.Tensor) -> AlignedGroups:
        if self.vocabulary is None:
            raise RuntimeError("CrossTokenizer.bind(...) must be called before use (DistillModule does it)")
        return AlignedGroups.build(self.vocabulary, student_ids, student_mask, teacher_ids, teacher_mask)

    def loss(self, objective: Any, student_logits: Logits, teacher_logits: Logits, groups: AlignedGroups,
             student_ids: torch.Tensor, teacher_ids: torch.Tensor, student_mask: torch.Tensor,
             sequence_weights: torch.Tensor | None = None, reduction: str | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``objective``'s reduced loss over aligned groups and the same pass's diagnostics.

        ``student_logits`` ``(B, C_S, V_S)`` (or :class:`HeadLogits`) and ``teacher_logits`` ``(B, C_T, V_T)``
        (or a lazy source), tempered, at each side's completion positions; ``student_ids``/``teacher_ids``
        the completion tokens; ``student_mask`` ``(B, C_S)``. The reduction is ``reduction`` (default the
        objective's), over groups (one per group, at its first student token): with identical tokenizers,
        over tokens as usual.
        Diagnostics: ``kl_forward``, ``kl_reverse``, entropies on the events, ``teacher_unmapped_mass`` (the
        teacher's probability on tokens outside the map, at group starts), ``one_to_one_share``, ``misaligned_rows``
        (rows left out of the loss because their two tokenizations spell different bytes: :meth:`AlignedGroups.build`),
        ``cut_rows`` (rows whose groups stop at a special token inside the completion).
        """
        from kdlab.objectives.kl import KLObjective
        from kdlab.objectives.reduction import token_weights

        if self.vocabulary is None:
            raise RuntimeError("CrossTokenizer.bind(...) must be called before use (DistillModule does it)")
        if type(objective).token_loss is KLObjective.token_loss:
            raise ValueError(f"{type(objective).__name__} defines no token_loss, so it cannot be taken over aligned groups "
                             "(CrossTokenizer needs a per-token divergence: ForwardKL, ReverseKL, GeneralizedJSD, TotalVariation, sampled KLs)")
        starts = groups.start_mask(student_mask.shape)
        dtype = compute_dtype(student_logits)
        weights = token_weights(starts, reduction or objective.reduction, dtype)
        diagnostic_weights = weights
        if sequence_weights is not None:
            weights = weights * sequence_weights.to(weights.dtype)[:, None]
        vocabulary, (s_layout, t_layout) = self.on_device(student_mask.device)
        t_unmapped = t_layout.unmapped
        chunk_size = objective.chunk_size
        uld = self.uld_weight
        teacher_logits = teacher_logits.detach()
        diagnostics = torch.zeros(len(DIAGNOSTICS), dtype=dtype, device=student_mask.device)
        covered = torch.zeros(student_mask.shape, dtype=torch.bool, device=student_mask.device)
        if len(groups):
            b, t, _ = groups.positions(torch.arange(len(groups), device=covered.device), "student")
            covered[b, t] = True

        def compute(source: Logits, dtype: torch.dtype, gradient) -> torch.Tensor:
            total = torch.zeros((), dtype=dtype, device=student_mask.device)
            for chunk in groups.chunks(chunk_size):
                part = groups.chunk(chunk, student_ids, teacher_ids, vocabulary)
                with torch.no_grad():
                    t_rows = vocabulary.merged_ends(gather_rows(teacher_logits, part.teacher.b, part.teacher.t, dtype), "teacher")
                    t_start, t_events = side_events(t_rows, part.teacher, t_layout, part.removed)
                    unmapped_mass = (torch.logsumexp(t_start.index_select(1, t_unmapped), -1).exp() if t_unmapped.numel()
                                     else torch.zeros(len(chunk), dtype=dtype, device=t_start.device))
                w = weights[groups.row[chunk], groups.student_start[chunk]]
                d = diagnostic_weights[groups.row[chunk], groups.student_start[chunk]]
                with torch.enable_grad():
                    rows = gather_rows(source, part.student.b, part.student.t, dtype).detach().requires_grad_(gradient is not None)
                    s_start, s_events = side_events(vocabulary.merged_ends(rows, "student"), part.student, s_layout, part.removed)
                    s_events, t_events = drop_impossible_rest(s_events, t_events)
                    closed = closed_form(objective) if uld == 0.0 else None
                    if closed is None:
                        losses = event_loss(objective, s_events, t_events) if uld < 1.0 else torch.zeros(len(chunk), dtype=dtype, device=rows.device)
                        if uld > 0.0:
                            losses = (1.0 - uld) * losses + uld * sorted_probability_distance(s_start, t_start)
                        chunk_loss = (losses * w).sum()
                        if gradient is not None:
                            (grad,) = torch.autograd.grad(chunk_loss, rows)
                with torch.no_grad():
                    statistics, event_grad = event_statistics(s_events.detach(), t_events, closed)
                    if closed is not None:  # the loss is one of the statistics; its gradient on the events is known
                        chunk_loss = (statistics[:, DIAGNOSTICS.index(closed)] * w).sum()
                        if gradient is not None:
                            (grad,) = torch.autograd.grad(s_events, rows, event_grad.mul_(w[:, None]))
                    values = torch.cat([statistics, unmapped_mass[:, None]], dim=1)
                    diagnostics.add_(torch.mv(values.T.to(dtype), d))
                if gradient is not None:
                    gradient.add_chunk(torch.stack([part.student.b, part.student.t], dim=1), grad)
                total += chunk_loss.detach()
            return total

        compute.covered = covered  # type: ignore[attr-defined]
        with objective.recording_tokens():  # a statistic the objective records per token covers every chunk
            if isinstance(student_logits, HeadLogits):
                head = student_logits
                loss = _AlignedObjective.apply(None, head.hidden, head.weight, head, compute)
            else:
                loss = _AlignedObjective.apply(student_logits, None, None, None, compute)
        out = dict(zip(DIAGNOSTICS, diagnostics.unbind()))
        out["one_to_one_share"] = torch.tensor(groups.one_to_one_share)
        out["misaligned_rows"] = torch.tensor(float(groups.misaligned_rows))
        out["cut_rows"] = torch.tensor(float(groups.cut_rows))
        return loss, out
