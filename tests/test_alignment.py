"""Byte-span alignment between two tokenizations of the same text (kdlab.alignment, issue #27)."""

from __future__ import annotations

import unicodedata
from functools import lru_cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kdlab.alignment import Alignment, align, check_reproduces, token_byte_spans, token_bytes
from kdlab.errors import ConfigError

LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "Café, naïve, résumé, über, façade, jalapeño, Ångström.",
    "東京は日本の首都です。中文分词很有意思。",
    "Emoji: 🎉 party 🎉, 👍 ok, 🚀 launch, 😀 smile 😀.",
    "Σὲ γνωρίζω ἀπὸ τὴν κόψη — Привет, мир! 안녕하세요",
    "<think> 12 + 30 = 42 </think> <answer>42</answer>",
]


@lru_cache(maxsize=1)
def tiny():
    """The packaged byte-level BPE tokenizer (NFC normaliser, 353 tokens)."""
    from kdlab.models.loading import ModelSpec, load_tokenizer

    return load_tokenizer(ModelSpec("kdlab://tiny-random/student"))


def _wrap(backend):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@lru_cache(maxsize=1)
def trained():
    """A second byte-level BPE with a different vocabulary (no normaliser), trained here on mixed text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=["<s>", "</s>", "<pad>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [f"{line} {k}" for k in range(50) for line in LINES]
    backend.train_from_iterator(corpus, trainer=trainer)
    return _wrap(backend)


def lossy(normalizer):
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(trained().backend_tokenizer.to_str())
    backend.normalizer = normalizer
    return _wrap(backend)


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def assert_tiles(spans, text):
    """Non-empty spans tile the text's bytes from 0, in order; empty spans sit at a boundary."""
    position = 0
    for start, end in spans:
        assert start == position and end >= start
        position = end
    assert position == len(text.encode("utf-8"))


def assert_groups(alignment: Alignment, text: str):
    a, b, groups = alignment.spans_a, alignment.spans_b, alignment.groups
    i = j = 0
    for ra, rb in groups:
        assert ra.start == i and rb.start == j and len(ra) + len(rb) > 0  # contiguous and ordered
        i, j = ra.stop, rb.stop
        cover_a = [a[k] for k in ra if a[k][0] != a[k][1]]
        cover_b = [b[k] for k in rb if b[k][0] != b[k][1]]
        if not cover_a or not cover_b:  # a lone special token: unmatched, covers no byte
            assert not cover_a and not cover_b and len(ra) + len(rb) == 1
            continue
        assert (cover_a[0][0], cover_a[-1][1]) == (cover_b[0][0], cover_b[-1][1])  # the same bytes
        interior_a = {end for _, end in cover_a[:-1]}
        interior_b = {end for _, end in cover_b[:-1]}
        assert not interior_a & interior_b  # minimal: no common boundary inside the group
    assert (i, j) == (len(a), len(b))  # every token of both sides
    assert sum(1 for ra, rb in groups for _ in ra) == len(a)


def test_token_bytes_reproduce_split_characters():
    text = "héllo 世界 🎉"
    ids = encode(tiny(), text)
    pieces = token_bytes(tiny(), ids)
    assert b"".join(pieces) == text.encode("utf-8")
    assert b"\xf0" in pieces  # 🎉's first byte alone: a partial character, kept as bytes
    assert_tiles(token_byte_spans(tiny(), ids), text)


def test_special_and_added_tokens():
    tok = tiny()
    text = "<|im_start|>user\nhi<|im_end|><think>x</think>"
    ids = encode(tok, text)
    spans = token_byte_spans(tok, ids)
    names = tok.convert_ids_to_tokens(ids)
    assert spans[names.index("<|im_start|>")] == (0, 0)
    end = names.index("<|im_end|>")
    assert spans[end][0] == spans[end][1]
    assert check_reproduces(tok, "user\nhi<think>x</think>", ids, "student") == spans  # tags keep their bytes


