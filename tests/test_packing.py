"""Padding-free micro-batches (``DistillModule(max_tokens_per_row=...)``, :mod:`kdlab.rollouts.packing`): the packed
layout puts every real token exactly once, restarts positions per sequence and keeps sequences apart; a training
step on packed rows has the padded step's loss, diagnostics and gradients (tiny pair here, across tokenizers too; SmolLM2 in the real tier,
FSDP2 in tests/test_distributed.py); a budget smaller than one sequence fails at construction naming the key."""

import json

import pytest
import torch

from kdlab.data import PromptBatch, Rollout, encode_prompts, left_pad, right_pad
from kdlab.objectives import ForwardKL, ReverseKL
from kdlab.rollouts import TeacherDatasetRollouts, TeacherRollouts, packing
from kdlab.rollouts.packing import Packed, PackedBatch, Padded, first_fit_decreasing
from kdlab.stages import DistillModule
from kdlab.tasks import Addition

TINY = ("kdlab://tiny/student", "kdlab://tiny/teacher")
OBJECTIVES = {"fkl": ForwardKL, "rkl": ReverseKL, "fkl-token": lambda: ForwardKL(reduction="token")}


def ragged_batch(lengths=((3, 5), (1, 2), (4, 0), (2, 6)), pad=7):
    """A padded ``[prompt | completion]`` micro-batch with the given (prompt, completion) real lengths."""
    width_p, width_c = max(p for p, _ in lengths), max(c for _, c in lengths)
    ids = torch.full((len(lengths), width_p + width_c), pad)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for b, (p, c) in enumerate(lengths):
        ids[b, width_p - p:width_p] = torch.arange(100 * b + 1, 100 * b + 1 + p)
        ids[b, width_p:width_p + c] = torch.arange(100 * b + 50, 100 * b + 50 + c)
        mask[b, width_p - p:width_p + c] = True
    return ids, mask, width_c


def test_packing_puts_every_real_token_once_with_positions_restarting_per_sequence():
    ids, mask, width_c = ragged_batch()
    packed = PackedBatch.build(ids, mask, width_c, Packed(9))
    rows, width = packed.shape
    assert (rows, width) == (3, 8)  # sizes 8, 3, 4, 8 -> [8], [8], [4, 3] by first fit, longest first; L = the longest row
    for b in range(ids.shape[0]):
        real = ids[b][mask[b]]
        where = (packed.segments == b).nonzero()
        assert where[:, 0].unique().numel() == 1  # a sequence never straddles rows
        assert torch.equal(packed.input_ids[packed.segments == b], real)
        assert torch.equal(packed.position_ids[packed.segments == b], torch.arange(real.numel()))
    assert int((packed.segments >= 0).sum()) == int(mask.sum()) == packed.real_tokens()
    # the gather index points at the position just before each completion token
    flat_ids = packed.input_ids.reshape(-1)
    for b, (p, c) in enumerate(((3, 5), (1, 2), (4, 0), (2, 6))):
        for t in range(c):
            following = packed.gather[b, t] + 1
            assert int(flat_ids[following]) == 100 * b + 50 + t
    # (R, L, ...) outputs gather back to (B, C, ...)
    outputs = torch.arange(rows * width).reshape(rows, width, 1).float()
    assert packed.unpack(outputs).shape == (4, width_c, 1)


def test_the_block_diagonal_mask_lets_a_position_see_only_its_own_sequence_causally():
    ids, mask, width_c = ragged_batch()
    packed = PackedBatch.build(ids, mask, width_c, Packed(9))
    allowed = packed.attention_mask("sdpa", torch.float32)[:, 0]
    rows, width = packed.shape
    for r in range(rows):
        for i in range(width):
            for j in range(width):
                si, sj = int(packed.segments[r, i]), int(packed.segments[r, j])
                expected = (si >= 0 and si == sj and j <= i) or (si < 0 and i == j)
                assert bool(allowed[r, i, j]) == expected, (r, i, j)
    additive = packed.attention_mask("eager", torch.bfloat16)
    assert additive.dtype == torch.bfloat16
    assert torch.equal(additive[:, 0] == 0, allowed)


