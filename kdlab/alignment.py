"""Byte-span alignment between two tokenizations of the same text (distillation across tokenizers, #27).

Each token of a Hugging Face fast tokenizer's encoding gets the ``[start, end)`` byte offsets it covers in
the text's UTF-8 bytes, computed from the token's own bytes (never by decoding a token to ``str``: a token
that holds half of a multi-byte character, as byte-level BPE makes for emoji and CJK, keeps its partial
span). Special tokens (BOS, EOS, padding, chat-template markers the tokenizer flags as special) cover no
bytes: they get an empty span at their position.

:func:`align` then pairs the two sequences into the finest groups that cover the same bytes: a group closes
at the first byte offset where both sides have a token boundary. A group of one token on each side is one
to one; :attr:`Alignment.one_to_one_share` is the share of the text's bytes such groups cover.

Standard library only (and :mod:`kdlab.errors`); a tokenizer is used through ``convert_ids_to_tokens``,
``added_tokens_decoder``, ``all_special_ids`` and ``backend_tokenizer.decoder``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from kdlab.errors import ConfigError

Span = tuple[int, int]
Group = tuple[range, range]

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_METASPACE = "\u2581"  # SentencePiece's '▁', a space


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: the character a byte-level BPE token string uses for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes)}


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """The class names of the backend decoder (and of its parts, for a ``Sequence`` decoder)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return set()
    kinds = {type(decoder).__name__}
    text = repr(decoder)
    for name in ("ByteLevel", "ByteFallback", "Metaspace", "Replace"):
        if name in text:
            kinds.add(name)
    return kinds


