"""The lm-evaluation-harness back end of OODForgetting: a local task over a local file, the tiny random
student in memory, nothing downloaded."""

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

pytest.importorskip("lm_eval")

from kdlab.callbacks import OODForgetting  # noqa: E402
from kdlab.evaluation.lm_eval_suite import (
    MMLU_PRO_SUBJECTS,
    PAPER_SUITE,
    LMEvalTask,
    evaluate_suite,
    task_manager,
    validate_suite,
)  # noqa: E402
from kdlab.stages import DistillModule  # noqa: E402
from kdlab.tasks import Addition  # noqa: E402

# two entries over the same 8-row file: all rows, and the first 4 (each entry has its own limit)
TOY = {"toy": LMEvalTask("kdlab_toy_mc", limit=8, metric="acc,none"), "toy_first4": LMEvalTask("kdlab_toy_mc", 4, "acc,none")}


pytestmark = pytest.mark.usefixtures("lm_eval_offline")  # conftest.py: offline, inside a copy of the fixture tasks (task_dir)


@pytest.fixture
def module(tiny_pair):
    return DistillModule(*tiny_pair, Addition(num_train=8, num_val=4), max_completion_tokens=6, batch_size=4, val_examples=4)


def test_local_task_scores_the_very_student_object_and_leaves_it_as_found(module, task_dir, monkeypatch):
    import lm_eval.models.huggingface as hf

    wrappers = []

    class RecordingHFLM(hf.HFLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            wrappers.append(self)

    monkeypatch.setattr(hf, "HFLM", RecordingHFLM)
    student = module.student.train()
    storage = {name: p.data_ptr() for name, p in student.named_parameters()}
    rng = torch.get_rng_state()
    scores = evaluate_suite(student, module.student_tokenizer, TOY, include_path=task_dir, batch_size=4)
    assert set(scores) == {"toy", "toy_first4"}
    for name, documents in (("toy", 8), ("toy_first4", 4)):
        assert 0.0 <= scores[name] <= 100.0
        assert scores[name] * documents / 100 == pytest.approx(round(scores[name] * documents / 100))  # k of n right
    (wrapper,) = wrappers
    assert wrapper.model is student  # wrapped in place: no reload from disk, no copy
    assert {name: p.data_ptr() for name, p in student.named_parameters()} == storage
    assert student.training and torch.equal(torch.get_rng_state(), rng)  # HFLM's eval() and lm-eval's seeding undone


def test_a_missing_metric_names_the_ones_the_task_reports(module, task_dir):
    with pytest.raises(KeyError, match=r"no metric 'f1,none'.*acc,none"):
        evaluate_suite(module.student, module.student_tokenizer, {"toy": ("kdlab_toy_mc", 2, "f1,none")}, include_path=task_dir)


def metrics_file(trainer):
    return [json.loads(line) for line in open(f"{trainer.log_dir}/metrics.jsonl")]


def test_ood_forgetting_with_lm_eval_reports_before_after_and_delta_in_a_real_fit(module, task_dir, tmp_path):
    callback = OODForgetting(lm_eval_tasks=TOY, lm_eval_include_path=str(task_dir), lm_eval_batch_size=4)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=TensorBoardLogger(tmp_path), callbacks=[callback],
                         limit_val_batches=0, enable_progress_bar=False, enable_checkpointing=False)
    trainer.fit(module)
    before, after = [row for row in metrics_file(trainer) if any(key.startswith("ood/") for key in row)]
    assert before["step"] == 0 and after["step"] == 1
    assert before["ood/mean_before"] == pytest.approx((before["ood/toy_before"] + before["ood/toy_first4_before"]) / 2)
    assert after["ood/mean"] == pytest.approx((after["ood/toy"] + after["ood/toy_first4"]) / 2)
    assert after["ood/mean_delta"] == pytest.approx(after["ood/mean"] - before["ood/mean_before"])
    assert all(0.0 <= after[f"ood/{name}"] <= 100.0 for name in TOY)
    assert callback.state_dict()["before"] == {name: before[f"ood/{name}_before"] for name in TOY}


