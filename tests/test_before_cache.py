"""``before_cache`` on the in-loop evaluation callbacks: a run that starts from the same student with the same
evaluation reads the scores before training from the cache instead of sampling them again, and gets exactly the
numbers measuring gives; anything that could change them (weights, settings, examples, kdlab's source) misses."""

import json
from types import SimpleNamespace

import pytest
import torch
from test_callbacks import bare_trainer, metrics_file

from kdlab.callbacks import Coverage, OODForgetting
from kdlab.evaluation import before_cache as before_cache_module
from kdlab.stages import DistillModule
from kdlab.tasks import Addition
from kdlab.tasks.skills import Sorting


@pytest.fixture
def module(tiny_pair):
    return DistillModule(*tiny_pair, Addition(num_train=8, num_val=4), max_completion_tokens=6, batch_size=4, val_examples=4)


def counted(callback):
    """``callback`` whose sampling counts the prompts it decodes in ``callback.decoded``."""
    callback.decoded, sample = 0, callback.sample

    def sample_counting(pl_module, task, examples, *args, **kwargs):
        callback.decoded += len(examples)
        return sample(pl_module, task, examples, *args, **kwargs)

    callback.sample = sample_counting
    return callback


def coverage(cache, **settings):
    settings = {"temperature": 1.0, **settings}
    return counted(Coverage(Addition(num_val=4, seed=3), ks=(1, 2), samples=2, examples=4, max_new_tokens=6, name="add",
                            before_cache=None if cache is None else str(cache), **settings))


def global_random_states():
    """The process-wide random states a training run draws from (torch, Python, NumPy), comparable with ``==``."""
    import random

    import numpy as np

    numpy_state = np.random.get_state()
    return torch.get_rng_state().tolist(), random.getstate(), (numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:])


def before_row(trainer):
    (row,) = metrics_file(trainer)
    return row


def test_a_second_run_reads_coverage_before_from_the_cache_and_gets_what_measuring_gives(module, tmp_path):
    cache = tmp_path / "cache"
    first, second, plain = coverage(cache), coverage(cache), coverage(None)
    trainers = [bare_trainer(tmp_path / name) for name in ("first", "second", "plain")]
    for callback, trainer in zip((first, second, plain), trainers):
        states = global_random_states()
        callback.on_fit_start(trainer, module)
        assert global_random_states() == states, "measuring draws from its own generator: skipping it changes no later draw"
    assert first.decoded == 4 and second.decoded == 0 and plain.decoded == 4
    rows = [before_row(trainer) for trainer in trainers]
    assert rows[0]["coverage/add/pass@1_before"] == rows[0]["coverage/add/pass@1"]
    assert {k: v for k, v in rows[1].items() if k != "step"} == {k: v for k, v in rows[2].items() if k != "step"}
    assert {k: v for k, v in rows[0].items() if k != "step"} == {k: v for k, v in rows[2].items() if k != "step"}
    (written,) = cache.glob("before-*.json")
    assert json.loads(written.read_text())["callback"] == "Coverage"


@pytest.mark.parametrize("change", ["seed", "examples", "temperature", "weights", "source", "matmul_precision"])
def test_anything_that_could_change_the_scores_misses(module, tmp_path, monkeypatch, change):
    cache = tmp_path / "cache"
    coverage(cache).on_fit_start(bare_trainer(tmp_path / "first"), module)
    settings = {"seed": {"seed": 1}, "temperature": {"temperature": 0.7}}.get(change, {})
    again = coverage(cache, **settings)
    if change == "examples":
        again.examples = 3
    if change == "weights":
        with torch.no_grad():
            next(module.student.parameters()).view(-1)[0] += 1e-3
    if change == "source":
        before_cache_module.source_digest.cache_clear()
        monkeypatch.setattr(before_cache_module, "source_digest", lambda: "another checkout")
    if change == "matmul_precision":  # TF32 matmuls ("high") round otherwise than full float32 ("highest")
        monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    again.on_fit_start(bare_trainer(tmp_path / "again"), module)
    assert again.decoded == again.examples
    assert len(list(cache.glob("before-*.json"))) == 2


def test_the_key_holds_the_device_type_the_gpu_name_and_the_matmul_precision(module, monkeypatch):
    """CPU and CUDA generators draw different streams from one seed: a score sampled on one is not reused on the
    other; nor across GPU models or float32 matmul precisions."""
    callback = coverage(None)
    examples = [callback.task.examples("val")[:4]]

    def key(device):
        return before_cache_module.evaluation_key(callback, [callback.task], examples, module.student_tokenizer, (1, 0), "32-true", {}, device)

    on_cpu = key("cpu")
    assert key(torch.device("cpu")) == on_cpu and key("cuda") != on_cpu
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    names = iter(["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: next(names))
    assert key("cuda:0") == key("cuda:0") != key("cuda:0")  # one GPU model's kernels, then another's
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "medium")
    assert key("cpu") != on_cpu


def test_ood_forgetting_before_comes_from_the_cache_on_the_second_run(module, tmp_path):
    cache = tmp_path / "cache"

    def ood():
        return counted(OODForgetting([Addition(num_val=4, seed=1), Sorting(num_val=4, seed=1)], examples=4, max_new_tokens=6,
                                     before_cache=str(cache)))

    first, second = ood(), ood()
    first.on_fit_start(bare_trainer(tmp_path / "first"), module)
    second.on_fit_start(bare_trainer(tmp_path / "second"), module)
    assert first.decoded == 8 and second.decoded == 0
    assert second.before == first.before and set(first.before) == {"addition", "sorting"}


def test_the_cache_is_refused_under_several_processes(module, tmp_path):
    callback = coverage(tmp_path / "cache")
    with pytest.raises(ValueError, match="Coverage.before_cache works on one process"):
        callback.before_scores(SimpleNamespace(world_size=2), module, [callback.task], [[]], lambda: {})


def test_an_lm_eval_suite_does_not_take_the_in_loop_cache():
    """The lm-eval suite keeps its before scores off the loop (``kdlab forgetting --cache_dir``)."""
    pytest.importorskip("lm_eval")
    with pytest.raises(ValueError, match="before_cache"):
        OODForgetting(lm_eval_tasks={"arc": {"task": "arc_easy", "limit": 2}}, before_cache="x")


def test_a_lora_student_is_digested_by_its_merged_weights(tiny_pair):
    """A LoRA grid's seeds draw other random ``A`` matrices while ``B = 0``: the student they evaluate is one, so the
    digest (and the "before" cache) is one; a trained adapter (``B != 0``) changes the effective weights and the digest."""
    pytest.importorskip("peft")
    from kdlab.models.loading import ModelSpec, load_causal_lm
    from kdlab.stages.lora import LoraSpec, apply_lora

    def student(seed):
        torch.manual_seed(seed)
        return apply_lora(load_causal_lm(ModelSpec(tiny_pair[0])), LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))

    first, second = student(1), student(2)
    a_names = [name for name, _ in first.named_parameters() if "lora_A" in name]
    assert a_names and any(not torch.equal(first.get_parameter(n), second.get_parameter(n)) for n in a_names)  # other A, same B = 0
    assert before_cache_module.weights_digest(first) == before_cache_module.weights_digest(second)
    with torch.no_grad():
        next(p for name, p in second.named_parameters() if "lora_B" in name).add_(1e-3)  # a trained adapter
    assert before_cache_module.weights_digest(first) != before_cache_module.weights_digest(second)

