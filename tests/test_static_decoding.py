"""The decoder that is not launch-bound (``kdlab.rollouts.static_cache``) against today's: greedy decodes are
identical token for token to :class:`IncrementalLM` with a check after every token and to Hugging Face
``generate``; sampled decodes draw the same tokens from the same seeded generator and leave it in the same
state, while finished rows leave the batch and the finished check runs once every ``check_every`` tokens.
The real-model tier (SmolLM2) repeats the greedy comparison in ``tests/test_real_model.py``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kdlab.data import left_pad
from kdlab.models import ModelSpec, load_causal_lm, load_tokenizer
from kdlab.rollouts.decoding import (
    IncrementalLM,
    exponential_draw,
    incremental_decoder,
    sample_tokens,
)
from kdlab.rollouts.static_cache import CACHE_BUCKET, SHARED_PREFIX_MIN, StaticCacheLM, distributed, shared_prefix, static_cache_supported

ROLES = ("student", "teacher")


@pytest.fixture(scope="module", params=ROLES)
def tiny(request):
    spec = ModelSpec(f"kdlab://tiny-random/{request.param}")
    tokenizer, model = load_tokenizer(spec, request.param), load_causal_lm(spec, request.param).eval()
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randint(5, 300, (n,), generator=generator).tolist() for n in (5, 9, 3, 12, 7, 7, 2, 10)]
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    return model, tokenizer, ids, mask


def reference_decode(model, ids, mask, columns, temperature, steps, eos, pad, generator, greedy, stop=None):
    """Today's loop, written out: IncrementalLM, every row in the batch to the end, a check after every token
    (``stop``'s too), ``torch.multinomial`` on the whole batch. Returns ids, mask, entropy ``(B, C)``."""
    decoder = IncrementalLM(model, ids, mask, columns, temperature)
    finished = torch.zeros(ids.shape[0], dtype=torch.bool)
    tokens, masks, entropies, previous = [], [], [], None
    for step in range(steps):
        logprobs = decoder(previous)
        probs = logprobs.exp()
        token = logprobs.argmax(-1) if greedy else torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        token = torch.where(~finished, token, torch.full_like(token, pad))
        tokens.append(token), masks.append(~finished)
        entropies.append(torch.where(~finished, -(probs * logprobs.clamp(min=-1e30)).sum(-1), 0.0))
        now = finished | torch.isin(token, torch.tensor(eos)) | (step + 1 >= steps)
        if stop is not None:
            now = now | stop(torch.stack(tokens, 1), ~finished & ~now)
        finished = now
        if bool(finished.all()):
            break
        previous = token
    return torch.stack(tokens, 1), torch.stack(masks, 1), torch.stack(entropies, 1)


class Recorded:
    """A decoder whose ``keep_rows`` calls and batch sizes are recorded."""

    def __init__(self, decoder):
        self.decoder, self.batches, self.kept = decoder, [], []

    def __call__(self, previous):
        out = self.decoder(previous)
        self.batches.append(out.shape[0])
        return out

    def keep_rows(self, rows):
        self.kept.append(len(rows))
        self.decoder.keep_rows(rows)


def spread_end_tokens(reference_ids: torch.Tensor) -> tuple[int, ...]:
    """End tokens that end the rows of a greedy decode at spread lengths: the tokens rows 0-3 write at steps 2-5."""
    return tuple(sorted({int(reference_ids[row, 2 + row]) for row in range(4)}))


def test_a_static_cache_greedy_decode_equals_todays_and_generate(tiny):
    from transformers import GenerationConfig

    model, tokenizer, ids, mask = tiny
    columns, steps, pad = len(tokenizer), 24, tokenizer.pad_token_id
    free, _, _ = reference_decode(model, ids, mask, columns, 0.0, steps, (-1,), pad, None, True)
    eos = spread_end_tokens(free)
    want_ids, want_mask, want_entropy = reference_decode(model, ids, mask, columns, 0.0, steps, eos, pad, None, True)
    lengths = want_mask.sum(1)
    assert lengths.min() < steps // 2 < lengths.max(), "the end tokens must end rows at spread lengths"
    decoder = Recorded(StaticCacheLM(model, ids, mask, columns, 0.0, steps, compile="never"))
    got_ids, got_mask, got_entropy = sample_tokens(decoder, ids.shape[0], steps, eos, pad, None, greedy=True, check_every=4)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_mask, want_mask)
    torch.testing.assert_close(got_entropy, want_entropy)
    assert decoder.kept and min(decoder.batches) < ids.shape[0]  # finished rows left the batch
    assert decoder.batches[-1] == decoder.kept[-1]
    # Hugging Face generate, restricted to the tokenizer's columns as kdlab's decoders are
    config = GenerationConfig(do_sample=False, max_new_tokens=steps, eos_token_id=list(eos), pad_token_id=pad,
                              suppress_tokens=list(range(columns, model.config.vocab_size)))
    with torch.no_grad():
        theirs = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1]:]
    assert torch.equal(theirs, got_ids)


