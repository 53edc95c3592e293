"""The data of distillation across tokenizers: which tokens two vocabularies share (:class:`VocabularyMap`)
and the byte-aligned groups of a batch's completions (:class:`AlignedGroups`), flat tensors the aligned
objective (:mod:`kdlab.objectives.aligned`) walks chunk by chunk."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kdlab.alignment import align, special_ids, token_bytes


@dataclass
class VocabularyMap:
    """The tokens two vocabularies share, and each token's bytes.

    ``teacher_ids``, ``student_ids``: ``(M,)`` long, pair ``i`` is ``(teacher_ids[i], student_ids[i])``;
    ``teacher_pair`` ``(V_T,)`` / ``student_pair`` ``(V_S,)``: each id's pair index, -1 if unmapped;
    ``teacher_bytes`` / ``student_bytes``: each id's bytes in a text (``b""`` for a special token);
    ``teacher_ends`` / ``student_ends``: ``(E,)`` long, each side's end ids, the first the one the map pairs:
    every end id of a side has that pair's index (one shared "end" event, :meth:`merged_ends`);
    ``teacher_canonical`` / ``student_canonical``: ``(V,)`` long, each id with every end id replaced by the first.
    """

    teacher_ids: torch.Tensor
    student_ids: torch.Tensor
    teacher_pair: torch.Tensor
    student_pair: torch.Tensor
    teacher_bytes: list[bytes]
    student_bytes: list[bytes]
    teacher_specials: frozenset[int]
    student_specials: frozenset[int]
    teacher_ends: torch.Tensor
    student_ends: torch.Tensor
    teacher_canonical: torch.Tensor
    student_canonical: torch.Tensor

    @classmethod
    def build(cls, teacher_tokenizer: Any, student_tokenizer: Any, teacher_columns: int, student_columns: int,
              teacher_end_ids: Sequence[int] | None = None, student_end_ids: Sequence[int] | None = None) -> VocabularyMap:
        """Pairs tokens with the same bytes (special tokens by content), except end tokens: every end id of a side
        (``*_end_ids``, default its tokenizer's EOS; a completion ends at any of them) joins one shared "end" pair,
        whose probability on each side is the sum over that side's end ids. Ids ``>= columns`` are ignored."""
        sides = []
        for tokenizer, columns, end_ids in ((teacher_tokenizer, teacher_columns, teacher_end_ids),
                                            (student_tokenizer, student_columns, student_end_ids)):
            ids = list(range(columns))
            specials = frozenset(i for i in special_ids(tokenizer) if i < columns)
            if end_ids is None:
                end_ids = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
            ends = [int(i) for i in dict.fromkeys(end_ids) if int(i) < columns]
            pieces = token_bytes(tokenizer, ids)
            names = tokenizer.convert_ids_to_tokens(ids)
            keys: dict[tuple[str, bytes], int] = {}
            for token_id, piece, name in zip(ids, pieces, names):
                if token_id in ends:
                    continue  # paired as the end event below, never by name
                key = ("special", str(name).encode("utf-8")) if token_id in specials else ("text", piece)
                keys.setdefault(key, token_id)
            sides.append((pieces, specials, keys, columns, ends))
        (t_bytes, t_specials, t_keys, t_columns, t_ends), (s_bytes, s_specials, s_keys, s_columns, s_ends) = sides
        pairs = [(t_id, s_keys[key]) for key, t_id in t_keys.items() if key in s_keys]
        if t_ends and s_ends:
            pairs.append((t_ends[0], s_ends[0]))
        pairs.sort(key=lambda pair: pair[1])
        teacher_pair = torch.full((t_columns,), -1, dtype=torch.long)
        student_pair = torch.full((s_columns,), -1, dtype=torch.long)
        for index, (t_id, s_id) in enumerate(pairs):
            teacher_pair[t_id], student_pair[s_id] = index, index
        canonical = []
        for pair, ends, columns in ((teacher_pair, t_ends, t_columns), (student_pair, s_ends, s_columns)):
            ids = torch.arange(columns)
            if t_ends and s_ends:
                pair[ends] = int(pair[ends[0]])
                ids[ends] = ends[0]
            canonical.append(ids)
        as_ids = lambda values: torch.tensor(values if t_ends and s_ends else [], dtype=torch.long)  # noqa: E731
        return cls(
            torch.tensor([t for t, _ in pairs], dtype=torch.long), torch.tensor([s for _, s in pairs], dtype=torch.long),
            teacher_pair, student_pair, t_bytes, s_bytes, t_specials, s_specials, as_ids(t_ends), as_ids(s_ends), *canonical,
        )

    def merged_ends(self, rows: torch.Tensor, side: str) -> torch.Tensor:
        """``rows`` ``(n, V)`` logits (or log-probs) of ``side`` with its first end id's column holding the
        log-sum-exp over all its end ids and the other end columns at ``-1e4``: the normaliser is unchanged,
        and the end event's probability is the sum over the side's end ids. Returns ``rows`` itself with fewer
        than two end ids."""
        ends = getattr(self, f"{side}_ends")
        if ends.numel() < 2:
            return rows
        merged = torch.logsumexp(rows.index_select(1, ends), dim=1)
        out = rows.index_fill(1, ends[1:], -1e4)
        out[:, ends[0]] = merged
        return out

    @property
    def size(self) -> int:
        return int(self.student_ids.numel())

    def to(self, device: torch.device) -> VocabularyMap:
        if self.student_ids.device == device:
            return self
        move = lambda tensor: tensor.to(device)  # noqa: E731
        return VocabularyMap(move(self.teacher_ids), move(self.student_ids), move(self.teacher_pair), move(self.student_pair),
                             self.teacher_bytes, self.student_bytes, self.teacher_specials, self.student_specials,
                             move(self.teacher_ends), move(self.student_ends), move(self.teacher_canonical), move(self.student_canonical))


def _spans(pieces: list[bytes], ids: Sequence[int]) -> list[tuple[int, int]]:
    spans, position = [], 0
    for token_id in ids:
        length = len(pieces[token_id])
        spans.append((position, position + length))
        position += length
    return spans


def pair_specials(groups: list[tuple[range, range]]) -> list[tuple[range, range]]:
    """Pair lone special tokens at the same byte offset: the k-th student-only special with the k-th
    teacher-only one (the two EOS tokens at a completion's end), as one-to-one groups; the others stay alone."""
    out: list[tuple[range, range]] = []
    run: list[tuple[range, range]] = []

    def flush() -> None:
        a_side = [g for g in run if len(g[0]) == 1]
        b_side = [g for g in run if len(g[1]) == 1]
        for x, y in zip(a_side, b_side):
            out.append((x[0], y[1]))
        for extra in a_side[len(b_side):] + b_side[len(a_side):]:
            out.append(extra)
        run.clear()

    for group in groups:
        lone = (len(group[0]) == 1 and len(group[1]) == 0) or (len(group[0]) == 0 and len(group[1]) == 1)
        if lone:
            run.append(group)
            continue
        flush()
        out.append(group)
    flush()
    return out


def _first_inner_special(tokens: list[int], specials: frozenset[int], ends: set[int]) -> int:
    """Index of the first special token of ``tokens`` that is not the last token and an end id; -1 if none."""
    for index, token in enumerate(tokens):
        if token in specials and not (index == len(tokens) - 1 and token in ends):
            return index
    return -1


@dataclass
class ChunkSide:
    """One side's rows of a chunk of groups: ``(b, t)`` positions of every token, the group of each row
    (``owner``), each group's first row (``first``) and the tokens written (``ids``), all ``(n,)`` / ``(G,)``."""

    b: torch.Tensor
    t: torch.Tensor
    owner: torch.Tensor
    first: torch.Tensor
    ids: torch.Tensor


@dataclass
class GroupChunk:
    """A chunk of groups: both sides' rows and, per group, the two map pairs left out (``removed`` ``(G, 2)``:
    the pairs of the student's and the teacher's first tokens, -1 where a first token is unmapped)."""

    student: ChunkSide
    teacher: ChunkSide
    removed: torch.Tensor


@dataclass
class AlignedGroups:
    """The groups of one batch, flat over its rows: ``(N,)`` long tensors (groups with a token on both
    sides only). ``student_start``/``teacher_start`` are positions in each side's completion columns;
    ``aligned_bytes`` / ``one_to_one_bytes`` count the batch's completion bytes and those that one-to-one
    groups cover; ``misaligned_rows`` counts the rows left out because their two tokenizations spell
    different bytes, ``cut_rows`` the rows whose groups stop at a special token inside the completion."""

    row: torch.Tensor
    student_start: torch.Tensor
    student_length: torch.Tensor
    teacher_start: torch.Tensor
    teacher_length: torch.Tensor
    aligned_bytes: int
    one_to_one_bytes: int
    misaligned_rows: int = 0
    cut_rows: int = 0

    @classmethod
    def build(cls, vocabulary: VocabularyMap, student_ids: torch.Tensor, student_mask: torch.Tensor,
              teacher_ids: torch.Tensor, teacher_mask: torch.Tensor) -> AlignedGroups:
        """Align each row's masked-in student and teacher completion tokens (``(B, C_S)``, ``(B, C_T)``).

        A row whose two tokenizations spell different bytes (a reader tokenizer whose normalizer changed the
        text: NFC turns ``'e\u0301'`` into ``'\u00e9'``) gets no groups, so it is left out of the loss, and is
        counted in ``misaligned_rows``; the run goes on. A row's groups stop before the first special token
        that is not its side's final end token (a ``<|im_start|>`` in the middle of a completion): the other
        model reads no such token (it covers no bytes), so after it the two models no longer condition on the
        same text; such rows are counted in ``cut_rows``."""
        rows, s_start, s_len, t_start, t_len = [], [], [], [], []
        total = one = misaligned = cut = 0
        s_ends, t_ends = set(vocabulary.student_ends.tolist()), set(vocabulary.teacher_ends.tolist())
        for b, (s_row, s_keep, t_row, t_keep) in enumerate(zip(student_ids.tolist(), student_mask.tolist(), teacher_ids.tolist(), teacher_mask.tolist())):
            s_tokens = [token for token, keep in zip(s_row, s_keep) if keep]
            t_tokens = [token for token, keep in zip(t_row, t_keep) if keep]
            s_text = b"".join(vocabulary.student_bytes[i] for i in s_tokens)
            t_text = b"".join(vocabulary.teacher_bytes[i] for i in t_tokens)
            if s_text != t_text:
                misaligned += 1
                continue
            s_spans, t_spans = _spans(vocabulary.student_bytes, s_tokens), _spans(vocabulary.teacher_bytes, t_tokens)
            s_cut = _first_inner_special(s_tokens, vocabulary.student_specials, s_ends)
            t_cut = _first_inner_special(t_tokens, vocabulary.teacher_specials, t_ends)
            for t_range, s_range in pair_specials(align(t_spans, s_spans)):
                if s_cut in s_range or t_cut in t_range:
                    cut += 1
                    break
                if not len(t_range) or not len(s_range):
                    continue
                rows.append(b)
                s_start.append(s_range.start)
                s_len.append(len(s_range))
                t_start.append(t_range.start)
                t_len.append(len(t_range))
                size = s_spans[s_range.stop - 1][1] - s_spans[s_range.start][0]
                total += size
                one += size if len(t_range) == 1 and len(s_range) == 1 else 0
        device = student_ids.device
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        return cls(as_tensor(rows), as_tensor(s_start), as_tensor(s_len), as_tensor(t_start), as_tensor(t_len), total, one, misaligned, cut)

    def __len__(self) -> int:
        return int(self.row.numel())

    @property
    def one_to_one_share(self) -> float:
        """Share of the aligned completion bytes covered by one-to-one groups (1.0 when there are none)."""
        return self.one_to_one_bytes / self.aligned_bytes if self.aligned_bytes else 1.0

    def start_mask(self, shape: torch.Size) -> torch.Tensor:
        """``(B, C_S)`` bool: True at each group's first student token."""
        mask = torch.zeros(shape, dtype=torch.bool, device=self.row.device)
        mask[self.row, self.student_start] = True
        return mask

    def positions(self, groups: torch.Tensor, side: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(b, t, owner)`` of every token of ``groups`` on ``side``, ``owner`` indexing into ``groups``;
        each group's first token comes first among its own."""
        start = getattr(self, f"{side}_start")[groups]
        length = getattr(self, f"{side}_length")[groups]
        owner = torch.repeat_interleave(torch.arange(groups.numel(), device=groups.device), length)
        offset = torch.arange(owner.numel(), device=groups.device) - torch.repeat_interleave(torch.cumsum(length, 0) - length, length)
        return self.row[groups][owner], start[owner] + offset, owner

    def chunk(self, groups: torch.Tensor, student_ids: torch.Tensor, teacher_ids: torch.Tensor, vocabulary: VocabularyMap) -> GroupChunk:
        """The rows of ``groups`` (indices) on both sides, with the completion tokens ``(B, C_S)``, ``(B, C_T)``."""
        sides = []
        for side, ids in (("student", student_ids), ("teacher", teacher_ids)):
            b, t, owner = self.positions(groups, side)
            length = getattr(self, f"{side}_length")[groups]
            # any end id written reads as the side's first: the end event (VocabularyMap.merged_ends)
            sides.append(ChunkSide(b, t, owner, torch.cumsum(length, 0) - length, getattr(vocabulary, f"{side}_canonical")[ids[b, t]]))
        student, teacher = sides
        removed = torch.stack([vocabulary.student_pair[student.ids[student.first]], vocabulary.teacher_pair[teacher.ids[teacher.first]]], dim=1)
        return GroupChunk(student, teacher, removed)

    def chunks(self, chunk_size: int) -> list[torch.Tensor]:
        """Consecutive group indices holding about ``chunk_size`` student tokens each (a group is never split)."""
        lengths = self.student_length.tolist()
        out, start, rows = [], 0, 0
        for index, length in enumerate(lengths):
            rows += length
            if rows >= chunk_size:
                out.append(torch.arange(start, index + 1, device=self.row.device))
                start, rows = index + 1, 0
        if start < len(lengths):
            out.append(torch.arange(start, len(lengths), device=self.row.device))
        return out
