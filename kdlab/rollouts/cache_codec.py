"""The compact teacher cache format (``compact-v1``): an example's completion tokens and top-k rows in
about ``k (r + 2 + b) / 8 + 8 + w / 8`` bytes per token (below) instead of the full format's ``12 k + 8``.

Each example is one uint8 tensor ``<id>/rows`` (:func:`encode_example`), little-endian, its sections
byte-aligned, in this order:

* ``C`` (uint32): the number of positions (rows).
* ``max``, ``rest`` (``C`` fp32 each): each row's largest log-prob, exactly as given, and the log of the
  total probability of its other ``k - 1`` entries (computed in float64 at write time).
* ``tokens``: the ``C`` completion tokens, ``w = bit_length(V - 1)`` bits each.
* ``codes``: every entry's log-prob code, ``b`` bits each, in id order (below).
* ``remainders`` and ``unary``: the token ids. Each row is sorted by id and written as gaps (the first id,
  then the differences, all ``>= 0``), Rice-coded with one parameter ``r = max(0, floor(log2(V / k)))``
  per file: gap ``g`` is its ``r`` low bits in ``remainders`` (a fixed-width block) and its quotient
  ``g >> r`` in unary (that many one bits, then a zero bit) in ``unary``, one stream for all rows. A row's
  gaps sum to at most ``V - 1 < k 2^(r+1)``, so a row takes at most ``k (r + 3)`` bits; uniformly spread
  ids take ``k (r + 1 + 1 / (exp(2^r (k + 1) / V) - 1))``, between ``k (r + 1.6)`` and ``k (r + 2.6)``.
  Decoding is vectorised: the zero bits' positions (``nonzero``) give every quotient at once (their
  differences), a ``cumsum`` the ids.

**Log-probs.** The row's largest entry (one, if several tie) has code 0 and decodes to ``m`` exactly.
Each other entry ``i`` is stored as the code of ``u_i = m - logprob_i >= 0`` on a compressive map
(:class:`LogprobMap`): ``code = 1 + round(A log1p(min(u, U) / u0))``, ``A = (2^b - 2) / log1p(U / u0)``,
decoded as ``u0 expm1((code - 1) / A)``: fine where the probability is (``u`` near 0), coarse far down the
row. The decoded other entries are then scaled by one factor ``lambda`` per row so that their
probabilities sum to ``exp(rest)`` again: the mass left to the tail (``1 - sum_k p``, which :func:`~kdlab.rollouts.teacher_cache.expand_topk`
spreads over the other ``V - k`` tokens, and which reverse KL weighs by the student's mass there) is
the uncompressed row's, not shifted by rounding errors of the large entries.

**Worst-case log-prob error**, per entry, as a function of its ``u``: ``beta(u) = (u0 + u) (exp(1 / (2A))
- 1)`` for ``u <= U`` (the code is the rounded ``A log1p(u / u0)``, so ``(u0 + u_decoded) / (u0 + u)``
lies within ``exp(+-1 / (2A))``) and ``u - U`` for ``u > U`` (decoded as ``u = U``: the log-prob is
overstated, the probability by at most ``exp(m - U)``); plus the row's ``|log lambda|``, which is at most
``max(log(S / sum_i p_i exp(-beta_i)), log(sum_i p_i exp(beta_i) / S))`` over the row's other entries
(``S = sum_i p_i``; never more than their largest ``beta``); plus fp32 rounding.
:meth:`LogprobMap.error_bound` gives ``beta``, :func:`renormalisation_bound` the row's term.

Rows decode in rank order (code ascending, ties by id), the order ``top_k`` writes. The file's metadata
holds ``format: compact-v1``, ``rice_r``, ``logprob_bits`` (``b``), ``logprob_u0`` and ``logprob_clip``
(``U``) next to the cache's own keys; :func:`read_metadata` checks them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

FORMAT = "compact-v1"
DEFAULT_U0, DEFAULT_CLIP = 1.0, 64.0
"""The map's defaults, chosen from the measurements of ``benchmarks/cache_size.py`` (docs/benchmarks.md)."""
MIN_BITS, MAX_BITS = 4, 16
BYTES_PER_TOKEN = 300
"""The file size per completion token that :func:`choose_bits` aims at (issue #28: at most 300 at k = 128)."""


