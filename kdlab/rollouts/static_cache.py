"""A decoder that is not launch-bound: a preallocated KV cache, a decode step that can be captured, and rows
that leave the batch when they finish.

:class:`StaticCacheLM` is a :data:`~kdlab.rollouts.decoding.NextLogprobs` like
:class:`~kdlab.rollouts.decoding.IncrementalLM` (same prompts, same log-probs) with three differences that
matter on a GPU, where a small model's decode step is a few hundred kernel launches and a host sync:

* the KV cache is Hugging Face's ``StaticCache``, allocated once for ``prompt + max_new_tokens`` positions
  (rounded up to :data:`CACHE_BUCKET` so that decodes of different prompt lengths share one captured step),
  and the attention mask is one ``(B, 1, 1, L)`` buffer updated in place: nothing is concatenated or
  rebuilt per token, so every step has the same shapes and addresses; an eager step (not captured) attends
  over the filled positions only (the cache and the mask as views of their first ``written`` positions,
  :func:`filled_prefix_cache`), so it reads no more of the cache than a growing one and copies nothing;
* the decode step can be compiled (``compile``): ``"cuda"`` (the default) compiles it with
  ``mode="reduce-overhead"`` (CUDA graphs) on a CUDA device and runs it eagerly elsewhere, ``"always"``
  compiles it on any device (inductor's C++ kernels on a CPU), ``"never"`` runs it eagerly. On a CPU the
  eager step is the default because compiling did not pay there (``benchmarks/decode.py`` measures both);
* :meth:`StaticCacheLM.keep_rows` drops finished rows (their cache rows go with them), which
  :func:`~kdlab.rollouts.decoding.sample_tokens` calls when half a batch has ended;
* prompts that begin alike (a task's instruction, a chat template's system turn) are prefilled once: the
  leading tokens every row shares (:func:`shared_prefix`, at least :data:`SHARED_PREFIX_MIN`) run as one row,
  their keys and values are copied into every row's cache at that row's offset, and the batch's prompt forward
  runs only over the columns after them (``share_prefix``); ``benchmarks/decode.py`` records how many leading
  tokens its Countdown prompts share (``shared_prompt_tokens``) and what the shared prefill is worth.

The log-probs equal :class:`~kdlab.rollouts.decoding.IncrementalLM`'s: the same prompt forward, the same
position ids, and masked cache positions contribute exactly nothing to attention (tests compare greedy
decodes token for token with it and with Hugging Face ``generate``, on the tiny pair and SmolLM2).
Models whose layers are not all full attention (sliding windows, whether the config names them in ``layer_types``
or only sets ``sliding_window`` as Mistral's and Phi-3's do) fall back to :class:`IncrementalLM` in
:func:`~kdlab.rollouts.decoding.incremental_decoder`.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from kdlab.models.loading import windowed_attention
from kdlab.objectives.logits import cache_argument, forward_parameters, innermost_model

SHARED_PREFIX_MIN = 16
"""Prompts that share fewer leading tokens than this are prefilled whole (the copy is not worth it)."""

CACHE_BUCKET = 64
"""Cache lengths are rounded up to a multiple of this, so prompts of different lengths share one compiled step."""

PREFILL_TOKENS = 16384
"""The most prompt tokens one prefill forward runs (rows x prompt columns): a batch of more is prefilled a group of
rows at a time, each group writing its rows of the cache, so the prefill's activations (``rows x P x (3I + 4h)``,
tens of GiB for 128 prompts of 2,048 tokens through a 7B model) are bounded by this many tokens' worth whatever
the batch; at least one row per forward. Large enough that a forward of this many tokens keeps a GPU busy."""

COMPILE_CHOICES = ("cuda", "always", "never")


def _config(model: torch.nn.Module) -> Any:
    return getattr(innermost_model(model), "config", None) or getattr(model, "config", None)


def static_cache_supported(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot decode with :class:`StaticCacheLM` (``None`` when it can): it needs a Hugging Face
    causal LM whose every layer is full attention (no sliding window: :func:`~kdlab.models.loading.windowed_attention`),
    whose forward takes ``logits_to_keep`` and whose attention is ``sdpa`` or ``eager`` (they take the ``(B, 1, Q, L)``
    mask it builds)."""
    config = _config(model)
    if config is None:
        return "the model has no Hugging Face config"
    if (windowed := windowed_attention(config)) is not None:
        return windowed
    if "logits_to_keep" not in forward_parameters(model):
        return "its forward takes no logits_to_keep"
    attention = getattr(config, "_attn_implementation", None) or "sdpa"
    if attention not in ("sdpa", "eager"):
        return f"attention {attention!r} takes no (B, 1, Q, L) mask (sdpa and eager do)"
    return None