def test_first_fit_decreasing_fills_rows_up_to_the_budget():
    sizes = [5, 9, 2, 7, 3, 4]
    row_of, offset_of, used = first_fit_decreasing(sizes, 10)
    assert all(u <= 10 for u in used) and sum(used) == sum(sizes)
    for row in range(len(used)):  # items of a row sit end to end
        items = sorted((offset_of[i], sizes[i]) for i in range(len(sizes)) if row_of[i] == row)
        assert [o for o, _ in items] == [sum(s for _, s in items[:k]) for k in range(len(items))]
    assert len(used) == 4  # 9 | 7+3 | 5+4 | 2 (lower bound ceil(30/10) = 3 is not reachable with 9 and 7)


@pytest.mark.parametrize("budget", [0, -3, 2.5, True])
def test_a_budget_that_is_not_a_positive_count_names_the_key(budget):
    with pytest.raises(ValueError, match="DistillModule.max_tokens_per_row"):
        DistillModule(*TINY, Addition(num_train=2), max_tokens_per_row=budget)


def test_a_budget_smaller_than_one_sequence_fails_at_construction_naming_the_key():
    with pytest.raises(ValueError, match=r"DistillModule.max_tokens_per_row=70 is smaller than one sequence: max_prompt_tokens \+ max_completion_tokens \(72"):
        DistillModule(*TINY, Addition(num_train=2), max_prompt_tokens=64, max_completion_tokens=8, max_tokens_per_row=70)
    # at run time a sequence longer than the budget (across tokenizers, the teacher's tokens) is no error: that
    # micro-batch's rows hold up to the longest sequence
    ids, mask, width_c = ragged_batch()  # real lengths 8, 3, 4, 8
    packed = PackedBatch.build(ids, mask, width_c, Packed(5))
    assert packed.shape == (3, 8) and packed.real_tokens() == int(mask.sum())  # rows 8 | 8 | 4 + 3


def dataset_rollouts(tmp_path, task):
    """Teacher-written completions of very different lengths (so the padded rows carry padding)."""
    path = tmp_path / "teacher.jsonl"
    path.write_text("".join(json.dumps({"id": ex["id"], "completion": f"<answer>{ex['a'] * 10 ** (3 * i)}</answer>" * (1 + i % 3)}) + "\n"
                            for i, ex in enumerate(task.examples("train"))))
    return TeacherDatasetRollouts(str(path))


def step(module, batch, rollout):
    """One training step on ``rollout``: the loss, the logged diagnostics and the student's gradients."""
    logged = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, value.detach() if torch.is_tensor(value) else value)
    module.make_rollout = lambda examples, seed, policy=None: rollout
    module.student.zero_grad(set_to_none=True)
    loss = module.training_step(batch, 0)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in module.student.named_parameters() if p.grad is not None}
    return loss.detach(), logged, grads


def assert_same_step(padded, packed, atol=1e-5):
    (loss_a, logged_a, grads_a), (loss_b, logged_b, grads_b) = padded, packed
    torch.testing.assert_close(loss_b, loss_a, atol=atol, rtol=0)
    assert logged_a.keys() == logged_b.keys()
    for name, value in logged_a.items():
        torch.testing.assert_close(torch.as_tensor(logged_b[name]), torch.as_tensor(value), atol=atol, rtol=0, msg=name)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, value in grads_a.items():
        torch.testing.assert_close(grads_b[name], value, atol=atol, rtol=atol, msg=name)  # + relative: fp32 sums in another order


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
@pytest.mark.parametrize("budget, attention", [(180, "segments"), (180, "mask"), (4096, "mask")],
                         ids=["segment-attention", "mask-several-rows", "mask-one-row"])