def test_identical_tokenizers_are_one_to_one():
    for text in LINES:
        spans = check_reproduces(tiny(), text, encode(tiny(), text), "teacher")
        alignment = Alignment.from_spans(spans, spans)
        assert all(Alignment.is_one_to_one(group) for group in alignment.groups)
        assert alignment.one_to_one_share == 1.0


def test_two_tokenizers_align():
    text = " ".join(LINES)
    a = check_reproduces(tiny(), text, encode(tiny(), text), "teacher")
    b = check_reproduces(trained(), text, encode(trained(), text), "student")
    alignment = Alignment.from_spans(a, b)
    assert_groups(alignment, text)
    assert 0.0 < alignment.one_to_one_share < 1.0


@pytest.mark.parametrize("char, whole_in_b", [("🎉", True), ("中", True), ("東", False)])
def test_split_multibyte_character(char, whole_in_b):
    """The packaged tokenizer splits ``char`` into single bytes; the trained one keeps it whole (🎉 with the
    space before it, 中) or splits it elsewhere (東: 2 + 1 bytes against 1 + 1 + 1)."""
    text = f"x {char} y"
    ids_a, ids_b = encode(tiny(), text), encode(trained(), text)
    a, b = check_reproduces(tiny(), text, ids_a, "teacher"), check_reproduces(trained(), text, ids_b, "student")
    start = len("x ".encode("utf-8"))
    end = start + len(char.encode("utf-8"))
    assert [span for span in a if start <= span[0] < end] == [(k, k + 1) for k in range(start, end)]
    assert any(s <= start and e >= end for s, e in b) == whole_in_b
    alignment = Alignment.from_spans(a, b)
    assert_groups(alignment, text)
    inside = [alignment.group_bytes(g) for g in alignment.groups if start <= alignment.group_bytes(g)[0] < end]
    if whole_in_b:  # one many-to-one group holds all the character's bytes
        group = next(g for g in alignment.groups if alignment.group_bytes(g)[0] <= start < alignment.group_bytes(g)[1])
        lo, hi = alignment.group_bytes(group)
        assert lo <= start and hi >= end and len(group[0]) > 1 and len(group[1]) == 1
    else:  # groups close inside the character where both sides split it
        assert inside == [(start, start + 2), (start + 2, end)]


characters = st.characters(exclude_categories=("Cs",))
texts = st.text(alphabet=st.one_of(characters, st.sampled_from(list("é世界東🎉😀👍 \n\t"))), max_size=40)


@settings(max_examples=200, deadline=None)
@given(text=texts, bos_a=st.booleans(), eos_b=st.booleans(), swap=st.booleans())
def test_random_texts_never_misalign_a_byte(text, bos_a, eos_b, swap):
    text = unicodedata.normalize("NFC", text)  # the packaged tokenizer normalises to NFC
    first, second = (trained(), tiny()) if swap else (tiny(), trained())
    ids_a, ids_b = encode(first, text), encode(second, text)
    if bos_a:  # BOS on one side only
        ids_a = [first.convert_tokens_to_ids("<|im_start|>" if first is tiny() else "<s>")] + ids_a
    if eos_b:  # EOS on the other side only
        ids_b = ids_b + [second.eos_token_id]
    a, b = check_reproduces(first, text, ids_a, "teacher"), check_reproduces(second, text, ids_b, "student")
    assert_tiles(a, text)
    assert_tiles(b, text)
    alignment = Alignment.from_spans(a, b)
    assert_groups(alignment, text)
    if bos_a:
        assert alignment.groups[0] == (range(0, 1), range(0, 0))
    if eos_b:
        assert alignment.groups[-1] == (range(len(a), len(a)), range(len(b) - 1, len(b)))
    assert 0.0 <= alignment.one_to_one_share <= 1.0


