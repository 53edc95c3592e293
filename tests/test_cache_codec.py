"""The compact teacher cache (``compact-v1``, :mod:`kdlab.rollouts.cache_codec`): rows round-trip within the
documented bound, the file stays within 300 bytes per token at k = 128, the tiny world's KL from it is the
full cache's, and ``kdlab generate --top_k`` writes it."""

import json
import re
import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kdlab.rollouts import cache_codec as codec
from kdlab.rollouts.teacher_cache import TeacherCache, prompt_digest, top_k_logprobs, write_cache

PROMPT = [1, 2, 3]  # the teacher prompt every hand-made row here follows
DIGEST = prompt_digest(PROMPT)


def teacher_rows(rows: int, vocab: int, k: int, seed: int, scale: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ``(indices, logprobs)`` ``(rows, k)`` of random tempered logits, spread out enough that ``u``
    covers the clip; the last row is a padding-like flat one (every entry ties with the max)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator) * scale * torch.rand(rows, 1, generator=generator) * 4
    logits[-1] = 0.0
    return top_k_logprobs(logits, k, temperature=0.5)


def check_round_trip(indices: torch.Tensor, logprobs: torch.Tensor, vocab: int, bits: int, u0: float = codec.DEFAULT_U0,
                     clip: float = codec.DEFAULT_CLIP) -> None:
    rows, k = indices.shape
    r, logprob_map = codec.rice_parameter(vocab, k), codec.LogprobMap(bits, u0, clip)
    tokens = torch.arange(rows) % vocab
    data = codec.encode_example(tokens, indices, logprobs, vocab, r, logprob_map)
    assert torch.equal(codec.decode_tokens(data, k, vocab, r, logprob_map), tokens)
    got_indices, got = codec.decode_rows(data, rows, k, vocab, r, logprob_map)
    assert got_indices.dtype == torch.int64 and got.dtype == torch.float32 and got.shape == (rows, k)
    assert torch.equal(got_indices.sort(-1).values, indices.sort(-1).values)  # ids exactly
    top = logprobs.max(-1)
    assert torch.equal(got[:, 0], top.values)  # rank order: the max first, exactly
    assert torch.equal(logprobs[indices == got_indices[:, :1]], top.values)  # ... at an id that holds it
    # every entry within beta(u) + the row's renormalisation bound (+ fp32 rounding of the two log-probs)
    exact = logprobs.gather(-1, indices.argsort(-1)).double()
    decoded = got.gather(-1, got_indices.argsort(-1)).double()
    u = top.values.double()[:, None] - exact
    bound = logprob_map.error_bound(u) + codec.renormalisation_bound(logprobs, logprob_map)[:, None]
    slack = 2e-7 * (1 + exact.abs() + decoded.abs())
    assert bool(((decoded - exact).abs() <= bound + slack).all()), float(((decoded - exact).abs() - bound).max())
    if rows > 1:  # a prefix of the rows is the prefix of the decode
        prefix = codec.decode_rows(data, rows - 1, k, vocab, r, logprob_map)
        assert torch.equal(prefix[0], got_indices[:-1]) and torch.equal(prefix[1], got[:-1])


@pytest.mark.parametrize("vocab", [50, 999, 49152, 151936])
@pytest.mark.parametrize("k", [1, 20, 128])
@pytest.mark.parametrize("bits", [4, 6, 8, 16])
def test_rows_round_trip_ids_exactly_and_log_probs_within_the_bound(vocab, k, bits):
    k = min(k, vocab)
    indices, logprobs = teacher_rows(12, vocab, k, seed=vocab + k + bits)
    check_round_trip(indices, logprobs, vocab, bits)


@settings(max_examples=60, deadline=None)
@given(vocab=st.integers(1, 3000), k_share=st.floats(0.0, 1.0), rows=st.integers(1, 6), bits=st.integers(4, 16),
       u0=st.sampled_from([0.05, 1.0, 8.0]), clip=st.sampled_from([4.0, 64.0]), seed=st.integers(0, 2**16), scale=st.floats(0.0, 40.0))
