"""Top-k teacher caches: the distribution they stand for, the file, and distillation without a teacher."""


import pytest
import torch

from kdlab.objectives import ForwardKL, ReverseKL, SampledReverseKL
from kdlab.objectives.kl import kl_diagnostics
from kdlab.rollouts.teacher_cache import TeacherCache, TopKLogprobs, expand_topk, prompt_digest, top_k_logprobs, write_cache

PROMPT = [2, 7, 1, 8]  # a teacher prompt's token ids


def test_a_top_k_teacher_keeps_the_top_k_exactly_and_spreads_the_tail_evenly():
    logits = torch.randn(3, 5, 50, generator=torch.Generator().manual_seed(0))
    indices, logprobs = top_k_logprobs(logits, k=8, temperature=0.5)
    full = expand_topk(indices, logprobs, 50)
    exact = torch.log_softmax(logits / 0.5, -1)
    assert torch.allclose(full.exp().sum(-1), torch.ones(3, 5), atol=1e-5)
    assert torch.allclose(full.gather(-1, indices), exact.gather(-1, indices))
    tail = 1 - exact.gather(-1, indices).exp().sum(-1)
    others = torch.ones_like(full, dtype=torch.bool).scatter_(-1, indices, False)
    assert torch.allclose(full.exp()[others].reshape(3, 5, 42), (tail / 42)[..., None].expand(3, 5, 42), atol=1e-6)


def test_with_k_equal_to_the_vocabulary_every_objective_sees_the_exact_teacher():
    generator = torch.Generator().manual_seed(1)
    student, teacher = torch.randn(2, 4, 30, generator=generator), torch.randn(2, 4, 30, generator=generator)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    full = expand_topk(*top_k_logprobs(teacher, k=30), 30)
    for objective in (ForwardKL(), ReverseKL()):
        torch.testing.assert_close(objective(student, full, mask), objective(student, teacher, mask), atol=1e-5, rtol=1e-5)


def test_forward_kl_to_a_top_k_teacher_approaches_the_exact_one_as_k_grows():
    generator = torch.Generator().manual_seed(2)
    student, teacher = torch.randn(1, 6, 200, generator=generator), 3 * torch.randn(1, 6, 200, generator=generator)
    mask = torch.ones(1, 6, dtype=torch.bool)
    exact = ForwardKL()(student, teacher, mask)
    gaps = [abs(float(ForwardKL()(student, expand_topk(*top_k_logprobs(teacher, k), 200), mask) - exact)) for k in (5, 50, 150, 200)]
    assert gaps[-1] < 1e-5 and gaps[0] > gaps[1] > gaps[2]


def test_a_top_k_batch_gives_every_objective_the_same_loss_and_gradient_as_its_dense_expansion():
    """TopKLogprobs expands one chunk of rows at a time; the result must equal the dense (B, C, V) teacher."""
    generator = torch.Generator().manual_seed(3)
    student, teacher = torch.randn(3, 7, 40, generator=generator), torch.randn(3, 7, 40, generator=generator)
    mask = torch.rand(3, 7, generator=generator) > 0.3
    lazy = TopKLogprobs(*top_k_logprobs(teacher, k=6), 40)
    dense = lazy.dense()
    assert lazy.shape == dense.shape == (3, 7, 40)
    for objective in (ForwardKL(chunk_size=4), ReverseKL(chunk_size=4), SampledReverseKL(seed=5, chunk_size=4)):
        values, grads = [], []
        for target in (lazy, dense):
            logits = student.clone().requires_grad_(True)
            objective.reseed(5)
            value = objective(logits, target, mask)
            value.backward()
            values.append(value.detach())
            grads.append(logits.grad)
        torch.testing.assert_close(values[0], values[1])
        torch.testing.assert_close(grads[0], grads[1])
    for name, value in kl_diagnostics(student, lazy, mask, chunk_size=4).items():
        torch.testing.assert_close(value, kl_diagnostics(student, dense, mask)[name], msg=name)