def test_a_static_cache_sampled_decode_draws_todays_tokens_and_leaves_the_generator_where_today_does(tiny):
    model, tokenizer, ids, mask = tiny
    columns, steps, pad = len(tokenizer), 24, tokenizer.pad_token_id
    free, _, _ = reference_decode(model, ids, mask, columns, 0.0, steps, (-1,), pad, None, True)
    eos = spread_end_tokens(free)
    want_gen, got_gen = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    want = reference_decode(model, ids, mask, columns, 1.0, steps, eos, pad, want_gen, False)
    decoder = Recorded(StaticCacheLM(model, ids, mask, columns, 1.0, steps, compile="never"))
    got = sample_tokens(decoder, ids.shape[0], steps, eos, pad, got_gen, check_every=5)
    assert want[1].sum(1).min() < want[1].shape[1], "some row must end early"
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2])
    assert torch.equal(got_gen.get_state(), want_gen.get_state())  # steps decoded past the end drew nothing kept
    assert len(decoder.batches) >= want[0].shape[1]


def test_stop_strings_are_read_only_at_the_checks_and_end_rows_where_a_check_after_every_token_does(tiny):
    from kdlab.rollouts.decoding import stop_strings_check

    model, tokenizer, ids, mask = tiny
    columns, steps, pad, check_every = len(tokenizer), 24, tokenizer.pad_token_id, 5
    stop = stop_strings_check(tokenizer, ["%}", "<|"])
    want_gen, got_gen = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    want = reference_decode(model, ids, mask, columns, 1.0, steps, (-1,), pad, want_gen, False, stop=stop)
    lengths = want[1].sum(1)
    assert lengths.min() < check_every and 2 * check_every < lengths.max(), "the stop strings must end rows at spread steps"
    assert (lengths % check_every != 0).any(), "some row must stop between two checks"
    decoder = Recorded(StaticCacheLM(model, ids, mask, columns, 1.0, steps, compile="never"))
    asked_after = []  # the decoder calls made when ``stop`` is asked

    def recorded_stop(tokens, rows):
        asked_after.append(len(decoder.batches))
        assert tokens.device.type == "cpu"
        return stop(tokens, rows)

    got = sample_tokens(decoder, ids.shape[0], steps, (-1,), pad, got_gen, stop=recorded_stop, check_every=check_every)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2])
    assert torch.equal(got_gen.get_state(), want_gen.get_state())
    assert asked_after and all(calls % check_every == 0 or calls == steps for calls in asked_after)  # never between checks
    assert decoder.kept, "rows a stop string ended must leave the batch"


def test_the_exponential_draw_is_torch_multinomials_one_sample_draw():
    probs = torch.softmax(torch.randn(6, 500), -1)
    mine, theirs = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for _ in range(20):
        assert torch.equal(exponential_draw(probs, mine, torch.arange(6), 6), torch.multinomial(probs, 1, generator=theirs).squeeze(-1))
    rows = torch.tensor([1, 4])
    drawn = exponential_draw(probs[rows], mine, rows, 6)
    assert torch.equal(drawn, torch.multinomial(probs, 1, generator=theirs).squeeze(-1)[rows])
    assert torch.equal(mine.get_state(), theirs.get_state())


