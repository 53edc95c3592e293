"""Precomputed teacher outputs for off-policy runs: the teacher's top-k log-probs at every completion
position, stored once, so distillation never has to hold the teacher in training memory.

Written by ``kdlab generate ... --top_k K`` next to the teacher dataset (``<output>.topk.safetensors``)
and read by ``CachedTeacherRollouts(dataset=..., teacher_cache=...)``. The file is safetensors (no pickle)
with metadata ``top_k``, ``temperature``, ``token_columns`` (the columns ``V`` of the distributions: the
student's and teacher's shared tokens, ``DistillModule.token_columns``), ``teacher`` and ``teacher_prompts``:
a JSON object giving, per example id, the SHA-256 of the teacher prompt's token ids its log-probs follow
(:func:`prompt_digest`), so that a run whose teacher prompt differs (another ``teacher_system_prompt``, chat
template or tokenizer) is refused rather than trained on another prompt's log-probs. A file without it (every
kdlab before the prompts were recorded wrote one) is refused, naming the file and how to rebuild it: nothing in
it tells which prompts its log-probs follow. Per example id the file holds the completion tokens the rollouts
will use (end token included), ``C`` of them, and at each the teacher's k most likely tokens and their
log-probs under ``softmax(z_T / temperature)``, in one of two formats (``cache_format`` of :func:`write_cache`
and of ``kdlab generate``):

* ``compact`` (metadata ``format: compact-v1``; the default): one uint8 tensor ``<id>/rows``: the ids
  Rice-coded, each row's largest log-prob in fp32 and every other entry as a ``logprob_bits``-bit code
  (:mod:`kdlab.rollouts.cache_codec` gives the layout and the bound on the rounding; docs/benchmarks.md
  the sizes). ``logprob_bits`` is the most (up to 16) that keep the file within 300 bytes per token,
  unless given.
* ``full`` (no ``format`` key, what every kdlab before the compact format wrote): ``<id>/tokens``
  ``(C,)`` int64, ``<id>/indices`` ``(C, k)`` int64 and ``<id>/logprobs`` ``(C, k)`` fp32, 12 bytes per
  entry, the log-probs exactly: with ``k = V`` this is the teacher exactly (the compact format with
  ``k = V`` stores all V entries too, rounded).

:meth:`TeacherCache.row` reads both the same way.

**How full-vocabulary objectives treat a top-k teacher.** The cached teacher is the distribution that
keeps the k cached probabilities exactly and spreads the remaining mass ``1 - sum_k p_T`` uniformly over
the other ``V - k`` tokens (:func:`expand_topk`). It is a proper distribution, so every objective
(forward/reverse KL, JSD, TV, the sampled estimators) is well defined and unchanged in code; with
``k = V`` it is the teacher exactly. A batch of it is a :class:`TopKLogprobs`: ``(B, C, k)`` in memory,
expanded to ``(chunk, V)`` rows only inside the objectives' chunk loop. The forward KL then differs from the exact one only through the tail
(``sum_tail p_T log p_T`` terms and how the tail's student mass is weighted), which vanishes as the
tail mass does; the diagnostics ``train/kl_forward`` etc. are computed against the same distribution.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kdlab.objectives.lazy import LazyLogits
from kdlab.rollouts import cache_codec as codec
from kdlab.rollouts.cache_codec import LogprobMap

MAX_TOKEN_COLUMNS = 1 << 24
"""The most token columns a cache file may declare (16.8 million; vocabularies are below a million)."""
TAIL_FLOOR = 1e-6
"""Smallest tail mass used: keeps the expanded log-probs finite when the top k hold (almost) all mass. The
tail is ``1 - sum`` of k fp32 probabilities, known only to about 1e-7 (the log-probs' own rounding), so a
smaller floor would let rounding set the tail tokens' log-probs (between ``log(1e-12)`` and ``log(2e-7)``
when it was 1e-12, which moved a reverse KL by 1e-2 nats between two roundings of one teacher)."""
REBUILD = "rebuild it with `kdlab generate --config <your generate config> --top_k K` (it writes <output>.topk.safetensors)"


def prompt_digest(prompt: Sequence[int]) -> str:
    """The SHA-256 (64 hex digits) of a teacher prompt's token ids, each as a little-endian int64."""
    return hashlib.sha256(b"".join(int(token).to_bytes(8, "little", signed=True) for token in prompt)).hexdigest()