def test_a_packed_step_has_the_padded_steps_loss_diagnostics_and_gradients(tmp_path, monkeypatch, objective, fused, budget, attention):
    """The tiny pair on teacher-written completions of ragged lengths: packed sequences (one row with kdlab's segment
    attention, the sdpa model's default; or rows of the budget, several or one, with the block-diagonal mask) give the
    padded step's loss, every logged diagnostic and every student gradient to 1e-5."""
    if attention == "mask":
        monkeypatch.setattr(packing, "segments_apply", lambda model: False)
    task = Addition(num_train=6)
    rollouts = dataset_rollouts(tmp_path, task)
    settings = dict(rollout=rollouts, objective=OBJECTIVES[objective](), max_prompt_tokens=80, max_completion_tokens=16,
                    batch_size=6, fused_lm_head=fused)
    padded = DistillModule(*TINY, task, **settings)
    packed = DistillModule(*TINY, task, max_tokens_per_row=budget, **settings)
    assert isinstance(padded.layout, Padded) and isinstance(packed.layout, Packed)
    assert packed.teacher_source.layout is packed.layout  # the in-process teacher reads the same packing
    batch = task.examples("train")
    rollout = padded.make_rollout(batch, 0)
    mask = rollout.completion_mask
    assert bool((~mask).any()) and len(set(mask.sum(1).tolist())) > 2  # ragged: the padded rows hold padding
    rows = packed.layout.pack(rollout, "student", model=packed.student).shape[0]
    assert (rows > 1) == (budget == 180 and attention == "mask")
    assert_same_step(step(padded, batch, rollout), step(packed, batch, rollout))


def test_packed_sampled_rollouts_and_a_cached_top_k_teacher_align_with_padded(tmp_path):
    """Student-facing signals that are indexed by completion position (a top-k cache as the teacher) land on the
    same tokens packed and padded; teacher-sampled completions (TeacherRollouts) train alike."""
    task = Addition(num_train=4)
    settings = dict(rollout=TeacherRollouts(), max_prompt_tokens=80, max_completion_tokens=12, batch_size=4)
    padded = DistillModule(*TINY, task, **settings)
    packed = DistillModule(*TINY, task, max_tokens_per_row=100, **settings)
    batch = task.examples("train")
    rollout = padded.make_rollout(batch, 3)
    assert_same_step(step(padded, batch, rollout), step(packed, batch, rollout))
    # a teacher signal already on the rollout (a cache or a server's top-k): read as given, packed or not
    with torch.no_grad():
        teacher = padded.teacher_source.completion_logprobs(rollout)
    cached = Rollout(rollout.prompts, rollout.completion_ids, rollout.completion_mask, teacher_logprobs=teacher)
    assert_same_step(step(padded, batch, cached), step(packed, batch, cached))


def test_an_eager_attention_model_reads_the_additive_mask(tmp_path):
    """Eager attention adds its mask: the packed layout hands it 0 / min, and its logits equal the padded ones."""
    task = Addition(num_train=4)
    module = DistillModule(*TINY, task, rollout=dataset_rollouts(tmp_path, task), max_prompt_tokens=80, max_completion_tokens=16,
                           batch_size=4, fused_lm_head=False)
    module.student.config._attn_implementation = "eager"
    rollout = module.make_rollout(task.examples("train"), 0)
    with torch.no_grad():
        padded = Padded().completion_logits(module.student, rollout, "student", module.token_columns)
        packed = Packed(200).completion_logits(module.student, rollout, "student", module.token_columns)
    mask = rollout.completion_mask
    torch.testing.assert_close(packed[mask], padded[mask], atol=1e-5, rtol=0)


def test_routed_rows_of_a_packed_teacher_equal_the_padded_ones(tmp_path):
    """``rows_logprobs`` (several teachers routing rows) reads only the given rows, in the packed layout too."""
    task = Addition(num_train=4)
    module = DistillModule(*TINY, task, rollout=dataset_rollouts(tmp_path, task), max_prompt_tokens=80, max_completion_tokens=16,
                           batch_size=4, max_tokens_per_row=128)
    rollout = module.make_rollout(task.examples("train"), 0)
    rows = torch.tensor([2, 0])
    packed = module.teacher_source.rows_logprobs(rollout, rows)
    module.teacher_source.run.layout = Padded()
    padded = module.teacher_source.rows_logprobs(rollout, rows)
    mask = rollout.completion_mask[rows]
    torch.testing.assert_close(packed[mask], padded[mask], atol=1e-5, rtol=0)