def test_the_finished_check_and_the_collective_decision_run_once_every_check_every_tokens(tiny):
    model, tokenizer, ids, mask = tiny
    asked = []

    def all_done(local: bool) -> bool:
        asked.append(local)
        return local

    decoder = StaticCacheLM(model, ids, mask, len(tokenizer), 0.0, 20, compile="never")
    out, kept, _ = sample_tokens(decoder, ids.shape[0], 20, (-1,), tokenizer.pad_token_id, None, greedy=True, all_done=all_done, check_every=8)
    assert asked == [False, False, True] and out.shape == kept.shape == (ids.shape[0], 20)  # after 8, 16 and 20 tokens


def test_the_static_cache_is_rounded_up_and_refuses_to_decode_past_it(tiny):
    model, tokenizer, ids, mask = tiny
    decoder = StaticCacheLM(model, ids, mask, len(tokenizer), 0.0, 3, compile="never")
    length = decoder.step_mask.shape[-1]
    assert length % CACHE_BUCKET == 0 and length >= ids.shape[1] + 3
    previous = decoder(None).argmax(-1)
    for _ in range(length - ids.shape[1]):
        previous = decoder(previous).argmax(-1)
    with pytest.raises(RuntimeError, match="past its cache"):
        decoder(previous)
    with pytest.raises(ValueError, match="compile must be one of"):
        StaticCacheLM(model, ids, mask, len(tokenizer), 0.0, 3, compile="sometimes")


def test_models_with_sliding_window_layers_keep_the_dynamic_cache(tiny):
    model, tokenizer, ids, mask = tiny
    assert isinstance(incremental_decoder(model, ids, mask, len(tokenizer), 0.0, 4), StaticCacheLM)
    model.config.layer_types = ["sliding_attention", "full_attention"]
    try:
        assert isinstance(incremental_decoder(model, ids, mask, len(tokenizer), 0.0, 4), IncrementalLM)
    finally:
        model.config.layer_types = ["full_attention", "full_attention"]


@pytest.mark.slow
def test_the_compiled_decode_step_decodes_what_the_eager_one_does(tiny):
    """``compile="always"`` (inductor on a CPU; CUDA graphs on a GPU take the same path with ``reduce-overhead``)."""
    model, tokenizer, ids, mask = tiny
    eager = sample_tokens(StaticCacheLM(model, ids, mask, len(tokenizer), 0.0, 12, compile="never"), ids.shape[0], 12, (-1,), 0, None, greedy=True)
    compiled = sample_tokens(StaticCacheLM(model, ids, mask, len(tokenizer), 0.0, 12, compile="always"), ids.shape[0], 12, (-1,), 0, None, greedy=True)
    assert torch.equal(eager[0], compiled[0])


@pytest.mark.slow
def test_the_compiled_step_compiles_at_most_three_times_per_model_however_many_shapes_it_decodes():
    """A student and a teacher decoding at three batch sizes and two cache lengths each (rows leaving the batch
    give a decode new sizes too): at most three compilations per model (its first shape, then one more for each
    of batch and cache length when first seen to change), not one per shape: at ``dynamic=False`` the batch
    sizes alone took six of dynamo's eight recompiles per code object, and on the H200 the next shapes ran
    eagerly. Every compiled decode is still the eager one, token for token."""
    from torch._dynamo.utils import counters

    from kdlab.rollouts import static_cache

    torch._dynamo.reset()
    static_cache._COMPILED.clear()
    counters.clear()
    generator = torch.Generator().manual_seed(3)
    for role in ROLES:
        spec = ModelSpec(f"kdlab://tiny-random/{role}")
        tokenizer, model = load_tokenizer(spec, role), load_causal_lm(spec, role).eval()
        for batch, new_tokens in ((8, 6), (3, 6), (3, 70), (5, 6)):  # 70 new tokens: the next CACHE_BUCKET of cache length
            rows = [torch.randint(5, 300, (n,), generator=generator).tolist() for n in torch.randint(2, 12, (batch,), generator=generator).tolist()]
            ids, mask = left_pad(rows, tokenizer.pad_token_id)
            decode = [sample_tokens(StaticCacheLM(model, ids, mask, len(tokenizer), 0.0, new_tokens, compile=how), batch, new_tokens, (-1,), 0, None,
                                    greedy=True)[0] for how in ("never", "always")]
            assert torch.equal(*decode), (role, batch, new_tokens)
    assert counters["stats"]["unique_graphs"] <= 3 * len(ROLES)
    torch._dynamo.reset()
    static_cache._COMPILED.clear()


