import json

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from kdlab.callbacks import Coverage, OODForgetting, RolloutSensitivity, StyleTransfer, UpdateSparsity
from kdlab.callbacks.sparsity import module_group
from kdlab.evaluation.metrics import pass_at_k
from kdlab.stages import DistillModule
from kdlab.tasks import Addition
from kdlab.tasks.skills import Sorting


@pytest.fixture
def module(tiny_pair):
    return DistillModule(*tiny_pair, Addition(num_train=8, num_val=4), max_completion_tokens=6, batch_size=4, val_examples=4)


def bare_trainer(tmp_path):
    return pl.Trainer(accelerator="cpu", logger=TensorBoardLogger(tmp_path), enable_progress_bar=False)


def metrics_file(trainer):
    return [json.loads(line) for line in open(f"{trainer.log_dir}/metrics.jsonl")]


def test_sparsity_callback_counts_known_moves_by_hand(module, tmp_path):
    trainer = bare_trainer(tmp_path)
    callback = UpdateSparsity(thresholds=(1e-6, 1e-2))
    callback.on_fit_start(trainer, module)
    params = dict(module.student.named_parameters())
    total = sum(p.numel() for p in params.values())
    attention = [n for n in params if module_group(n) == "attention"]
    with torch.no_grad():
        params[attention[0]].view(-1)[:10] += 1e-3  # 10 entries move by 1e-3: below 1e-2, above 1e-6
        params["lm_head.weight"].view(-1)[:7] += 1.0  # 7 entries move by 1
    callback.measure(trainer, module)
    (row,) = metrics_file(trainer)
    assert row["sparsity/1e-06"] == pytest.approx((total - 17) / total)
    assert row["sparsity/0.01"] == pytest.approx((total - 7) / total)
    attention_total = sum(params[n].numel() for n in attention)
    assert row["sparsity/1e-06/attention"] == pytest.approx((attention_total - 10) / attention_total)
    assert row["sparsity/1e-06/embeddings"] < 1.0 and row["sparsity/1e-06/mlp"] == 1.0


def test_sparsity_needs_positive_thresholds():
    with pytest.raises(ValueError, match="UpdateSparsity.thresholds"):
        UpdateSparsity(thresholds=(0.0,))


def test_ood_forgetting_reports_before_after_and_delta_in_points(module, tmp_path):
    trainer = bare_trainer(tmp_path)
    tasks = [Addition(num_val=4, seed=1), Sorting(num_val=4, seed=1)]
    callback = OODForgetting(tasks, examples=4, max_new_tokens=6)
    scores = iter([{"addition": 50.0, "sorting": 100.0}, {"addition": 25.0, "sorting": 75.0}])
    callback.scores = lambda pl_module: next(scores)  # the arithmetic of the report, independent of the model
    callback.on_fit_start(trainer, module)
    callback.measure(trainer, module)
    before, after = metrics_file(trainer)
    assert before["ood/mean_before"] == 75.0
    assert after["ood/addition"] == 25.0 and after["ood/mean"] == 50.0 and after["ood/mean_delta"] == -25.0
    restored = OODForgetting(tasks)
    restored.load_state_dict(callback.state_dict())
    assert restored.before == {"addition": 50.0, "sorting": 100.0}
    added_on_resume = OODForgetting(tasks)  # a checkpoint without its state: the scores, and no delta from nothing
    added_on_resume.scores = lambda pl_module: {"addition": 25.0, "sorting": 75.0}
    added_on_resume.measure(trainer, module)
    assert metrics_file(trainer)[-1]["ood/mean"] == 50.0 and "ood/mean_delta" not in metrics_file(trainer)[-1]