def test_padding_of_a_top_k_batch_is_the_uniform_distribution():
    rows = [(torch.tensor([[3, 1]]), torch.log(torch.tensor([[0.5, 0.25]])))]
    lazy = TopKLogprobs.from_rows(rows, length=3, k=2, token_columns=10)
    probs = lazy.dense().exp()
    assert torch.allclose(probs[0, 0, [3, 1]], torch.tensor([0.5, 0.25]))
    assert torch.allclose(probs[0, 1:], torch.full((2, 10), 0.1))


@pytest.mark.parametrize("cache_format", ["full", "compact"])
def test_cache_files_check_what_they_were_computed_on(cache_format, tmp_path):
    """Both formats (``full``: what every kdlab before the compact format wrote) read and check the same way: the
    completion tokens and the teacher prompt an example's log-probs follow must be the run's."""
    path = tmp_path / "cache.safetensors"
    rows = {"a": {"tokens": torch.tensor([5, 6, 7]), "indices": torch.tensor([[1, 4]] * 3), "logprobs": torch.log(torch.tensor([[0.5, 0.25]] * 3)),
                  "prompt_sha256": prompt_digest(PROMPT)}}
    write_cache(path, rows, {"top_k": 2, "temperature": 0.5, "token_columns": 10, "teacher": "t"}, cache_format=cache_format)
    cache = TeacherCache(str(path))
    assert (cache.top_k, cache.temperature, cache.token_columns, cache.ids) == (2, 0.5, 10, {"a"})
    assert cache.format == {"full": "full", "compact": "compact-v1"}[cache_format]
    indices, logprobs = cache.row("a", [5, 6, 7], PROMPT)
    assert indices.dtype == torch.int64 and logprobs.dtype == torch.float32 and indices.tolist() == [[1, 4]] * 3
    assert torch.equal(logprobs[:, 0], rows["a"]["logprobs"][:, 0])  # the row's max, exactly in both formats
    torch.testing.assert_close(logprobs, rows["a"]["logprobs"], atol=1e-5, rtol=0)  # k = 2: the other entry is renormalised
    assert cache.row("a", [5, 6], PROMPT)[0].shape == (2, 2)  # a prefix (shorter max length) is fine
    with pytest.raises(ValueError, match="example 'a' was cached on other completion tokens"):
        cache.row("a", [5, 9], PROMPT)
    for other in (PROMPT[:-1], PROMPT + [3], [2, 7, 1, 9], []):
        with pytest.raises(ValueError, match="example 'a' was cached after another teacher prompt than this run gives"):
            cache.row("a", [5, 6, 7], other)
    with pytest.raises(KeyError, match="no entry for example id 'b'"):
        cache.row("b", [1], PROMPT)
    del rows["a"]["prompt_sha256"]
    with pytest.raises(ValueError, match="example 'a' has no prompt_sha256"):
        write_cache(tmp_path / "unchecked.safetensors", rows, {"top_k": 2, "temperature": 0.5, "token_columns": 10}, cache_format=cache_format)
    with pytest.raises(FileNotFoundError, match="CachedTeacherRollouts.teacher_cache: no such file"):
        TeacherCache(str(tmp_path / "missing.safetensors"))
    (tmp_path / "bad.safetensors").write_bytes(b"junk")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        TeacherCache(str(tmp_path / "bad.safetensors"))