class StaticCacheLM:
    """One model decoding a left-padded prompt batch step by step with a preallocated KV cache.

    Args:
        model: a causal LM (put in eval mode by the caller); see :func:`static_cache_supported`.
        input_ids, attention_mask: ``(B, P)`` left-padded prompt.
        token_columns: logits beyond this index (padded embedding rows) are dropped.
        temperature: next-token log-probs are ``log_softmax(logits / temperature)``; 0 gives the untempered
            ``log_softmax(logits)`` (for greedy decoding).
        max_new_tokens: the most tokens any row decodes (the cache holds ``P + max_new_tokens`` positions,
            rounded up to :data:`CACHE_BUCKET`).
        compile: ``"cuda"`` (compile the decode step with CUDA graphs on a CUDA device, eager elsewhere),
            ``"always"`` or ``"never"``.
        prefill_tokens: the most prompt tokens one prefill forward runs (:data:`PREFILL_TOKENS`): more rows
            are prefilled a group at a time (:meth:`_prefill_rows`), on models whose cache takes it (:func:`_writable`).
        share_prefix: prefill the leading tokens every prompt shares once (:func:`shared_prefix`); the
            log-probs are those of the whole prefill up to floating-point rounding (the shared rows' matrix
            products run at another size), greedy decodes identical in the tests.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_columns: int,
        temperature: float,
        max_new_tokens: int,
        compile: str = "cuda",
        share_prefix: bool = True,
        prefill_tokens: int = PREFILL_TOKENS,
    ) -> None:
        if compile not in COMPILE_CHOICES:
            raise ValueError(f"decoder compile must be one of {COMPILE_CHOICES}, got {compile!r}")
        if (why := static_cache_supported(model)) is not None:
            raise ValueError(f"StaticCacheLM cannot decode this model: {why}")
        from transformers import StaticCache

        self.model = model
        self.input_ids = input_ids
        self.attention_mask = attention_mask
        self.token_columns = token_columns
        self.temperature = temperature
        self.cache_argument = cache_argument(model)
        batch, prompt = input_ids.shape
        length = -(-(prompt + max(int(max_new_tokens), 1)) // CACHE_BUCKET) * CACHE_BUCKET
        use_compiled = compile == "always" or (compile == "cuda" and input_ids.device.type == "cuda")
        # eager: the cache hands attention only its filled positions (a captured step needs one shape throughout)
        self.cache = (StaticCache if use_compiled else filled_prefix_cache())(config=_config(model), max_cache_len=length)
        self.prompt_length = prompt
        self.written = prompt  # cache positions filled so far
        # (B, 1, 1, L) mask of the decode steps, True where a step may attend: the prompt's tokens and the tokens
        # decoded so far; one column opens per step, in place. Boolean (SDPA takes it in any compute dtype: bf16
        # under autocast or FSDP mixed precision) unless the model runs eager attention, which adds its mask
        self.additive = getattr(_config(model), "_attn_implementation", "sdpa") == "eager"
        self.step_mask = torch.zeros((batch, 1, 1, length), dtype=torch.bool, device=input_ids.device)
        self.step_mask[:, 0, 0, :prompt] = attention_mask.bool()
        if self.additive:
            self.step_mask = self._additive(self.step_mask)
        _static(self.step_mask)
        self.last_position: torch.Tensor | None = None
        self.step = _compiled_step(input_ids.device.type) if use_compiled else _step
        self.prefix_only = not use_compiled
        self.inference = not use_compiled and not distributed()
        """Whether the model runs under ``torch.inference_mode()`` (the eager path in a process outside any process
        group; :meth:`_no_grad`): on a CPU, where a small model's decode step is a few hundred operator calls, it
        skips autograd's view and version bookkeeping on each. Every tensor it creates stays inside (the cache, the
        mask, the positions) or is read by an ordinary operation (the logits). In a process group (:func:`distributed`)
        the decode keeps ``no_grad``: a sharded model's forward gathers parameters into tensors that training reuses,
        which must not be inference tensors; a captured step keeps it too (one graph per autograd mode, and the GPU
        path is unchanged)."""
        self.prefill_tokens = int(prefill_tokens)
        self.shared = shared_prefix(input_ids, attention_mask) if share_prefix and _writable(self.cache) else 0
        """Leading prompt tokens prefilled once for every row (0: the whole prompt batch is prefilled)."""

    def _prompt_mask(self, rows: slice = slice(None), start: int = 0, length: int | None = None) -> torch.Tensor:
        """``(b, 1, P - start, L')`` mask of the prompt forward of rows ``rows`` over prompt columns ``start ..``:
        causal, padding blocked; ``L'``: ``length`` key columns (default the cache's ``L``)."""
        attention = self.attention_mask[rows]
        batch, prompt = attention.shape
        length = self.step_mask.shape[-1] if length is None else length
        keys = torch.arange(length, device=self.input_ids.device)
        causal = keys[None, :] <= torch.arange(start, prompt, device=self.input_ids.device)[:, None]  # (P - start, L')
        padded = torch.zeros(batch, length, dtype=torch.bool, device=self.input_ids.device)
        padded[:, :prompt] = attention.bool()
        allowed = causal[None, None] & padded[:, None, None, :]
        # a padding position attends to itself, so that no row is all masked (its output is never read)
        allowed[:, 0, :, start:prompt] |= torch.eye(prompt - start, dtype=torch.bool, device=allowed.device)
        return self._additive(allowed) if self.additive else allowed

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """``allowed`` as an additive mask in the model's parameter dtype: 0 where True, its lowest value elsewhere."""
        dtype = next(self.model.parameters()).dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)

    def _logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits[:, -1, : self.token_columns].float()
        if self.temperature > 0 and self.temperature != 1:  # x / 1 is x: one operator call fewer per token at T = 1
            logits = logits / self.temperature
        return torch.log_softmax(logits, dim=-1)

    def _no_grad(self) -> Any:
        """The context every model call and cache edit runs in: ``torch.inference_mode()`` on the eager path outside a
        process group (:attr:`inference`), ``torch.no_grad()`` otherwise."""
        return torch.inference_mode() if self.inference else torch.no_grad()

    def __call__(self, previous: torch.Tensor | None) -> torch.Tensor:
        """Next-token log-probs ``(b, V)`` after feeding ``previous`` ``(b,)`` (None on the first call); ``b`` is
        the rows still in the batch (see :meth:`keep_rows`). Ordinary tensors (not inference tensors) whatever
        :attr:`inference` is: the log-softmax runs outside the model's context."""
        with self._no_grad():
            logits = self._next_logits(previous)
        with torch.no_grad():
            return self._logprobs(logits)

    def _next_logits(self, previous: torch.Tensor | None) -> torch.Tensor:
        """The model's logits ``(b, 1, V')`` at the next position (see :meth:`__call__`)."""
        if previous is None:
            positions = (self.attention_mask.cumsum(dim=1) - 1).clamp(min=0)
            self.last_position = positions[:, -1:]
            start = self._prefill_shared() if self.shared else 0  # prompt columns before it are in the cache
            if self.prefix_only:
                self.cache.filled = self.written
            return self._prefill_rows(start, positions)
        if self.written >= self.step_mask.shape[-1]:
            raise RuntimeError(f"StaticCacheLM: decoded past its cache of {self.step_mask.shape[-1]} positions")
        self.step_mask[:, :, :, self.written] = 0.0 if self.additive else True
        self.written += 1
        self.last_position = self.last_position + 1
        mask = self.step_mask
        if self.prefix_only:
            self.cache.filled = self.written
            mask = mask[..., : self.written]
        return self.step(self.model, previous[:, None], self.last_position, mask, self.cache, self.cache_argument)

    def _prefill_rows(self, start: int, positions: torch.Tensor) -> torch.Tensor:
        """The prompt forward over columns ``start ..`` (the shared prefix, if any, already cached): last-position
        logits ``(B, 1, V')``. At most :attr:`prefill_tokens` tokens per forward: a larger batch runs a group of
        rows at a time, each group's forward writing its own rows of every cache layer (the layers' keys and values
        handed to it as views of those rows, :meth:`_cache_rows`; a layer the first group allocates is widened to
        the whole batch after it). A model whose cache has no such layers (:func:`_writable`) runs the whole batch."""
        batch, prompt = self.input_ids.shape
        rows = max(1, self.prefill_tokens // max(prompt - start, 1)) if _writable(self.cache) else batch
        length = self.written if self.prefix_only else None  # eager: keys over the filled positions only
        logits = []
        for first in range(0, batch, rows):
            group = slice(first, min(first + rows, batch))
            with self._cache_rows(group, start, batch):
                outputs = self.model(input_ids=self.input_ids[group, start:], attention_mask=self._prompt_mask(group, start, length),
                                     position_ids=positions[group, start:], use_cache=True, logits_to_keep=1,
                                     **{self.cache_argument: self.cache})
            logits.append(outputs.logits)
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    @contextlib.contextmanager
    def _cache_rows(self, group: slice, start: int, batch: int):
        """Inside: every initialised cache layer holds rows ``group`` of its keys and values (views: what the forward
        writes lands in the batch's cache) and writes from position ``start``; on leaving, the whole batch's tensors
        again. A layer the forward allocates inside (the first group, no shared prefix) is widened to ``batch`` rows
        on leaving, the group's rows copied in. Nothing changes when ``group`` is every row (one forward)."""
        if group.stop - group.start == batch:
            yield
            return
        whole = {}
        for index, layer in enumerate(self.cache.layers):
            if getattr(layer, "is_initialized", False):
                whole[index] = (layer.keys, layer.values)
                layer.keys, layer.values = layer.keys[group], layer.values[group]
            layer.cumulative_length.fill_(start)
        try:
            yield
        finally:
            for index, layer in enumerate(self.cache.layers):
                if index in whole:
                    layer.keys, layer.values = whole[index]
                elif getattr(layer, "is_initialized", False):  # allocated for this group's rows: widen to the batch
                    keys = layer.keys.new_zeros((batch, *layer.keys.shape[1:]))
                    values = layer.values.new_zeros((batch, *layer.values.shape[1:]))
                    keys[group], values[group] = layer.keys, layer.values
                    layer.keys, layer.values = _static(keys), _static(values)
                    if hasattr(layer, "batch_size"):
                        layer.batch_size = batch
                    if hasattr(layer, "max_batch_size"):
                        layer.max_batch_size = batch

    def _prefill_shared(self) -> int:
        """Run the :attr:`shared` leading tokens as one row, copy their keys and values into every row's cache
        positions (row ``r``'s real tokens start at its padding ``p_r``: positions ``p_r .. p_r + shared - 1``)
        and point every cache layer at the first column the batch's prompt forward still has to run: ``P - (the
        longest prompt - shared)``. Columns of that window that hold shared tokens of a shorter row are computed
        again (and written again); its padding columns attend only to themselves, as in the whole prefill."""
        from transformers import DynamicCache

        batch, prompt = self.input_ids.shape
        lengths = self.attention_mask.sum(dim=1)
        pads = (prompt - lengths).tolist()
        first = self.input_ids[:1, pads[0]: pads[0] + self.shared]
        positions = torch.arange(self.shared, device=first.device)[None]
        prefix = DynamicCache()
        self.model(input_ids=first, position_ids=positions, use_cache=True, logits_to_keep=1, **{self.cache_argument: prefix})
        start = prompt - (int(lengths.max()) - self.shared)
        rows = torch.arange(batch, device=first.device)[:, None]  # (B, 1)
        columns = torch.tensor(pads, device=first.device)[:, None] + positions  # (B, shared): row r's positions
        for layer, source in zip(self.cache.layers, prefix.layers):
            keys, values = source.keys, source.values  # (1, heads, shared, head_dim)
            if not layer.is_initialized:
                layer.lazy_initialization(keys.expand(batch, -1, -1, -1), values.expand(batch, -1, -1, -1))
            # one write per layer and tensor: [rows, :, columns] indexes (B, shared, heads, head_dim)
            layer.keys[rows, :, columns] = keys[0].transpose(0, 1).expand(batch, -1, -1, -1)
            layer.values[rows, :, columns] = values[0].transpose(0, 1).expand(batch, -1, -1, -1)
            layer.cumulative_length.fill_(start)
        return start

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only rows ``rows`` (indices into the current batch, in the order given) from now on: the cache,
        the mask and the positions of every other row are dropped."""
        with self._no_grad():
            self._keep_rows(rows)

    def _keep_rows(self, rows: torch.Tensor) -> None:
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", True) and getattr(layer, "keys", None) is not None:
                layer.keys = _static(layer.keys.index_select(0, rows))
                layer.values = _static(layer.values.index_select(0, rows))
                if hasattr(layer, "max_batch_size"):
                    layer.max_batch_size = len(rows)
        self.step_mask = _static(self.step_mask.index_select(0, rows))
        self.last_position = self.last_position.index_select(0, rows)


def distributed() -> bool:
    """Whether this process is one of a process group (``torch.distributed`` initialised): a model's forward may then
    gather sharded parameters (FSDP1, FSDP2), whether or not the decoder can see them (a teacher that calls the
    student's FSDP root, holding it as no submodule of its own)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def shared_prefix(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """The leading real tokens every row of a left-padded ``(B, P)`` batch has in common, at most the shortest
    prompt less one (each row keeps a token of its own to prefill); 0 for one row, for a mask that is not left
    padding, or below :data:`SHARED_PREFIX_MIN`."""
    batch, prompt = input_ids.shape
    lengths = attention_mask.sum(dim=1)
    columns = torch.arange(prompt, device=input_ids.device)
    if batch < 2 or not torch.equal(attention_mask.bool(), columns[None, :] >= (prompt - lengths)[:, None]):
        return 0
    shortest = int(lengths.min())
    aligned = input_ids.gather(1, (prompt - lengths)[:, None] + columns[None, :shortest])  # (B, shortest): real tokens
    common = int((aligned == aligned[:1]).all(dim=0).long().cumprod(dim=0).sum())
    shared = min(common, shortest - 1)
    return shared if shared >= SHARED_PREFIX_MIN else 0


def _writable(cache: Any) -> bool:
    """Whether the shared prefix can be written into ``cache`` directly: static layers that write where their
    ``cumulative_length`` points (transformers 5; older layers take a ``cache_position`` and prefill whole)."""
    return all(hasattr(layer, "cumulative_length") and hasattr(layer, "lazy_initialization") for layer in getattr(cache, "layers", [None]))


@functools.cache
def filled_prefix_cache() -> type:
    """``StaticCache`` whose ``update`` returns only the first ``filled`` positions of each layer's keys and values
    (views, no copy), so an eager decode step attends over the tokens so far rather than the whole preallocated
    length, while still writing in place (no concatenation per token, as a growing cache does). Built on first use:
    transformers is imported lazily."""
    from transformers import StaticCache

    class FilledPrefixCache(StaticCache):
        filled: int | None = None

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
            if self.filled is None:
                return keys, values
            return keys[:, :, : self.filled], values[:, :, : self.filled]

    return FilledPrefixCache


def _static(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, marked as living at one address for as long as it is used (as ``StaticCache`` marks its own):
    a captured step reads it in place instead of copying it into the graph every step."""
    torch._dynamo.mark_static_address(tensor)
    return tensor


def _step(model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Any,
          cache_arg: str) -> torch.Tensor:
    """One decode step: logits ``(b, 1, V)`` of tokens ``(b, 1)`` at positions ``(b, 1)`` under ``mask``."""
    return model(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True,
                 logits_to_keep=1, **{cache_arg: cache}).logits


_COMPILED: dict[str, Any] = {}


def _compiled_step(device_type: str) -> Any:
    """:func:`_step` compiled once per device type (CUDA graphs on CUDA: ``mode="reduce-overhead"``), with
    dynamo's automatic dynamic shapes: a model's first decode compiles for its batch and cache length, and a later
    shape compiles once more for each of those sizes first seen to change (then symbolic), so at most three
    compilations per model (batch and cache length); every later shape reuses them (on CUDA a new shape records one
    more CUDA graph, no new compilation). Static shapes (``dynamic=False``) compiled once per
    batch size and model: rows leaving the batch (:meth:`StaticCacheLM.keep_rows`) and two models (a student
    and a teacher) reached dynamo's recompile limit (8 per code object) within one decode section of
    ``benchmarks/gpu.py``, after which the step ran eagerly, slower than Hugging Face ``generate``."""
    if device_type not in _COMPILED:
        mode = "reduce-overhead" if device_type == "cuda" else None
        _COMPILED[device_type] = torch.compile(_step, mode=mode, dynamic=None)
    return _COMPILED[device_type]