def test_ood_forgetting_refuses_tasks_of_one_name_and_names_tells_them_apart(module, tmp_path, monkeypatch):
    """Two Additions are both ``addition``: one score would replace the other and the means would average fewer
    tasks than configured, so the callback is refused at construction naming both; ``names`` keeps every task."""
    import kdlab.callbacks.periodic as callbacks

    tasks = [Addition(max_digits=1, num_val=2, seed=1), Addition(max_digits=4, num_val=2, seed=1), Sorting(num_val=2, seed=1)]
    with pytest.raises(ValueError, match=r"OODForgetting.tasks: tasks\[0\] \(Addition\), tasks\[1\] \(Addition\) are all named 'addition'.*"
                                         r"give OODForgetting.names"):
        OODForgetting(tasks, examples=2)
    with pytest.raises(ValueError, match=r"OODForgetting.names: tasks\[0\] \(Addition\), tasks\[2\] \(Sorting\) are all named 'a'"):
        OODForgetting(tasks, names=["a", "b", "a"], examples=2)
    with pytest.raises(ValueError, match="OODForgetting.names must give one name per task: 2 names for 3 tasks"):
        OODForgetting(tasks, names=["a", "b"], examples=2)
    callback = OODForgetting(tasks, names=["add1", "add4", "sort"], examples=2, max_new_tokens=4)
    right = {id(tasks[0]): True, id(tasks[1]): False, id(tasks[2]): True}  # the 1-digit sums and the sorts right, the 4-digit wrong

    def known(model, tokenizer, task, examples, **settings):
        return [task.reference_completion(ex) if right[id(task)] else "x" for ex in examples]

    monkeypatch.setattr(callbacks, "completion_texts", known)
    trainer = bare_trainer(tmp_path)
    callback.on_fit_start(trainer, module)
    (before,) = metrics_file(trainer)
    assert before == {**before, "ood/add1_before": 100.0, "ood/add4_before": 0.0, "ood/sort_before": 100.0}
    assert before["ood/mean_before"] == pytest.approx(200 / 3)  # over the three tasks configured


def test_ood_scores_are_real_accuracies(module, monkeypatch):
    import kdlab.callbacks.periodic as callbacks

    task = Addition(num_val=4, seed=2)
    callback = OODForgetting([task], examples=3, max_new_tokens=6)
    assert callback.scores(module) == {"addition": 0.0}  # a random student cannot add
    # known completions through the same path: right on the 1st and 3rd of the first 3 problems, a wrong sum on the 2nd
    def known(model, tokenizer, task, examples, **settings):
        assert [ex["id"] for ex in examples] == [ex["id"] for ex in task.examples("val")[:3]]
        wrong = f"<answer>{examples[1]['a'] + examples[1]['b'] + 1}</answer>"
        return [task.reference_completion(examples[0]), wrong, task.reference_completion(examples[2])]

    monkeypatch.setattr(callbacks, "completion_texts", known)
    assert callback.scores(module) == {"addition": pytest.approx(200 / 3)}  # in points
    with pytest.raises(ValueError, match="at least one task"):
        OODForgetting([])


def test_coverage_uses_the_unbiased_estimator_over_samples(module, tmp_path):
    trainer = bare_trainer(tmp_path)
    task = Addition(num_val=2, seed=3)
    callback = Coverage(task, ks=(1, 2), samples=3, examples=2, name="add")
    examples = task.examples("val")[:2]
    right = [task.reference_completion(examples[0])] * 2 + ["x"]  # 2 of 3 right on problem 0
    callback.sample = lambda pl_module, task, examples, repeat: right + ["x"] * 3  # 0 of 3 on problem 1
    callback.measure(trainer, module)
    (row,) = metrics_file(trainer)
    assert row["coverage/add/pass@1"] == pytest.approx((2 / 3 + 0) / 2)
    assert row["coverage/add/pass@2"] == pytest.approx((pass_at_k(3, 2, 2) + 0) / 2)
    with pytest.raises(ValueError, match="Coverage.ks"):
        Coverage(task, ks=(11,), samples=10)
    callback.on_fit_start(trainer, module)  # the measurement before training is also kept as <metric>_before
    before = metrics_file(trainer)[-1]
    assert before["coverage/add/pass@1_before"] == before["coverage/add/pass@1"] == pytest.approx(1 / 3)


