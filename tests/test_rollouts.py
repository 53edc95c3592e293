import json
import math
from pathlib import Path

import pytest
import torch

from kdlab.rollouts import MixtureRollouts, StudentRollouts, TeacherDatasetRollouts, TeacherRollouts
from kdlab.rollouts.mixture import mixture_logprobs
from kdlab.stages import DistillModule
from kdlab.tasks import Addition

V = 9


def normalised(seed, shape=(4, V)):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(shape, generator=g) * 2, dim=-1)


def test_mixture_endpoints_are_the_two_policies_and_zero_is_the_geometric_mean():
    s, t = normalised(0), normalised(1)
    assert torch.equal(mixture_logprobs(s, t, -1.0), t)
    assert torch.equal(mixture_logprobs(s, t, 1.0), s)
    geometric = torch.sqrt(s.exp() * t.exp())
    torch.testing.assert_close(mixture_logprobs(s, t, 0.0).exp(), geometric / geometric.sum(-1, keepdim=True))


def test_mixture_is_continuous_at_the_interpolation_endpoints():
    s, t = normalised(2), normalised(3)
    torch.testing.assert_close(mixture_logprobs(s, t, 1 - 1e-6), s, atol=1e-4, rtol=0)
    torch.testing.assert_close(mixture_logprobs(s, t, 1 + 1e-6), s, atol=1e-4, rtol=0)
    torch.testing.assert_close(mixture_logprobs(s, t, -1 - 1e-6), t, atol=1e-4, rtol=0)


def test_amplified_student_regime_follows_the_paper_formula_by_hand():
    s = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    t = torch.log(torch.tensor([0.1, 0.6, 0.05, 0.25]))
    lam, alpha, clip = 2.0, 0.2, 2 * math.log(3)
    # M_S: s >= log(0.5 * 0.2) = log 0.1 -> tokens 0, 1, 2 (0.05 < 0.1 is out)
    r = s - t
    bonus = torch.tensor([min(max(r[0].item(), 0), clip), 0.0, min(max(r[2].item(), 0), clip), 0.0])
    expected = torch.log_softmax(s + 0.5 * bonus, -1)
    torch.testing.assert_close(mixture_logprobs(s, t, lam, alpha, clip), expected)
    # the bonus of token 2 (ratio 3 = the cap) multiplies its odds by at most 3^(1/2) at lam = 2
    assert r[2].item() == pytest.approx(math.log(3))


def test_amplified_teacher_regime_is_the_mirror_image():
    s, t = normalised(4), normalised(5)
    torch.testing.assert_close(mixture_logprobs(s, t, -1.7), mixture_logprobs(t, s, 1.7))


def test_mixture_handles_zero_probability_tokens_without_nan():
    s, t = normalised(6), normalised(7)
    s[:, 0] = float("-inf")
    t[:, 1] = float("-inf")
    for lam in (-2.0, -1.5, -0.5, 0.0, 0.5, 1.5, 2.0):
        out = mixture_logprobs(s, t, lam)
        assert not torch.isnan(out).any(), lam
        assert torch.allclose(out.exp().sum(-1), torch.ones(4))


@pytest.mark.parametrize("kwargs, key", [({"lam": 2.5}, "lam"), ({"alpha": 0.0}, "alpha"), ({"alpha": 1.5}, "alpha"), ({"clip": 0.0}, "clip")])
def test_bad_mixture_settings_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=f"MixtureRollouts.{key}"):
        MixtureRollouts(**kwargs)


@pytest.fixture(scope="module")
def module(tiny_pair):
    student, teacher = tiny_pair
    return DistillModule(student, teacher, Addition(num_train=8), max_completion_tokens=10, batch_size=4)


def rollout_with(module, policy, seed=5):
    module.rollout = policy
    return module.make_rollout(module.task.examples("train")[:4], seed)


@pytest.mark.parametrize("lam, same_as", [(-1.0, TeacherRollouts), (1.0, StudentRollouts)])
def test_mixture_at_the_endpoints_samples_exactly_like_the_pure_policy(module, lam, same_as):
    mixed, pure = rollout_with(module, MixtureRollouts(lam)), rollout_with(module, same_as())
    assert torch.equal(mixed.completion_ids, pure.completion_ids)
    assert torch.equal(mixed.completion_mask, pure.completion_mask)


