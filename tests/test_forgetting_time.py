"""``kdlab estimate --forgetting SWEEP.yaml`` (:mod:`kdlab.study.forgetting_time`): the lm-eval suite off the training
loop, at vLLM's batch and the bf16 decode rate, its before pass shared by a grid's runs of one student, recomputed
here from :mod:`kdlab.study.step_time`'s constants."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdlab.study import step_time
from kdlab.study.forgetting_time import (
    VLLM_MAX_NUM_SEQS,
    off_loop,
    runs_per_student,
    suite_pass_seconds,
)
from kdlab.study.run_time import CHOICES, LM_EVAL_COST
from kdlab.study.setups import Setup
from kdlab.study.shapes import PUBLISHED

ROOT = Path(__file__).parents[1]
H200 = step_time.HARDWARE["H200"]


def qwen_1_5b() -> Setup:
    return Setup(student=PUBLISHED["Qwen/Qwen2.5-1.5B-Instruct"], teacher=None)


def by_hand(shape, rows: int, prompt: int, generated: int, size: int, backend: str) -> float:
    """One decode: the prefill's FLOPs (host ops overlapped) and ``generated`` token steps at the mean context."""
    prefill = max((shape.layers * step_time.OPS_FORWARD_LAYER + step_time.OPS_FORWARD_OUTSIDE) * H200.op_seconds,
                  2 * shape.params * rows * prompt / (H200.flops * H200.train_efficiency))
    return prefill + generated * step_time.decode_token_seconds(shape, size, rows, prompt + generated / 2, backend, H200)


