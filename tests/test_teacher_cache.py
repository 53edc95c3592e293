"""Top-k teacher caches: the distribution they stand for, the file, and distillation without a teacher."""


import pytest
import torch

from kdlab.objectives import ForwardKL, ReverseKL
from kdlab.teacher_cache import TeacherCache, expand_topk, top_k_logprobs, write_cache


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


def test_cache_files_check_what_they_were_computed_on(tmp_path):
    path = tmp_path / "cache.safetensors"
    rows = {"a": {"tokens": torch.tensor([5, 6, 7]), "indices": torch.zeros(3, 2, dtype=torch.long), "logprobs": torch.zeros(3, 2)}}
    write_cache(path, rows, {"top_k": 2, "temperature": 0.5, "vocab_size": 10, "teacher": "t"})
    cache = TeacherCache(str(path))
    assert (cache.top_k, cache.temperature, cache.vocab_size, cache.ids) == (2, 0.5, 10, {"a"})
    assert cache.row("a", [5, 6])[0].shape == (2, 2)  # a prefix (shorter max length) is fine
    with pytest.raises(ValueError, match="example 'a' was cached on other completion tokens"):
        cache.row("a", [5, 9])
    with pytest.raises(KeyError, match="no entry for example id 'b'"):
        cache.row("b", [1])
    with pytest.raises(FileNotFoundError, match="TeacherRollouts.teacher_cache: no such file"):
        TeacherCache(str(tmp_path / "missing.safetensors"))
    (tmp_path / "bad.safetensors").write_bytes(b"junk")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        TeacherCache(str(tmp_path / "bad.safetensors"))


def test_distillation_from_a_full_cache_equals_distillation_from_the_teacher_without_loading_it(tiny_pair, tmp_path):
    """kdlab generate --top_k V writes the teacher's exact log-probs; a DistillModule with teacher: null
    reading them computes the same loss and gradients as one that runs the teacher."""
    from kdlab.module import DistillModule
    from kdlab.rollouts import TeacherRollouts
    from kdlab.tasks import Addition
    from kdlab.teacher_data import generate_teacher_data

    task = Addition(num_train=4, num_val=0, num_test=0)
    data = tmp_path / "teacher.jsonl"
    from kdlab.models import ModelSpec, load_tokenizer

    vocab = len(load_tokenizer(ModelSpec(tiny_pair[1])))
    summary = generate_teacher_data(ModelSpec(tiny_pair[1]), task, str(data), max_new_tokens=6, top_k=vocab, cache_temperature=0.5)
    assert summary["cached"] == 4
    cache = str(data) + ".topk.safetensors"
    with_teacher = DistillModule(*tiny_pair, task, rollout=TeacherRollouts(dataset=str(data)), max_completion_tokens=6, batch_size=4)
    without = DistillModule(tiny_pair[0], None, task, rollout=TeacherRollouts(dataset=str(data), teacher_cache=cache), max_completion_tokens=6, batch_size=4)
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
    with pytest.raises(ValueError, match="teacher temperature 0.5, but DistillModule.teacher_temperature is 1.0"):
        DistillModule(tiny_pair[0], None, task, rollout=TeacherRollouts(dataset=str(data), teacher_cache=cache), teacher_temperature=1.0)
    with pytest.raises(ValueError, match="DistillModule.teacher is required"):
        DistillModule(tiny_pair[0], None, task)
    with pytest.raises(RuntimeError, match="no teacher model"):
        without.teacher