def test_any_rows_round_trip(vocab, k_share, rows, bits, u0, clip, seed, scale):
    """Any V, k <= V (k = V included), flat rows, entries past the clip: the same guarantees."""
    k = max(1, round(k_share * vocab))
    check_round_trip(*teacher_rows(rows, vocab, k, seed, scale), vocab, bits, u0, clip)


def test_the_exact_teacher_the_largest_vocabulary_and_too_large_a_k(tmp_path):
    check_round_trip(*teacher_rows(4, 447, 447, seed=1), 447, bits=6)  # k = V: all V entries stored
    check_round_trip(*teacher_rows(3, 2**18, 128, seed=2), 2**18, bits=6)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 50\]"):
        codec.rice_parameter(50, 51)
    rows = {"a": {"tokens": torch.tensor([1]), "indices": torch.zeros(1, 51, dtype=torch.long), "logprobs": torch.zeros(1, 51), "prompt_sha256": DIGEST}}
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 50\]"):
        write_cache(tmp_path / "c.safetensors", rows, {"top_k": 51, "temperature": 1.0, "token_columns": 50})
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 50\)"):
        rows = {"a": {"tokens": torch.tensor([1]), "indices": torch.tensor([[3, 50]]), "logprobs": torch.zeros(1, 2), "prompt_sha256": DIGEST}}
        write_cache(tmp_path / "c.safetensors", rows, {"top_k": 2, "temperature": 1.0, "token_columns": 50})
    with pytest.raises(ValueError, match="logprob_bits must be an integer in"):
        codec.LogprobMap(17)
    empty = {"a": {"tokens": torch.zeros(0, dtype=torch.long), "indices": torch.zeros(0, 4, dtype=torch.long), "logprobs": torch.zeros(0, 4),
                   "prompt_sha256": DIGEST}}
    write_cache(tmp_path / "empty.safetensors", empty, {"top_k": 4, "temperature": 1.0, "token_columns": 50})
    assert TeacherCache(str(tmp_path / "empty.safetensors")).row("a", [], PROMPT)[0].shape == (0, 4)