def test_prompts_encode_as_the_layout_expects():
    """The packed layout needs left-padded prompts and right-padded completions (what kdlab.data builds)."""
    from kdlab.models.loading import ModelSpec, load_tokenizer

    tokenizer = load_tokenizer(ModelSpec(TINY[0]), "student")
    task = Addition(num_train=3)
    prompts = encode_prompts(task, task.examples("train"), tokenizer, tokenizer, 64, int(tokenizer.pad_token_id))
    ids, mask = right_pad([[5, 6, 7], [5], [5, 6]], int(tokenizer.pad_token_id))
    rollout = Rollout(prompts, ids, mask)
    packed = Packed(256).pack(rollout, "student")
    assert packed.real_tokens() == int(prompts.student_mask.sum()) + int(mask.sum())
    bad = Rollout(prompts, ids, torch.tensor([[True, False, True], [True, False, False], [True, True, False]]))
    with pytest.raises(ValueError, match="one run of real tokens"):
        Packed(256).pack(bad, "student")


def test_across_tokenizers_each_model_packs_its_own_tokens_and_the_step_equals_the_padded_one(tmp_path):
    """With ``cross_tokenizer`` the teacher reads the completion in its own tokens (``teacher_completion_ids``): packed,
    each model packs its own prompt and completion, and the aligned loss, diagnostics and gradients are the padded ones."""
    from kdlab.objectives import CrossTokenizer

    task = Addition(max_digits=2, system_prompt="", num_train=4, num_val=0, num_test=0, seed=0)
    settings = dict(rollout=TeacherRollouts(), max_prompt_tokens=80, max_completion_tokens=12, batch_size=4)
    padded = DistillModule(TINY[0], "kdlab://tiny-random/teacher", task, cross_tokenizer=CrossTokenizer(), **settings)
    packed = DistillModule(TINY[0], "kdlab://tiny-random/teacher", task, cross_tokenizer=CrossTokenizer(), max_tokens_per_row=120, **settings)
    batch = task.examples("train")
    rollout = padded.make_rollout(batch, 5)
    assert rollout.teacher_completion_ids is not None
    assert packed.layout.pack(rollout, "teacher").real_tokens() == int(rollout.model_inputs("teacher")["attention_mask"].sum())
    assert_same_step(step(padded, batch, rollout), step(packed, batch, rollout))


def test_a_flash_attention_model_gets_one_flat_row_and_no_mask():
    """Hugging Face's variable-length flash path reads restarting position ids of a single row only (a batch of
    rows would attend across sequences), so a flash model's packed rows are laid end to end as one row, with no mask;
    the flat row holds the same outputs at the same gather indices (checked here with the explicit mask on sdpa,
    as flash attention needs a GPU)."""
    from kdlab.models.loading import ModelSpec, load_causal_lm

    ids, mask, width_c = ragged_batch()
    packed = PackedBatch.build(ids, mask, width_c, Packed(9))
    flash = torch.nn.Module()
    flash.config = type("Config", (), {"_attn_implementation": "flash_attention_2"})()
    flat = packed.flattened()
    inputs = flat.model_inputs(flash)
    assert inputs["attention_mask"] is None and inputs["input_ids"].shape == (1, packed.shape[0] * packed.shape[1])
    starts = (flat.position_ids[0] == 0) & (flat.segments[0] >= 0)
    assert int(starts.sum()) == ids.shape[0]  # each sequence starts at position 0
    with pytest.raises(ValueError, match="one packed row"):
        packed.model_inputs(flash)
    # the flat row and the rows give the same outputs at the gather indices (sdpa, explicit mask)
    model = load_causal_lm(ModelSpec(TINY[0]), "student")
    ids = ids.clamp(max=300)
    packed = PackedBatch.build(ids, mask, width_c, Packed(9))
    with torch.no_grad():
        rows = packed.unpack(model(**packed.model_inputs(model), use_cache=False).logits)
        one = packed.flattened().unpack(model(**packed.flattened().model_inputs(model), use_cache=False).logits)
    real = torch.arange(width_c)[None, :] < torch.tensor([5, 2, 0, 6])[:, None]
    torch.testing.assert_close(one[real], rows[real], atol=1e-5, rtol=0)


