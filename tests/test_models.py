import pytest
import torch

from kdlab.models import ModelSpec, load_causal_lm, load_tokenizer, resolve_path, shared_vocab_size
from kdlab.module import DistillModule
from kdlab.tasks import Addition
from kdlab.tiny import build_tokenizer, tiny_qwen2


def test_packaged_paths_resolve_inside_the_package():
    assert resolve_path("kdlab://tiny-random/student").endswith("kdlab/assets/tiny-random/student")
    assert resolve_path("Qwen/Qwen2.5-1.5B-Instruct") == "Qwen/Qwen2.5-1.5B-Instruct"


def test_padded_teacher_embedding_is_restricted_to_the_tokenizer_vocabulary(tiny_pair):
    module = DistillModule(*tiny_pair, Addition(num_train=4), max_completion_tokens=4)
    teacher_rows = module.teacher.get_output_embeddings().weight.shape[0]
    student_rows = module.student.get_output_embeddings().weight.shape[0]
    assert teacher_rows > student_rows == module.vocab_size == len(module.student_tokenizer)
    rollout = module.make_rollout(module.task.examples("train")[:2], seed=0)
    student, teacher = module.distillation_logits(rollout)
    assert student.shape[-1] == teacher.shape[-1] == module.vocab_size


def test_teacher_is_frozen_and_stays_in_eval_mode(tiny_pair):
    module = DistillModule(*tiny_pair, Addition(num_train=4))
    module.train()
    assert module.student.training and not module.teacher.training
    assert not any(p.requires_grad for p in module.teacher.parameters())
    assert all(p.requires_grad for p in module.student.parameters())


def test_different_tokenizers_fail_before_training_naming_both_paths(tiny_pair, tmp_path):
    other = build_tokenizer(["completely different corpus " * 50, "zebra quartz"], vocab_size=300)
    model = tiny_qwen2(len(other), hidden=16, layers=1, heads=2)
    model.save_pretrained(tmp_path / "other")
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="tokenizers differ.*student.path.*teacher.path"):
        DistillModule(tiny_pair[0], str(tmp_path / "other"), Addition(num_train=4))


def test_missing_model_directory_names_the_role_and_path(tiny_pair):
    with pytest.raises(FileNotFoundError, match="teacher.path.*does-not-exist"):
        DistillModule(tiny_pair[0], "kdlab://does-not-exist", Addition(num_train=4))


def test_bad_dtype_names_the_key():
    with pytest.raises(ValueError, match="dtype"):
        ModelSpec("x", dtype="float8")


def test_model_loads_in_the_requested_dtype_with_checkpointing(tiny_pair):
    model = load_causal_lm(ModelSpec(tiny_pair[0], dtype="bfloat16", gradient_checkpointing=True))
    assert next(model.parameters()).dtype == torch.bfloat16
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    assert load_tokenizer(ModelSpec(tiny_pair[0])).pad_token_id is not None


def test_vocab_check_rejects_a_model_with_too_few_rows(tiny_pair):
    tokenizer = load_tokenizer(ModelSpec(tiny_pair[0]))
    small = tiny_qwen2(len(tokenizer) - 5, hidden=16, layers=1, heads=2)
    with pytest.raises(ValueError, match="fewer than"):
        shared_vocab_size(tokenizer, tokenizer, small, small)


def test_corrupted_weight_file_names_the_file(tiny_pair, tmp_path):
    import shutil

    from kdlab.models import resolve_path

    folder = tmp_path / "student"
    shutil.copytree(resolve_path(tiny_pair[0]), folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(OSError, match=r"student.path: could not load the model weights from .*model.safetensors"):
        load_causal_lm(ModelSpec(str(folder)), "student")


def test_missing_packaged_model_names_the_rebuild_command():
    with pytest.raises(FileNotFoundError, match="python -m kdlab.tiny world"):
        load_causal_lm(ModelSpec("kdlab://tiny-missing/student"), "student")