def random_cache_rows(vocab: int) -> dict:
    """64 examples x 64 tokens of k = 128 distinct ids uniform over the vocabulary: benchmarks/cache_size.py's rows."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from cache_size import synthetic_rows

    return synthetic_rows(64, 64, 128, vocab=vocab)  # each after the teacher prompt cache_size.SYNTHETIC_PROMPT


@pytest.mark.parametrize("vocab", [151936, 49152])
def test_a_compact_cache_takes_at_most_300_bytes_per_token_at_k_128(vocab, tmp_path):
    """Uniformly random ids at k = 128, 64 examples x 64 tokens: the stored tensors and the real file (its
    safetensors header included) within 300 bytes per token; the full format takes over 1,500."""
    from safetensors import safe_open

    rows = random_cache_rows(vocab)
    from cache_size import SYNTHETIC_PROMPT  # (benchmarks/, which random_cache_rows put on the path)

    tokens = sum(row["tokens"].numel() for row in rows.values())
    metadata = {"top_k": 128, "temperature": 0.5, "token_columns": vocab, "teacher": "t"}
    sizes = {}
    for cache_format in ("compact", "full"):
        path = tmp_path / f"{cache_format}.safetensors"
        write_cache(path, rows, metadata, cache_format=cache_format)
        with safe_open(str(path), framework="pt") as handle:
            stored = sum(handle.get_tensor(key).nbytes for key in handle.keys())
        sizes[cache_format] = (stored / tokens, path.stat().st_size / tokens)
    cache = TeacherCache(str(tmp_path / "compact.safetensors"))
    print(f"V = {vocab}: logprob_bits {cache.logprob_map.bits}, bytes per token (tensors, file): {sizes}")
    assert sizes["compact"][0] <= sizes["compact"][1] <= 300
    assert sizes["full"][0] > 1500 and cache.logprob_map.bits >= 6
    full = TeacherCache(str(tmp_path / "full.safetensors"))
    for example_id in ("synthetic-0", "synthetic-63"):
        tokens_of = rows[example_id]["tokens"].tolist()
        (a, la), (b, lb) = full.row(example_id, tokens_of, SYNTHETIC_PROMPT), cache.row(example_id, tokens_of, SYNTHETIC_PROMPT)
        assert torch.equal(a.sort(-1).values, b.sort(-1).values) and torch.equal(la[:, 0], lb[:, 0])


def test_the_tiny_worlds_kl_from_a_compact_cache_is_the_full_caches(tmp_path):
    """The packaged tiny teacher's top-128 on its own Countdown completions, cached both ways from the same
    outputs; forward and reverse KL of the packaged tiny student against each agree within 1e-3 nats."""
    from safetensors.torch import load_file

    from kdlab.models import ModelSpec
    from kdlab.objectives import ForwardKL, ReverseKL
    from kdlab.rollouts import CachedTeacherRollouts
    from kdlab.rollouts.teacher_data import generate_teacher_data
    from kdlab.stages import DistillModule
    from kdlab.tiny.world import countdown

    task = countdown(num_train=16, num_val=0, num_test=0)
    data = tmp_path / "teacher.jsonl"
    generate_teacher_data(ModelSpec("kdlab://tiny/teacher"), task, str(data), max_new_tokens=64, top_k=128, cache_temperature=0.5,
                          cache_format="full", batch_size=16)
    full = str(data) + ".topk.safetensors"
    stored, digests = load_file(full), json.loads(TeacherCache(full)._file.metadata()["teacher_prompts"])
    rows = {key[: -len("/tokens")]: {**{name: stored[key[: -len("tokens")] + name] for name in ("tokens", "indices", "logprobs")},
                                     "prompt_sha256": digests[key[: -len("/tokens")]]}
            for key in stored if key.endswith("/tokens")}
    compact = str(tmp_path / "compact.safetensors")
    cache = TeacherCache(full)
    write_cache(compact, rows, {"top_k": 128, "temperature": 0.5, "token_columns": cache.token_columns, "teacher": cache.teacher})
    tokens = sum(row["tokens"].numel() for row in rows.values())
    bits = TeacherCache(compact).logprob_map.bits
    values = {}
    batch = task.examples("train")
    for name, path in (("full", full), ("compact", compact)):
        module = DistillModule("kdlab://tiny/student", None, task, rollout=CachedTeacherRollouts(str(data), path), max_completion_tokens=64,
                               batch_size=16, fused_lm_head=False)
        with torch.no_grad():
            rollout = module.make_rollout(batch, 0)
            student, teacher = module.distillation_logits(rollout)
            mask = rollout.completion_mask
            values[name] = {kl: float(objective(student, teacher, mask)) for kl, objective in (("forward", ForwardKL()), ("reverse", ReverseKL()))}
    assert teacher.indices.shape[-1] == 128 and teacher.token_columns == 447 and int(mask.sum()) == tokens > 300
    differences = {kl: values["compact"][kl] - values["full"][kl] for kl in ("forward", "reverse")}
    print(f"tiny world, {tokens} tokens, logprob_bits {bits}, {(tmp_path / 'compact.safetensors').stat().st_size / tokens:.1f} bytes/token: "
          f"KL {values['full']}, compact - full {differences}")
    assert all(abs(difference) < 1e-3 for difference in differences.values()), differences


def test_unknown_and_corrupt_compact_files_are_refused_naming_the_setting_and_file(tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "cache.safetensors"
    rows = {"a": {"tokens": torch.tensor([5, 6, 7]), "indices": torch.tensor([[1, 4]] * 3), "logprobs": torch.log(torch.tensor([[0.5, 0.25]] * 3)),
                  "prompt_sha256": DIGEST}}
    write_cache(path, rows, {"top_k": 2, "temperature": 0.5, "token_columns": 10, "teacher": "t"})
    cache = TeacherCache(str(path))
    tensors, metadata = load_file(str(path)), dict(cache._file.metadata())
    setting = "CachedTeacherRollouts.teacher_cache"

    def rewrite(name, tensors=tensors, **changes):
        changed = tmp_path / name
        save_file(tensors, str(changed), metadata={key: value for key, value in {**metadata, **changes}.items() if value is not None})
        return str(changed)

    with pytest.raises(ValueError, match=rf"{setting} '.*future.safetensors': unknown teacher cache format 'compact-v9'"):
        TeacherCache(rewrite("future.safetensors", format="compact-v9"))
    with pytest.raises(ValueError, match=rf"{setting} '.*no_r.safetensors': corrupt compact-v1 metadata"):
        TeacherCache(rewrite("no_r.safetensors", rice_r=None))
    with pytest.raises(ValueError, match="corrupt compact-v1 metadata"):
        TeacherCache(rewrite("bits.safetensors", logprob_bits="99"))
    short = rewrite("short.safetensors", tensors={"a/rows": tensors["a/rows"][:-3]})
    with pytest.raises(ValueError, match=rf"{setting} .*short.safetensors: example 'a' is not readable as compact-v1"):
        TeacherCache(short).row("a", [5, 6, 7], PROMPT)
    with pytest.raises(ValueError, match=r"example 'a' is not readable as compact-v1"):
        TeacherCache(rewrite("renamed.safetensors", tensors={"a/tokens": torch.tensor([5])})).row("a", [5], PROMPT)


def test_generate_top_k_writes_the_compact_format_unless_told_full(tmp_path):
    """``kdlab generate --top_k K`` writes ``compact-v1`` (``--cache_format full``: the format without a
    ``format`` key); ``CachedTeacherRollouts`` reads both, to the same ids and maxima."""
    from kdlab.cli.main import main

    config = tmp_path / "generate.yaml"
    config.write_text("teacher: {path: kdlab://tiny-random/teacher}\ntask: {class_path: kdlab.tasks.Addition, init_args: {num_train: 3}}\n"
                      f"output: {tmp_path}/teacher.jsonl\nmax_new_tokens: 4\n")
    caches = {}
    for cache_format in ("compact", "full"):
        main(["generate", f"--config={config}", "--top_k=16", *([] if cache_format == "compact" else ["--cache_format=full"])])
        path = tmp_path / f"{cache_format}.safetensors"
        (tmp_path / "teacher.jsonl.topk.safetensors").rename(path)
        caches[cache_format] = TeacherCache(str(path))
    metadata = caches["compact"]._file.metadata()
    assert caches["compact"].format == metadata["format"] == "compact-v1" and "format" not in caches["full"]._file.metadata()
    assert int(metadata["logprob_bits"]) == 16  # a small vocabulary and k affords the most bits within 300 bytes a token
    from kdlab.data import encode_prompts
    from kdlab.models import ModelSpec, load_tokenizer
    from kdlab.tasks import Addition

    tokenizer, examples = load_tokenizer(ModelSpec("kdlab://tiny-random/teacher")), Addition(num_train=3).examples("train")
    prompts = dict(zip([e["id"] for e in examples], encode_prompts(Addition(num_train=3), examples, tokenizer, tokenizer, 2048, 0).prompt_tokens("teacher")))
    for example_id in caches["full"].ids:
        tokens = caches["full"]._file.get_tensor(f"{example_id}/tokens").tolist()
        (a, la), (b, lb) = (caches[name].row(example_id, tokens, prompts[example_id]) for name in ("full", "compact"))
        assert torch.equal(a.sort(-1).values, b.sort(-1).values) and torch.equal(la[:, 0], lb[:, 0])
        torch.testing.assert_close(lb.gather(-1, b.argsort(-1)), la.gather(-1, a.argsort(-1)), atol=1e-3, rtol=0)
    with pytest.raises(ValueError, match=r"generate.cache_format must be one of \('compact', 'full'\), got 'zip'"):
        main(["generate", f"--config={config}", "--top_k=16", "--cache_format=zip"])
    with pytest.raises(ValueError, match=r"generate.cache_logprob_bits must be null or an integer in \[4, 16\], got 3"):
        main(["generate", f"--config={config}", "--top_k=16", "--cache_logprob_bits=3"])


def test_the_map_and_the_bits_it_chooses():
    logprob_map = codec.LogprobMap(6, 1.0, 64.0)
    u = torch.tensor([0.0, 0.5, 3.0, 64.0, 70.0, math.inf], dtype=torch.float64)
    codes = logprob_map.encode(u)
    assert codes.tolist()[0] == 1 and codes.tolist()[-3:] == [63, 63, 63] and logprob_map.decode(torch.tensor([0])).item() == 0.0
    assert logprob_map.decode(codes)[3].item() == pytest.approx(64.0)
    assert logprob_map.error_bound(u)[4].item() == pytest.approx(6.0)  # past the clip: u - U
    assert json.loads(json.dumps(logprob_map.metadata())) == {"logprob_bits": "6", "logprob_u0": "1.0", "logprob_clip": "64.0"}
    # 1,000 tokens, 100 bytes each besides the codes of its 128 entries: 12 bits make 292 bytes a token, 13 bits 308
    assert codec.choose_bits({"a/rows": (100_000, 128_000)}, 1000, {}) == 12
    assert codec.choose_bits({"a/rows": (250_000, 128_000)}, 1000, {}) == codec.MIN_BITS


# ---- hostile files (issue #41 item 4): a named error, never a crash, a hang or a huge allocation ----------
HOSTILE_ROWS = {name: {"tokens": torch.tensor(tokens), "indices": indices, "logprobs": logprobs, "prompt_sha256": DIGEST}
                for name, tokens, (indices, logprobs) in (("a", [5, 6, 7, 8], teacher_rows(4, 40, 3, 0)), ("b", [9, 1], teacher_rows(2, 40, 3, 1)))}


def hostile_file(tmp_path, cache_format: str) -> bytes:
    path = tmp_path / f"valid-{cache_format}.safetensors"
    write_cache(path, HOSTILE_ROWS, {"top_k": 3, "temperature": 0.5, "token_columns": 40, "teacher": "t"}, cache_format=cache_format)
    return path.read_bytes()


def read_all(path: Path) -> None:
    """Open ``path`` and read every example: either a ValueError/KeyError naming the file, or rows that are
    valid (ids in [0, 40), none twice in a row, log-probs not NaN and at most 0)."""
    try:
        cache = TeacherCache(str(path))
        for name, row in HOSTILE_ROWS.items():
            indices, logprobs = cache.row(name, row["tokens"].tolist(), PROMPT)
            assert indices.shape == logprobs.shape == (row["tokens"].numel(), 3)
            assert int(indices.min()) >= 0 and int(indices.max()) < 40
            assert all(len(set(r)) == 3 for r in indices.tolist())
            assert not bool(torch.isnan(logprobs).any()) and float(logprobs.max()) <= 1e-3
    except (ValueError, KeyError) as error:
        assert str(path) in str(error), error


@pytest.mark.parametrize("cache_format", ["compact", "full"])
@settings(max_examples=120, deadline=5000)
@given(data=st.data())
def test_mutated_and_truncated_cache_files_give_a_named_error_or_valid_rows(tmp_path_factory, cache_format, data):
    """Random byte overwrites (anywhere: header, metadata, tensors), extreme 32-bit values written over a
    tensor's bytes, and truncations of a valid file of either format: every read ends in a ValueError or
    KeyError naming the file, or gives valid rows; never another exception, a hang (the deadline) or a crash."""
    folder = tmp_path_factory.mktemp("hostile")
    original = bytearray(hostile_file(folder, cache_format))
    header = 8 + int.from_bytes(original[:8], "little")
    kind = data.draw(st.sampled_from(["bytes", "int32", "truncate"]))
    if kind == "truncate":
        mutated = original[: data.draw(st.integers(0, len(original) - 1))]
    else:
        mutated = bytearray(original)
        for _ in range(data.draw(st.integers(1, 6))):
            if kind == "bytes":
                mutated[data.draw(st.integers(0, len(original) - 1))] = data.draw(st.integers(0, 255))
            else:
                at = data.draw(st.integers(header, len(original) - 4))
                value = data.draw(st.sampled_from([0x7FFFFFFF, -1, -(2**31), 2**24, 0x7F800000, 0x7FC00000, 0xFF800000 - 2**32]))
                mutated[at : at + 4] = value.to_bytes(4, "little", signed=True)
    path = folder / "mutated.safetensors"
    path.write_bytes(bytes(mutated))
    read_all(path)


@pytest.mark.parametrize("key, value, message", [
    ("rice_r", "9", "rice_r 9, not the 3 of top_k 3 over 40 columns"), ("token_columns", "99999999999", "token_columns 99999999999"),
    ("top_k", "-3", "top_k -3"), ("temperature", "nan", "temperature nan"), ("top_k", "x", "invalid literal for int()"),
    ("teacher_prompts", "[]", "teacher_prompts: not a JSON object of SHA-256 digests"), ("teacher_prompts", '{"a": "x"}', "teacher_prompts"),
])
def test_hostile_metadata_is_refused_naming_the_file(tmp_path, key, value, message):
    from safetensors.torch import load_file, save_file

    hostile_file(tmp_path, "compact")
    valid = tmp_path / "valid-compact.safetensors"
    metadata = dict(TeacherCache(str(valid))._file.metadata())
    path = tmp_path / "bad.safetensors"
    save_file(load_file(str(valid)), str(path), metadata={**metadata, key: value})
    with pytest.raises(ValueError, match=rf"teacher_cache '.*bad.safetensors': corrupt .*{re.escape(message)}"):
        TeacherCache(str(path))


def test_a_long_id_stream_is_unpacked_only_as_far_as_valid_rows_reach(tmp_path, monkeypatch):
    """An example whose unary stream is 2 MB of zero bytes (16 million terminators) after a valid file's
    rows: only the bytes n valid rows can take are unpacked (today all of it: 64 times its size); one of
    0xFF bytes (quotients past the token columns) is refused, not shifted into negative ids."""
    from safetensors.torch import load_file, save_file

    hostile_file(tmp_path, "compact")
    valid = tmp_path / "valid-compact.safetensors"
    metadata, tensors = dict(TeacherCache(str(valid))._file.metadata()), load_file(str(valid))
    unpacked: list[int] = []
    original = codec.unpack_bits
    monkeypatch.setattr(codec, "unpack_bits", lambda data: unpacked.append(data.numel()) or original(data))
    rows = load_file(str(valid))["a/rows"]
    unary = codec._layout(rows, 3, 40, 3, int(metadata["logprob_bits"]))[1][5]
    for fill, outcome in ((0, None), (255, "not readable as compact-v1")):  # after the valid stream; in place of it
        kept = rows if fill == 0 else rows[:unary]
        tensors["a/rows"] = torch.cat([kept, torch.full((2 << 20,), fill, dtype=torch.uint8)])
        path = tmp_path / f"long-{fill}.safetensors"
        save_file(tensors, str(path), metadata=metadata)
        unpacked.clear()
        if outcome is None:
            TeacherCache(str(path)).row("a", [5, 6, 7, 8], PROMPT)
        else:
            with pytest.raises(ValueError, match=outcome):
                TeacherCache(str(path)).row("a", [5, 6, 7, 8], PROMPT)
        assert max(unpacked) <= 64  # the fixed-width sections' bytes and n (k + (V - 1) >> r) bits of the stream, not 2 MB