def test_interior_mixture_differs_from_both_endpoints_and_is_seeded(module):
    mixed = rollout_with(module, MixtureRollouts(0.0))
    again = rollout_with(module, MixtureRollouts(0.0))
    assert torch.equal(mixed.completion_ids, again.completion_ids)
    teacher, student = rollout_with(module, TeacherRollouts()), rollout_with(module, StudentRollouts())
    assert not torch.equal(mixed.completion_ids, teacher.completion_ids)
    assert not torch.equal(mixed.completion_ids, student.completion_ids)
    other_seed = rollout_with(module, MixtureRollouts(0.0), seed=6)
    assert not torch.equal(mixed.completion_ids, other_seed.completion_ids)


def test_rollout_masks_end_at_the_end_token_and_pad_after(module):
    rollout = rollout_with(module, StudentRollouts())
    ids, mask = rollout.completion_ids, rollout.completion_mask
    for row_ids, row_mask in zip(ids.tolist(), mask.tolist()):
        length = sum(row_mask)
        assert row_mask == [True] * length + [False] * (len(row_mask) - length)
        assert all(token == module.pad_id for token in row_ids[length:])
        if length < len(row_ids):  # finished early: its last token is an end token
            assert row_ids[length - 1] in module.end_ids
    assert rollout.sampling_entropy.shape == ids.shape
    assert torch.all(rollout.sampling_entropy[~mask] == 0)


def test_sampling_leaves_no_gradient_and_restores_train_mode(module):
    module.student.train()
    rollout = rollout_with(module, StudentRollouts())
    assert module.student.training and not module.teacher.training
    assert not rollout.completion_ids.requires_grad and not rollout.sampling_entropy.requires_grad


def test_teacher_rollouts_from_a_dataset_file(module, tmp_path):
    examples = module.task.examples("train")[:4]
    path = tmp_path / "teacher.jsonl"
    path.write_text("".join(json.dumps({"id": ex["id"], "completion": f"<answer>{i}</answer>"}) + "\n" for i, ex in enumerate(examples)))
    rollout = rollout_with(module, TeacherDatasetRollouts(str(path)))
    assert rollout.sampling_entropy is None
    first = rollout.completion_ids[0][rollout.completion_mask[0]].tolist()
    assert module.student_tokenizer.decode(first[:-1]) == "<answer>0</answer>"
    assert first[-1] == module.end_ids[0]


