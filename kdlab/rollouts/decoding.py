"""Token-by-token decoding with KV caches, shared by every rollout policy and by evaluation.

kdlab decodes with its own loop instead of ``model.generate`` because the token-level mixture
policy must combine two models' next-token distributions at every step, and because sampling must
use an explicit seeded ``torch.Generator`` so rollouts are reproducible and resumable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kdlab.data import decode_completions, left_pad, prompt_token_ids
from kdlab.models.loading import end_token_ids
from kdlab.objectives.logits import cache_argument, forward_parameters
from kdlab.rollouts.static_cache import StaticCacheLM, static_cache_supported
from kdlab.tasks.base import Example, Task

NextLogprobs = Callable[[torch.Tensor | None], torch.Tensor]
"""``previous tokens (B,) or None for the first step -> next-token log-probs (B, V)``."""


class IncrementalLM:
    """One model decoding a left-padded prompt batch step by step with its KV cache.

    Args:
        model: a causal LM (put in eval mode by the caller).
        input_ids, attention_mask: ``(B, P)`` left-padded prompt.
        token_columns: logits beyond this index (padded embedding rows) are dropped.
        temperature: next-token log-probs are ``log_softmax(logits / temperature)``;
            0 gives the untempered ``log_softmax(logits)`` (for greedy decoding).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_columns: int,
        temperature: float,
    ) -> None:
        self.model = model
        self.input_ids = input_ids
        self.attention_mask = attention_mask
        self.token_columns = token_columns
        self.temperature = temperature
        self.cache_argument = cache_argument(model)
        self.cache = None
        self.last_position: torch.Tensor | None = None

    def _logprobs(self, outputs) -> torch.Tensor:
        self.cache = getattr(outputs, self.cache_argument, None)
        if self.cache is None:
            self.cache = outputs.past_key_values
        logits = outputs.logits[:, -1, : self.token_columns].float()
        if self.temperature > 0:
            logits = logits / self.temperature
        return torch.log_softmax(logits, dim=-1)

    @torch.no_grad()
    def __call__(self, previous: torch.Tensor | None) -> torch.Tensor:
        """Next-token log-probs ``(B, V)`` after feeding ``previous`` ``(B,)`` (None on the first call)."""
        if previous is None:
            positions = (self.attention_mask.cumsum(dim=1) - 1).clamp(min=0)
            self.last_position = positions[:, -1:]
            keep = {"logits_to_keep": 1} if "logits_to_keep" in forward_parameters(self.model) else {}
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


def incremental_decoder(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_columns: int,
                        temperature: float, max_new_tokens: int, compile: str = "cuda") -> NextLogprobs:
    """The decoder of ``model`` for a ``(B, P)`` prompt batch decoding at most ``max_new_tokens``:
    :class:`~kdlab.rollouts.static_cache.StaticCacheLM` where the model allows it
    (:func:`~kdlab.rollouts.static_cache.static_cache_supported`), :class:`IncrementalLM` otherwise."""
    if static_cache_supported(model) is None:
        return StaticCacheLM(model, input_ids, attention_mask, token_columns, temperature, max_new_tokens, compile)
    return IncrementalLM(model, input_ids, attention_mask, token_columns, temperature)


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
"""``(tokens so far (B, t), rows to check (B,) bool) -> (B,) bool``: which rows have just completed a stop.
:func:`sample_tokens` asks it on the host, at its checks, once for each step since the last check."""


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


CHECK_EVERY = 8
""":func:`sample_tokens` reads back whether every row has finished once every this many tokens (one host sync)."""


def exponential_draw(probs: torch.Tensor, generator: torch.Generator | None, rows: torch.Tensor, batch_size: int) -> torch.Tensor:
    """One token per row of ``probs`` ``(b, V)``, the rows ``rows`` ``(b,)`` of a ``(batch_size, V)`` batch, drawn
    exactly as ``torch.multinomial(full_probs, 1, generator)`` draws the full batch: ``argmax(p / q)`` with
    ``q ~ Exp(1)`` drawn for all ``batch_size`` rows (torch's own one-sample path), so a row's token does not
    depend on which other rows are still in the batch, and the generator advances as it always did."""
    q = torch.empty((batch_size, probs.shape[-1]), dtype=probs.dtype, device=probs.device).exponential_(1, generator=generator)
    if probs.shape[0] != batch_size:
        q = q.index_select(0, rows)
    return (probs / q).argmax(dim=-1)