def test_eager_attention_takes_an_additive_mask_and_decodes_what_sdpa_does(tiny):
    model, tokenizer, ids, mask = tiny
    want = sample_tokens(StaticCacheLM(model, ids, mask, len(tokenizer), 0.0, 10, compile="never"), ids.shape[0], 10, (-1,), 0, None, greedy=True)[0]
    model.config._attn_implementation = "eager"
    try:
        decoder = StaticCacheLM(model, ids, mask, len(tokenizer), 0.0, 10, compile="never")
        assert decoder.step_mask.dtype == torch.float32
        assert torch.equal(sample_tokens(decoder, ids.shape[0], 10, (-1,), 0, None, greedy=True)[0], want)
    finally:
        model.config._attn_implementation = "sdpa"


def shared_prompts(tokenizer, prefix: int = 20, generator_seed: int = 1):
    """Eight left-padded prompts that begin with the same ``prefix`` tokens (a task's instruction), then 1-9
    tokens of their own."""
    generator = torch.Generator().manual_seed(generator_seed)
    head = torch.randint(5, 300, (prefix,), generator=generator).tolist()
    rows = [head + torch.randint(5, 300, (n,), generator=generator).tolist() for n in (3, 1, 9, 5, 2, 7, 4, 6)]
    return left_pad(rows, tokenizer.pad_token_id)


def test_prompts_that_begin_alike_are_prefilled_once_and_decode_as_the_whole_prefill_and_generate(tiny):
    """The shared leading tokens run as one row and are copied into each row's cache at its offset; the batch's
    prompt forward runs only over the columns after them. Greedy decodes equal the whole prefill's and
    ``generate``'s token for token, first-step log-probs agree to rounding, sampled decodes draw the same tokens."""
    from transformers import GenerationConfig

    model, tokenizer, _, _ = tiny
    ids, mask = shared_prompts(tokenizer)
    columns, steps, pad = len(tokenizer), 16, tokenizer.pad_token_id
    shared = StaticCacheLM(model, ids, mask, columns, 0.0, steps, compile="never")
    whole = StaticCacheLM(model, ids, mask, columns, 0.0, steps, compile="never", share_prefix=False)
    assert shared.shared == 20 and whole.shared == 0
    torch.testing.assert_close(shared(None), whole(None), atol=1e-5, rtol=0)
    got, _, _ = sample_tokens(StaticCacheLM(model, ids, mask, columns, 0.0, steps, compile="never"), 8, steps, (-1,), pad, None, greedy=True)
    want, _, _ = sample_tokens(StaticCacheLM(model, ids, mask, columns, 0.0, steps, compile="never", share_prefix=False), 8, steps, (-1,), pad, None, greedy=True)
    config = GenerationConfig(do_sample=False, max_new_tokens=steps, eos_token_id=None, pad_token_id=pad,
                              suppress_tokens=list(range(columns, model.config.vocab_size)))
    config.eos_token_id = model.config.vocab_size  # no end token, as on kdlab's side
    with torch.no_grad():
        theirs = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1]:]
    assert torch.equal(got, want) and torch.equal(got, theirs)
    drawn = [sample_tokens(StaticCacheLM(model, ids, mask, columns, 1.0, steps, compile="never", share_prefix=share), 8, steps, (-1,), pad,
                           torch.Generator().manual_seed(3))[0] for share in (True, False)]
    assert torch.equal(*drawn)