def test_a_cache_is_refused_for_another_teacher_prompt_and_a_file_without_prompts_is_refused(tmp_path):
    """A cache computed after the teacher prompt "Answer in French." trains a run with that prompt, and is refused,
    naming the example and the rebuild, for a run whose teacher prompt differs (another teacher_system_prompt, or
    none): its log-probs follow another prompt (before, such a run trained on them silently). A cache written
    before the prompts were recorded (kdlab 0.1's full file, a compact file without them) is refused naming the
    file, since nothing in it tells which prompts its log-probs follow."""
    import json

    from safetensors.torch import load_file, save_file

    from kdlab.models import ModelSpec, load_causal_lm, load_tokenizer
    from kdlab.rollouts import TeacherDatasetRollouts
    from kdlab.rollouts.teacher_data import build_teacher_cache
    from kdlab.stages import DistillModule
    from kdlab.tasks import Addition
    from kdlab.teachers import CachedTeacher

    student, teacher = "kdlab://tiny-random/student", "kdlab://tiny-random/teacher"

    def task(prompt):
        return Addition(max_digits=2, system_prompt="", teacher_system_prompt=prompt, num_train=4, num_val=0, num_test=0, seed=0)

    data, cache = tmp_path / "teacher.jsonl", tmp_path / "teacher.jsonl.topk.safetensors"
    data.write_text("".join(json.dumps({"id": e["id"], "completion": task(None).reference_completion(e)}) + "\n" for e in task(None).examples("train")))
    build_teacher_cache(load_causal_lm(ModelSpec(teacher)), load_tokenizer(ModelSpec(teacher)), task("Answer in French."), str(data), str(cache),
                        top_k=8, temperature=0.5, max_new_tokens=8, max_prompt_tokens=2048, batch_size=4)

    def rollout(prompt, path=cache):
        module = DistillModule(student, CachedTeacher(str(path)), task(prompt), rollout=TeacherDatasetRollouts(str(data)), batch_size=2,
                               max_completion_tokens=8, teacher_temperature=0.5, fused_lm_head=False)
        return module.make_rollout(task(prompt).examples("train")[:2], 0)

    assert rollout("Answer in French.").teacher_logprobs.indices.shape[-1] == 8
    for prompt in ("Answer in German, briefly.", None):
        with pytest.raises(ValueError, match=r"example 'add-train-0' was cached after another teacher prompt than this run gives "
                                             r"\(a changed teacher_system_prompt, .*rebuild it with `kdlab generate"):
            rollout(prompt)
    tensors, metadata = load_file(str(cache)), TeacherCache(str(cache))._file.metadata()
    ids = [example["id"] for example in task(None).examples("train")]
    assert sorted(json.loads(metadata["teacher_prompts"])) == sorted(ids)  # the SHA-256 of each example's teacher prompt
    unrecorded = tmp_path / "unrecorded.safetensors"
    save_file(tensors, str(unrecorded), metadata={key: value for key, value in metadata.items() if key != "teacher_prompts"})
    first = ids[0]
    old = tmp_path / "kdlab-0.1.safetensors"  # its full format, its metadata key for the columns
    save_file({f"{first}/tokens": torch.tensor([5]), f"{first}/indices": torch.tensor([[1, 4]]), f"{first}/logprobs": torch.tensor([[-0.7, -1.4]])},
              str(old), metadata={"top_k": "2", "temperature": "0.5", "vocab_size": "353", "teacher": "t"})
    for path in (unrecorded, old):
        with pytest.raises(ValueError, match=rf"DistillModule.teacher.path '{path}': written without the teacher prompts its log-probs follow "
                                             r".*rebuild it with `kdlab generate --config <your generate config> --top_k K`"):
            rollout("Answer in French.", path)


