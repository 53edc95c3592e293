"""How a micro-batch's sequences meet a model's forward: padded rows (:class:`Padded`, kdlab's layout) or
padding-free packed rows (:class:`Packed`).

A rollout of ``B`` completions is read by each model as ``[own prompt | completion]``: the padded layout is
``(B, P + C)`` with left-padded prompts and right-padded completions, so every row runs to the micro-batch's
longest prompt plus its longest completion. The packed layout lays the sequences' real tokens end to end in
rows of at most ``max_tokens_per_row`` tokens (:class:`PackedBatch`, ``(R, L)``), each sequence attending only
to itself: position ids restart at 0 on each sequence, and attention is block-diagonal. How depends on the model's
attention: a flash-attention model reads its rows laid end to end as one row through its variable-length path (the
sequence boundaries from the restarting position ids); an ``sdpa`` or ``eager`` model gets every sequence in one
row with no padding and kdlab's segment attention, each sequence's causal attention computed on its own
(:mod:`kdlab.rollouts.segment_attention`: the padded layout's attention cost, not ``L^2`` per row); a model that recomputes its
activations in the backward (gradient checkpointing) or another attention gets rows of the budget and an explicit
4D block-diagonal mask. Either way the objective receives the same ``(B, C, ...)``
tensors at the completion positions (the packed outputs are gathered back), so every reduction, diagnostic
and teacher signal (a cache's or a server's top-k, indexed by ``(B, C)``) lands on the same tokens.
A layer with a sliding window attends within its own sequence to the window's keys, as in the padded layout (segment
attention applies it, the 4D mask carries it; flash attention's variable-length path takes the window the model passes
it, as padded rows do); a model with layers of another kind (``chunked_attention``...) is refused
(:meth:`Packed.check_model`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from kdlab.models.loading import SLIDING, attention_windows, layer_kinds
from kdlab.objectives.logits import (
    completion_head_logits,
    completion_logits,
    forward_parameters,
    full_head_weight,
    fused_head_unsupported,
    innermost_model,
)
from kdlab.rollouts.segment_attention import NAME as SEGMENTS
from kdlab.rollouts.segment_attention import segment_attention_for

SETTING = "DistillModule.max_tokens_per_row"


class RowLayout:
    """How a model reads a rollout: every layout returns the outputs that predict the completion tokens of
    ``role`` (``"student"`` or ``"teacher"``: its own prompt and its own completion tokens) as ``(B, C, ...)``,
    ``C`` the rollout's completion width in that model's tokens; ``rows`` (a 1-D index) reads only those rows."""

    def completion_logits(self, model: torch.nn.Module, rollout: Any, role: str, token_columns: int,
                          rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(B, C, token_columns)`` (untempered), as :func:`~kdlab.objectives.logits.completion_logits`."""
        raise NotImplementedError

    def completion_head_logits(self, model: torch.nn.Module, rollout: Any, role: str, token_columns: int,
                               temperature: float = 1.0) -> Any:
        """A :class:`~kdlab.objectives.lazy.HeadLogits` of hidden states ``(B, C, H)``, as
        :func:`~kdlab.objectives.logits.completion_head_logits`."""
        raise NotImplementedError

    def check_model(self, config: Any, who: str) -> None:
        """An error naming the setting and ``config``'s field when a model with Hugging Face ``config`` (``who``:
        ``"the student"``, ``"DistillModule.teacher"``...) cannot be read in this layout; every model can be padded."""


class Padded(RowLayout):
    """One row per sequence, padded to ``(B, P + C)``: kdlab's layout (:meth:`kdlab.data.Rollout.model_inputs`)."""

    def completion_logits(self, model, rollout, role, token_columns, rows=None):
        inputs = rollout.model_inputs(role)
        if rows is not None:
            inputs = {key: value[rows.to(value.device)] for key, value in inputs.items()}
        return completion_logits(model, inputs, rollout.completion(role)[0].shape[1], token_columns)

    def completion_head_logits(self, model, rollout, role, token_columns, temperature=1.0):
        return completion_head_logits(model, rollout.model_inputs(role), rollout.completion(role)[0].shape[1], token_columns, temperature)