def test_an_sdpa_model_reads_one_row_of_exactly_the_real_tokens_through_segment_attention(tmp_path):
    """An sdpa model without activation checkpointing: every sequence in one row with no padding, each sequence's
    attention on its own (``kdlab_segments`` while the forward runs, the model's own implementation after), and the
    logits equal the padded ones; a checkpointed model keeps rows of the budget and the mask."""
    from kdlab.rollouts.segment_attention import NAME, segment_lengths

    task = Addition(num_train=4)
    module = DistillModule(*TINY, task, rollout=dataset_rollouts(tmp_path, task), max_prompt_tokens=80, max_completion_tokens=16,
                           batch_size=4, fused_lm_head=False)
    rollout = module.make_rollout(task.examples("train"), 0)
    lengths = rollout.model_inputs("student")["attention_mask"].sum(1)
    layout, seen = Packed(100), []
    row = layout.pack(rollout, "student", model=module.student)
    assert row.shape == (1, int(lengths.sum())) and bool((row.segments >= 0).all())
    assert segment_lengths(row.position_ids) == sorted(lengths.tolist(), reverse=True)
    attention = type(module.student.model.layers[0].self_attn)
    forward = attention.forward

    def spy(self, *args, **kwargs):
        seen.append(self.config._attn_implementation)
        return forward(self, *args, **kwargs)

    attention.forward = spy
    try:
        with torch.no_grad():
            packed = layout.completion_logits(module.student, rollout, "student", module.token_columns)
            padded = Padded().completion_logits(module.student, rollout, "student", module.token_columns)
    finally:
        attention.forward = forward
    assert seen[: len(module.student.model.layers)] == [NAME] * len(module.student.model.layers)
    assert set(seen[len(module.student.model.layers):]) == {"sdpa"} and module.student.config._attn_implementation == "sdpa"
    mask = rollout.completion_mask
    torch.testing.assert_close(packed[mask], padded[mask], atol=1e-5, rtol=0)
    module.student.gradient_checkpointing_enable()
    assert not packing.segments_apply(module.student)
    assert layout.pack(rollout, "student", model=module.student).shape[0] > 1


