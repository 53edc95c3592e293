"""Token-by-token decoding with KV caches, shared by every rollout policy and by evaluation.

kdlab decodes with its own loop instead of ``model.generate`` because the token-level mixture
policy must combine two models' next-token distributions at every step, and because sampling must
use an explicit seeded ``torch.Generator`` so rollouts are reproducible and resumable.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

NextLogprobs = Callable[[torch.Tensor | None], torch.Tensor]
"""``previous tokens (B,) or None for the first step -> next-token log-probs (B, V)``."""


@functools.cache
def _class_forward_parameters(model_class: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_class.forward).parameters)


def innermost_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside training wrappers (FSDP1, DDP, ``torch.compile``, peft), whose ``forward``
    signature says which arguments it takes (the wrappers' own take ``*args, **kwargs``)."""
    for _ in range(8):  # wrappers nest a few levels at most
        inner = getattr(model, "_fsdp_wrapped_module", None) or getattr(model, "_orig_mod", None)
        if inner is None and isinstance(getattr(model, "module", None), torch.nn.Module):
            inner = model.module
        if inner is None and callable(getattr(model, "get_base_model", None)):
            inner = model.get_base_model()
        if not isinstance(inner, torch.nn.Module) or inner is model:
            return model
        model = inner
    return model


def _forward_parameters(model: torch.nn.Module) -> frozenset[str]:
    return _class_forward_parameters(type(innermost_model(model)))


def _cache_argument(model: torch.nn.Module) -> str:
    # transformers 5.x renamed ``past_key_values`` to ``cache``; accept both.
    return "cache" if "cache" in _forward_parameters(model) else "past_key_values"


def completion_logits(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    completion_length: int,
    vocab_size: int,
) -> torch.Tensor:
    """Logits ``(B, C, vocab_size)`` that predict the last ``C = completion_length`` tokens of ``inputs``.

    Asks the model for only those ``C`` positions (``logits_to_keep`` as a position tensor), so the
    prompt's logits are never computed and the result is contiguous, and drops embedding rows beyond the
    tokenizer's vocabulary (padded embeddings, e.g. Qwen2.5's 151,936 vs 152,064).
    """
    if "logits_to_keep" in _forward_parameters(model):
        # exactly the C positions that predict the completion, so the logits (and the gradient an
        # objective hands back) are one contiguous (B, C, V) tensor, with no slice to undo in backward
        length = inputs["input_ids"].shape[1]
        keep = torch.arange(length - completion_length - 1, length - 1, device=inputs["input_ids"].device)
        logits = model(**inputs, use_cache=False, logits_to_keep=keep).logits
    else:
        logits = model(**inputs, use_cache=False).logits
    if logits.shape[1] != completion_length:
        logits = logits[:, -(completion_length + 1) : -1]
    return logits if logits.shape[-1] == vocab_size else logits[..., :vocab_size]


def completion_head_logits(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    completion_length: int,
    vocab_size: int,
    temperature: float = 1.0,
):
    """:class:`~kdlab.objectives.HeadLogits` standing for ``completion_logits(...) / temperature`` without
    computing them: the final hidden states ``(B, C, H)`` at the positions that predict the completion
    and the LM head's first ``vocab_size`` rows. Only one position's logits are computed by the model
    (``logits_to_keep=1``). The head must have no bias."""
    from kdlab.objectives import HeadLogits

    reason = fused_head_unsupported(model)
    if reason:
        raise ValueError(f"fused_lm_head: {reason}; use the logits path (fused_lm_head: false)")
    head = model.get_output_embeddings()
    keep = {"logits_to_keep": 1} if "logits_to_keep" in _forward_parameters(model) else {}
    outputs = model(**inputs, use_cache=False, output_hidden_states=True, **keep)
    hidden = outputs.hidden_states[-1][:, -(completion_length + 1) : -1]
    return HeadLogits(hidden, full_head_weight(head)[:vocab_size], 1.0 / temperature)


def fused_head_unsupported(model: torch.nn.Module) -> str | None:
    """Why the fused hidden-state + LM-head path cannot stand for ``model``'s logits, or ``None``: a head
    with a bias, logits transformed after the head (soft-capping, scaling), a head that is not a plain
    weight (FSDP1's flat parameters), or no head at all."""
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        return "the model has no LM head with a weight"
    if getattr(head, "bias", None) is not None:
        return "the LM head has a bias"
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", 1.0) not in (None, 1.0):
        return "this model transforms its logits after the LM head (soft-capping or scaling)"
    if getattr(model, "_fsdp_wrapped_module", None) is not None or head.weight.dim() != 2:
        return "the LM head is flattened and sharded by FSDP1 (strategy: fsdp)"
    return None


def full_head_weight(head: torch.nn.Module) -> torch.Tensor:
    """The LM head's whole ``(V, H)`` weight, read after the model's forward. Under FSDP2 the root's
    parameters (embeddings, final norm, head) are still gathered then (a root unit does not reshard
    after forward), so this is the unsharded parameter and its gradient is reduce-scattered by FSDP2
    after backward as usual; a head still sharded (a ``DTensor``) is all-gathered with ``full_tensor()``,
    whose backward reduce-scatters the gradient into the shards. FSDP1 flattens parameters and is refused
    before training (``TaskStage``)."""
    weight = head.weight
    return weight.full_tensor() if hasattr(weight, "full_tensor") else weight