class Packed(RowLayout):
    """Sequences packed end to end into rows of at most ``max_tokens_per_row`` real tokens (longest first, each
    into the first row it fits), all rows in one forward ``(R, L)``, ``L`` the longest row: the micro-batch
    computes its real tokens plus the tail of its shorter rows instead of ``B x (P + C)``; with kdlab's segment
    attention (:func:`segments_apply`) one row of exactly the real tokens. A sequence longer than the budget widens
    its micro-batch's rows to its length (across tokenizers the teacher's tokens of a completion can outrun the budget
    that :meth:`check_fits` held the student's longest sequence to when the module was built)."""

    def __init__(self, max_tokens_per_row: int, setting: str = SETTING, segment_attention: bool = True) -> None:
        if isinstance(max_tokens_per_row, bool) or not isinstance(max_tokens_per_row, int) or max_tokens_per_row < 1:
            raise ValueError(f"{setting} must be a positive number of tokens (or null: padded rows), got {max_tokens_per_row!r}")
        self.max_tokens_per_row, self.setting = max_tokens_per_row, setting
        self.segment_attention = segment_attention  # False: rows of the budget and the mask even where segments apply

    def segments(self, model: torch.nn.Module | None) -> bool:
        """Whether ``model``'s packed forward runs kdlab's segment attention (:func:`segments_apply`)."""
        return model is not None and self.segment_attention and segments_apply(model)

    def check_model(self, config: Any, who: str) -> None:
        """Packed rows apply full and sliding-window attention (:func:`~kdlab.models.loading.attention_windows`): a
        model with layers of another kind (``chunked_attention``...) is refused, naming the setting and the field."""
        if config is None:
            return
        try:
            attention_windows(config)
        except ValueError as error:
            raise ValueError(f"{self.setting}={self.max_tokens_per_row} cannot pack {who}: its {error}, which packed rows "
                             f"do not apply; use padded rows ({self.setting.rsplit('.', 1)[-1]}: null)") from None

    def check_fits(self, longest_sequence: int, why: str) -> None:
        """An error naming the setting when a sequence of ``longest_sequence`` tokens (``why``) cannot fit one row."""
        if longest_sequence > self.max_tokens_per_row:
            raise ValueError(f"{self.setting}={self.max_tokens_per_row} is smaller than one sequence: {why} ({longest_sequence} tokens)")

    def pack(self, rollout: Any, role: str, rows: torch.Tensor | None = None, model: torch.nn.Module | None = None) -> PackedBatch:
        """``role``'s sequences of ``rollout`` (of ``rows`` only, when given) as a :class:`PackedBatch`; for a ``model``
        whose attention is variable-length (flash attention), its rows laid end to end as one row (Hugging Face's
        variable-length path reads the restarting position ids of a single row only); for one that attends with
        kdlab's segment attention (:func:`segments_apply`), every sequence in one row with no padding at all."""
        if model is not None:
            self.check_model(getattr(innermost_model(model), "config", None), "the model")
        inputs = rollout.model_inputs(role)
        completion_mask = rollout.completion(role)[1]
        if rows is not None:
            inputs = {key: value[rows.to(value.device)] for key, value in inputs.items()}
            completion_mask = completion_mask[rows.to(completion_mask.device)]
        one_row = self.segments(model)
        packed = PackedBatch.build(inputs["input_ids"], inputs["attention_mask"].bool(), completion_mask.shape[1], self, one_row=one_row)
        return packed.flattened() if model is not None and variable_length(model) else packed

    def attention(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """The block a packed forward of ``model`` runs in: kdlab's segment attention where it applies."""
        return segment_attention_for(model) if self.segments(model) else contextlib.nullcontext()

    def completion_logits(self, model, rollout, role, token_columns, rows=None):
        packed = self.pack(rollout, role, rows, model)
        with self.attention(model):
            inputs = packed.model_inputs(model)
            if "logits_to_keep" in forward_parameters(model):
                # only the columns that predict some completion token (with one row: exactly those positions)
                kept = packed.kept_columns()
                logits = model(**inputs, use_cache=False, logits_to_keep=kept).logits
                logits = packed.unpack(logits, kept)
            else:
                logits = packed.unpack(model(**inputs, use_cache=False).logits)
        return logits if logits.shape[-1] == token_columns else logits[..., :token_columns]

    def completion_head_logits(self, model, rollout, role, token_columns, temperature=1.0):
        from kdlab.objectives.lazy import HeadLogits

        reason = fused_head_unsupported(model)
        if reason:
            raise ValueError(f"fused_lm_head: {reason}; use the logits path (fused_lm_head: false)")
        packed = self.pack(rollout, role, model=model)
        keep = {"logits_to_keep": 1} if "logits_to_keep" in forward_parameters(model) else {}
        with self.attention(model):
            outputs = model(**packed.model_inputs(model), use_cache=False, output_hidden_states=True, **keep)
        hidden = packed.unpack(outputs.hidden_states[-1])
        return HeadLogits(hidden, full_head_weight(model.get_output_embeddings())[:token_columns], 1.0 / temperature)


@dataclass
class PackedBatch:
    """``B`` sequences packed into ``R`` rows.

    ``input_ids``: ``(R, L)`` long, each row's sequences end to end, then padding (id 0); ``position_ids``:
    ``(R, L)``, 0 at each sequence's first token (padding: 0, each padding position its own sequence);
    ``segments``: ``(R, L)`` long, which sequence (0..B-1) each position holds, -1 on padding; ``gather``:
    ``(B, C)`` long, for completion token c of sequence b the flat index (``row * L + column``) of the
    position whose output predicts it (masked-out completion positions point at the sequence's first
    predicting position, so they hold a real output that the objective's mask then ignores).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segments: torch.Tensor
    gather: torch.Tensor

    @classmethod
    def build(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int, packing: Packed,
              one_row: bool = False) -> PackedBatch:
        """From a padded ``[prompt | completion]`` micro-batch: ``input_ids`` / ``attention_mask`` ``(B, P + C)``
        (real tokens: left-padded prompt, right-padded completion, each a contiguous run) and ``C``; rows of at most
        ``packing.max_tokens_per_row`` tokens (of the longest sequence's, when that is longer), or with ``one_row``
        all sequences in one row ``(1, real tokens)``."""
        device = input_ids.device
        lengths = attention_mask.sum(1)
        prompt_length = input_ids.shape[1] - completion_length
        prompt_real = attention_mask[:, :prompt_length].sum(1)
        completion_real = attention_mask[:, prompt_length:].sum(1)
        completion_columns = torch.arange(completion_length, device=device)
        prompt_columns = torch.arange(prompt_length, device=device)
        if not torch.equal(attention_mask[:, prompt_length:], completion_columns[None, :] < completion_real[:, None]):
            raise ValueError("PackedBatch: each completion must be one run of real tokens from its first column (right padding only)")
        if not torch.equal(attention_mask[:, :prompt_length], prompt_columns[None, :] >= (prompt_length - prompt_real)[:, None]):
            raise ValueError("PackedBatch: each prompt must be one run of real tokens ending at its last column (left padding only)")
        if not bool(prompt_real.all()):  # its first completion token would read the output that predicts its second
            empty = int((prompt_real == 0).nonzero()[0, 0])
            raise ValueError(f"PackedBatch: sequence {empty} has no prompt token, so no position predicts its first completion token")
        sizes = lengths.tolist()
        # a sequence longer than the budget (across tokenizers, the teacher's spelling of a completion can outrun
        # max_prompt_tokens + max_completion_tokens) widens this micro-batch's rows to it: never an error mid-run
        # (the (R, L) input and the (R, L, L) mask are as wide as the longest row either way)
        capacity = sum(sizes) if one_row else max(packing.max_tokens_per_row, max(sizes, default=0))
        row_of, offset_of, row_sizes = first_fit_decreasing(sizes, capacity)
        width = max(row_sizes, default=0)
        rows = len(row_sizes)
        ids = torch.zeros((rows, width), dtype=input_ids.dtype, device=device)
        positions = torch.zeros((rows, width), dtype=torch.long, device=device)
        segments = torch.full((rows, width), -1, dtype=torch.long, device=device)
        starts = torch.tensor([row_of[b] * width + offset_of[b] for b in range(len(sizes))], dtype=torch.long, device=device)
        # flat destinations of every real token: its sequence's start plus its rank among the sequence's real tokens
        rank = attention_mask.long().cumsum(1) - 1
        destination = (starts[:, None] + rank)[attention_mask]
        ids.view(-1)[destination] = input_ids[attention_mask]
        positions.view(-1)[destination] = rank[attention_mask]
        segments.view(-1)[destination] = torch.arange(len(sizes), device=device)[:, None].expand_as(attention_mask)[attention_mask]
        # completion token c of sequence b is predicted by the sequence's token prompt_real + c - 1; a masked-out c
        # points at the sequence's first predicting position (a real output, ignored through the mask)
        last_prompt = starts[:, None] + prompt_real[:, None] - 1
        real = completion_columns[None, :] < completion_real[:, None]
        gather = torch.where(real, last_prompt + completion_columns[None, :], last_prompt)
        return cls(ids, positions, segments, gather)

    def flattened(self) -> PackedBatch:
        """The same sequences as one row ``(1, R x L)`` (a flat index of ``gather`` is the same position in it)."""
        return PackedBatch(*(tensor.reshape(1, -1) for tensor in (self.input_ids, self.position_ids, self.segments)), self.gather)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)

    def real_tokens(self) -> int:
        return int((self.segments >= 0).sum())

    def attention_mask(self, implementation: str, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
        """``(R, 1, L, L)`` block-diagonal causal mask: position i attends to j <= i of its own sequence (a
        padding position to itself only, so no row of the softmax is empty), with a sliding ``window`` only to
        ``i - window < j`` (Hugging Face's convention: :func:`~kdlab.models.loading.attention_windows`). Boolean
        (True: attend) for sdpa and other implementations; additive (0 / the dtype's minimum) for ``eager``, which adds it."""
        length = self.segments.shape[1]
        causal = torch.ones((length, length), dtype=torch.bool, device=self.segments.device).tril()
        if window is not None:
            causal = causal.triu(1 - window)
        same = self.segments[:, :, None] == self.segments[:, None, :]
        padding = self.segments < 0
        eye = torch.eye(length, dtype=torch.bool, device=self.segments.device)
        allowed = (same & causal & ~padding[:, None, :]) | (padding[:, :, None] & eye)
        allowed = allowed[:, None]
        if implementation == "eager":
            return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)
        return allowed

    def model_inputs(self, model: torch.nn.Module) -> dict[str, Any]:
        """``input_ids``, ``position_ids`` and the attention mask for ``model``: none for a flash-attention
        implementation (its variable-length path reads the restarting position ids), the 4D mask otherwise; for a
        model with sliding-window layers one per layer kind (``{"full_attention": ..., "sliding_attention": ...}``,
        which Hugging Face's models with ``layer_types`` take), or, for a config without ``layer_types`` (Mistral's,
        Phi-3's: one mask for every layer), the windowed mask."""
        implementation = attention_implementation(model)
        inputs = {"input_ids": self.input_ids, "position_ids": self.position_ids}
        if variable_length(model):
            if self.input_ids.shape[0] != 1:
                raise ValueError("PackedBatch: a variable-length attention reads one packed row; use flattened()")
            inputs["attention_mask"] = None
        else:
            dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
            if torch.is_autocast_enabled(self.input_ids.device.type):
                dtype = torch.get_autocast_dtype(self.input_ids.device.type)
            config = getattr(innermost_model(model), "config", None)
            windows = attention_windows(config) if config is not None else [None]
            if all(window is None for window in windows):
                inputs["attention_mask"] = self.attention_mask(implementation, dtype)
            elif getattr(config.get_text_config(), "layer_types", None):
                window = next(window for window in windows if window is not None)
                inputs["attention_mask"] = {kind: self.attention_mask(implementation, dtype, window if kind == SLIDING else None)
                                            for kind in set(layer_kinds(config))}
            else:
                inputs["attention_mask"] = self.attention_mask(implementation, dtype, windows[0])
        return inputs

    def kept_columns(self) -> torch.Tensor:
        """The sorted columns ``(K,)`` holding some predicting position (one row: exactly those positions)."""
        width = self.input_ids.shape[1]
        return torch.unique(self.gather.reshape(-1) % width) if self.gather.numel() else self.gather.new_zeros(0)

    def unpack(self, outputs: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
        """``outputs`` ``(R, L, ...)`` (or ``(R, K, ...)`` at the ``kept`` columns) gathered to ``(B, C, ...)``; the
        backward scatters the gradient back to the packed positions."""
        rows, width = self.input_ids.shape
        if kept is not None:
            where = torch.full((width,), -1, dtype=torch.long, device=kept.device)
            where[kept] = torch.arange(kept.numel(), device=kept.device)
            index = (self.gather // width) * kept.numel() + where[self.gather % width]
            flat = outputs.reshape(rows * kept.numel(), *outputs.shape[2:])
        else:
            index = self.gather
            flat = outputs.reshape(rows * width, *outputs.shape[2:])
        return flat[index]


def attention_implementation(model: torch.nn.Module) -> str:
    """The model's attention implementation (``config._attn_implementation``; ``sdpa`` when unset)."""
    return str(getattr(getattr(model, "config", None), "_attn_implementation", None) or "sdpa")


def variable_length(model: torch.nn.Module) -> bool:
    """Whether the model's attention takes packed sequences from restarting position ids alone (flash attention, or
    kdlab's segment attention while :func:`~kdlab.rollouts.segment_attention.segment_attention_for` holds)."""
    implementation = attention_implementation(model)
    return "flash" in implementation or implementation == SEGMENTS


def segments_apply(model: torch.nn.Module) -> bool:
    """Whether a packed forward of ``model`` runs kdlab's segment attention (one row, each sequence's attention on its
    own): an ``sdpa`` or ``eager`` model that does not recompute its activations in the backward (a recompute would
    run after the forward's attention switch has ended; those models keep the block-diagonal mask)."""
    if attention_implementation(model) not in ("sdpa", "eager"):
        return False
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else "is_gradient_checkpointing"
    return not getattr(model, name, False)


def first_fit_decreasing(sizes: list[int], capacity: int) -> tuple[list[int], list[int], list[int]]:
    """Bins of at most ``capacity`` for items of ``sizes``, longest first, each in the first bin it fits (ties
    in input order): ``(row of each item, offset of each item in its row, each row's used size)``."""
    order = sorted(range(len(sizes)), key=lambda item: -sizes[item])
    row_of, offset_of, used = [0] * len(sizes), [0] * len(sizes), []
    for item in order:
        for row, filled in enumerate(used):
            if filled + sizes[item] <= capacity:
                break
        else:
            row = len(used)
            used.append(0)
        row_of[item], offset_of[item] = row, used[row]
        used[row] += sizes[item]
    return row_of, offset_of, used