def test_segment_attention_is_sdpa_under_the_block_diagonal_mask_with_its_gradients():
    """Three sequences of one row, grouped heads (4 query heads over 2 key/value heads): the outputs and the
    gradients of query, key and value equal causal sdpa under the block-diagonal mask."""
    from kdlab.rollouts.segment_attention import segment_attention

    generator = torch.Generator().manual_seed(0)
    lengths, heads, kv_heads, dim = [5, 3, 7], 4, 2, 8
    total = sum(lengths)
    q = torch.randn(1, heads, total, dim, generator=generator, requires_grad=True)
    k = torch.randn(1, kv_heads, total, dim, generator=generator, requires_grad=True)
    v = torch.randn(1, kv_heads, total, dim, generator=generator, requires_grad=True)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    out, weights = segment_attention(torch.nn.Module(), q, k, v, None, scaling=dim**-0.5, position_ids=positions)
    assert weights is None and out.shape == (1, total, heads, dim)
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    allowed = (segment[:, None] == segment[None, :]) & (torch.arange(total)[:, None] >= torch.arange(total)[None, :])
    reference = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                                 attn_mask=allowed, scale=dim**-0.5).transpose(1, 2)
    torch.testing.assert_close(out, reference, atol=1e-6, rtol=1e-6)
    weights_out = torch.randn(out.shape, generator=generator)
    grads = torch.autograd.grad((out * weights_out).sum(), (q, k, v))
    expected = torch.autograd.grad((reference * weights_out).sum(), (q, k, v))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def layered_copy(tmp_path, role, kind, **fields):
    """The packaged tiny ``role`` with every layer of attention ``kind`` (``fields`` added to its config), a copy under ``tmp_path``."""
    import shutil
    from pathlib import Path

    folder = tmp_path / f"{kind}-{role}"
    shutil.copytree(Path(packing.__file__).parents[1] / "assets" / "tiny" / role, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(layer_types=[kind] * config["num_hidden_layers"], **fields)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_a_sliding_window_model_packs_at_construction_and_its_packed_logits_are_the_padded_ones(tmp_path):
    """A student whose every layer slides over 4 keys (Qwen2 with ``use_sliding_window``; before, refused when the
    module was built: packed rows applied no window and the logits were 0.37 off the padded ones) builds with
    ``max_tokens_per_row``, and its packed completion logits are the padded ones though its sequences are longer
    than the window (more windowed families, and the 4D mask, in tests/test_packing_windows.py)."""
    student = layered_copy(tmp_path, "student", "sliding_attention", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    task = Addition(num_train=2)
    module = DistillModule(student, TINY[1], task, rollout=TeacherRollouts(), max_prompt_tokens=80, max_completion_tokens=16,
                           batch_size=2, max_tokens_per_row=96)
    assert isinstance(module.layout, Packed)
    rollout = module.make_rollout(task.examples("train"), 0)
    assert int(rollout.model_inputs("student")["attention_mask"].sum(1).min()) > 4
    mask = rollout.completion("student")[1].bool()
    with torch.no_grad():
        packed = module.layout.completion_logits(module.student, rollout, "student", module.token_columns)
        padded = Padded().completion_logits(module.student, rollout, "student", module.token_columns)
    torch.testing.assert_close(packed[mask], padded[mask], atol=1e-5, rtol=0)


def test_packing_a_model_with_layers_of_another_kind_is_refused_at_construction_naming_the_key_and_the_field(tmp_path):
    """Packed rows apply full and sliding-window attention only: a student or teacher with layers of another kind
    (``chunked_attention``) is refused when the module is built, naming max_tokens_per_row and the config field;
    padded rows still build; a packed forward of such a model built another way is refused too."""
    student, teacher = layered_copy(tmp_path, "student", "chunked_attention"), layered_copy(tmp_path, "teacher", "chunked_attention")
    task = Addition(num_train=2)
    with pytest.raises(ValueError, match=r"DistillModule.max_tokens_per_row=96 cannot pack the student: its config.layer_types holds "
                                         r"\['chunked_attention'\] layers, neither full_attention nor sliding_attention, which packed rows "
                                         r"do not apply; use padded rows \(max_tokens_per_row: null\)"):
        DistillModule(student, TINY[1], task, max_prompt_tokens=80, max_completion_tokens=16, max_tokens_per_row=96)
    with pytest.raises(ValueError, match=r"DistillModule.max_tokens_per_row=96 cannot pack DistillModule.teacher: its config.layer_types"):
        DistillModule(TINY[0], teacher, task, max_prompt_tokens=80, max_completion_tokens=16, max_tokens_per_row=96)
    module = DistillModule(student, TINY[1], task, rollout=TeacherRollouts(), max_prompt_tokens=80, max_completion_tokens=16, batch_size=2)
    rollout = module.make_rollout(task.examples("train"), 0)
    with pytest.raises(ValueError, match=r"cannot pack the model: its config.layer_types holds \['chunked_attention'\]"):
        Packed(96).completion_logits(module.student, rollout, "student", module.token_columns)


def test_segment_attention_applies_an_eager_models_attention_logit_softcapping():
    """Gemma2's attention soft-capping (``tanh(s / c) c`` on the scores, eager attention), all layers full
    attention: the packed logits through segment attention equal each sequence's own forward (they were 5.8e-4
    off with the cap skipped)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, layer_types=["full_attention"] * 2, attn_logit_softcapping=5.0,
                          final_logit_softcapping=None)
    config._attn_implementation = "eager"
    model = Gemma2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30)  # scores well past the cap
    generator = torch.Generator().manual_seed(1)
    lengths = [(5, 7), (1, 3), (9, 2), (3, 11)]
    prompts = [torch.randint(3, 300, (p,), generator=generator).tolist() for p, _ in lengths]
    completions = [torch.randint(3, 300, (c,), generator=generator).tolist() for _, c in lengths]
    prompt_ids, prompt_mask = left_pad(prompts, 0)
    completion_ids, completion_mask = right_pad(completions, 0)
    rollout = Rollout(PromptBatch(list(range(4)), prompt_ids, prompt_mask, prompt_ids, prompt_mask), completion_ids, completion_mask)
    alone = torch.zeros(4, completion_ids.shape[1], 300)
    with torch.no_grad():
        for row, (prompt, completion) in enumerate(zip(prompts, completions)):
            logits = model(input_ids=torch.tensor([prompt + completion]), use_cache=False).logits[0]
            alone[row, : len(completion)] = logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)]
        assert Packed(64).pack(rollout, "student", model=model).shape[0] == 1  # one row: segment attention
        packed = Packed(64).completion_logits(model, rollout, "student", 300)
    torch.testing.assert_close(packed[completion_mask], alone[completion_mask], atol=1e-5, rtol=0)


@pytest.mark.parametrize("attention", ["segments", "mask"])
def test_a_teacher_sequence_longer_than_the_budget_across_tokenizers_widens_its_micro_batchs_rows(tmp_path, monkeypatch, attention):
    """Across tokenizers the teacher reads the student's completion in its own tokens, which can outrun
    ``max_prompt_tokens + max_completion_tokens`` (a teacher whose tokenizer is nearly bytes: 99 tokens against a
    budget of 76). The module built with that budget trains (before, the step raised "smaller than one sequence"
    mid-run): the micro-batch's rows hold up to that sequence, and the step is the padded one."""
    from kdlab.data import prompt_token_ids
    from kdlab.objectives import CrossTokenizer
    from kdlab.rollouts import StudentRollouts
    from kdlab.tiny import build_tokenizer, tiny_qwen2

    if attention == "mask":
        monkeypatch.setattr(packing, "segments_apply", lambda model: False)
    teacher = tmp_path / "bytes-teacher"
    tokenizer = build_tokenizer(["zebra quartz " * 50], vocab_size=270)  # few merges: most text one token a byte
    torch.manual_seed(0)
    tiny_qwen2(len(tokenizer), hidden=16, layers=1, heads=2).save_pretrained(teacher)
    tokenizer.save_pretrained(teacher)
    task = Addition(max_digits=2, system_prompt="", num_train=4, num_val=0, num_test=0, seed=0)
    student = "kdlab://tiny-random/student"  # random weights: completions of every token, which the teacher spells in bytes
    prompt_tokens = max(len(prompt_token_ids(task, tokenizer, example, "teacher", 4096)) for example in task.examples("train"))
    settings = dict(rollout=StudentRollouts(), cross_tokenizer=CrossTokenizer(), max_prompt_tokens=prompt_tokens, max_completion_tokens=16,
                    batch_size=4)
    padded = DistillModule(student, str(teacher), task, **settings)
    packed = DistillModule(student, str(teacher), task, max_tokens_per_row=prompt_tokens + 16, **settings)
    batch = task.examples("train")
    rollout = padded.make_rollout(batch, 0)
    lengths = rollout.model_inputs("teacher")["attention_mask"].sum(1)
    assert int(lengths.max()) > prompt_tokens + 16
    rows = packed.layout.pack(rollout, "teacher", model=packed.teacher)
    assert rows.shape[1] == (int(lengths.sum()) if attention == "segments" else int(lengths.max()))
    assert_same_step(step(padded, batch, rollout), step(packed, batch, rollout))