def test_the_shared_prefix_is_the_common_start_of_the_real_tokens_and_leaves_each_row_a_token():
    pad = 0
    head = list(range(10, 10 + SHARED_PREFIX_MIN + 4))
    ids, mask = left_pad([head + [1, 2], head + [3], head[:-1]], pad)
    assert shared_prefix(ids, mask) == len(head) - 2  # the shortest row keeps its last token to prefill itself
    ids, mask = left_pad([head + [1], head + [2]], pad)
    assert shared_prefix(ids, mask) == len(head)
    assert shared_prefix(ids[:1], mask[:1]) == 0  # one row: nothing to share
    short = head[: SHARED_PREFIX_MIN - 1]
    ids, mask = left_pad([short + [1], short + [2]], pad)
    assert shared_prefix(ids, mask) == 0  # below the floor
    ids, mask = left_pad([head + [1, 2], head + [3]], pad)
    assert shared_prefix(ids, mask) == len(head) and shared_prefix(ids, mask.flip(1)) == 0  # right padding: not the decoder's layout


def test_the_scaling_pages_shared_prefix_figure_is_the_decode_benchmarks():
    """docs/scaling.md's "126 of the 150 padded columns" is benchmarks/results/decode-cpu.json's SmolLM2 batch-8 row."""
    import json
    import re
    from pathlib import Path

    root = Path(__file__).parents[1]
    text = " ".join((root / "docs" / "scaling.md").read_text(encoding="utf-8").split())
    (shared, width), = re.findall(r"(\d+) of the (\d+) padded columns of SmolLM2's Countdown prompts at batch 8", text)
    (row,) = [r for r in json.loads((root / "benchmarks/results/decode-cpu.json").read_text())["results"]["smollm2"] if r["batch"] == 8]
    assert (int(shared), int(width)) == (row["shared_prompt_tokens"], row["prompt_tokens"])