def _generator_of(generator: torch.Generator | None, device: torch.device | str) -> torch.Generator:
    if generator is not None:
        return generator
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


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
    check_every: int = CHECK_EVERY,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw completions token by token until every row has produced an end token (or completed a stop
    string, see :func:`stop_strings_check`) or used its budget.

    ``max_new_tokens``: one budget for every row, or a ``(B,)`` tensor of per-row budgets.
    Returns ``ids (B, C)`` (``pad_token_id`` after a row's end), ``mask (B, C)`` bool (True on each
    row's tokens, end token included) and ``entropy (B, C)`` of the distribution each token was
    drawn from (0 where masked). ``C <= max(max_new_tokens)``.

    No host sync per token: whether every row has finished is read back once every ``check_every`` tokens, and
    ``stop`` (which reads text) is asked then, on a host copy of the tokens, for each step since the last check
    (:func:`_replay_stops`); the steps decoded past the end are dropped, and the generator is put
    back where it stood after the last token that mattered, so ids, mask, entropy and the generator's state
    after the call are what a check after every token gives. When ``next_logprobs`` has ``keep_rows(rows)``
    (:class:`~kdlab.rollouts.static_cache.StaticCacheLM`), finished rows leave its batch once at most half
    of it is still decoding; tokens are drawn by :func:`exponential_draw`, so a row's draws do not change.

    ``all_done(local_done) -> bool`` makes the stopping decision collective: with sharded models every
    forward is a collective operation, so all ranks must take the same number of steps (a rank whose
    rows have all ended keeps feeding padding until every rank is done). It is asked at the checks only, and
    then ``C`` is the steps every rank took (a multiple of ``check_every`` or the budget), its last columns
    padding where this rank ended earlier, and the generator stays where those steps left it.
    """
    if check_every < 1:
        raise ValueError(f"sample_tokens: check_every must be >= 1, got {check_every}")
    eos = torch.tensor(list(eos_token_ids), dtype=torch.long, device=device)
    limits = torch.as_tensor(max_new_tokens, device=device).expand(batch_size)
    steps = int(limits.max()) if batch_size else 0
    if steps <= 0:
        empty = torch.zeros(batch_size, 0, device=device)
        return empty.long(), empty.bool(), empty
    ids = torch.full((batch_size, steps), pad_token_id, dtype=torch.long, device=device)
    masks = torch.zeros(batch_size, steps, dtype=torch.bool, device=device)
    entropies = torch.zeros(batch_size, steps, device=device, dtype=torch.float32)  # fp32 whatever the default dtype (bf16-true sets it)
    finished = limits <= 0
    ended_by = torch.zeros(steps, dtype=torch.bool, device=device)  # [t]: every row had finished after step t
    rows = torch.arange(batch_size, device=device)  # the rows in the decoder's batch, in its order
    keep_rows = getattr(next_logprobs, "keep_rows", None)
    draws = None if greedy else _generator_of(generator, device)
    states: list[torch.Tensor] = []  # the generator's state after each step since the last check
    previous, taken, checked = None, 0, 0  # checked: the steps ``stop`` has been asked about
    every_row = True  # rows is still the whole batch in order: plain column writes, no indexing by rows
    for step in range(steps):
        logprobs = next_logprobs(previous)
        probs = logprobs.exp()
        token = logprobs.argmax(dim=-1) if greedy else exponential_draw(probs, draws, rows, batch_size)
        if draws is not None:
            states.append(draws.get_state())
        entropy = (probs * logprobs.clamp(min=-1e30)).sum(-1).neg_()
        if every_row:
            token.masked_fill_(finished, pad_token_id)
            ids[:, step] = token
            torch.logical_not(finished, out=masks[:, step])
            entropies[:, step] = entropy.masked_fill_(finished, 0.0)
            now = finished | torch.isin(token, eos) | (limits <= step + 1)
            finished = now
        else:
            alive = ~finished[rows]
            token = torch.where(alive, token, torch.full_like(token, pad_token_id))
            ids[rows, step] = token
            masks[rows, step] = alive
            entropies[rows, step] = torch.where(alive, entropy, 0.0).float()
            now = finished[rows] | torch.isin(token, eos) | (limits[rows] <= step + 1)
            finished = finished.index_put((rows,), now)
        ended_by[step] = finished.all()
        taken = step + 1
        previous = token
        if taken % check_every and taken < steps:
            continue
        if stop is not None:
            finished = _replay_stops(stop, ids, masks, entropies, finished, ended_by, checked, taken, pad_token_id)
            now, checked = finished[rows], taken
        local = ended_by[:taken].nonzero()  # the one host sync of these check_every steps
        done = local.numel() > 0
        if all_done is not None:
            done = all_done(done)
        elif done:
            taken = int(local[0]) + 1
            if draws is not None:
                draws.set_state(states[taken - 1 - (step + 1 - len(states))])
        if done:
            break
        states.clear()
        live = (~now).nonzero().flatten()
        if keep_rows is not None and 0 < live.numel() <= len(rows) // 2:
            keep_rows(live)
            rows, previous, every_row = rows[live], previous[live], False
    return ids[:, :taken], masks[:, :taken], entropies[:, :taken]


def _replay_stops(stop: StopCheck, ids: torch.Tensor, masks: torch.Tensor, entropies: torch.Tensor, finished: torch.Tensor,
                  ended_by: torch.Tensor, first: int, taken: int, pad_token_id: int) -> torch.Tensor:
    """Asks ``stop`` about steps ``first .. taken - 1`` of a decode, as a check after each of those tokens would have,
    and ends each row at the first step where it completed a stop: its later tokens become padding (``ids``,
    ``masks``, ``entropies`` ``(B, steps)``, in place) and ``ended_by`` ``(steps,)`` is recomputed over those steps.
    One copy of the tokens to the host; ``stop`` runs there. Returns ``finished`` ``(B,)`` with the stopped rows."""
    host_ids, host_masks = ids[:, :taken].cpu(), masks[:, first:taken].cpu()
    alive_next = torch.cat([host_masks[:, 1:], ~finished.cpu().unsqueeze(1)], dim=1)  # [:, j]: decoding after step first + j
    ended = host_masks & ~alive_next  # an end token or the budget ended the row at that step
    stopped_at = torch.full((ids.shape[0],), -1, dtype=torch.long)
    for j in range(taken - first):
        rows = host_masks[:, j] & ~ended[:, j] & (stopped_at < 0)
        if rows.any():
            hit = stop(host_ids[:, : first + j + 1], rows).cpu() & rows
            stopped_at[hit] = first + j
    stopped = (stopped_at >= 0).nonzero().flatten().tolist()
    if not stopped:
        return finished
    for row in stopped:
        after = int(stopped_at[row]) + 1
        ids[row, after:taken], masks[row, after:taken], entropies[row, after:taken] = pad_token_id, False, 0.0
    finished = finished.index_fill(0, torch.tensor(stopped, device=finished.device), True)
    ended_by[first : taken - 1] = (~masks[:, first + 1 : taken]).all(dim=0)
    ended_by[taken - 1] = finished.all()
    return finished


PROMPT_LIMIT = 2048
"""The longest prompt, in tokens, :func:`sample_completions` takes by default (the paper's limit); a longer one is refused."""


@torch.no_grad()
def sample_completions(
    model: torch.nn.Module,
    tokenizer: Any,
    task: Task,
    examples: Sequence[Example],
    *,
    role: str = "student",
    temperature: float = 0.0,
    max_new_tokens: int | Sequence[int] = 512,
    max_prompt_tokens: int = PROMPT_LIMIT,
    batch_size: int = 16,
    generator: torch.Generator | None = None,
    token_columns: int | None = None,
    all_done: Callable[[bool], bool] | None = None,
    end_ids: Sequence[int] | None = None,
    stop_strings: Sequence[str] = (),
    device: torch.device | None = None,
) -> list[tuple[str, bool]]:
    """``(text, ended)`` for each of ``examples``, prompted as ``role`` (``"student"`` or ``"teacher"``);
    ``ended`` is False when the completion was cut by ``max_new_tokens`` instead of ending with an end
    token (``end_ids``, default: the tokenizer's and the model's) or a stop string (kept in the text).
    ``max_new_tokens``: one budget, or one per example.

    ``temperature`` 0 decodes greedily. The model is put in eval mode for the call and its mode is
    restored afterwards. ``all_done`` makes stopping collective under sharded training; every rank
    must then call with the same number of batches. ``device``: where the prompts go (default: the device of the
    model's first parameter; a view with no parameters of its own, such as the student's base under disabled
    LoRA adapters, needs it given).
    """
    if device is None:
        device = next(model.parameters()).device
    vocab = token_columns or len(tokenizer)
    end_ids = tuple(end_ids) if end_ids else end_token_ids(tokenizer, model)
    was_training = model.training
    model.eval()
    results: list[tuple[str, bool]] = []
    stop = stop_strings_check(tokenizer, stop_strings)
    budgets = [max_new_tokens] * len(examples) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != len(examples):
        raise ValueError(f"sample_completions: {len(budgets)} budgets for {len(examples)} examples")
    try:
        for start in range(0, len(examples), batch_size):
            batch = examples[start : start + batch_size]
            rows = [prompt_token_ids(task, tokenizer, ex, role, max_prompt_tokens) for ex in batch]
            ids, mask = left_pad(rows, tokenizer.pad_token_id)
            limits = budgets[start : start + batch_size]
            decoder = incremental_decoder(model, ids.to(device), mask.to(device), vocab, temperature, max(limits, default=0))
            out_ids, out_mask, _ = sample_tokens(
                decoder,
                batch_size=len(batch),
                max_new_tokens=torch.tensor(limits, device=device),
                eos_token_ids=end_ids,
                pad_token_id=tokenizer.pad_token_id,
                generator=generator,
                greedy=temperature == 0,
                device=device,
                all_done=all_done,
                stop=stop,
            )
            results += completion_records(tokenizer, out_ids, out_mask, end_ids, stop_strings)
    finally:
        model.train(was_training)
    return results


def completion_records(
    tokenizer: Any, completion_ids: torch.Tensor, completion_mask: torch.Tensor, end_ids: Sequence[int], stop_strings: Sequence[str] = ()
) -> list[tuple[str, bool]]:
    """``(text, ended)`` per completion ``(B, C)``: the text without a final end token, and whether the
    completion ended (an end token or a stop string) rather than running out of budget."""
    texts = decode_completions(tokenizer, completion_ids, completion_mask, end_ids)
    return [
        (text, bool(row_mask.any()) and (int(row_ids[row_mask.bool()][-1]) in end_ids or any(s and s in text for s in stop_strings)))
        for row_ids, row_mask, text in zip(completion_ids, completion_mask, texts)
    ]