def test_distillation_from_a_full_cache_equals_distillation_from_the_teacher_without_loading_it(tiny_pair, tmp_path):
    """kdlab generate --top_k V writes the teacher's exact log-probs; a DistillModule with teacher: null
    reading them computes the same loss and gradients as one that runs the teacher."""
    from kdlab.rollouts import CachedTeacherRollouts, TeacherDatasetRollouts
    from kdlab.rollouts.teacher_data import generate_teacher_data
    from kdlab.stages import DistillModule
    from kdlab.tasks import Addition

    task = Addition(num_train=4, num_val=0, num_test=0)
    data = tmp_path / "teacher.jsonl"
    from kdlab.models import ModelSpec, load_tokenizer

    vocab = len(load_tokenizer(ModelSpec(tiny_pair[1])))
    summary = generate_teacher_data(ModelSpec(tiny_pair[1]), task, str(data), max_new_tokens=6, top_k=vocab, cache_temperature=0.5,
                                    cache_format="full")  # the compact format rounds the log-probs
    assert summary["cached"] == 4
    cache = str(data) + ".topk.safetensors"
    with_teacher = DistillModule(*tiny_pair, task, rollout=TeacherDatasetRollouts(str(data)), max_completion_tokens=6, batch_size=4)
    without = DistillModule(tiny_pair[0], None, task, rollout=CachedTeacherRollouts(str(data), cache), max_completion_tokens=6, batch_size=4)
    assert "teacher" not in without._frozen
    batch = task.examples("train")
    losses = []
    for module in (with_teacher, without):
        module.log = lambda *args, **kwargs: None
        loss = module.training_step(batch, 0)
        loss.backward()
        losses.append((loss.detach(), [p.grad.clone() for p in module.student.parameters()]))
    torch.testing.assert_close(losses[1][0], losses[0][0], atol=1e-5, rtol=1e-5)
    for a, b in zip(losses[0][1], losses[1][1]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    # a top-k cache (k < V) is held as (B, C, k) and trains exactly like its dense expansion
    top = tmp_path / "top.jsonl"
    generate_teacher_data(ModelSpec(tiny_pair[1]), task, str(top), max_new_tokens=6, top_k=5, cache_temperature=0.5)
    sparse = DistillModule(tiny_pair[0], None, task, rollout=CachedTeacherRollouts(str(top), str(top) + ".topk.safetensors"), max_completion_tokens=6, batch_size=4)
    rollout = sparse.make_rollout(batch, 0)
    assert isinstance(rollout.teacher_logprobs, TopKLogprobs) and rollout.teacher_logprobs.indices.shape[-1] == 5
    student, teacher = sparse.distillation_logits(rollout)
    mask = rollout.completion_mask
    torch.testing.assert_close(sparse.objective(student, teacher, mask), sparse.objective(student, teacher.dense(), mask))
    with pytest.raises(ValueError, match="teacher temperature 0.5, but DistillModule.teacher_temperature is 1.0"):
        DistillModule(tiny_pair[0], None, task, rollout=CachedTeacherRollouts(str(data), cache), teacher_temperature=1.0)
    with pytest.raises(ValueError, match="DistillModule.teacher is required"):
        DistillModule(tiny_pair[0], None, task)
    with pytest.raises(RuntimeError, match="has no model in this process: its outputs come from a teacher cache"):
        without.teacher


def test_a_step_from_a_top_k_cache_logs_the_mass_its_teacher_spreads(tiny_pair, tmp_path):
    """``train/teacher_tail_mass``: the mean over completion tokens of ``1 - sum(top-k probabilities)``, the teacher
    mass the KLs against a top-k teacher see only as an even spread; 0 for a cache of the whole vocabulary, and
    not logged for a teacher model (nothing left out)."""
    from kdlab.models import ModelSpec, load_tokenizer
    from kdlab.rollouts import CachedTeacherRollouts, TeacherDatasetRollouts
    from kdlab.rollouts.teacher_data import generate_teacher_data
    from kdlab.stages import DistillModule
    from kdlab.tasks import Addition

    task = Addition(num_train=4, num_val=0, num_test=0)
    vocab = len(load_tokenizer(ModelSpec(tiny_pair[1])))
    logged = {}
    for k in (5, vocab):
        data = tmp_path / f"top{k}.jsonl"
        generate_teacher_data(ModelSpec(tiny_pair[1]), task, str(data), max_new_tokens=6, top_k=k, cache_temperature=0.5, cache_format="full")
        module = DistillModule(tiny_pair[0], None, task, rollout=CachedTeacherRollouts(str(data), str(data) + ".topk.safetensors"),
                               max_completion_tokens=6, batch_size=4)
        module.log = lambda name, value, **kwargs: logged.setdefault(k, {}).__setitem__(name, float(value))
        rollout = module.make_rollout(task.examples("train"), 0)
        module.training_step(task.examples("train"), 0)
        teacher, mask = rollout.teacher_logprobs, rollout.completion_mask.bool()
        expected = (1 - teacher.logprobs.exp().sum(-1))[mask].mean()
        assert logged[k]["train/teacher_tail_mass"] == pytest.approx(float(expected), abs=1e-6)
    assert logged[5]["train/teacher_tail_mass"] > 0.01 and logged[vocab]["train/teacher_tail_mass"] == pytest.approx(0.0, abs=1e-5)
    plain = DistillModule(*tiny_pair, task, rollout=TeacherDatasetRollouts(str(tmp_path / "top5.jsonl")), max_completion_tokens=6, batch_size=4)
    names = []
    plain.log = lambda name, value, **kwargs: names.append(name)
    plain.training_step(task.examples("train"), 0)
    assert "train/kl_forward" in names and "train/teacher_tail_mass" not in names