def special_ids(tokenizer: Any) -> set[int]:
    """Ids of the tokens that cover no text: ``all_special_ids`` and added tokens flagged ``special``."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return ids


def token_bytes(tokenizer: Any, ids: Sequence[int]) -> list[bytes]:
    """The bytes of each token of ``ids`` in the text (``b""`` for a special token).

    Byte-level BPE tokens map their characters back through GPT-2's byte table; byte-fallback tokens
    ``<0xNN>`` are the byte ``NN``; SentencePiece's ``'▁'`` is a space; non-special added tokens (tags such
    as ``<think>``) are their own content in UTF-8.
    """
    ids = [int(i) for i in ids]
    specials = special_ids(tokenizer)
    added = {int(k): v for k, v in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items()}
    kinds = _decoder_kinds(tokenizer)
    byte_level = "ByteLevel" in kinds
    table = _byte_decoder()
    out = []
    for token_id, token in zip(ids, tokenizer.convert_ids_to_tokens(ids)):
        if token is None and token_id not in specials:
            raise ConfigError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no token for id {token_id} "
                              "(convert_ids_to_tokens gave None): a vocabulary with holes cannot be aligned by bytes")
        if token_id in specials:
            out.append(b"")
        elif token_id in added:
            out.append(str(added[token_id].content).encode("utf-8"))
        elif byte_level and all(char in table for char in token):
            out.append(bytes(table[char] for char in token))
        elif (match := _BYTE_FALLBACK.fullmatch(token)) is not None:
            out.append(bytes([int(match.group(1), 16)]))
        else:
            out.append(token.replace(_METASPACE, " ").encode("utf-8"))
    return out


def token_byte_spans(tokenizer: Any, ids: Sequence[int]) -> list[Span]:
    """The ``[start, end)`` byte offsets in the text's UTF-8 bytes of each token of ``ids``.

    Offsets accumulate the tokens' own bytes (:func:`token_bytes`), so they are the text's offsets exactly
    when the tokenizer reproduces the text (:func:`check_reproduces`). Special tokens get the empty span
    ``(p, p)`` at their position ``p``; a token holding part of a multi-byte character gets a partial span.
    """
    spans, position = [], 0
    for piece in token_bytes(tokenizer, ids):
        spans.append((position, position + len(piece)))
        position += len(piece)
    return spans


def check_reproduces(tokenizer: Any, text: str, ids: Sequence[int], role: str) -> list[Span]:
    """``ids``' byte spans, after checking their bytes (special tokens aside) are ``text``'s UTF-8 bytes.

    A tokenizer that normalises its input (lowercasing, NFKC, a SentencePiece prefix space) cannot be
    aligned by bytes: :class:`ConfigError` names ``role`` and the first character that differs.
    """
    expected = text.encode("utf-8")
    got = b"".join(token_bytes(tokenizer, ids))
    if got == expected:
        return token_byte_spans(tokenizer, ids)
    first = next((k for k, (x, y) in enumerate(zip(expected, got)) if x != y), min(len(expected), len(got)))
    index = len(expected[:first].decode("utf-8", errors="ignore"))
    wanted = repr(text[index]) if index < len(text) else "the end of the text"
    start = len(expected[:first].decode("utf-8", errors="ignore").encode("utf-8"))
    produced = got[start:start + 4].decode("utf-8", errors="replace")[:1]
    produced = repr(produced) if produced else "the end of its tokens"
    raise ConfigError(
        f"{role} tokenizer does not reproduce the text's bytes (a lossy normaliser?), so its tokens cannot be "
        f"aligned by byte spans: first difference at character {index} {wanted}, its tokens give {produced}"
    )


def first_unreproduced(tokenizer: Any, texts: Sequence[str]) -> int | None:
    """The index in ``texts`` of the first text whose encoding (``add_special_tokens=False``) does not spell its
    UTF-8 bytes (:func:`check_reproduces` then says where), or ``None`` when every one does. One batched
    encoding and one :func:`token_bytes` table of the ids met, so checking every text of a task is cheap."""
    if not texts:
        return None
    encodings = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    seen = sorted({int(i) for ids in encodings for i in ids})
    table = dict(zip(seen, token_bytes(tokenizer, seen)))
    for index, (text, ids) in enumerate(zip(texts, encodings)):
        if b"".join(table[int(i)] for i in ids) != text.encode("utf-8"):
            return index
    return None


def align(spans_a: Sequence[Span], spans_b: Sequence[Span]) -> list[Group]:
    """The finest groups ``(range of A's tokens, range of B's tokens)`` that cover the same bytes.

    Two pointers walk both sequences; a group closes at the first byte offset past its start where both
    sides have a token boundary, so no group has a common boundary inside it. A special token (empty span)
    that falls where both sides are at a common boundary forms its own group with an empty range on the
    other side: it is unmatched on the side that has it. One inside a multi-token group (a boundary only
    its own side has) stays in that group, so that every group is a contiguous range on both sides.
    Groups are ordered, contiguous and cover every token of both sides. Raises :class:`ValueError` if the
    spans do not tile the same bytes from offset 0.
    """
    groups: list[Group] = []
    i = j = position = 0
    n, m = len(spans_a), len(spans_b)

    def empty(spans, k):
        return spans[k][0] == spans[k][1]

    def check(spans, k, side):
        if spans[k][0] != position:
            raise ValueError(f"side {side}: token {k} starts at byte {spans[k][0]}, expected {position}")

    while i < n or j < m:
        if i < n and empty(spans_a, i):
            check(spans_a, i, "A")
            groups.append((range(i, i + 1), range(j, j)))
            i += 1
            continue
        if j < m and empty(spans_b, j):
            check(spans_b, j, "B")
            groups.append((range(i, i), range(j, j + 1)))
            j += 1
            continue
        if i >= n or j >= m:
            raise ValueError(f"the spans cover different bytes: one side ends at byte {position}, the other goes on")
        check(spans_a, i, "A")
        check(spans_b, j, "B")
        i_end, j_end = i + 1, j + 1
        end_a, end_b = spans_a[i][1], spans_b[j][1]
        while end_a != end_b:
            if end_a < end_b:
                if i_end >= n or spans_a[i_end][0] != end_a:
                    raise ValueError(f"side A's spans end or jump at byte {end_a} inside a group")
                end_a = spans_a[i_end][1]
                i_end += 1
            else:
                if j_end >= m or spans_b[j_end][0] != end_b:
                    raise ValueError(f"side B's spans end or jump at byte {end_b} inside a group")
                end_b = spans_b[j_end][1]
                j_end += 1
        groups.append((range(i, i_end), range(j, j_end)))
        i, j, position = i_end, j_end, end_a
    return groups


@dataclass(frozen=True)
class Alignment:
    """Two tokenizations' byte spans and the finest groups of tokens that cover the same bytes."""

    spans_a: list[Span]
    spans_b: list[Span]
    groups: list[Group]

    @classmethod
    def from_spans(cls, spans_a: Sequence[Span], spans_b: Sequence[Span]) -> Alignment:
        return cls(list(spans_a), list(spans_b), align(spans_a, spans_b))

    def group_bytes(self, group: Group) -> Span:
        """The byte range ``[start, end)`` a group covers (empty for a lone special token)."""
        spans = [self.spans_a[k] for k in group[0]] + [self.spans_b[k] for k in group[1]]
        return min(s for s, _ in spans), max(e for _, e in spans)

    @staticmethod
    def is_one_to_one(group: Group) -> bool:
        return len(group[0]) == 1 and len(group[1]) == 1

    @property
    def num_bytes(self) -> int:
        return max((end for _, end in self.spans_a), default=0)

    @property
    def one_to_one_share(self) -> float:
        """The share of the text's bytes that one-to-one groups cover (1.0 for an empty text)."""
        if self.num_bytes == 0:
            return 1.0
        covered = 0
        for group in self.groups:
            if self.is_one_to_one(group):
                start, end = self.group_bytes(group)
                covered += end - start
        return covered / self.num_bytes


def align_tokenizations(text: str, tokenizer_a: Any, ids_a: Sequence[int], tokenizer_b: Any, ids_b: Sequence[int],
                        roles: tuple[str, str] = ("teacher", "student")) -> Alignment:
    """The alignment of two tokenizers' encodings of ``text``, each first checked to reproduce its bytes."""
    return Alignment.from_spans(check_reproduces(tokenizer_a, text, ids_a, roles[0]),
                                check_reproduces(tokenizer_b, text, ids_b, roles[1]))
