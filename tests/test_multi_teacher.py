"""Several teachers in one DistillModule (issue #28, item 2): routing by a field, averaging probabilities or
log-probabilities, per-teacher diagnostics, and one teacher reproducing today's run exactly."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch

from kdlab.errors import ConfigError
from kdlab.models.loading import ModelSpec, load_causal_lm
from kdlab.objectives.kl import kl_diagnostics
from kdlab.objectives.logits import completion_logits
from kdlab.rollouts.decoding import IncrementalLM
from kdlab.rollouts.policies import StudentRollouts, TeacherDatasetRollouts, TeacherRollouts
from kdlab.rollouts.mixture import MixtureRollouts
from kdlab.teachers import Average, ByField
from kdlab.teachers.legacy import TeacherEntry
from kdlab.tasks import Addition, Sorting
from kdlab.tasks.mixture import MultiTask

STUDENT, TEACHER = "kdlab://tiny-random/student", "kdlab://tiny-random/teacher"
TEMPERATURE = 0.5


def mixed():
    return MultiTask({"addition": Addition(max_digits=2, system_prompt="", num_train=8, num_val=4, num_test=0),
                      "sorting": Sorting(system_prompt="", num_train=8, num_val=4, num_test=0)})


def entry(path):
    return TeacherEntry(model=ModelSpec(path))


def module(task=None, **settings):
    from kdlab.stages.distill import DistillModule

    base = dict(rollout=TeacherRollouts(), batch_size=4, max_completion_tokens=6, val_examples=4, val_batch_size=4, warmup_steps=1,
                lr=1e-2, teacher_temperature=TEMPERATURE, fused_lm_head=False)
    base.update(settings)
    return DistillModule(STUDENT, base.pop("teacher", None), task or mixed(), **base)


def routed(**settings):
    return module(teachers={"strong": entry(TEACHER), "self": entry(STUDENT)},
                  teacher_choice=ByField({"addition": "strong", "sorting": "self"}), **settings)


def tempered_logprobs(path, rollout, columns):
    model = load_causal_lm(ModelSpec(path)).eval()
    with torch.no_grad():
        logits = completion_logits(model, rollout.model_inputs("teacher"), rollout.completion_ids.shape[1], columns)
    return torch.log_softmax(logits.float() / TEMPERATURE, -1)


def test_multitask_interleaves_tasks_and_delegates_each_example():
    task = mixed()
    rows = task.examples("train")
    assert [row["task"] for row in rows[:4]] == ["addition", "sorting", "addition", "sorting"]
    assert rows[0]["id"] == "addition:" + Addition(max_digits=2, num_train=8).examples("train")[0]["id"]
    assert len(rows) == 16 and len({row["id"] for row in rows}) == 16
    sorting = Sorting(system_prompt="", num_train=8)
    assert task.student_messages(rows[1]) == sorting.student_messages(sorting.examples("train")[0])
    assert task.score(rows[0], task.reference_completion(rows[0])) == 1.0
    assert task.score(rows[1], task.reference_completion(rows[0])) == 0.0


def test_one_teacher_entry_is_todays_run_exactly(tmp_path):
    params = []
    for settings in ({"teacher": TEACHER}, {"teachers": {"only": entry(TEACHER)}}):
        pl.seed_everything(0)
        m = module(**settings)
        trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, num_sanity_val_steps=0,
                             limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
        trainer.fit(m)
        params.append([p.detach().clone() for p in m.student.parameters()])
        if "teachers" in settings:
            logged = trainer.callback_metrics
            assert torch.equal(logged["train/kl_forward/only"], logged["train/kl_forward"])
    assert all(torch.equal(a, b) for a, b in zip(*params))


def test_routing_gives_each_example_its_own_teachers_distribution_and_kls():
    m = routed()
    examples = m.task.examples("train")[:4]
    rollout = m.make_rollout(examples, 0)
    student, teacher = m.distillation_logits(rollout)
    mask = rollout.completion_mask
    columns = m.token_columns
    strong, own = tempered_logprobs(TEACHER, rollout, columns), tempered_logprobs(STUDENT, rollout, columns)
    for row, example in enumerate(examples):
        expected = (strong if example["task"] == "addition" else own)[row]
        assert (teacher[row][mask[row]] - expected[mask[row]]).abs().max().item() < 1e-5
    rows = torch.tensor([0, 2])  # the addition rows: the strong teacher's
    kls = kl_diagnostics(student.detach()[rows], strong[rows], mask[rows], m.objective.reduction)
    assert torch.allclose(m.teacher_source.diagnostics["kl_forward/strong"], kls["kl_forward"], atol=1e-6)
    assert torch.allclose(m.teacher_source.diagnostics["kl_reverse/strong"], kls["kl_reverse"], atol=1e-6)


def test_routed_teacher_rollouts_are_decoded_by_each_rows_teacher():
    m = routed()
    examples = m.task.examples("train")[:4]
    prompts = m._prompts(examples)
    combined = m.rollout_context(None).decoder("teacher", prompts)
    first = combined(None)
    for path, rows in ((TEACHER, [0, 2]), (STUDENT, [1, 3])):
        model = load_causal_lm(ModelSpec(path)).eval()
        index = torch.tensor(rows)
        alone = IncrementalLM(model, prompts.teacher_ids[index], prompts.teacher_mask[index], m.token_columns, TEMPERATURE)(None)
        assert (first[index] - alone).abs().max().item() < 1e-5
    rollout = m.make_rollout(examples, 0)
    assert rollout.completion_mask.any(1).all()


@pytest.mark.parametrize("over", ["probs", "logprobs"])
def test_averaging_mixes_probabilities_or_log_probabilities(over):
    m = module(teachers={"strong": entry(TEACHER), "self": entry(STUDENT)}, teacher_choice=Average({"strong": 3.0, "self": 1.0}, over=over),
               rollout=StudentRollouts())
    rollout = m.make_rollout(m.task.examples("train")[:2], 0)
    _, teacher = m.distillation_logits(rollout)
    columns = m.token_columns
    a, b = tempered_logprobs(TEACHER, rollout, columns), tempered_logprobs(STUDENT, rollout, columns)
    if over == "probs":
        expected = torch.log(0.75 * a.exp() + 0.25 * b.exp())
    else:
        expected = torch.log_softmax(0.75 * a + 0.25 * b, -1)
    mask = rollout.completion_mask
    assert (teacher[mask] - expected[mask]).abs().max().item() < 1e-5
    assert set(m.teacher_source.diagnostics) == {"kl_forward/strong", "kl_reverse/strong", "kl_forward/self", "kl_reverse/self"}


def test_a_cached_teacher_scores_its_rows_of_a_teacher_dataset(tmp_path):
    from kdlab.models.loading import load_tokenizer
    from kdlab.rollouts.teacher_data import build_teacher_cache

    task = mixed()
    data = tmp_path / "teacher.jsonl"
    data.write_text("".join(json.dumps({"id": ex["id"], "completion": task.reference_completion(ex)}) + "\n" for ex in task.examples("train")))
    cache = tmp_path / "teacher.topk.safetensors"
    columns = load_tokenizer(ModelSpec(STUDENT)).__len__()
    build_teacher_cache(load_causal_lm(ModelSpec(TEACHER)).eval(), load_tokenizer(ModelSpec(TEACHER)), task, str(data), str(cache), columns,
                        TEMPERATURE, 6, 64, 4, cache_format="full")
    m = module(task, teachers={"cached": TeacherEntry(cache=str(cache)), "self": entry(STUDENT)},
               teacher_choice=ByField({"addition": "cached", "sorting": "self"}), rollout=TeacherDatasetRollouts(str(data)))
    examples = task.examples("train")[:4]
    rollout = m.make_rollout(examples, 0)
    _, teacher = m.distillation_logits(rollout)
    strong = tempered_logprobs(TEACHER, rollout, m.token_columns)
    mask = rollout.completion_mask
    for row in (0, 2):
        assert (teacher[row][mask[row]] - strong[row][mask[row]]).abs().max().item() < 1e-5
    with pytest.raises(ConfigError, match="teacher.teachers.cached.path .* at teacher temperature 0.5, but DistillModule.teacher_temperature is 1.0"):
        module(task, teachers={"cached": TeacherEntry(cache=str(cache)), "self": entry(STUDENT)}, teacher_temperature=1.0,
               teacher_choice=ByField({"addition": "cached", "sorting": "self"}), rollout=TeacherDatasetRollouts(str(data)))


def test_a_served_teacher_scores_its_rows():
    """A served entry (kdlab's loopback server, top_k -1: the whole vocabulary) beside an in-process one: the
    served rows get the in-process teacher's tempered log-probs to 1e-5."""
    from kdlab.rollouts.loopback import LoopbackServer
    from kdlab.rollouts.served import ServedTeacher

    with LoopbackServer(TEACHER, name="tiny-teacher") as server:
        served = ServedTeacher(server.url, "tiny-teacher", TEACHER, top_k=-1, timeout_s=10.0, retries=0)
        m = module(teachers={"served": TeacherEntry(served=served), "self": entry(STUDENT)},
                   teacher_choice=ByField({"addition": "served", "sorting": "self"}), rollout=StudentRollouts())
        m.teacher_source.ready()
        rollout = m.make_rollout(m.task.examples("train")[:4], 0)
        _, teacher = m.distillation_logits(rollout)
    strong = tempered_logprobs(TEACHER, rollout, m.token_columns)
    mask = rollout.completion_mask
    for row in (0, 2):
        assert (teacher[row][mask[row]] - strong[row][mask[row]]).abs().max().item() < 1e-5


def test_the_docs_results_are_the_committed_reports():
    """docs/several_teachers.md's results table is what scripts/several_teachers_results.py writes from the
    committed report (nothing typed by hand)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "scripts/several_teachers_results.py", "--check"], cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_bad_multi_teacher_settings_fail_naming_the_setting():
    with pytest.raises(ConfigError, match="replaces"):
        module(teacher=TEACHER, teachers={"a": entry(TEACHER)})
    with pytest.raises(ConfigError, match="teachers.a: give exactly one"):
        module(teachers={"a": TeacherEntry(model=ModelSpec(TEACHER), cache="x.safetensors")})
    with pytest.raises(ConfigError, match="teacher_choice is required"):
        module(teachers={"a": entry(TEACHER), "b": entry(STUDENT)})
    with pytest.raises(ConfigError, match="ByField.routes.sorting"):
        module(teachers={"a": entry(TEACHER)}, teacher_choice=ByField({"sorting": "b"}))
    with pytest.raises(ConfigError, match="TeacherRollouts needs .*a teacher that writes completions.*Several"):
        module(teachers={"a": entry(TEACHER), "b": TeacherEntry(cache="x.safetensors")}, teacher_choice=Average())
    with pytest.raises(ConfigError, match="MixtureRollouts needs a teacher that decodes token by token.*Several"):
        module(teachers={"a": entry(TEACHER), "b": TeacherEntry(cache="x.safetensors")}, teacher_choice=Average(),
               rollout=MixtureRollouts(0.5))
    with pytest.raises(ConfigError, match="DistillModule.teacher.teachers.other: student and teacher tokenizers differ"):
        module(teachers={"other": entry("kdlab://tiny/teacher"), "b": entry(STUDENT)}, teacher_choice=Average())
    m = module(teachers={"a": entry(TEACHER), "b": entry(STUDENT)}, teacher_choice=ByField({"addition": "a"}))
    with pytest.raises(KeyError, match="sorting:sort.*does not route"):
        m.make_rollout(m.task.examples("train")[:2], 0)


def test_multitask_splits_train_on_one_task_and_hold_out_another():
    from kdlab.tasks import Countdown

    train = Countdown(variant="countdown3", instruction=False, system_prompt="", num_train=6, num_val=3, num_test=0)
    harder = Countdown(variant="countdown3s", instruction=False, system_prompt="", num_train=5, num_val=4, num_test=2)
    task = MultiTask({"countdown3": train, "countdown3s": harder}, splits={"train": ["countdown3"], "val": ["countdown3s"]})
    assert [row["id"] for row in task.examples("train")] == [f"countdown3:{row['id']}" for row in train.examples("train")]
    assert [row["id"] for row in task.examples("val")] == [f"countdown3s:{row['id']}" for row in harder.examples("val")]
    assert len(task.examples("test")) == 2  # a split not named draws from every task
    row = task.examples("val")[0]
    assert task.score(row, harder.reference_completion(harder.examples("val")[0])) == 1.0  # scored by its own task
    assert MultiTask({"a": train}, splits={"val": []}).examples("val") == []
    with pytest.raises(ValueError, match=r"MultiTask.splits.val: \['nope'\] not among"):
        MultiTask({"a": train}, splits={"val": ["nope"]})
    with pytest.raises(ValueError, match="MultiTask.splits: 'dev' is not a split"):
        MultiTask({"a": train}, splits={"dev": ["a"]})
