"""Packing models whose layers attend over a sliding window (:mod:`kdlab.rollouts.packing`,
:mod:`kdlab.rollouts.segment_attention`): each packed sequence attends within its own sequence to the window's keys,
as Hugging Face's masks have it, so packed logits are each sequence's own forward for Mistral, Phi-3, Qwen2 with
``use_sliding_window`` and Gemma2 (alternating sliding and full layers) with sequences longer than the window,
through segment attention and through the 4D mask; Qwen2.5's configs (a ``sliding_window`` with
``use_sliding_window: false``) read as full attention; layers of another kind are still refused."""

import pytest
import torch

from kdlab.data import PromptBatch, Rollout, left_pad, right_pad
from kdlab.models.loading import attention_windows, layer_kinds, windowed_attention
from kdlab.rollouts import packing
from kdlab.rollouts.packing import Packed

WINDOW, VOCAB = 4, 300
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_model(family: str, full: bool = False) -> torch.nn.Module:
    """A tiny random ``family`` model (no hub) whose layers slide over ``WINDOW`` keys (Qwen2: the second layer
    only, ``max_window_layers=1``; Qwen2-MoE and Gemma2: the first), or with ``full`` its every layer full."""
    import transformers

    window = None if full else WINDOW
    if family == "mistral":
        config = transformers.MistralConfig(sliding_window=window, head_dim=16, **SIZES)
    elif family == "phi3":
        config = transformers.Phi3Config(sliding_window=window, **SIZES)
    elif family == "qwen2":
        config = transformers.Qwen2Config(use_sliding_window=not full, sliding_window=WINDOW, max_window_layers=1, **SIZES)
    elif family == "qwen2_moe":  # slides through its mask only: its attention is passed no window
        config = transformers.Qwen2MoeConfig(use_sliding_window=not full, sliding_window=WINDOW, max_window_layers=1, num_experts=4,
                                             num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, **SIZES)
    else:
        config = transformers.Gemma2Config(sliding_window=WINDOW, head_dim=16, attn_logit_softcapping=5.0, final_logit_softcapping=None,
                                           layer_types=["full_attention"] * 2 if full else None, **SIZES)
        config._attn_implementation = "eager"  # Gemma2's soft-capping: eager attention
    torch.manual_seed(0)
    model = getattr(transformers, f"{type(config).__name__.removesuffix('Config')}ForCausalLM")(config).eval()
    with torch.no_grad():  # sharp attention, so keys outside the window would move the logits
        for layer in model.model.layers:
            attention = layer.self_attn  # Phi-3 projects queries, keys and values in one qkv_proj, queries first
            query = attention.q_proj.weight if hasattr(attention, "q_proj") else attention.qkv_proj.weight[: config.hidden_size]
            query.mul_(4)
    return model


def ragged_rollout(lengths=((5, 7), (1, 3), (9, 2), (3, 11))):
    """Four sequences, the longest 14 tokens (past a window of 4), with their prompts and completions."""
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (p,), generator=generator).tolist() for p, _ in lengths]
    completions = [torch.randint(3, VOCAB, (c,), generator=generator).tolist() for _, c in lengths]
    prompt_ids, prompt_mask = left_pad(prompts, 0)
    completion_ids, completion_mask = right_pad(completions, 0)
    rollout = Rollout(PromptBatch(list(range(len(lengths))), prompt_ids, prompt_mask, prompt_ids, prompt_mask), completion_ids, completion_mask)
    return rollout, prompts, completions


def alone_logits(model, prompts, completions, width):
    """``(B, width, V)``: each sequence's own forward (no padding, no packing), at its completion positions."""
    logits = torch.zeros(len(prompts), width, VOCAB)
    with torch.no_grad():
        for row, (prompt, completion) in enumerate(zip(prompts, completions)):
            out = model(input_ids=torch.tensor([prompt + completion]), use_cache=False).logits[0]
            logits[row, : len(completion)] = out[len(prompt) - 1 : len(prompt) - 1 + len(completion)]
    return logits