@pytest.mark.parametrize("fails", [False, True])
def test_under_several_processes_only_rank_0_runs_the_suite_and_every_rank_gets_its_scores(module, task_dir, monkeypatch, fails):
    """The rank logic of OODForgetting's lm-eval back end with the collectives stood in for (the real ones:
    tests/test_distributed.py): rank 0 scores the student and broadcasts; a failure there is raised on
    every rank, none left waiting."""
    from types import SimpleNamespace

    import kdlab.callbacks.evaluations as evaluations

    callback = OODForgetting(lm_eval_tasks=TOY, lm_eval_include_path=str(task_dir))
    scored = []

    def run_suite(model, tokenizer):
        scored.append(model)
        if fails:
            raise ValueError("no such metric")
        return {"toy": 50.0, "toy_first4": 25.0}

    sent = []

    def broadcast(message, src, group=None):
        if module._trainer.is_global_zero:
            sent.append(list(message))
        else:
            message[:] = sent[-1]

    monkeypatch.setattr(callback, "run_suite", run_suite)
    monkeypatch.setattr(evaluations, "distributed", lambda trainer: True)
    monkeypatch.setattr(torch.distributed, "broadcast_object_list", broadcast)
    results = []
    for first in (True, False):
        module._trainer = SimpleNamespace(is_global_zero=first, world_size=2)
        try:
            results.append(callback.scores(module))
        except Exception as error:
            results.append(error)
    module._trainer = None
    assert scored == [module.student]  # rank 0 only, on the (unsharded) student itself
    if not fails:
        assert results == [{"toy": 50.0, "toy_first4": 25.0}] * 2
    else:
        assert isinstance(results[0], ValueError) and sent == [[None, "ValueError: no such metric"]]
        assert isinstance(results[1], RuntimeError) and "failed on global rank 0: ValueError: no such metric" in str(results[1])


def test_bad_settings_fail_at_construction_naming_the_setting(task_dir):
    with pytest.raises(ValueError, match=r"OODForgetting\.lm_eval_tasks: unknown lm-eval task 'no_such_task'"):
        OODForgetting(lm_eval_tasks={"x": LMEvalTask("no_such_task", 5)}, lm_eval_include_path=str(task_dir))
    with pytest.raises(ValueError, match=r"OODForgetting\.lm_eval_tasks: \['mmlu'\] are not in the paper's suite"):
        OODForgetting(lm_eval_tasks=["mmlu"])
    with pytest.raises(ValueError, match=r"OODForgetting\.lm_eval_allow_code_execution"):
        OODForgetting(lm_eval_tasks=["humaneval_instruct"], lm_eval_include_path=str(task_dir))
    with pytest.raises(ValueError, match="not both"):
        OODForgetting([Addition(num_val=2)], lm_eval_tasks="paper")
    with pytest.raises(ValueError, match="at least one task"):
        OODForgetting()
    with pytest.raises(ValueError, match=r"\['examples'\] apply to the tiny back end only"):
        OODForgetting(lm_eval_tasks=TOY, lm_eval_include_path=str(task_dir), examples=3)
    with pytest.raises(ValueError, match=r"OODForgetting\.lm_eval_include_path"):
        OODForgetting(lm_eval_tasks=TOY, lm_eval_include_path=str(task_dir / "missing"))
    with pytest.raises(ValueError, match=r"LMEvalTask\.limit"):
        LMEvalTask("kdlab_toy_mc", 0)


def test_missing_lm_eval_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what `import lm_eval` meets when it is not installed
    with pytest.raises(ImportError, match=r"OODForgetting\.lm_eval_tasks.*pip install 'kdlab\[eval\]'"):
        OODForgetting(lm_eval_tasks="paper")
    with pytest.raises(ImportError, match=r"kdlab\[eval\]"):
        evaluate_suite(torch.nn.Linear(1, 1), None, "paper")