def rice_parameter(token_columns: int, k: int) -> int:
    """``max(0, floor(log2(V / k)))``, in integers."""
    if not 1 <= k <= token_columns:
        raise ValueError(f"top_k must be in [1, {token_columns}] (the token columns), got {k}")
    return (token_columns // k).bit_length() - 1


def token_bits(token_columns: int) -> int:
    return max(1, (token_columns - 1).bit_length())


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Zeros and ones ``(L,)`` -> uint8 ``(ceil(L / 8),)``, most significant bit first, zero-padded."""
    bits = bits.to(torch.uint8).flatten()
    padded = torch.zeros(-(-bits.numel() // 8) * 8, dtype=torch.uint8)
    padded[: bits.numel()] = bits
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
    return (padded.view(-1, 8) * weights).sum(-1, dtype=torch.uint8)


def unpack_bits(data: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_bits`, padding included: uint8 zeros and ones ``(8 len(data),)``."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8)
    return ((data.to(torch.uint8)[:, None] >> shifts) & 1).flatten()


def pack_fixed(values: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative integers ``(N,)``, each below ``2^width``, as ``width`` bits each, packed."""
    shifts = torch.arange(width - 1, -1, -1, dtype=torch.int64)
    return pack_bits((values.long().flatten()[:, None] >> shifts) & 1)


def unpack_fixed(data: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """The first ``count`` values (int64) of :func:`pack_fixed`'s ``data``."""
    if width == 0 or count == 0:
        return torch.zeros(count, dtype=torch.int64)
    bits = unpack_bits(data[: -(-count * width // 8)])[: count * width]
    if bits.numel() < count * width:
        raise ValueError(f"a {width}-bit block holds fewer than {count} values")
    weights = 2 ** torch.arange(width - 1, -1, -1, dtype=torch.int64)
    return (bits.view(count, width).long() * weights).sum(-1)


@dataclass(frozen=True)
class LogprobMap:
    """The ``b``-bit code of ``u = max - logprob`` of an entry other than the row's max (which has code 0):
    ``1 + round(A log1p(min(u, U) / u0))``, ``A = (2^b - 2) / log1p(U / u0)`` (the module docstring gives
    the error bound)."""

    bits: int
    u0: float = DEFAULT_U0
    clip: float = DEFAULT_CLIP

    def __post_init__(self) -> None:
        if not (isinstance(self.bits, int) and MIN_BITS <= self.bits <= MAX_BITS):
            raise ValueError(f"logprob_bits must be an integer in [{MIN_BITS}, {MAX_BITS}], got {self.bits!r}")
        if not (math.isfinite(self.u0) and math.isfinite(self.clip) and 0 < self.u0 and 0 < self.clip):
            raise ValueError(f"logprob_u0 and logprob_clip must be finite and > 0, got {self.u0!r}, {self.clip!r}")

    @property
    def scale(self) -> float:
        """``A``: codes per unit of ``log1p(u / u0)``."""
        return (2**self.bits - 2) / math.log1p(self.clip / self.u0)

    def encode(self, u: torch.Tensor) -> torch.Tensor:
        """Codes (int64, ``1 .. 2^b - 1``) of ``u >= 0`` (float64 arithmetic; ``inf`` clips to ``U``)."""
        clipped = u.double().clamp(min=0.0, max=self.clip)
        return 1 + torch.round(self.scale * torch.log1p(clipped / self.u0)).long().clamp(0, 2**self.bits - 2)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """``u`` (float64) of ``codes``; code 0 (the row's max) is 0 exactly."""
        return torch.where(codes == 0, 0.0, self.u0 * torch.expm1((codes.double() - 1).clamp(min=0) / self.scale))

    def error_bound(self, u: torch.Tensor) -> torch.Tensor:
        """``beta(u)``: the largest ``|decode(encode(u)) - u|`` (float64), renormalisation and fp32 aside."""
        u = u.double()
        return torch.where(u <= self.clip, (self.u0 + u) * math.expm1(0.5 / self.scale), u - self.clip)

    def metadata(self) -> dict[str, str]:
        return {"logprob_bits": str(self.bits), "logprob_u0": repr(self.u0), "logprob_clip": repr(self.clip)}


def renormalisation_bound(logprobs: torch.Tensor, logprob_map: LogprobMap) -> torch.Tensor:
    """The bound on each row's ``|log lambda|`` (module docstring) from its exact log-probs ``(C, k)``."""
    lp = logprobs.double().sort(dim=-1, descending=True).values
    if lp.shape[-1] < 2:
        return torch.zeros(lp.shape[0], dtype=torch.float64)
    rest = lp[:, 1:]
    beta = logprob_map.error_bound(lp[:, :1] - rest)
    total = torch.logsumexp(rest, -1)
    return torch.maximum(total - torch.logsumexp(rest - beta, -1), torch.logsumexp(rest + beta, -1) - total)


def metadata(token_columns: int, k: int, logprob_map: LogprobMap) -> dict[str, str]:
    """The format's metadata keys for a cache of ``k`` entries over ``token_columns``."""
    return {"format": FORMAT, "rice_r": str(rice_parameter(token_columns, k)), **logprob_map.metadata()}


def read_metadata(values: dict[str, str], where: str) -> tuple[int, LogprobMap]:
    """``(r, map)`` of a compact file's metadata; raises naming ``where`` (setting and file) when a key is
    missing or out of range."""
    try:
        r = int(values["rice_r"])
        logprob_map = LogprobMap(int(values["logprob_bits"]), float(values["logprob_u0"]), float(values["logprob_clip"]))
    except (KeyError, ValueError) as error:
        raise ValueError(f"{where}: corrupt {FORMAT} metadata ({error})") from error
    if not 0 <= r <= 40:
        raise ValueError(f"{where}: corrupt {FORMAT} metadata (rice_r = {r})")
    return r, logprob_map


def header_bytes(sizes: dict[str, int], metadata: dict[str, str]) -> int:
    """An upper bound on the safetensors header (length prefix included) of uint8 tensors ``{key: bytes}``
    and ``metadata``."""
    digits = len(str(sum(sizes.values())))
    tensors = sum(len(json.dumps(key)) + len('{"dtype":"U8","shape":[],"data_offsets":[,]},') + 3 * digits + 1 for key in sizes)
    return 8 + tensors + len(json.dumps({"__metadata__": metadata})) + 8


def choose_bits(sizes: dict[str, tuple[int, int]], tokens: int, metadata: dict[str, str], budget: float = BYTES_PER_TOKEN) -> int:
    """The most bits per log-prob (``MIN_BITS`` .. ``MAX_BITS``) for which a file of examples ``{key: (bytes
    without codes, entries)}`` and ``metadata`` stays within ``budget`` bytes per token (``MIN_BITS`` when
    none does)."""
    for bits in range(MAX_BITS, MIN_BITS, -1):
        total = {key: fixed + -(-entries * bits // 8) for key, (fixed, entries) in sizes.items()}
        if sum(total.values()) + header_bytes(total, {**metadata, "logprob_bits": str(bits)}) <= budget * tokens:
            return bits
    return MIN_BITS


def _as_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.contiguous().view(torch.uint8).flatten()


def encode_example(tokens: torch.Tensor, indices: torch.Tensor, logprobs: torch.Tensor, token_columns: int, r: int,
                   logprob_map: LogprobMap) -> torch.Tensor:
    """One example's ``tokens`` ``(C,)`` and top-k ``indices`` / ``logprobs`` ``(C, k)`` as one uint8 tensor
    (the layout of the module docstring)."""
    if indices.shape != logprobs.shape or indices.dim() != 2 or indices.shape[0] != tokens.numel():
        raise ValueError(f"teacher cache: indices and logprobs must both be (C, k) for C = {tokens.numel()} tokens, "
                         f"got {tuple(indices.shape)}, {tuple(logprobs.shape)}")
    tokens, indices, logprobs = tokens.cpu().long(), indices.cpu().long(), logprobs.cpu().float()
    for name, values in (("token ids", indices), ("completion tokens", tokens)):
        if values.numel() and (int(values.min()) < 0 or int(values.max()) >= token_columns):
            raise ValueError(f"teacher cache: {name} must lie in [0, {token_columns}), got {int(values.min())}..{int(values.max())}")
    ids, order = indices.sort(dim=-1, stable=True)
    gaps = ids.diff(dim=-1, prepend=torch.zeros_like(ids[:, :1])).flatten()
    quotients = gaps >> r
    unary = torch.ones(int(quotients.sum()) + gaps.numel(), dtype=torch.uint8)
    unary[torch.cumsum(quotients + 1, 0) - 1] = 0
    top, argmax = logprobs.max(dim=-1) if logprobs.numel() else (torch.zeros(logprobs.shape[0]), torch.zeros(logprobs.shape[0], dtype=torch.long))
    if not bool(torch.isfinite(top).all()) or bool(torch.isnan(logprobs).any()):
        raise ValueError("teacher cache: a log-prob is NaN, or a row's largest log-prob is not finite")
    others = logprobs.double().scatter(-1, argmax[:, None], -math.inf)
    rest = torch.logsumexp(others, -1).float() if logprobs.shape[-1] > 1 else torch.full_like(top, -math.inf)
    codes = logprob_map.encode(top.double()[:, None] - logprobs.gather(-1, order).double())
    codes.scatter_(-1, order.argsort(dim=-1).gather(-1, argmax[:, None]), 0)  # the max, where it sits in id order
    sections = [
        _as_bytes(torch.tensor([tokens.numel()], dtype=torch.int32)), _as_bytes(top), _as_bytes(rest),
        pack_fixed(tokens, token_bits(token_columns)), pack_fixed(codes, logprob_map.bits),
        pack_fixed(gaps & ((1 << r) - 1), r), pack_bits(unary),
    ]
    return torch.cat(sections)


LOGPROB_TOLERANCE = 1e-3
"""How far above 0 a stored log-prob may lie (fp32 rounding of a softmax); past it a file is refused."""


def _layout(data: torch.Tensor, k: int, token_columns: int, r: int, bits: int) -> tuple[int, list[int]]:
    """``C`` and the byte offsets of the sections after it (max, rest, tokens, codes, remainders, unary, end),
    every size checked against the bytes there are before anything is sized from it."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(f"a {data.dtype} tensor of shape {tuple(data.shape)}, not a 1-D uint8 one")
    if data.numel() < 4:
        raise ValueError("shorter than its header")
    positions = int(data[:4].view(torch.int32)[0])
    if positions < 0 or 8 * positions > data.numel():
        raise ValueError(f"{data.numel()} bytes cannot hold {positions} rows")
    sizes = [4 * positions, 4 * positions] + [-(-positions * width // 8) for width in (token_bits(token_columns), k * bits, k * r)]
    offsets = [4]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    if offsets[-1] > data.numel():
        raise ValueError(f"{data.numel()} bytes cannot hold {positions} rows")
    return positions, offsets + [data.numel()]


def decode_tokens(data: torch.Tensor, k: int, token_columns: int, r: int, logprob_map: LogprobMap) -> torch.Tensor:
    """The completion tokens ``(C,)`` (int64) of :func:`encode_example`'s tensor, checked below ``token_columns``."""
    positions, offsets = _layout(data, k, token_columns, r, logprob_map.bits)
    tokens = unpack_fixed(data[offsets[2] : offsets[3]], positions, token_bits(token_columns))
    if tokens.numel() and int(tokens.max()) >= token_columns:
        raise ValueError(f"a completion token {int(tokens.max())} outside the token columns [0, {token_columns})")
    return tokens


def decode_rows(data: torch.Tensor, n: int, k: int, token_columns: int, r: int, logprob_map: LogprobMap) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` rows of :func:`encode_example`'s tensor: ``(indices (n, k) int64, logprobs (n, k)
    fp32)`` in rank order. Raises ``ValueError`` when ``data`` cannot be what it wrote: sections too short,
    ids outside ``[0, token_columns)`` or repeated in a row, a stored value that is not finite or above 0.
    At most the bits ``n`` valid rows can take are unpacked (a row's gaps sum to below ``token_columns``,
    so its quotients to at most ``(token_columns - 1) >> r``), whatever the stream's length."""
    positions, offsets = _layout(data, k, token_columns, r, logprob_map.bits)
    if n > positions:
        raise ValueError(f"holds {positions} rows, {n} asked for")
    count = n * k
    most_bits = count + n * ((token_columns - 1) >> r)
    stream = data[offsets[5] : min(offsets[6], offsets[5] + -(-most_bits // 8))]
    zeros = (unpack_bits(stream) == 0).nonzero().flatten()[:count]
    if zeros.numel() < count:
        raise ValueError(f"its id stream ends (or runs past what {n} rows of {k} ids below {token_columns} take) before {n} rows of {k}")
    quotients = zeros.diff(prepend=torch.tensor([-1])) - 1
    if count and int(quotients.view(n, k).sum(-1).max()) > (token_columns - 1) >> r:
        raise ValueError(f"a row's ids reach past the token columns ({token_columns})")
    gaps = (quotients << r) | unpack_fixed(data[offsets[4] : offsets[5]], count, r)
    ids = gaps.view(n, k).cumsum(dim=-1)
    if ids.numel() and int(ids[:, -1].max()) >= token_columns:
        raise ValueError(f"a token id reaches {int(ids[:, -1].max())}, the token columns are {token_columns}")
    if k > 1 and n and bool((gaps.view(n, k)[:, 1:] == 0).any()):
        raise ValueError("a token id appears twice in one row")
    codes, order = unpack_fixed(data[offsets[3] : offsets[4]], count, logprob_map.bits).view(n, k).sort(dim=-1, stable=True)
    if n and bool((codes[:, 0] != 0).any()):
        raise ValueError("a row has no largest entry (code 0)")
    top, rest = (data[offsets[i] : offsets[i] + 4 * n].view(torch.float32).double() for i in (0, 1))
    if not bool(torch.isfinite(top).all()) or (n and float(top.max()) > LOGPROB_TOLERANCE):
        raise ValueError("a row's largest log-prob is not finite or above 0")
    if bool(torch.isnan(rest).any()) or bool((rest > LOGPROB_TOLERANCE).any()):
        raise ValueError("a row's stored rest mass is NaN or above 1")
    logprobs = top[:, None] - logprob_map.decode(codes)
    if k > 1:  # scale the other entries' probabilities back to their stored total exp(rest)
        shift = rest - torch.logsumexp(logprobs[:, 1:], -1)
        logprobs[:, 1:] += torch.where(torch.isfinite(shift), shift, 0.0)[:, None]
    return ids.gather(-1, order), logprobs.float()


def check_full_rows(tokens: torch.Tensor, indices: torch.Tensor, logprobs: torch.Tensor, k: int, token_columns: int) -> None:
    """The ``full`` format's tensors of one example checked (``ValueError`` naming what is wrong): ``tokens``
    1-D integers, ``indices`` and ``logprobs`` ``(C, k)`` (integers, floats) for its ``C`` tokens, ids in
    ``[0, token_columns)`` and none twice in a row, log-probs not NaN, at most 0 and each row's largest finite."""
    if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise ValueError(f"tokens is {tokens.dtype} {tuple(tokens.shape)}, not 1-D integers")
    shape = (tokens.numel(), k)
    if tuple(indices.shape) != shape or tuple(logprobs.shape) != shape:
        raise ValueError(f"indices {tuple(indices.shape)} and logprobs {tuple(logprobs.shape)} are not {shape} for its {tokens.numel()} tokens")
    if indices.dtype.is_floating_point or indices.dtype == torch.bool or not logprobs.dtype.is_floating_point:
        raise ValueError(f"indices is {indices.dtype} and logprobs {logprobs.dtype}: not integers and floats")
    for name, values in (("a token id", indices), ("a completion token", tokens)):
        if values.numel() and (int(values.min()) < 0 or int(values.max()) >= token_columns):
            raise ValueError(f"{name} outside the token columns [0, {token_columns})")
    if k > 1 and indices.numel() and bool((indices.sort(-1).values.diff(dim=-1) == 0).any()):
        raise ValueError("a token id appears twice in one row")
    if logprobs.numel():
        if bool(torch.isnan(logprobs).any()) or float(logprobs.max()) > LOGPROB_TOLERANCE:
            raise ValueError("a log-prob is NaN or above 0")
        if not bool(torch.isfinite(logprobs.max(-1).values).all()):
            raise ValueError("a row's largest log-prob is not finite")