@pytest.mark.parametrize("attention", ["segments", "mask"])
@pytest.mark.parametrize("family", ["mistral", "phi3", "qwen2", "qwen2_moe", "gemma2"])
def test_packed_logits_of_a_sliding_window_model_are_each_sequences_own_past_the_window(family, attention, monkeypatch):
    """Sequences up to 14 tokens against a window of 4: the packed logits (one row through segment attention, or
    rows of the budget under the 4D mask, one mask per layer kind where the config has ``layer_types``) equal each
    sequence's own Hugging Face forward, which the window changes (the full-attention twin's logits differ)."""
    if attention == "mask":
        monkeypatch.setattr(packing, "segments_apply", lambda model: False)
    model = tiny_model(family)
    rollout, prompts, completions = ragged_rollout()
    mask = rollout.completion_mask
    alone = alone_logits(model, prompts, completions, mask.shape[1])
    layout = Packed(16)
    layout.check_model(model.config, "the student")
    with torch.no_grad():
        rows = layout.pack(rollout, "student", model=model).shape[0]
        packed = layout.completion_logits(model, rollout, "student", VOCAB)
    assert rows == (1 if attention == "segments" else 3)
    torch.testing.assert_close(packed[mask], alone[mask], atol=1e-5, rtol=0)
    unwindowed = alone_logits(tiny_model(family, full=True), prompts, completions, mask.shape[1])
    assert (unwindowed[mask] - alone[mask]).abs().max() > 1e-2  # the window matters to these sequences


def test_segment_attention_slides_as_hugging_faces_sliding_window_mask():
    """A window of ``W`` keys: the query at position ``i`` attends to ``i - W + 1 .. i`` of its own sequence, as
    Hugging Face's ``sliding_window_causal_mask_function`` has it (the window is passed as the models pass it)."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    from kdlab.rollouts.segment_attention import segment_attention

    generator = torch.Generator().manual_seed(0)
    lengths, heads, dim = [9, 2, 6], 2, 8
    total = sum(lengths)
    q, k, v = (torch.randn(1, heads, total, dim, generator=generator) for _ in range(3))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    out, _ = segment_attention(torch.nn.Module(), q, k, v, None, scaling=dim**-0.5, position_ids=positions, sliding_window=3)
    slide = sliding_window_causal_mask_function(3)
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    allowed = torch.tensor([[bool(segment[i] == segment[j]) and bool(slide(0, 0, positions[0, i], positions[0, j]))
                             for j in range(total)] for i in range(total)])
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=dim**-0.5).transpose(1, 2)
    torch.testing.assert_close(out, reference, atol=1e-6, rtol=1e-6)
    assert allowed[8].sum() == 3  # the 9th token of the first sequence reads its last 3 keys


def test_qwen2_5s_sliding_window_with_use_sliding_window_false_is_full_attention():
    """Qwen2.5's configs carry ``sliding_window: 32768`` (or 131072) and ``max_window_layers`` with
    ``use_sliding_window: false``: every layer is full attention, as Qwen2's attention reads it."""
    from transformers import Qwen2Config

    config = Qwen2Config(use_sliding_window=False, sliding_window=32768, max_window_layers=28, num_hidden_layers=4)
    assert windowed_attention(config) is None
    assert attention_windows(config) == [None] * 4
    sliding = Qwen2Config(use_sliding_window=True, sliding_window=4, max_window_layers=1, num_hidden_layers=2)
    assert layer_kinds(sliding) == ["full_attention", "sliding_attention"] and attention_windows(sliding) == [None, 4]


def test_a_window_the_model_passes_that_its_config_does_not_give_is_an_error():
    """Segment attention reads each layer's window from its config (Qwen2-MoE and PhiMoE slide through their mask
    only, passing the attention no window); a window passed that the config does not give fails, naming both."""
    from kdlab.rollouts.segment_attention import segment_attention

    model = tiny_model("qwen2")
    attention = model.model.layers[0].self_attn  # a full-attention layer (max_window_layers=1)
    q = k = v = torch.zeros(1, 4, 6, 16)
    with pytest.raises(ValueError, match=r"layer 0 \(Qwen2Attention\) passed sliding_window=4, its config's layers give None"):
        segment_attention(attention, q, k, v, None, position_ids=torch.arange(6)[None], sliding_window=4)


def test_segment_attention_refuses_attention_sinks():
    """GPT-OSS's attention sinks (``s_aux``) are an extra logit column that segment attention does not apply."""
    from kdlab.rollouts.segment_attention import segment_attention

    q = k = v = torch.zeros(1, 2, 3, 8)
    with pytest.raises(ValueError, match=r"does not apply Module's attention sinks \(s_aux\).*max_tokens_per_row: null"):
        segment_attention(torch.nn.Module(), q, k, v, None, position_ids=torch.arange(3)[None], s_aux=torch.zeros(2))