def test_yaml_selects_the_lm_eval_back_end(task_dir):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(OODForgetting, "ood")
    config = parser.parse_string(
        f"ood:\n  lm_eval_tasks:\n    toy: {{task: kdlab_toy_mc, limit: 8, metric: 'acc,none'}}\n  lm_eval_include_path: {task_dir}\n"
    )
    callback = parser.instantiate_classes(config).ood
    assert isinstance(callback, OODForgetting) and callback.lm_eval_tasks == {"toy": TOY["toy"]}


def test_paper_suite_is_the_papers_seven_tasks_with_its_sample_sizes(task_dir):
    assert {name: (entry.task, entry.limit, entry.metric) for name, entry in PAPER_SUITE.items()} == {
        "mmlu_pro": ("mmlu_pro", 200, "exact_match,custom-extract"),  # 14 subjects x 200
        "truthfulqa_mc1": ("truthfulqa_mc1", 200, "acc,none"),
        "ifeval": ("ifeval", 200, "prompt_level_strict_acc,none"),
        "humaneval_instruct": ("humaneval_instruct", 164, "pass@1,create_test"),
        "eq_bench": ("eq_bench", 171, "eqbench,none"),
        "bbq": ("bbq", 200, "acc,none"),
        "toxigen": ("toxigen", 200, "acc,none"),
    }
    assert PAPER_SUITE["eq_bench"].scale == 1.0  # eqbench is already in points; the others are fractions
    assert [name for name, entry in PAPER_SUITE.items() if entry.executes_code] == ["humaneval_instruct"]
    # every name exists in the installed lm-eval, and its mmlu_pro group is the 14 subjects
    validate_suite(PAPER_SUITE, task_dir, allow_code_execution=True)
    group = task_manager(task_dir).task_index["mmlu_pro"].cfg
    assert group["task"] == [f"mmlu_pro_{subject}" for subject in MMLU_PRO_SUBJECTS] and len(MMLU_PRO_SUBJECTS) == 14


def test_an_entry_with_a_seed_scores_documents_drawn_at_random_not_the_datasets_first(module, task_dir, monkeypatch):
    """lm-eval's limit takes a task's first documents in the dataset's order; an entry with a seed passes lm-eval the
    same ``limit`` documents drawn at random from each leaf task (a group's members too), whatever model it scores."""
    import lm_eval

    from kdlab.evaluation.lm_eval_suite import PAPER_SUITE, document_samples

    manager = task_manager(task_dir)
    drawn = document_samples(lm_eval, manager, LMEvalTask("kdlab_toy_mc", 4, seed=1))
    assert list(drawn) == ["kdlab_toy_mc"] and len(set(drawn["kdlab_toy_mc"])) == 4 and set(drawn["kdlab_toy_mc"]) <= set(range(8))
    assert drawn != {"kdlab_toy_mc": [0, 1, 2, 3]} and drawn == document_samples(lm_eval, manager, LMEvalTask("kdlab_toy_mc", 4, seed=1))
    assert document_samples(lm_eval, manager, LMEvalTask("kdlab_toy_group", 4, seed=1)) == drawn  # per member of a group
    assert document_samples(lm_eval, manager, LMEvalTask("kdlab_toy_mc", 20, seed=1)) == {"kdlab_toy_mc": list(range(8))}
    calls, real = [], lm_eval.simple_evaluate
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kwargs: calls.append(kwargs) or real(**kwargs))
    scores = evaluate_suite(module.student, module.student_tokenizer, {"drawn": LMEvalTask("kdlab_toy_mc", 4, seed=1)}, include_path=task_dir, batch_size=4)
    assert calls[0]["samples"] == drawn and calls[0]["limit"] is None
    assert scores["drawn"] * 4 / 100 == pytest.approx(round(scores["drawn"] * 4 / 100))  # k of the 4 drawn right
    assert {entry.seed for entry in PAPER_SUITE.values()} == {0}  # the paper's suite draws its documents
    assert {name: entry.limit for name, entry in PAPER_SUITE.items() if entry.limit != 200} == {"humaneval_instruct": 164, "eq_bench": 171}