class IncrementalLM:
    """One model decoding a left-padded prompt batch step by step with its KV cache.

    Args:
        model: a causal LM (put in eval mode by the caller).
        input_ids, attention_mask: ``(B, P)`` left-padded prompt.
        vocab_size: logits beyond this index (padded embedding rows) are dropped.
        temperature: next-token log-probs are ``log_softmax(logits / temperature)``;
            0 gives the untempered ``log_softmax(logits)`` (for greedy decoding).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        vocab_size: int,
        temperature: float,
    ) -> None:
        self.model = model
        self.input_ids = input_ids
        self.attention_mask = attention_mask
        self.vocab_size = vocab_size
        self.temperature = temperature
        self.cache_argument = _cache_argument(model)
        self.cache = None
        self.last_position: torch.Tensor | None = None

    def _logprobs(self, outputs) -> torch.Tensor:
        self.cache = getattr(outputs, self.cache_argument, None)
        if self.cache is None:
            self.cache = outputs.past_key_values
        logits = outputs.logits[:, -1, : self.vocab_size].float()
        if self.temperature > 0:
            logits = logits / self.temperature
        return torch.log_softmax(logits, dim=-1)

    @torch.no_grad()
    def __call__(self, previous: torch.Tensor | None) -> torch.Tensor:
        """Next-token log-probs ``(B, V)`` after feeding ``previous`` ``(B,)`` (None on the first call)."""
        if previous is None:
            positions = (self.attention_mask.cumsum(dim=1) - 1).clamp(min=0)
            self.last_position = positions[:, -1:]
            keep = {"logits_to_keep": 1} if "logits_to_keep" in _forward_parameters(self.model) else {}
            outputs = self.model(
                input_ids=self.input_ids,
                attention_mask=self.attention_mask,
                position_ids=positions,
                use_cache=True,
                **keep,
            )
            return self._logprobs(outputs)
        ones = torch.ones_like(self.attention_mask[:, :1])
        self.attention_mask = torch.cat([self.attention_mask, ones], dim=1)
        self.last_position = self.last_position + 1
        outputs = self.model(
            input_ids=previous[:, None],
            attention_mask=self.attention_mask,
            position_ids=self.last_position,
            use_cache=True,
            **{self.cache_argument: self.cache},
        )
        return self._logprobs(outputs)


def top_p_logprobs(logprobs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filtering of normalised log-probs ``(B, V)``: keep the smallest set of most likely tokens
    whose probabilities sum to at least ``top_p`` (the most likely token always stays), renormalise,
    and give every other token -inf. ``top_p >= 1`` returns ``logprobs`` unchanged."""
    if top_p >= 1.0:
        return logprobs
    sorted_logprobs, order = logprobs.sort(dim=-1, descending=True)
    mass_before = sorted_logprobs.exp().cumsum(dim=-1) - sorted_logprobs.exp()
    drop_sorted = mass_before >= top_p  # a token is kept while the mass before it is still short of top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return torch.log_softmax(logprobs.masked_fill(drop, float("-inf")), dim=-1)


StopCheck = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(tokens so far (B, t), rows to check (B,) bool) -> (B,) bool``: which rows have just completed a stop."""


def stop_strings_check(tokenizer: Any, stop_strings: Sequence[str], window: int = 32) -> StopCheck | None:
    """A :data:`StopCheck` that ends a row once the text of its last ``window`` tokens contains one of
    ``stop_strings`` (the tokens that complete it are kept). ``None`` when there are no stop strings."""
    stops = [text for text in stop_strings if text]
    if not stops:
        return None

    def check(tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        hit = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        for row in rows.nonzero().flatten().tolist():
            tail = tokenizer.decode(tokens[row, -window:].tolist(), skip_special_tokens=False)
            hit[row] = any(stop in tail for stop in stops)
        return hit

    return check


@torch.no_grad()
def sample_tokens(
    next_logprobs: NextLogprobs,
    batch_size: int,
    max_new_tokens: int | torch.Tensor,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    generator: torch.Generator | None,
    greedy: bool = False,
    device: torch.device | str = "cpu",
    all_done: Callable[[bool], bool] | None = None,
    stop: StopCheck | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw completions token by token until every row has produced an end token (or completed a stop
    string, see :func:`stop_strings_check`) or used its budget.

    ``max_new_tokens``: one budget for every row, or a ``(B,)`` tensor of per-row budgets.
    Returns ``ids (B, C)`` (``pad_token_id`` after a row's end), ``mask (B, C)`` bool (True on each
    row's tokens, end token included) and ``entropy (B, C)`` of the distribution each token was
    drawn from (0 where masked). ``C <= max(max_new_tokens)``.

    ``all_done(local_done) -> bool`` makes the stopping decision collective: with sharded models every
    forward is a collective operation, so all ranks must take the same number of steps (a rank whose
    rows have all ended keeps feeding padding until every rank is done).
    """
    eos = torch.tensor(list(eos_token_ids), dtype=torch.long, device=device)
    limits = torch.as_tensor(max_new_tokens, device=device).expand(batch_size)
    finished = limits <= 0
    tokens, masks, entropies = [], [], []
    previous = None
    for step in range(int(limits.max()) if batch_size else 0):
        logprobs = next_logprobs(previous)
        probs = logprobs.exp()
        if greedy:
            token = logprobs.argmax(dim=-1)
        else:
            token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        alive = ~finished
        token = torch.where(alive, token, torch.full_like(token, pad_token_id))
        tokens.append(token)
        masks.append(alive)
        entropies.append(torch.where(alive, -(probs * logprobs.clamp(min=-1e30)).sum(-1), 0.0))
        finished = finished | torch.isin(token, eos) | (limits <= step + 1)
        if stop is not None:
            finished = finished | stop(torch.stack(tokens, 1), alive & ~finished)
        done = bool(finished.all())
        if all_done is not None:
            done = all_done(done)
        if done:
            break
        previous = token
    if not tokens:
        empty = torch.zeros(batch_size, 0, device=device)
        return empty.long(), empty.bool(), empty
    return torch.stack(tokens, 1), torch.stack(masks, 1), torch.stack(entropies, 1)