@pytest.mark.parametrize("architecture", ["Mistral", "Phi3"])
def test_sliding_window_models_without_layer_types_keep_the_dynamic_cache_and_decode_past_the_window(architecture):
    """Mistral's and Phi-3's configs carry no ``layer_types``, only ``sliding_window``: such a model decodes with
    :class:`IncrementalLM`, past its window (prompts of 10 and 6 tokens, window 8, 20 new tokens), as Hugging
    Face ``generate`` decodes greedily."""
    import transformers

    config = getattr(transformers, f"{architecture}Config")(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        sliding_window=8, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = getattr(transformers, f"{architecture}ForCausalLM")(config).eval()
    assert "sliding_window=8" in static_cache_supported(model)
    generator = torch.Generator().manual_seed(2)
    ids, mask = left_pad([torch.randint(5, 300, (n,), generator=generator).tolist() for n in (10, 6)], 0)
    decoder = incremental_decoder(model, ids, mask, 300, 0.0, 20)
    assert isinstance(decoder, IncrementalLM)
    got_ids, got_mask, _ = sample_tokens(decoder, 2, 20, (-1,), 0, None, greedy=True)
    assert bool(got_mask.all())
    generation = transformers.GenerationConfig(do_sample=False, max_new_tokens=20, min_new_tokens=20, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        theirs = model.generate(input_ids=ids, attention_mask=mask, generation_config=generation)[:, ids.shape[1]:]
    assert torch.equal(theirs, got_ids)


def test_the_eager_step_of_an_unsharded_model_runs_in_inference_mode_and_hands_back_ordinary_log_probs(tiny):
    model, tokenizer, ids, mask = tiny
    modes = []
    hook = model.register_forward_pre_hook(lambda module, args: modes.append(torch.is_inference_mode_enabled()))
    try:
        decoder = StaticCacheLM(model, ids, mask, len(tokenizer), 1.0, 6)
        assert decoder.inference and not distributed()
        tokens, _, entropy = sample_tokens(decoder, ids.shape[0], 6, (), tokenizer.pad_token_id, torch.Generator().manual_seed(0))
        logprobs = decoder(tokens[:, -1])
    finally:
        hook.remove()
    assert modes and all(modes)  # the prompt forward and every step
    assert not logprobs.is_inference() and not tokens.is_inference() and not entropy.is_inference()
    assert not torch.is_inference_mode_enabled()
    # what it decoded trains: an ordinary tensor in a forward and a backward
    model.train()
    try:
        model(input_ids=torch.cat([ids, tokens], 1)).logits.logsumexp(-1).mean().backward()
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()
    # a compiled step keeps no_grad (one autograd mode for the captured graph): not asked to compile here, only built
    assert not StaticCacheLM(model, ids, mask, len(tokenizer), 1.0, 6, compile="always").inference


def test_a_sharded_model_decodes_under_no_grad_and_trains_on_what_it_decoded():
    """FSDP2 over one gloo process: in a process group the decoder keeps ``no_grad``; forced into inference mode, the
    training step after the decode fails (FSDP's gathered parameters became inference tensors). The FSDP1 root of a
    LoRA student called by its base teacher (no submodule of the decoder's model) is ``tests/test_distill_lora.py``'s."""
    worker, env = Path(__file__).with_name("inference_mode_worker.py"), {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(*extra):
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = str(free.getsockname()[1])
        return subprocess.run([sys.executable, str(worker), port, *extra], env=env, capture_output=True, text=True, timeout=300)

    kept = run()
    assert kept.returncode == 0, kept.stderr[-3000:]
    assert "inference False" in kept.stdout and "backward ok" in kept.stdout
    forced = run("force")
    assert forced.returncode != 0 and "Inference tensors" in forced.stderr, forced.stdout + forced.stderr[-2000:]


@pytest.mark.parametrize("share_prefix", [False, True])
def test_a_prefill_of_more_than_prefill_tokens_runs_a_group_of_rows_at_a_time_and_decodes_as_the_whole_prefill(tiny, share_prefix):
    """``prefill_tokens`` small enough for groups of 3 rows (and a last group of 2): every group's forward writes its
    own rows of the cache (the first group's allocated layers widened to the batch); the log-probs equal the one-forward
    prefill's to rounding and the greedy decode is the same token for token, with or without a shared prefix."""
    model, tokenizer, ids, mask = tiny
    if share_prefix:
        ids, mask = shared_prompts(tokenizer)
    columns, steps = len(tokenizer), 12
    whole = StaticCacheLM(model, ids, mask, columns, 0.0, steps, share_prefix=share_prefix)
    assert bool(whole.shared) == share_prefix
    # the prompt forward runs the columns after the shared prefix: the longest prompt less the shared tokens
    columns_run = int(mask.sum(1).max()) - whole.shared if whole.shared else ids.shape[1]
    grouped = StaticCacheLM(model, ids, mask, columns, 0.0, steps, share_prefix=share_prefix, prefill_tokens=3 * columns_run)
    forwards = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: forwards.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    try:
        first = grouped(None)
    finally:
        hook.remove()
    assert forwards == ([1, 3, 3, 2] if share_prefix else [3, 3, 2])  # the shared prefix's one row first
    torch.testing.assert_close(first, whole(None), rtol=1e-5, atol=1e-5)
    for layer in grouped.cache.layers:
        assert layer.keys.shape[0] == ids.shape[0] and int(layer.cumulative_length) == ids.shape[1]
    for decoder in (whole, grouped):
        decoder.__init__(model, ids, mask, columns, 0.0, steps, share_prefix=share_prefix, prefill_tokens=decoder.prefill_tokens)
    tokens = [sample_tokens(decoder, ids.shape[0], steps, (), tokenizer.pad_token_id, None, greedy=True)[0] for decoder in (whole, grouped)]
    assert torch.equal(tokens[0], tokens[1])