def is_digest(value: Any) -> bool:
    """Whether ``value`` is a :func:`prompt_digest`: 64 lowercase hex digits."""
    return isinstance(value, str) and re.fullmatch("[0-9a-f]{64}", value) is not None


def top_k_logprobs(logits: torch.Tensor, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens ``(..., k)`` (int64) and their log-probs ``(..., k)`` (fp32) under
    ``log_softmax(logits / temperature)`` of ``logits`` ``(..., V)``."""
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"top_k must be in [1, {logits.shape[-1]}], got {k}")
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    values, indices = logprobs.topk(k, dim=-1)
    return indices, values


def expand_topk(indices: torch.Tensor, logprobs: torch.Tensor, token_columns: int) -> torch.Tensor:
    """Full log-probs ``(..., V)``: the cached ``k`` exactly, the remaining mass spread evenly over the
    other ``V - k`` tokens (see the module docstring). Rows sum to 1 (up to ``TAIL_FLOOR`` when the top k
    already hold everything)."""
    k = indices.shape[-1]
    if k == token_columns:
        full = torch.empty(*indices.shape[:-1], token_columns, dtype=torch.float32, device=logprobs.device)
        return full.scatter_(-1, indices.long(), logprobs.float())
    tail = (1.0 - logprobs.float().exp().sum(-1, keepdim=True)).clamp(min=TAIL_FLOOR)
    fill = torch.log(tail) - math.log(token_columns - k)
    full = fill.expand(*indices.shape[:-1], token_columns).clone()
    return full.scatter_(-1, indices.long(), logprobs.float())


class TopKLogprobs(LazyLogits):
    """The cached teacher of a batch, ``(B, C, V)`` log-probs held as its top k: ``indices`` ``(B, C, k)``
    (int64) and ``logprobs`` ``(B, C, k)`` (fp32). Objectives expand one chunk of rows at a time with
    :func:`expand_topk`, so the dense ``(B, C, V)`` teacher is never built (on the host or the device).

    Positions past a row's cached length (padding) stand for the uniform distribution."""

    def __init__(self, indices: torch.Tensor, logprobs: torch.Tensor, token_columns: int) -> None:
        if indices.shape != logprobs.shape or indices.dim() != 3:
            raise ValueError(f"TopKLogprobs: indices and logprobs must both be (B, C, k), got {tuple(indices.shape)}, {tuple(logprobs.shape)}")
        if indices.shape[-1] > token_columns:
            raise ValueError(f"TopKLogprobs: k = {indices.shape[-1]} exceeds the token columns ({token_columns})")
        self.indices, self.logprobs, self.token_columns = indices.long(), logprobs.float(), token_columns

    @classmethod
    def from_rows(cls, rows: list[tuple[torch.Tensor, torch.Tensor]], length: int, k: int, token_columns: int) -> TopKLogprobs:
        """Stack per-example ``(indices (n_i, k), logprobs (n_i, k))`` into ``(B, length, k)``; padding
        holds k tokens at ``log(1/V)`` each, which :func:`expand_topk` turns into the uniform distribution."""
        indices = torch.arange(k).expand(len(rows), length, k).clone()
        logprobs = torch.full((len(rows), length, k), -math.log(token_columns))
        for row, (row_indices, row_logprobs) in enumerate(rows):
            indices[row, : row_indices.shape[0]] = row_indices
            logprobs[row, : row_logprobs.shape[0]] = row_logprobs
        return cls(indices, logprobs, token_columns)

    def select(self, rows: list[int], length: int) -> TopKLogprobs:
        """The cached teacher of ``rows``, its first ``length`` positions (see :meth:`kdlab.data.Rollout.split`)."""
        index = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        return TopKLogprobs(self.indices[index][:, :length], self.logprobs[index][:, :length], self.token_columns)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.indices.shape[:2], self.token_columns))

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self.indices.device

    def rows(self, b: torch.Tensor, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        b, t = b.to(self.device), t.to(self.device)
        return expand_topk(self.indices[b, t], self.logprobs[b, t], self.token_columns).to(dtype)

    def detach(self) -> TopKLogprobs:
        return self

    def tail_mass(self) -> torch.Tensor:
        """``(B, C)``: the probability outside each position's top k, ``1 - sum(exp(logprobs))``, which
        :func:`expand_topk` spreads evenly over the other ``V - k`` tokens (0 when ``k = V``)."""
        return (1.0 - self.logprobs.exp().sum(-1)).clamp(min=0.0)

    def summary(self, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """``teacher_tail_mass``: the mean :meth:`tail_mass` over the positions of ``mask`` ``(B, C)``: how much of the
        teacher's distribution the KLs against this top-k teacher see only as an even spread."""
        mask = mask.to(self.device).bool()
        if tuple(mask.shape) != tuple(self.logprobs.shape[:2]):
            raise ValueError(f"TopKLogprobs.summary: a mask of {tuple(mask.shape)} positions for a teacher of {tuple(self.logprobs.shape[:2])}")
        return {"teacher_tail_mass": self.tail_mass()[mask].mean()} if mask.any() else {}

    def to(self, device: torch.device | str) -> TopKLogprobs:
        return TopKLogprobs(self.indices.to(device), self.logprobs.to(device), self.token_columns)

    def dense(self) -> torch.Tensor:
        """The full ``(B, C, V)`` log-probs (for tests and small vocabularies only)."""
        return expand_topk(self.indices, self.logprobs, self.token_columns)


CACHE_FORMATS = ("compact", "full")


def write_cache(
    path: str | Path, rows: dict[str, dict[str, torch.Tensor]], metadata: dict[str, Any], cache_format: str = "compact",
    logprob_bits: int | None = None,
) -> None:
    """Write ``{id: {"tokens", "indices", "logprobs", "prompt_sha256"}}`` and ``metadata`` (``top_k``,
    ``temperature``, ``token_columns``, ``teacher``) to a safetensors file (to a temporary name first, then
    renamed), in ``cache_format`` (module docstring); ``prompt_sha256`` is :func:`prompt_digest` of the teacher
    prompt the example's log-probs follow, all of them written to the metadata's ``teacher_prompts``. ``logprob_bits``: the compact format's bits per log-prob; ``None``
    takes the most (up to 16) that keep the file within :data:`~kdlab.rollouts.cache_codec.BYTES_PER_TOKEN`
    bytes per completion token."""
    from safetensors.torch import save_file

    if cache_format not in CACHE_FORMATS:
        raise ValueError(f"cache_format must be one of {CACHE_FORMATS}, got {cache_format!r}")
    for example_id, row in rows.items():
        if "/" in example_id:
            raise ValueError(f"teacher cache: example id {example_id!r} contains '/'")
        if not is_digest(row.get("prompt_sha256")):
            raise ValueError(f"teacher cache: example {example_id!r} has no prompt_sha256 (prompt_digest of the teacher prompt its "
                             "log-probs follow)")
    prompts = json.dumps({example_id: row["prompt_sha256"] for example_id, row in rows.items()}, separators=(",", ":"))
    metadata = {**{key: str(value) for key, value in metadata.items()}, "teacher_prompts": prompts}
    if cache_format == "full":
        tensors = {f"{example_id}/{name}": row[name].to(dtype).contiguous() for example_id, row in rows.items()
                   for name, dtype in (("tokens", torch.int64), ("indices", torch.int64), ("logprobs", torch.float32))}
    else:
        columns, k = int(metadata.get("token_columns", 0)), int(metadata["top_k"])
        r = codec.rice_parameter(columns, k)
        for example_id, row in rows.items():
            if row["indices"].dim() != 2 or row["indices"].shape[-1] != k:
                raise ValueError(f"teacher cache: example {example_id!r} has indices {tuple(row['indices'].shape)}, not (C, {k}) for top_k {k}")

        def encode(bits: int) -> dict[str, torch.Tensor]:
            logprob_map = LogprobMap(bits)
            metadata.update(codec.metadata(columns, k, logprob_map))
            return {i: codec.encode_example(row["tokens"], row["indices"], row["logprobs"], columns, r, logprob_map) for i, row in rows.items()}

        if logprob_bits is None:  # the sizes without the codes, from the smallest codes
            entries = {i: row["indices"].numel() for i, row in rows.items()}
            sizes = {f"{i}/rows": (data.numel() - -(-entries[i] * codec.MIN_BITS // 8), entries[i]) for i, data in encode(codec.MIN_BITS).items()}
            logprob_bits = codec.choose_bits(sizes, sum(row["tokens"].numel() for row in rows.values()), metadata)
        tensors = {f"{i}/rows": data for i, data in encode(logprob_bits).items()}
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    save_file(tensors, str(partial), metadata=metadata)
    partial.replace(path)


class TeacherCache:
    """A cache file opened for reading (lazily, tensor by tensor), in either format.

    Raises naming ``setting`` and the file when it is missing or not a kdlab teacher cache."""

    def __init__(self, path: str, setting: str = "CachedTeacherRollouts.teacher_cache") -> None:
        from safetensors import safe_open

        if not Path(path).is_file():
            raise FileNotFoundError(f"{setting}: no such file {path!r} (write one with `kdlab generate ... --top_k K`)")
        try:
            self._file = safe_open(path, framework="pt")
            metadata = self._file.metadata() or {}
        except Exception as error:  # safetensors raises its own error types for a corrupt header
            raise ValueError(f"{setting} {path!r}: not a readable safetensors file ({error})") from error
        if "top_k" not in metadata or "temperature" not in metadata:
            raise ValueError(f"{setting} {path!r}: not a kdlab teacher cache (metadata lacks "
                             f"{[key for key in ('top_k', 'temperature') if key not in metadata]})")
        if "teacher_prompts" not in metadata:
            raise ValueError(f"{setting} {path!r}: written without the teacher prompts its log-probs follow (by a kdlab before "
                             f"caches recorded them), so nothing tells whether they are this run's; {REBUILD}")
        try:
            self.prompts = json.loads(metadata["teacher_prompts"])
        except ValueError:
            self.prompts = None
        if not (isinstance(self.prompts, dict) and all(map(is_digest, self.prompts.values()))):
            raise ValueError(f"{setting} {path!r}: corrupt metadata (teacher_prompts: not a JSON object of SHA-256 digests)")
        if "token_columns" not in metadata:
            raise ValueError(f"{setting} {path!r}: not a kdlab teacher cache (metadata lacks ['token_columns'])")
        self.path, self.setting = path, setting
        try:
            self.top_k, self.temperature = int(metadata["top_k"]), float(metadata["temperature"])
            self.token_columns, self.teacher = int(metadata["token_columns"]), metadata.get("teacher", "?")
        except ValueError as error:
            raise ValueError(f"{setting} {path!r}: corrupt metadata ({error})") from None
        if not (1 <= self.token_columns <= MAX_TOKEN_COLUMNS and 1 <= self.top_k <= self.token_columns):
            raise ValueError(f"{setting} {path!r}: corrupt metadata (top_k {self.top_k}, token_columns {self.token_columns}: "
                             f"need 1 <= top_k <= token_columns <= {MAX_TOKEN_COLUMNS})")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"{setting} {path!r}: corrupt metadata (temperature {self.temperature})")
        self.format = metadata.get("format", "full")
        if self.format not in ("full", codec.FORMAT):
            raise ValueError(f"{setting} {path!r}: unknown teacher cache format {self.format!r} (this kdlab reads "
                             f"{codec.FORMAT!r} and files without a format key); rebuild the cache or update kdlab")
        if self.format == codec.FORMAT:
            self.rice_r, self.logprob_map = codec.read_metadata(metadata, f"{setting} {path!r}")
            if self.rice_r != codec.rice_parameter(self.token_columns, self.top_k):
                raise ValueError(f"{setting} {path!r}: corrupt {codec.FORMAT} metadata (rice_r {self.rice_r}, not the "
                                 f"{codec.rice_parameter(self.token_columns, self.top_k)} of top_k {self.top_k} over {self.token_columns} columns)")
        self.ids = {key.rsplit("/", 1)[0] for key in self._file.keys()}

    def row(self, example_id: str, tokens: list[int], prompt: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indices, logprobs)`` ``(len(tokens), k)`` (int64, fp32) for ``example_id``'s first ``len(tokens)``
        positions, after checking that the cache was computed on those very tokens, after the teacher prompt
        ``prompt`` (its token ids, without padding)."""
        if example_id not in self.ids:
            raise KeyError(f"{self.setting} {self.path}: no entry for example id {example_id!r}")
        n = len(tokens)
        if self.format == "full":
            try:
                cached, indices, logprobs = (self._file.get_tensor(f"{example_id}/{name}") for name in ("tokens", "indices", "logprobs"))
                codec.check_full_rows(cached, indices, logprobs, self.top_k, self.token_columns)
            except Exception as error:  # a missing tensor (safetensors' own error type), or one that fails the checks
                raise ValueError(f"{self.setting} {self.path}: example {example_id!r} is not readable as a full teacher cache ({error})") from error
            self._check_tokens(example_id, cached, tokens)
            self._check_prompt(example_id, prompt)
            return indices[:n].long(), logprobs[:n].float()
        args = (self.top_k, self.token_columns, self.rice_r, self.logprob_map)
        try:
            data = self._file.get_tensor(f"{example_id}/rows")
            cached = codec.decode_tokens(data, *args)
        except Exception as error:  # a missing tensor (safetensors' own error type) or one too short
            raise ValueError(f"{self.setting} {self.path}: example {example_id!r} is not readable as {codec.FORMAT} ({error})") from error
        self._check_tokens(example_id, cached, tokens)
        try:
            decoded = codec.decode_rows(data, n, *args)
        except ValueError as error:
            raise ValueError(f"{self.setting} {self.path}: example {example_id!r} is not readable as {codec.FORMAT} ({error})") from error
        self._check_prompt(example_id, prompt)
        return decoded

    def _check_prompt(self, example_id: str, prompt: Sequence[int]) -> None:
        if example_id not in self.prompts:
            raise ValueError(f"{self.setting} {self.path}: example {example_id!r} has no digest in the metadata's teacher_prompts; {REBUILD}")
        if self.prompts[example_id] != prompt_digest(prompt):
            raise ValueError(
                f"{self.setting} {self.path}: example {example_id!r} was cached after another teacher prompt than this run gives "
                f"(a changed teacher_system_prompt, chat template or teacher tokenizer?); {REBUILD}"
            )

    def _check_tokens(self, example_id: str, cached: torch.Tensor, tokens: list[int]) -> None:
        if len(tokens) > cached.numel() or cached[: len(tokens)].tolist() != list(tokens):
            raise ValueError(
                f"{self.setting} {self.path}: example {example_id!r} was cached on other completion tokens than the "
                "dataset gives now (a different dataset, tokenizer or max length?); rebuild the cache"
            )
