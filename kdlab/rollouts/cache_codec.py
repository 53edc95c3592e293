"""The compact teacher cache format (``compact-v1``): a top-k row of token ids and log-probs in about
``k * (log2(V / k) + 2.7 + b) / 8`` bytes instead of ``12 k``.

One example's rows ``(C, k)`` are stored as five tensors (:func:`encode_rows`, :func:`decode_rows`):

* ``max`` ``(C,)`` fp32: each row's largest log-prob, exactly as computed.
* ``unary``, ``remainders`` (uint8, bit-packed): the token ids. Each row is sorted by id and its ids are
  written as gaps (the first id, then the differences, all ``>= 0``), Rice-coded with one parameter
  ``r = max(0, floor(log2(V / k)))`` per file: gap ``g`` is the quotient ``g >> r`` in unary (that many
  one bits, then a zero bit) in ``unary``, one stream for all rows of the example, and the ``r`` low bits
  in ``remainders``, a fixed-width block. Since a row's gaps sum to at most ``V - 1 < k 2^(r+1)``, a row
  takes at most ``k (r + 3)`` bits; uniformly spread ids take about ``k (r + 1.7)``. Decoding is
  vectorised: the zero bits' positions (``nonzero``) give every quotient at once (their differences).
* ``codes`` (uint8, bit-packed, ``b`` bits each): every entry's ``u = max - logprob >= 0`` on a
  compressive map (:class:`LogprobMap`): ``code = round(A log1p(min(u, U) / u0))`` with
  ``A = (2^b - 1) / log1p(U / u0)``, decoded as ``u0 expm1(code / A)``. The map is fine where the
  probability is (``u`` near 0) and coarse far down the row; the row's max has ``u = 0``, code 0, and
  decodes to the stored max exactly.

**Worst-case log-prob error**, per entry, as a function of its ``u``:
``|decoded - logprob| <= (u0 + u) (exp(1 / (2A)) - 1)`` for ``u <= U`` (the code is the rounded
``A log1p(u / u0)``, so ``(u0 + u_decoded) / (u0 + u)`` lies within ``exp(+-1 / (2A))``), plus fp32
rounding; entries with ``u > U`` decode to ``max - U``: their log-prob is overstated by ``u - U``, their
probability by at most ``exp(max - U)``. :meth:`LogprobMap.error_bound` evaluates it.

Rows decode in rank order (the code ascending, ties by id), the order ``top_k`` writes. The file's
metadata holds ``format: compact-v1``, ``rice_r``, ``logprob_bits`` (``b``), ``logprob_u0`` and
``logprob_clip`` (``U``) next to the cache's own keys; :func:`read_metadata` checks them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FORMAT = "compact-v1"
PARTS = ("max", "unary", "remainders", "codes")
"""The tensors of one example besides its tokens (``<id>/<part>``)."""
DEFAULT_BITS, DEFAULT_U0, DEFAULT_CLIP = 6, 0.25, 32.0
"""The defaults, chosen from the measurements of ``benchmarks/cache_size.py`` (docs/benchmarks.md): 6 bits
keep 128 entries at ``V = 151,936`` under 300 bytes per token."""
MIN_BITS, MAX_BITS = 4, 16


def rice_parameter(token_columns: int, k: int) -> int:
    """``max(0, floor(log2(V / k)))``, in integers."""
    if not 1 <= k <= token_columns:
        raise ValueError(f"top_k must be in [1, {token_columns}] (the token columns), got {k}")
    return (token_columns // k).bit_length() - 1


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Zeros and ones ``(L,)`` -> uint8 ``(ceil(L / 8),)``, most significant bit first, zero-padded."""
    bits = bits.to(torch.uint8).flatten()
    padded = torch.zeros(-(-bits.numel() // 8) * 8, dtype=torch.uint8)
    padded[: bits.numel()] = bits
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
    return (padded.view(-1, 8) * weights).sum(-1, dtype=torch.uint8) if padded.numel() else padded


def unpack_bits(data: torch.Tensor, count: int | None = None) -> torch.Tensor:
    """The inverse of :func:`pack_bits`: the first ``count`` bits (all when ``None``), uint8 zeros and ones."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8)
    bits = ((data.to(torch.uint8)[:, None] >> shifts) & 1).flatten()
    return bits if count is None else bits[:count]


def pack_fixed(values: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative integers ``(N,)``, each below ``2^width``, as ``width`` bits each, packed."""
    if width == 0:
        return torch.zeros(0, dtype=torch.uint8)
    shifts = torch.arange(width - 1, -1, -1, dtype=torch.int64)
    return pack_bits((values.long().flatten()[:, None] >> shifts) & 1)


def unpack_fixed(data: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """The first ``count`` values of :func:`pack_fixed` (int64)."""
    if width == 0:
        return torch.zeros(count, dtype=torch.int64)
    bits = unpack_bits(data, count * width)
    if bits.numel() < count * width:
        raise ValueError(f"a {width}-bit block holds fewer than {count} values")
    weights = 2 ** torch.arange(width - 1, -1, -1, dtype=torch.int64)
    return (bits.view(count, width).long() * weights).sum(-1)


@dataclass(frozen=True)
class LogprobMap:
    """The ``b``-bit code of ``u = max - logprob``: ``round(A log1p(min(u, U) / u0))``, ``A = (2^b - 1) /
    log1p(U / u0)`` (see the module docstring for the error bound)."""

    bits: int = DEFAULT_BITS
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
        return (2**self.bits - 1) / math.log1p(self.clip / self.u0)

    def encode(self, u: torch.Tensor) -> torch.Tensor:
        """Codes (int64) of ``u >= 0`` (float64 arithmetic; ``inf`` clips to ``U``)."""
        clipped = u.double().clamp(min=0.0, max=self.clip)
        return torch.round(self.scale * torch.log1p(clipped / self.u0)).long().clamp(0, 2**self.bits - 1)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """``u`` (float64) of ``codes``; code 0 is 0 exactly."""
        return self.u0 * torch.expm1(codes.double() / self.scale)

    def error_bound(self, u: torch.Tensor) -> torch.Tensor:
        """The largest ``|decode(encode(u)) - u|`` at ``u`` (float64), fp32 rounding aside."""
        u = u.double()
        inside = (self.u0 + u) * math.expm1(0.5 / self.scale)
        return torch.where(u <= self.clip, inside, u - self.clip)

    def metadata(self) -> dict[str, str]:
        return {"logprob_bits": str(self.bits), "logprob_u0": repr(self.u0), "logprob_clip": repr(self.clip)}


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
    if not 0 <= r <= 62:
        raise ValueError(f"{where}: corrupt {FORMAT} metadata (rice_r = {r})")
    return r, logprob_map


def encode_rows(indices: torch.Tensor, logprobs: torch.Tensor, token_columns: int, r: int, logprob_map: LogprobMap) -> dict[str, torch.Tensor]:
    """One example's ``indices`` / ``logprobs`` ``(C, k)`` as the tensors :data:`PARTS` (module docstring)."""
    if indices.shape != logprobs.shape or indices.dim() != 2:
        raise ValueError(f"teacher cache: indices and logprobs must both be (C, k), got {tuple(indices.shape)}, {tuple(logprobs.shape)}")
    indices, logprobs = indices.cpu().long(), logprobs.cpu().float()
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= token_columns):
        raise ValueError(f"teacher cache: token ids must lie in [0, {token_columns}), got {int(indices.min())}..{int(indices.max())}")
    ids, order = indices.sort(dim=-1, stable=True)
    gaps = ids.diff(dim=-1, prepend=torch.zeros_like(ids[:, :1])).flatten()
    quotients = gaps >> r
    unary = torch.ones(int(quotients.sum()) + gaps.numel(), dtype=torch.uint8)
    unary[torch.cumsum(quotients + 1, 0) - 1] = 0
    top = logprobs.max(dim=-1).values if logprobs.shape[-1] else torch.zeros(logprobs.shape[0])
    if not bool(torch.isfinite(top).all()):
        raise ValueError("teacher cache: a row's largest log-prob is not finite")
    u = top.double()[:, None] - logprobs.gather(-1, order).double()
    if bool(torch.isnan(u).any()):
        raise ValueError("teacher cache: a log-prob is NaN")
    return {
        "max": top.contiguous(),
        "unary": pack_bits(unary),
        "remainders": pack_fixed(gaps & ((1 << r) - 1), r),
        "codes": pack_fixed(logprob_map.encode(u).flatten(), logprob_map.bits),
    }


def decode_rows(parts: dict[str, torch.Tensor], n: int, k: int, token_columns: int, r: int, logprob_map: LogprobMap) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` rows of :func:`encode_rows`' tensors: ``(indices (n, k) int64, logprobs (n, k) fp32)``
    in rank order. Raises ``ValueError`` when the tensors cannot be what :func:`encode_rows` wrote."""
    count = n * k
    zeros = (unpack_bits(parts["unary"]) == 0).nonzero().flatten()[:count]
    if zeros.numel() < count or parts["max"].numel() < n:
        raise ValueError(f"truncated {FORMAT} rows (wanted {n} rows of {k})")
    quotients = zeros.diff(prepend=torch.tensor([-1])) - 1
    gaps = (quotients << r) | unpack_fixed(parts["remainders"], count, r)
    ids = gaps.view(n, k).cumsum(dim=-1)
    if ids.numel() and int(ids[:, -1].max()) >= token_columns:
        raise ValueError(f"corrupt {FORMAT} rows: a token id reaches {int(ids[:, -1].max())}, the token columns are {token_columns}")
    codes = unpack_fixed(parts["codes"], count, logprob_map.bits).view(n, k)
    codes, order = codes.sort(dim=-1, stable=True)
    logprobs = (parts["max"][:n].double()[:, None] - logprob_map.decode(codes)).float()
    return ids.gather(-1, order), logprobs