def test_a_vllm_pass_is_each_gpus_share_in_waves_of_max_num_seqs_at_bf16():
    setup, devices = qwen_1_5b(), 2
    shape, expected = setup.student, 0.0
    for requests, kind, generated, prompt in LM_EVAL_COST.values():
        share = -(-requests // devices)
        if kind == "generate_until":
            waves = [VLLM_MAX_NUM_SEQS] * (share // VLLM_MAX_NUM_SEQS) + ([share % VLLM_MAX_NUM_SEQS] if share % VLLM_MAX_NUM_SEQS else [])
            expected += sum(by_hand(shape, rows, prompt, generated, 2, "vllm") for rows in waves)
        else:
            expected += max((shape.layers * step_time.OPS_FORWARD_LAYER + step_time.OPS_FORWARD_OUTSIDE) * H200.op_seconds,
                            2 * shape.params * share * CHOICES * prompt / (H200.flops * H200.train_efficiency))
    assert suite_pass_seconds(setup, "paper", H200, "vllm", "bfloat16", devices) == pytest.approx(expected)
    # MMLU-Pro alone: 2,800 requests on 2 GPUs = 1,400 each = 5 waves of 256 and one of 120
    mmlu = suite_pass_seconds(setup, ["mmlu_pro"], H200, "vllm", "bfloat16", devices)
    assert mmlu == pytest.approx(5 * by_hand(shape, 256, 1500, 2048, 2, "vllm") + by_hand(shape, 120, 1500, 2048, 2, "vllm"))


def test_the_hf_back_end_pays_kdlabs_host_cost_per_token_in_batches_of_batch_size():
    setup = qwen_1_5b()
    shape = setup.student
    requests, _, generated, prompt = LM_EVAL_COST["ifeval"]
    assert requests % 7 == 4  # 28 batches of 7 and one of 4
    expected = 28 * by_hand(shape, 7, prompt, generated, 4, "kdlab") + by_hand(shape, 4, prompt, generated, 4, "kdlab")
    assert suite_pass_seconds(setup, ["ifeval"], H200, "hf", "float32", 1, 7) == pytest.approx(expected)
    assert suite_pass_seconds(setup, ["ifeval"], H200, "vllm", "bfloat16", 1) < expected  # CUDA graphs, bf16, 200 rows at once


def test_the_before_pass_is_shared_by_the_grids_runs_of_one_student_and_the_after_pass_is_each_runs():
    cells = {"model.rollout": [1, 2], "model.objective": [1, 2], "model.lr": [1.0e-5, 5.0e-5]}
    assert runs_per_student(cells, [42, 43, 44]) == 24
    assert runs_per_student({**cells, "model.student": ["a", "b"]}, [42]) == 8
    assert runs_per_student({**cells, "model.policy.path": ["a", "b", "c"], "model.student_temperature": [1.0, 2.0]}, [42]) == 16
    setup = qwen_1_5b()
    setup.world = 1
    timed = off_loop(setup, {"tasks": "paper", "cache_dir": "runs/x"}, cells, [42, 43, 44], H200)
    one = suite_pass_seconds(setup, "paper", H200, "vllm", "bfloat16", 1)
    assert (timed.before, timed.after, timed.runs_per_student, timed.backend, timed.devices) == (pytest.approx(one), pytest.approx(one), 24, "vllm", 1)
    assert timed.evaluations() == {"forgetting before (off the loop, 1/24)": pytest.approx(one / 24), "forgetting after (off the loop)": pytest.approx(one)}
    setup.world = 8  # devices default to the run's GPUs; the sweep's devices win
    assert off_loop(setup, {"tasks": "paper"}, cells, [42], H200).after == pytest.approx(suite_pass_seconds(setup, "paper", H200, "vllm", "bfloat16", 8))
    assert off_loop(setup, {"tasks": "paper", "devices": 2}, cells, [42], H200).devices == 2


def test_an_unknown_task_or_back_end_names_the_key():
    with pytest.raises(ValueError, match=r"forgetting.tasks \['gsm8k'\]: kdlab estimate knows the cost of"):
        suite_pass_seconds(qwen_1_5b(), ["gsm8k"], H200)
    with pytest.raises(ValueError, match="forgetting.backend: kdlab estimate models vllm"):
        suite_pass_seconds(qwen_1_5b(), "paper", H200, "tgi")


@pytest.fixture
def in_root(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("sys.argv", ["kdlab"])


TARGET = ["--config", "experiments/paper/countdown3/base-qwen1.5b_from_qwen7b.yaml",
          "--config", "experiments/paper/countdown3/onpd_fkl-qwen1.5b_from_qwen7b.yaml"]
GRID = "experiments/paper/countdown3/grid-qwen1.5b_from_qwen7b.yaml"


def test_the_target_run_with_its_grids_forgetting_key_adds_a_24th_of_the_before_pass_and_the_after_pass(in_root):
    from kdlab.cli.estimate import run_estimate

    plain, result = run_estimate(TARGET).time, run_estimate([*TARGET, "--forgetting", GRID])
    one = suite_pass_seconds(result.setup, "paper", H200, "vllm", "bfloat16", 1)  # the grid: 2 x 2 x 2 cells x 3 seeds, one student
    assert result.time.evaluations == {**plain.evaluations, "forgetting before (off the loop, 1/24)": pytest.approx(one / 24),
                                       "forgetting after (off the loop)": pytest.approx(one)}
    assert result.time.seconds == pytest.approx(plain.seconds + one * (1 + 1 / 24))


def test_a_sweep_without_the_key_or_a_config_that_also_measures_in_the_loop_is_refused(in_root, tmp_path):
    import yaml

    from kdlab.cli.config_errors import ConfigError
    from kdlab.cli.estimate import run_estimate

    bare = tmp_path / "bare.yaml"
    bare.write_text(yaml.safe_dump({"base": TARGET[1], "output": str(tmp_path / "runs")}))
    with pytest.raises(ConfigError, match=f"--forgetting {bare}: the sweep file has no forgetting key"):
        run_estimate([*TARGET, "--forgetting", str(bare)])
    callback = '{"class_path": "kdlab.callbacks.OODForgetting", "init_args": {"lm_eval_tasks": "paper"}}'
    with pytest.raises(ConfigError, match=r"trainer.callbacks\[0\] \(OODForgetting with lm_eval_tasks\) also measures forgetting in the training loop"):
        run_estimate([*TARGET, f"--trainer.callbacks=[{callback}]", "--forgetting", GRID])
    with pytest.raises(ConfigError, match="--forgetting: needs a sweep file"):
        run_estimate([*TARGET, "--forgetting"])


def test_the_paper_presets_measure_forgetting_off_the_loop_through_their_sweeps_and_pipelines(in_root):
    import yaml

    from kdlab.study.grid import load_sweep
    from kdlab.study.pipeline import load_pipeline

    paper = ROOT / "experiments" / "paper"
    for path in sorted(paper.glob("*/*.yaml")):
        text = path.read_text(encoding="utf-8")
        assert "lm_eval_tasks" not in text, f"{path}: measures forgetting in the training loop"
        data = yaml.safe_load(text) or {}
        if "base" in data:  # a sweep: its forgetting key is the paper suite, checked as kdlab sweep reads it
            assert load_sweep(path.relative_to(ROOT)).forgetting["tasks"] == "paper", path
        elif "distill" in data:
            assert load_pipeline(path.relative_to(ROOT)).distill.forgetting["tasks"] == "paper", path
    assert sum(1 for path in paper.glob("*/*.yaml") if "base" in (yaml.safe_load(path.read_text(encoding="utf-8")) or {})) == 16