def test_special_inside_a_group_stays_in_it():
    # A: "ab" | <eos> | "c" ; B: "abc" -- A's boundary at 2 is not B's, so the special token joins the group.
    assert align([(0, 2), (2, 2), (2, 3)], [(0, 3)]) == [(range(0, 3), range(0, 1))]
    # At a common boundary it is its own, unmatched group.
    assert align([(0, 1), (1, 1), (1, 3)], [(0, 1), (1, 3)]) == [
        (range(0, 1), range(0, 1)), (range(1, 2), range(1, 1)), (range(2, 3), range(1, 2))]


def test_align_refuses_different_bytes():
    with pytest.raises(ValueError, match="different bytes"):
        align([(0, 2), (2, 3)], [(0, 2)])
    with pytest.raises(ValueError, match="side B"):
        align([(0, 3)], [(0, 1), (2, 3)])


@pytest.mark.parametrize("name, text, index, char", [
    ("Lowercase", "ok Hello", 3, "'H'"),
    ("NFKC", "ab ﬁne", 3, "'ﬁ'"),
])
def test_lossy_tokenizer_is_refused(name, text, index, char):
    from tokenizers import normalizers

    tokenizer = lossy(getattr(normalizers, name)())
    with pytest.raises(ConfigError, match=rf"student tokenizer does not reproduce.*character {index} {char}"):
        check_reproduces(tokenizer, text, encode(tokenizer, text), "student")


def test_packaged_tokenizer_refuses_decomposed_text():
    text = "cafe\u0301"  # NFD: the packaged tokenizer's NFC normaliser composes it
    with pytest.raises(ConfigError, match=r"teacher tokenizer.*character 3 'e'"):
        check_reproduces(tiny(), text, encode(tiny(), text), "teacher")


def sentencepiece_like(prepend: str):
    """A SentencePiece-style BPE (Metaspace '▁' for spaces, byte fallback to ordinary ``<0xNN>`` vocabulary
    tokens for unseen characters), as Llama 2, Mistral and Gemma tokenizers are; ``prepend`` is Metaspace's
    prefix-space scheme."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=prepend)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<pad>", "<unk>"], show_progress=False)
    trained.train_from_iterator([f"{line} {k}" for k in range(30) for line in LINES[:3]], trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for byte in range(256):  # the byte tokens are ordinary vocabulary entries, as in Llama 2's tokenizer
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    backend = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=prepend)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens(["<s>", "</s>", "<pad>"])
    return _wrap(backend)


def test_sentencepiece_style_tokenizers_align_through_byte_fallback_or_are_refused_for_a_prefix_space():
    """Metaspace without a prefix space: '▁' is a space and ``<0xNN>`` tokens are bytes, so emoji and CJK
    it never saw (byte fallback) still tile the text and align with a byte-level BPE. With Llama 2's prefix
    space the tokens spell ' ' + text: refused, naming the first character."""
    text = "Emoji 🎉 and 東京 12 + 30 = 42"
    plain = sentencepiece_like("never")
    ids = encode(plain, text)
    assert any(name.startswith("<0x") for name in plain.convert_ids_to_tokens(ids))  # byte fallback is exercised
    spans = check_reproduces(plain, text, ids, "teacher")
    assert_tiles(spans, text)
    alignment = Alignment.from_spans(spans, check_reproduces(tiny(), text, encode(tiny(), text), "student"))
    assert_groups(alignment, text)
    with pytest.raises(ConfigError, match="teacher tokenizer does not reproduce.*character 0 'E'"):
        check_reproduces(sentencepiece_like("always"), text, encode(sentencepiece_like("always"), text), "teacher")


def test_a_vocabulary_with_holes_is_refused_naming_the_id():
    class Holes:
        name_or_path, all_special_ids, added_tokens_decoder = "holes", [], {}

        def convert_ids_to_tokens(self, ids):
            return [None if i == 3 else "a" for i in ids]

    with pytest.raises(ConfigError, match="'holes' has no token for id 3"):
        token_bytes(Holes(), [1, 2, 3])