def test_teacher_dataset_errors_name_file_line_and_id(module, tmp_path):
    missing = tmp_path / "none.jsonl"
    with pytest.raises(FileNotFoundError, match="none.jsonl"):
        TeacherDatasetRollouts(str(missing))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "completion": "x"}\n{"id": "b"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: missing string field 'completion'"):
        TeacherDatasetRollouts(str(bad))
    partial = tmp_path / "partial.jsonl"
    partial.write_text('{"id": "not-an-example", "completion": "x"}\n')
    with pytest.raises(KeyError, match="add-train-0"):
        rollout_with(module, TeacherDatasetRollouts(str(partial)))


def test_truncated_teacher_responses_do_not_get_an_end_token(module, tmp_path):
    examples = module.task.examples("train")[:4]
    path = tmp_path / "teacher.jsonl"
    rows = [{"id": ex["id"], "completion": f"<answer>{i}</answer>", "ended": i != 1} for i, ex in enumerate(examples)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    rollout = rollout_with(module, TeacherDatasetRollouts(str(path)))
    first = rollout.completion_ids[0][rollout.completion_mask[0]].tolist()
    second = rollout.completion_ids[1][rollout.completion_mask[1]].tolist()
    assert first[-1] in module.end_ids and second[-1] not in module.end_ids
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "completion": "y", "ended": "no"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: field 'ended'"):
        TeacherDatasetRollouts(str(bad))


# ---- the three teacher policies, and kdlab 0.1's TeacherRollouts(dataset=..., teacher_cache=...) ----------
def teacher_files(module, tmp_path, ended=True):
    """A dataset of the first four train examples and a top-2 cache written on exactly its tokens, after the module's
    teacher prompts."""
    from kdlab.rollouts.teacher_cache import prompt_digest, write_cache

    examples = module.task.examples("train")[:4]
    data = tmp_path / "teacher.jsonl"
    data.write_text("".join(json.dumps({"id": ex["id"], "completion": f"<answer>{i}</answer>"}) + "\n" for i, ex in enumerate(examples)))
    rows, prompts = {}, module._prompts(examples).prompt_tokens("teacher")
    for i, ex in enumerate(examples):
        tokens = module.student_tokenizer(f"<answer>{i}</answer>", add_special_tokens=False)["input_ids"] + [module.end_ids[0]]
        tokens = tokens[: module.max_completion_tokens]
        indices = torch.stack([torch.tensor(tokens), torch.full((len(tokens),), 3)], dim=-1)
        logprobs = torch.log(torch.tensor([[0.75, 0.25]])).expand(len(tokens), 2)
        rows[ex["id"]] = {"tokens": torch.tensor(tokens), "indices": indices, "logprobs": logprobs, "prompt_sha256": prompt_digest(prompts[i])}
    cache = tmp_path / "teacher.jsonl.topk.safetensors"
    write_cache(cache, rows, {"top_k": 2, "temperature": module.teacher_temperature, "token_columns": module.token_columns, "teacher": "t"})
    return examples, str(data), str(cache)


def test_each_teacher_policy_has_one_meaning(module, tmp_path):
    from kdlab.rollouts import CachedTeacherRollouts
    from kdlab.rollouts.teacher_cache import TopKLogprobs

    examples, data, cache = teacher_files(module, tmp_path)
    # online: the teacher's own decoder at teacher_temperature, seeded like any sampling policy
    online = rollout_with(module, TeacherRollouts(), seed=3)
    prompts = module._prompts(examples)
    context = module.rollout_context(module._generator(3))
    by_hand = context.sample(context.decoder("teacher", prompts), prompts)
    assert torch.equal(online.completion_ids, by_hand.completion_ids) and online.sampling_entropy is not None
    assert online.teacher_logprobs is None and TeacherRollouts().covers({"id": "anything"})
    # a dataset: the file's completions (plus the end token), never sampled, no teacher log-probs
    dataset = rollout_with(module, TeacherDatasetRollouts(data))
    first = dataset.completion_ids[0][dataset.completion_mask[0]].tolist()
    assert module.student_tokenizer.decode(first[:-1]) == "<answer>0</answer>" and first[-1] == module.end_ids[0]
    assert dataset.sampling_entropy is None and dataset.teacher_logprobs is None
    assert TeacherDatasetRollouts(data).covers(examples[0]) and not TeacherDatasetRollouts(data).covers({"id": "elsewhere"})
    # cached: the same completions, and the teacher's log-probs read from the cache by a CachedTeacher source (the
    # teacher never runs); CachedTeacherRollouts is the dataset policy that names that cache
    from kdlab.teachers import CachedTeacher

    cached_policy = CachedTeacherRollouts(data, cache)
    source = CachedTeacher(cache)
    source.bind(module.teacher_source.run)
    source.load()
    cached = source.rollout(TeacherDatasetRollouts(data), module._prompts(module.task.examples("train")[:4]),
                            module.rollout_context(module._generator(5), 5))
    assert torch.equal(cached.completion_ids, dataset.completion_ids) and cached.sampling_entropy is None
    assert isinstance(cached.teacher_logprobs, TopKLogprobs) and cached.teacher_logprobs.shape == (4, cached.completion_ids.shape[1], module.token_columns)
    length = int(cached.completion_mask[0].sum())
    assert cached.teacher_logprobs.indices[0, :length, 0].tolist() == first
    torch.testing.assert_close(cached.teacher_logprobs.logprobs[0, :length, 0].exp(), torch.full((length,), 0.75))
    assert (cached_policy.dataset, cached_policy.teacher_cache, cached_policy.cache.top_k) == (data, cache, 2)
    # all three are teacher rollouts: isinstance checks and the teacher's next-token distribution hold
    s, t = normalised(8), normalised(9)
    for policy in (TeacherRollouts(), TeacherDatasetRollouts(data), cached_policy):
        assert isinstance(policy, TeacherRollouts) and torch.equal(policy.next_token_logprobs(s, t), t)
    with pytest.raises(TypeError, match="CachedTeacherRollouts"):
        TeacherDatasetRollouts(data, teacher_cache=cache)  # a cache is the other class's setting
    with pytest.raises(FileNotFoundError, match="CachedTeacherRollouts.teacher_cache: no such file"):
        CachedTeacherRollouts(data, str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match="CachedTeacherRollouts.dataset .*holds no completions"):
        (tmp_path / "empty.jsonl").write_text("\n")
        CachedTeacherRollouts(str(tmp_path / "empty.jsonl"), cache)


def test_the_old_spelling_gives_the_new_classes_with_a_future_warning(module, tmp_path):
    import copy
    import pickle
    import warnings

    from kdlab.rollouts import CachedTeacherRollouts

    _, data, cache = teacher_files(module, tmp_path)
    with pytest.warns(FutureWarning, match=r"use kdlab.rollouts.TeacherDatasetRollouts\(dataset=...\)") as caught:
        old = TeacherRollouts(dataset=data)
    assert type(old) is TeacherDatasetRollouts and old.dataset == data and old.covers({"id": "add-train-0"})
    assert caught[0].filename == __file__  # the warning points at the caller's line
    with pytest.warns(FutureWarning, match="TeacherDatasetRollouts"):
        assert type(TeacherRollouts(dataset=data, teacher_cache=None)) is TeacherDatasetRollouts  # as jsonargparse calls it
    with pytest.warns(FutureWarning, match="CachedTeacherRollouts"):
        old_cached = TeacherRollouts(dataset=data, teacher_cache=cache)
    assert type(old_cached) is CachedTeacherRollouts and old_cached.cache.top_k == 2
    assert torch.equal(rollout_with(module, old_cached).completion_ids, rollout_with(module, CachedTeacherRollouts(data, cache)).completion_ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the online policy and the new spellings warn about nothing
        assert type(TeacherRollouts()) is TeacherRollouts
        assert type(TeacherRollouts(dataset=None, teacher_cache=None)) is TeacherRollouts
        new = TeacherDatasetRollouts(dataset=data)
        CachedTeacherRollouts(dataset=data, teacher_cache=cache)
    with pytest.raises(ValueError, match="TeacherRollouts.teacher_cache needs TeacherRollouts.dataset .*CachedTeacherRollouts"):
        TeacherRollouts(teacher_cache=cache)
    with pytest.raises(TypeError, match="lam"):
        TeacherRollouts(lam=0.5)
    # copies and pickles keep the class (no second trip through the old spelling) and what it read
    for policy in (TeacherRollouts(), new, old):
        for twin in (copy.deepcopy(policy), pickle.loads(pickle.dumps(policy))):
            assert type(twin) is type(policy) and getattr(twin, "_completions", None) == getattr(policy, "_completions", None)


SMOKE = str(Path(__file__).parents[1] / "experiments" / "tiny" / "smoke.yaml")


@pytest.mark.parametrize("class_name, warns", [("TeacherRollouts", True), ("TeacherDatasetRollouts", False)])
def test_an_old_style_config_still_instantiates_through_the_cli(tmp_path, monkeypatch, class_name, warns):
    """``class_path: kdlab.rollouts.TeacherRollouts`` with ``init_args: {dataset: ...}``, as kdlab 0.1's
    configs wrote it, builds a TeacherDatasetRollouts (with a FutureWarning); the new class path, without."""
    import warnings

    import yaml

    from kdlab.cli.main import main

    data = tmp_path / "teacher.jsonl"
    data.write_text(json.dumps({"id": "add-train-0", "completion": "<answer>1</answer>"}) + "\n")
    overlay = tmp_path / "rollout.yaml"
    overlay.write_text(yaml.safe_dump({"model": {"rollout": {"class_path": f"kdlab.rollouts.{class_name}", "init_args": {"dataset": str(data)}}}}))
    monkeypatch.setattr("sys.argv", ["kdlab"])
    args = ["fit", f"--config={SMOKE}", f"--config={overlay}", f"--trainer.logger.init_args.save_dir={tmp_path}"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = main(args, run=False)
    future = [w for w in caught if issubclass(w.category, FutureWarning) and "TeacherRollouts(dataset=...)" in str(w.message)]
    assert bool(future) == warns, [str(w.message) for w in caught]
    rollout = cli.model.rollout
    assert type(rollout) is TeacherDatasetRollouts and rollout.dataset == str(data)
    assert [ex["id"] for ex in cli.model.training_examples()] == ["add-train-0"]


def test_generate_records_whether_each_sample_ended(module, tmp_path):
    from kdlab.rollouts.decoding import sample_completions

    samples = sample_completions(module.teacher, module.teacher_tokenizer, module.task, module.task.examples("train")[:4], max_new_tokens=2)
    assert all(isinstance(text, str) for text, _ in samples)
    assert not all(ended for _, ended in samples)  # two tokens rarely end a random model's answer


def test_per_row_budgets_and_stop_strings_end_rows_where_they_should():
    from kdlab.rollouts.decoding import sample_tokens

    vocab = 6

    def next_logprobs(previous):  # always emits token 3, never an end token
        logits = torch.full((3, vocab), -30.0)
        logits[:, 3] = 0.0
        return torch.log_softmax(logits, -1)

    ids, mask, _ = sample_tokens(next_logprobs, 3, torch.tensor([2, 5, 0]), eos_token_ids=(0,), pad_token_id=5, generator=None, greedy=True)
    assert mask.sum(1).tolist() == [2, 5, 0] and ids.shape[1] == 5  # a budget of 0 writes nothing
    assert (ids[~mask] == 5).all()

    def stop_after_three(tokens, rows):  # a stop string completed by the third token
        return rows & torch.tensor([tokens.shape[1] >= 3] * tokens.shape[0])

    ids, mask, _ = sample_tokens(next_logprobs, 3, 8, eos_token_ids=(0,), pad_token_id=5, generator=None, greedy=True, stop=stop_after_three)
    assert mask.sum(1).tolist() == [3, 3, 3]


def test_stop_strings_end_rollouts_and_evaluation_keeping_the_string(tiny_pair):
    from kdlab.models import ModelSpec, load_tokenizer
    from kdlab.rollouts.decoding import sample_completions, stop_strings_check

    tokenizer = load_tokenizer(ModelSpec(tiny_pair[0]))
    check = stop_strings_check(tokenizer, ["</answer>"])
    done = torch.tensor([tokenizer("<answer>12</answer>", add_special_tokens=False)["input_ids"]])
    assert check(done, torch.tensor([True])).tolist() == [True]
    assert check(done[:, :-2], torch.tensor([True])).tolist() == [False]
    assert stop_strings_check(tokenizer, []) is None

    module = DistillModule(*tiny_pair, Addition(num_train=4), rollout=StudentRollouts(), max_completion_tokens=12, batch_size=4, stop_strings=["1"])
    rollout = module.make_rollout(module.task.examples("train"), seed=0)
    for row, mask in zip(rollout.completion_ids, rollout.completion_mask):
        tokens = row[mask].tolist()  # a row stops with the token that first writes "1" (or an end token / the budget)
        assert "1" not in tokenizer.decode(tokens[:-1])
    results = sample_completions(module.student, tokenizer, module.task, module.task.examples("train"), temperature=1.0,
                                 max_new_tokens=[12, 12, 3, 12], generator=torch.Generator().manual_seed(0), stop_strings=["1"])
    for text, ended in results:
        assert ("1" in text) <= ended


def test_wrapped_models_are_asked_with_the_inner_models_arguments(tiny_pair):
    """FSDP1, DDP, compile and peft wrappers take ``*args, **kwargs``; kdlab looks through them, so a
    wrapped model still gets ``logits_to_keep`` (no prompt logits) and its KV-cache argument."""
    peft = pytest.importorskip("peft")
    from kdlab.models import ModelSpec, load_causal_lm
    from kdlab.objectives.logits import cache_argument, forward_parameters, innermost_model

    model = load_causal_lm(ModelSpec(tiny_pair[0]))
    compiled = torch.compile(model)
    assert innermost_model(compiled) is model
    ddp_like = torch.nn.Module()
    ddp_like.module = compiled
    assert innermost_model(ddp_like) is model
    assert "logits_to_keep" in forward_parameters(ddp_like) and cache_argument(ddp_like) == cache_argument(model)
    lora = peft.get_peft_model(load_causal_lm(ModelSpec(tiny_pair[0])), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert type(innermost_model(lora)).__name__ == type(model).__name__