def test_coverage_split_over_replicas_pools_to_the_counts_of_one_process(module, tmp_path, monkeypatch):
    import kdlab.callbacks.evaluations as evaluations

    trainer = bare_trainer(tmp_path)
    task = Addition(num_val=5, seed=3)
    examples = task.examples("val")
    ids = [ex["id"] for ex in examples]
    callback = Coverage(task, ks=(1, 2), samples=3, examples=5)
    calls = []

    def sample(pl_module, task, chosen, repeat):  # prompt i has i % 3 of its 3 samples right
        calls.append(([ex["id"] for ex in chosen], callback.seed))
        return [task.reference_completion(ex) if s < ids.index(ex["id"]) % 3 else "x" for ex in chosen for s in range(repeat)]

    callback.sample = sample
    whole = callback.correct_counts(trainer, module, examples)  # one process: every prompt, from seed
    assert whole == [0, 1, 2, 0, 1] and calls == [(ids, 0)]
    shares = []
    for rank in (0, 1):
        monkeypatch.setattr(evaluations, "replica_layout", lambda trainer, pl_module, rank=rank: (2, rank))
        shares.append(callback.correct_counts(trainer, module, examples))
    # replica r samples every other prompt from r, from seed + r; replica 1 is padded with prompt 0 (its
    # samples dropped) so both decode as many batches
    assert calls[1:] == [([ids[0], ids[2], ids[4]], 0), ([ids[1], ids[3], ids[0]], 1)]
    assert shares == [[0, -1, 2, -1, 1], [-1, 1, -1, 0, -1]]
    assert [max(counts) for counts in zip(*shares)] == whole  # what the processes' all_reduce(MAX) pools
    assert callback.seed == 0


def test_style_transfer_judges_real_text(module, tmp_path):
    trainer = bare_trainer(tmp_path)
    task = Addition(num_val=2, seed=4)
    callback = StyleTransfer([task], examples=2)
    replies = {"teacher": ["primero sumo y luego obtengo el resultado"] * 2, "student": ["first I add and then I get it", "primero sumo y luego obtengo"]}
    callback.sample = lambda pl_module, task, examples, role="student", repeat=1, model=None: replies[role]
    callback.on_fit_start(trainer, module)
    (row,) = metrics_file(trainer)
    assert row["style/teacher_spanish_share"] == 1.0 and row["style/spanish_share"] == 0.5
    later = StyleTransfer([task], examples=2, at_start=False)  # the end of fit only: nothing sampled at the start
    later.sample = lambda *a, **k: pytest.fail("at_start=False sampled at the start of fit")
    later.on_fit_start(trainer, module)
    later.sample = lambda pl_module, task, examples, role="student", repeat=1, model=None: replies[role]
    later.measure(trainer, module)
    assert metrics_file(trainer)[-1]["style/spanish_share"] == 0.5 and len(metrics_file(trainer)) == 2


def test_a_resumed_fit_does_not_measure_style_transfer_again_at_its_start(tiny_pair, tmp_path):
    """Lightning restores the weights before ``on_fit_start`` (global_step still 0): a resumed fit measuring there
    would log a trained student's share as the step-0 "before"; only the first run measures at its start."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    task = Addition(num_val=2, seed=4)
    sampled = []

    def fit(steps, ckpt_path=None):
        callback = StyleTransfer([task], examples=2)

        def sample(pl_module, task, examples, role="student", repeat=1, model=None):
            sampled.append((steps, role, pl_module.trainer.training))  # training is False at the start of fit, True at its end
            return ["primero sumo y luego obtengo el resultado"] * len(examples)

        callback.sample = sample
        module = DistillModule(*tiny_pair, Addition(num_train=8, num_val=4), max_completion_tokens=6, batch_size=4, val_examples=4)
        checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True, every_n_train_steps=1)
        pl.Trainer(max_steps=steps, accelerator="cpu", logger=TensorBoardLogger(tmp_path), callbacks=[callback, checkpoint], limit_val_batches=0,
                   enable_progress_bar=False, enable_model_summary=False).fit(module, ckpt_path=ckpt_path)

    fit(1)
    assert [role for steps, role, _ in sampled] == ["teacher", "student", "student"]  # before training (both), and at its end
    sampled.clear()
    fit(2, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert sampled == [(2, "student", True)]  # the end of fit alone


def test_style_transfer_draws_each_entry_from_its_own_split_and_count(module, tmp_path):
    """StyleTransfer.tasks: a TaskPrompts entry names its split and count (its own, else the callback's ``examples``); a
    plain task keeps the first ``examples`` of its ``val`` split. The share is over every response drawn: 3 + 4 + 4,
    of which the 3 train ones are Spanish."""
    from kdlab.callbacks import TaskPrompts

    first, second, plain = Addition(num_train=5, num_val=6, num_test=5, seed=1), Sorting(num_val=6, num_test=5, seed=1), Addition(num_val=6, seed=2)
    callback = StyleTransfer([TaskPrompts(first, "train", 3), TaskPrompts(second, "test"), plain], examples=4)
    drawn = []

    def sample(pl_module, task, examples, role="student", repeat=1, model=None):
        drawn.append((task, [example["id"] for example in examples]))
        return ["primero sumo y luego obtengo el resultado" if task is first else "first I add and then I get it" for _ in examples]

    callback.sample = sample
    trainer = bare_trainer(tmp_path)
    callback.measure(trainer, module)
    assert drawn == [(first, [ex["id"] for ex in first.examples("train")[:3]]), (second, [ex["id"] for ex in second.examples("test")[:4]]),
                     (plain, [ex["id"] for ex in plain.examples("val")[:4]])]
    assert metrics_file(trainer)[-1]["style/spanish_share"] == pytest.approx(3 / 11)


def test_task_prompts_refuse_a_split_that_is_not_one_and_a_count_below_one():
    from kdlab.callbacks import TaskPrompts

    with pytest.raises(ValueError, match=r"TaskPrompts.split must be one of \('train', 'val', 'test'\), got 'dev'"):
        TaskPrompts(Addition(num_val=1), "dev")
    with pytest.raises(ValueError, match="TaskPrompts.examples must be >= 1 or null, got 0"):
        TaskPrompts(Addition(num_val=1), "val", 0)


def test_callbacks_in_a_real_fit_write_tensorboard_and_the_metrics_file(module, tmp_path):
    tasks = [Addition(num_val=2, seed=5)]
    callbacks = [
        UpdateSparsity(every_n_steps=1),
        OODForgetting(tasks, examples=2, max_new_tokens=4),
        StyleTransfer(tasks, examples=2, max_new_tokens=4),
        Coverage(Addition(num_val=2, seed=6), ks=(1, 2), samples=2, examples=2, max_new_tokens=4),
        RolloutSensitivity(examples=2, every_n_steps=2),
    ]
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=TensorBoardLogger(tmp_path), callbacks=callbacks,
                         limit_val_batches=0, enable_progress_bar=False, enable_checkpointing=False)
    trainer.fit(module)
    rows = metrics_file(trainer)
    keys = set().union(*rows)
    for key in ("sparsity/1e-06", "sparsity/1e-08", "ood/mean_delta", "style/spanish_share", "coverage/addition/pass@2", "theory/grad_diff"):
        assert key in keys, key
    assert [row["step"] for row in rows if "sparsity/1e-06" in row] == [1, 2]
    events = EventAccumulator(trainer.log_dir)
    events.Reload()
    assert "sparsity/1e-06" in events.Tags()["scalars"] and "ood/mean_delta" in events.Tags()["scalars"]


def test_rollout_sensitivity_is_zero_between_identical_policies_and_positive_otherwise(module, tmp_path):
    from kdlab.callbacks import RolloutSensitivity
    from kdlab.rollouts import MixtureRollouts, TeacherRollouts

    trainer = bare_trainer(tmp_path)
    module.rollout = TeacherRollouts()
    grads_before = [p.grad for p in module.student.parameters()]
    RolloutSensitivity(reference=MixtureRollouts(lam=-1.0), examples=4).measure(trainer, module)
    RolloutSensitivity(examples=4).measure(trainer, module)  # reference: student rollouts
    same, different = metrics_file(trainer)
    assert same["theory/grad_diff"] == 0.0 and same["theory/tv_policy_teacher"] == pytest.approx(0.0, abs=1e-6)
    assert different["theory/grad_diff"] > 0 and different["theory/tv_reference_student"] == pytest.approx(0.0, abs=1e-6)
    assert different["theory/tv_policy_student"] > 0.01
    assert [p.grad for p in module.student.parameters()] == grads_before  # training state untouched


def test_policies_expose_their_next_token_distribution():
    from kdlab.rollouts import MixtureRollouts, StudentRollouts, TeacherRollouts
    from kdlab.rollouts.mixture import mixture_logprobs

    s, t = torch.log_softmax(torch.randn(3, 5), -1), torch.log_softmax(torch.randn(3, 5), -1)
    assert torch.equal(StudentRollouts().next_token_logprobs(s, t), s)
    assert torch.equal(TeacherRollouts().next_token_logprobs(s, t), t)
    assert torch.equal(MixtureRollouts(0.3).next_token_logprobs(s, t), mixture_logprobs(s, t, 0.3))


def test_missing_language_detector_fails_at_construction_naming_the_extra(monkeypatch):
    import kdlab.evaluation.metrics as metrics

    metrics._identifier.cache_clear()
    monkeypatch.setitem(__import__("sys").modules, "py3langid", None)
    try:
        with pytest.raises(ImportError, match=r"pip install 'kdlab\[eval\]'"):
            StyleTransfer([Addition(num_val=1)])
    finally:
        metrics._identifier.cache_clear()


# ---- StyleTransfer and RolloutSensitivity on stages without a teacher model -----------------------
def spy_on_generation(monkeypatch):
    """Record (role, hidden size of the model sampled) of every generation the callbacks run."""
    import kdlab.callbacks.periodic as callbacks

    calls, real = [], callbacks.completion_texts
    monkeypatch.setattr(callbacks, "completion_texts", lambda model, *a, **k: calls.append((k["role"], model.config.hidden_size)) or real(model, *a, **k))
    return calls


def fit(module, callbacks, tmp_path, steps=1):
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=TensorBoardLogger(tmp_path), callbacks=callbacks,
                         limit_val_batches=0, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(module)
    return trainer


@pytest.fixture
def grpo(tiny_pair):
    from kdlab.stages import GRPOModule

    return GRPOModule(tiny_pair[0], Addition(num_train=4, num_val=2), group_size=2, batch_size=2, max_completion_tokens=4, warmup_steps=0)


@pytest.fixture
def cached_distill(tiny_pair, tmp_path):
    """A DistillModule with teacher: null: teacher log-probs come from a top-k cache written beforehand."""
    from kdlab.models import ModelSpec
    from kdlab.rollouts import CachedTeacherRollouts
    from kdlab.rollouts.teacher_data import generate_teacher_data

    task = Addition(num_train=2, num_val=2, num_test=0)
    data = tmp_path / "teacher.jsonl"
    generate_teacher_data(ModelSpec(tiny_pair[1]), task, str(data), max_new_tokens=3, top_k=4, cache_temperature=0.5)
    rollout = CachedTeacherRollouts(dataset=str(data), teacher_cache=str(data) + ".topk.safetensors")
    return DistillModule(tiny_pair[0], None, task, rollout=rollout, max_completion_tokens=3, batch_size=2)


def test_every_measuring_callback_runs_on_a_grpo_stage(grpo, tiny_pair, tmp_path, monkeypatch):
    """docs/stages.md: UpdateSparsity, OODForgetting, Coverage and StyleTransfer (given a teacher) work on GRPOModule."""
    calls = spy_on_generation(monkeypatch)
    tasks = [Addition(num_val=2, seed=5)]
    callbacks = [
        UpdateSparsity(every_n_steps=1),
        OODForgetting(tasks, examples=2, max_new_tokens=3),
        StyleTransfer(tasks, examples=2, max_new_tokens=3, teacher=tiny_pair[1]),
        Coverage(Addition(num_val=2, seed=6), ks=(1, 2), samples=2, examples=2, max_new_tokens=3),
    ]
    trainer = fit(grpo, callbacks, tmp_path)
    keys = set().union(*metrics_file(trainer))
    for key in ("sparsity/1e-06", "ood/mean_delta", "style/teacher_spanish_share", "style/spanish_share", "coverage/addition/pass@2"):
        assert key in keys, key
    assert ("teacher", 64) in calls and ("student", 32) in calls  # the given teacher (hidden 64), the policy (32)
    assert all(size == 64 for role, size in calls if role == "teacher")


def test_style_transfer_refuses_a_grpo_stage_without_a_teacher_at_setup(grpo, tmp_path, monkeypatch):
    calls = spy_on_generation(monkeypatch)
    with pytest.raises(ValueError, match="StyleTransfer.teacher is required on a GRPOModule whose teacher writes no completions"):
        fit(grpo, [StyleTransfer([Addition(num_val=2)], examples=2, max_new_tokens=3)], tmp_path)
    assert calls == [] and grpo.global_step == 0  # nothing sampled, nothing trained


def test_style_transfer_on_distillation_from_a_teacher_cache(cached_distill, tiny_pair, tmp_path, monkeypatch):
    calls = spy_on_generation(monkeypatch)
    tasks = [Addition(num_val=2, seed=7)]
    with pytest.raises(ValueError, match="StyleTransfer.teacher is required on a DistillModule whose teacher writes no completions"):
        fit(cached_distill, [StyleTransfer(tasks, examples=2, max_new_tokens=3)], tmp_path / "refused")
    assert calls == [] and cached_distill.global_step == 0
    trainer = fit(cached_distill, [StyleTransfer(tasks, examples=2, max_new_tokens=3, teacher=tiny_pair[1])], tmp_path / "given")
    start, end = metrics_file(trainer)  # at the start of fit, and at its end
    assert {"style/teacher_spanish_share", "style/spanish_share"} <= start.keys() and "style/spanish_share" in end
    assert ("teacher", 64) in calls and "teacher" not in cached_distill._frozen  # loaded for the callback only


def test_style_transfer_prefers_the_teacher_it_is_given(module, tmp_path, monkeypatch):
    import gc
    import weakref

    import kdlab.models.loading as models

    calls, loaded, real_load = spy_on_generation(monkeypatch), [], models.load_causal_lm
    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: loaded.append(weakref.ref(model := real_load(*a, **k))) or model)
    callback = StyleTransfer([Addition(num_val=1)], examples=1, max_new_tokens=2, teacher="kdlab://tiny-random/student")
    callback.setup(bare_trainer(tmp_path), module, "fit")
    callback.on_fit_start(bare_trainer(tmp_path), module)
    assert calls == [("teacher", 32), ("student", 32)]  # the module's teacher (hidden 64) was not used
    gc.collect()
    assert len(loaded) == 1 and loaded[0]() is None  # loaded for the one measurement, then released
    with pytest.raises(FileNotFoundError, match="StyleTransfer.teacher"):
        StyleTransfer([Addition(num_val=1)], teacher=str(tmp_path / "missing")).setup(bare_trainer(tmp_path), module, "fit")


def test_rollout_sensitivity_refuses_stages_it_cannot_measure_at_setup(grpo, cached_distill, tmp_path):
    with pytest.raises(ValueError, match="RolloutSensitivity .* needs a DistillModule, got GRPOModule"):
        fit(grpo, [RolloutSensitivity(examples=2)], tmp_path / "grpo")
    with pytest.raises(ValueError, match=r"RolloutSensitivity needs a teacher that scores any completion .*DistillModule.teacher \(CachedTeacher\)"):
        fit(cached_distill, [RolloutSensitivity(examples=2)], tmp_path / "cache")
    assert grpo.global_step == 0 and cached_distill.global_step == 0


@pytest.mark.parametrize("callback, key", [("kdlab.callbacks.StyleTransfer", "teacher"), ("kdlab.callbacks.UpdateSparsity", "reference"),
                                           ("kdlab.callbacks.RolloutSensitivity", "reference")])
def test_a_callback_setting_that_takes_a_model_instantiates_no_other_class(callback, key):
    """``teacher``/``reference`` are typed (a model spec or path; a rollout policy), so a config cannot make them any
    importable class (they were ``Any``: ``{class_path: collections.OrderedDict}`` was built)."""
    from jsonargparse import ArgumentParser

    module, _, name = callback.rpartition(".")
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(getattr(__import__(module, fromlist=[name]), name), "cb")
    args = [f'--cb.{key}={{"class_path": "collections.OrderedDict"}}'] + (["--cb.tasks=[]"] if name == "StyleTransfer" else [])
    try:
        value = parser.parse_args(args).cb[key]
    except Exception:  # refused outright (a policy type)
        return
    assert isinstance(value, str)  # at most a path string, never a class to build (Any kept a class_path to instantiate)


def test_a_callbacks_decode_is_validations_decode_precision_ends_and_stop_strings_included(tiny_pair, tmp_path):
    """A callback samples the module's student as validation does: under the trainer's precision (Lightning wraps
    its steps in bf16 autocast, not callback hooks), ending at the module's end tokens and stop strings. At the same
    prompts, temperature and seed, Coverage's completions are validation's (before: fp32 outside autocast, the
    student's own end ids only and no stop strings)."""
    task = Addition(num_train=8, num_val=4)
    module = DistillModule(*tiny_pair, task, max_completion_tokens=8, batch_size=4, val_examples=4, stop_strings=["e"])
    trainer = pl.Trainer(accelerator="cpu", precision="bf16-mixed", logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         max_steps=0, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=tmp_path)
    seen = []
    forward = module.student.forward
    module.student.forward = lambda *a, **k: seen.append(torch.is_autocast_enabled("cpu")) or forward(*a, **k)
    trainer.fit(module)  # attaches the trainer, takes no step
    examples = task.examples("val")[:4]
    callback = Coverage(task, ks=(1,), samples=1, examples=4, temperature=0.5, batch_size=4, seed=5, max_new_tokens=8)
    texts = callback.sample(module, task, examples, repeat=1)
    assert seen and all(seen), "decoded outside the trainer's autocast"
    with trainer.precision_plugin.val_step_context():
        reference = module.eval_completions(examples, temperature=0.5, seed=5)
    assert texts == reference
    module.stop_strings = []
    unstopped = callback.sample(module, task, examples, repeat=1)
    assert any(len(cut) < len(whole) and "e" in cut for cut, whole in zip(texts, unstopped))  # the stop string ended one


def test_a_periodic_callback_measures_once_per_period_when_a_batch_takes_several_optimiser_steps(tmp_path):
    """A GRPOModule with ``mini_batches: 2`` makes two optimiser steps per rollout batch, so ``global_step`` goes
    2, 4, ...: every_n_steps=5 over 20 steps must measure once in each period of 5 steps (after the batch that
    crosses 5, 10, 15, 20), not only where the step lands on a multiple (10 and 20); an accumulating fit (one step
    every second micro-batch) still measures at each multiple, once."""
    from kdlab.callbacks.periodic import PeriodicCallback

    class Probe(PeriodicCallback):
        def __init__(self, every):
            super().__init__(every)
            self.at = []

        def measure(self, trainer, pl_module):
            self.at.append(trainer.global_step)

    class Steps(pl.LightningModule):
        def __init__(self, per_batch, manual):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))
            self.per_batch, self.automatic_optimization = per_batch, not manual

        def training_step(self, batch, batch_idx):
            loss = (self.weight * batch[0]).sum()
            if self.automatic_optimization:
                return loss
            optimizer = self.optimizers()
            for _ in range(self.per_batch):  # as GRPOModule's mini-batches
                optimizer.zero_grad()
                self.manual_backward((self.weight * batch[0]).sum())
                optimizer.step()

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.ones(64, 1), batch_size=1)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def measured(module, every, **trainer_args):
        probe = Probe(every)
        pl.Trainer(max_steps=20, accelerator="cpu", logger=False, callbacks=[probe], enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, default_root_dir=tmp_path, **trainer_args).fit(module)
        return probe.at

    assert measured(Steps(2, manual=True), 5) == [6, 10, 16, 20]
    assert measured(Steps(2, manual=True), 4) == [4, 8, 12, 16, 20]
    assert measured(Steps(1, manual=False), 5, accumulate_grad_batches=2) == [5, 10, 15, 20]
