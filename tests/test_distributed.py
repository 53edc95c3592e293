"""Multi-process training on CPU (gloo): FSDP2 through ModelParallelStrategy, FSDP1 through Lightning's
FSDPStrategy (let onto the CPU by a test-only subclass, see tests/distributed_worker.py), and DDP give the
same student as one process with the same global batch; FSDP1 under bf16-mixed reduces in fp32 and keeps
fp32 buffers; the evaluation callbacks measure once (OODForgetting's lm-eval suite) or split their prompts
(Coverage) over the ranks; validation counts each example once over the ranks (tests/val_ranks_worker.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("distributed_worker.py")


def run(layout: str, out: Path, *extra: str) -> dict[str, torch.Tensor]:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(WORKER), str(out), layout, *extra], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    sparsity = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    return torch.load(out / "student.pt", weights_only=True), sparsity


SINGLE_GRAD_NORM: list[float] = []


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "out"
    result = run("single", out)
    SINGLE_GRAD_NORM[:] = [json.loads((out / "rank0.json").read_text())["grad_norm"]]
    return result


@pytest.mark.parametrize("layout", ["fsdp2", *(pytest.param(layout, marks=pytest.mark.slow) for layout in ("fsdp2-fused", "fsdp1", "ddp"))])
def test_two_processes_train_the_same_student_as_one(single, layout, tmp_path):
    (sharded, sharded_sparsity), (whole, whole_sparsity) = run(layout, tmp_path / layout), single
    assert sharded.keys() == whole.keys()
    for name, value in whole.items():
        torch.testing.assert_close(sharded[name], value, atol=1e-6, rtol=0, msg=name)
    # the global gradient norm (what clipping and train/grad_norm use) is the same on every rank and layout
    norms = [json.loads((tmp_path / layout / f"rank{r}.json").read_text())["grad_norm"] for r in (0, 1)]
    assert norms == pytest.approx([SINGLE_GRAD_NORM[0]] * 2, abs=1e-6)
    if layout.startswith(("fsdp2", "fsdp1")):  # and each rank held about half of the student
        shares = [json.loads((tmp_path / layout / f"rank{r}.json").read_text()) for r in (0, 1)]
        assert sum(s["local"] for s in shares) == shares[0]["total"]
        assert all(abs(s["local"] / s["total"] - 0.5) < 0.01 for s in shares)
    # a weight push (vLLM) and an export see whole tensors under Hugging Face names, whatever the layout
    from transformers import AutoModelForCausalLM

    shapes = json.loads((tmp_path / layout / "merged_shapes.json").read_text())
    assert shapes == {name: list(value.shape) for name, value in whole.items()}
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / layout / "export").state_dict()
    for name, value in whole.items():
        torch.testing.assert_close(exported[name], value, atol=1e-6, rtol=0, msg=name)
    # final.ckpt is one file of whole weights, though FSDP2 saves its own checkpoints as folders of shards
    # (save_distributed_checkpoint); FSDP1's gather is not run on CPU (tests/distributed_worker.py says why)
    final = tmp_path / layout / "checkpoints" / "final.ckpt"
    if not layout.startswith("fsdp1"):
        assert final.is_file() and (not layout.startswith("fsdp2") or (tmp_path / layout / "checkpoints" / "last.ckpt").is_dir())
        weights = torch.load(final, weights_only=True)["state_dict"]
        for name, value in whole.items():
            torch.testing.assert_close(weights[f"student.{name}"], value, atol=1e-6, rtol=0, msg=name)
    # update sparsity (each rank counting its part of each whole weight, the counts summed) equals the single-process number
    for key in ("sparsity/1e-06", "sparsity/0.001", "sparsity/0.001/attention"):
        assert sharded_sparsity[key] == pytest.approx(whole_sparsity[key], abs=1e-4), key
    assert 0.0 < whole_sparsity["sparsity/0.001"] < 1.0


@pytest.mark.slow  # minutes on 2 cores: the slow tier (CI runs it)
def test_fsdp2_on_packed_micro_batches_trains_the_same_student_as_one_padded_process(single, tmp_path):
    """Padding-free micro-batches (``max_tokens_per_row``) under FSDP2 over two gloo processes, student and teacher
    sharded: the student ends where the padded single process ends (to 1e-5: fp32 sums in another order), and the
    global gradient norm agrees."""
    (sharded, _), (whole, _) = run("fsdp2-packed", tmp_path / "packed"), single
    assert sharded.keys() == whole.keys()
    for name, value in whole.items():
        torch.testing.assert_close(sharded[name], value, atol=1e-5, rtol=0, msg=name)
    norms = [json.loads((tmp_path / "packed" / f"rank{r}.json").read_text())["grad_norm"] for r in (0, 1)]
    assert norms == pytest.approx([SINGLE_GRAD_NORM[0]] * 2, abs=1e-5)


# about 75 s each, all three in the slow tier (python -m pytest -m slow tests/test_distributed.py)
@pytest.mark.slow  # minutes on 2 cores: the slow tier (CI runs it)
@pytest.mark.parametrize("layout", ["fsdp2", "fsdp1", "ddp"])
def test_two_processes_resumed_mid_epoch_end_where_an_uninterrupted_run_ends(layout, tmp_path):
    """24 prompts, 8 per step: 3 steps an epoch. Stopped after step 4 (one batch into epoch 2) and resumed
    from that checkpoint (sharded for FSDP2 and FSDP1), the run ends at step 5 exactly where an uninterrupted run
    does: the same data position on each rank, the same weights, the same sparsity against the start."""
    (whole, whole_sparsity) = run(layout, tmp_path / "whole", "5", "24")
    run(layout, tmp_path / "parts", "4", "24")
    last = tmp_path / "parts" / "checkpoints" / "last.ckpt"
    assert last.exists()
    (resumed, resumed_sparsity) = run(layout, tmp_path / "parts", "5", "24", str(last))
    for name, value in whole.items():
        torch.testing.assert_close(resumed[name], value, atol=1e-6, rtol=0, msg=name)
    for key in ("sparsity/1e-06", "sparsity/0.001"):
        assert resumed_sparsity[key] == pytest.approx(whole_sparsity[key], abs=1e-6), key


@pytest.mark.slow  # minutes on 2 cores: the slow tier (CI runs it)
def test_fsdp2_with_bf16_mixed_precision_trains_close_to_fp32(single, tmp_path):
    """bf16-mixed under FSDP2 is a MixedPrecisionPolicy (bf16 compute, fp32 reduction and master
    weights): the student stays fp32 and ends within bf16 rounding of the fp32 run."""
    mixed, _ = run("fsdp2-bf16", tmp_path / "bf16")
    whole, _ = single
    for name, value in whole.items():
        assert mixed[name].dtype == torch.float32
        torch.testing.assert_close(mixed[name], value, atol=2e-2, rtol=0, msg=name)
    assert any(not torch.equal(mixed[name], value) for name, value in whole.items())  # bf16 compute did happen


@pytest.mark.parametrize("layout", ["fsdp1-bf16", pytest.param("fsdp2", marks=pytest.mark.slow), pytest.param("ddp", marks=pytest.mark.slow)])
def test_two_processes_keep_fp32_reduction_and_buffers_and_evaluate_once_or_split(layout, tmp_path):
    """One step on 2 processes with the probes of tests/distributed_worker.py (38 s for FSDP1 on a shared 2-core machine)."""
    from transformers import AutoModelForCausalLM

    from kdlab.models.loading import resolve_path
    from kdlab.tasks import Addition

    out = tmp_path / layout
    student, _ = run(f"{layout}-probe", out, "1")
    ranks = (0, 1)
    # FSDP1 with bf16-mixed: every unit (student and sharded teacher) gathers in bf16 but reduces gradients
    # and keeps buffers in fp32, so Qwen2's rotary inv_freq is still fp32 after a forward (Lightning's own
    # FSDP1 default casts it to bf16 and reduces in bf16)
    for rank in ranks:
        report = json.loads((out / f"precision-rank{rank}.json").read_text())
        assert report["student_inv_freq"] == report["teacher_inv_freq"] == ["torch.float32"]
        units = [str((torch.bfloat16, torch.float32, torch.float32))] if layout == "fsdp1-bf16" else []
        assert report["student_units"] == report["teacher_units"] == units
    # OODForgetting's lm-eval suite runs on rank 0 only, at fit start and end; both ranks log its scores
    ood = [[json.loads(line) for line in (out / f"ood-rank{rank}.jsonl").read_text().splitlines()] for rank in ranks]
    assert [row["calls"] for row in ood[0]] == [1, 2] and [row["calls"] for row in ood[1]] == [0, 0]
    assert [(row["step"], row["toy"]) for row in ood[0]] == [(row["step"], row["toy"]) for row in ood[1]]
    # ... over the whole student (gathered from its shards): the initial weights, then the trained ones
    initial = AutoModelForCausalLM.from_pretrained(resolve_path("kdlab://tiny-random/student")).state_dict()
    for call, expected in ((1, initial), (2, student)):
        seen = torch.load(out / f"ood-model-{call}.pt", weights_only=True)
        for name, value in expected.items():
            if not name.endswith("inv_freq"):
                torch.testing.assert_close(seen[name], value.float(), atol=0, rtol=0, msg=name)
    # Coverage: rank r samples every other prompt from r (5 prompts: rank 1 pads with prompt 0, dropped),
    # from seed + r; the per-prompt counts are pooled, the same on both ranks
    task = Addition(num_val=5, seed=3)
    examples = task.examples("val")[:5]
    coverage = [[json.loads(line) for line in (out / f"coverage-rank{rank}.jsonl").read_text().splitlines()] for rank in ranks]
    assert len(coverage[0]) == len(coverage[1]) == 2  # at fit start and end
    for first, second in zip(*coverage):
        expected = [None] * len(examples)
        for rank, row in zip(ranks, (first, second)):
            share = range(rank, rank + 6, 2)
            assert row["ids"] == [examples[index % 5]["id"] for index in share] and row["seed"] == rank
            for position, index in enumerate(share):
                if index < len(examples):
                    texts = row["texts"][2 * position : 2 * position + 2]
                    expected[index] = sum(float(task.score(examples[index], text)) >= 1.0 for text in texts)
        assert first["counts"] == second["counts"] == expected


def test_fsdp1_bf16_mixed_precision_is_fp32_reduction_unless_the_strategy_has_its_own():
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import MixedPrecision

    from kdlab.stages.sharding import fsdp1_mixed_precision

    (policy,) = fsdp1_mixed_precision(FSDPStrategy(), "bf16-mixed").values()
    assert (policy.param_dtype, policy.reduce_dtype, policy.buffer_dtype) == (torch.bfloat16, torch.float32, torch.float32)
    own = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    assert fsdp1_mixed_precision(FSDPStrategy(mixed_precision=own), "bf16-mixed") == {}  # the user's, as given
    assert fsdp1_mixed_precision(FSDPStrategy(), "32-true") == {}


def test_tf32_matmuls_on_cuda_only_and_a_precision_set_by_the_user_is_kept():
    from kdlab.stages import DistillModule
    from kdlab.objectives.precision import use_float32_matmul_precision

    kept = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        use_float32_matmul_precision(torch.device("cpu"))
        assert torch.get_float32_matmul_precision() == "highest"
        use_float32_matmul_precision(torch.device("cuda", 0), None)  # TaskStage.float32_matmul_precision = None
        assert torch.get_float32_matmul_precision() == "highest"
        use_float32_matmul_precision(torch.device("cuda", 0))
        assert torch.get_float32_matmul_precision() == "high"
        torch.set_float32_matmul_precision("medium")
        use_float32_matmul_precision(torch.device("cuda", 0))
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(kept)
    assert DistillModule.float32_matmul_precision == "high"


@pytest.mark.slow  # two fits of about 75 s each
def test_fsdp2_trains_a_lora_student_like_one_process(tmp_path):
    """A LoRA student (peft adapters on every projection) sharded by FSDP2 over two processes ends where one
    process ends, adapters and frozen base alike, and the base did not move."""
    (whole, whole_sparsity), (sharded, sharded_sparsity) = run("single-lora", tmp_path / "single"), run("fsdp2-lora", tmp_path / "fsdp2")
    assert sharded.keys() == whole.keys() and any("lora_B" in name for name in whole)
    for name, value in whole.items():
        torch.testing.assert_close(sharded[name], value, atol=1e-6, rtol=0, msg=name)
    assert any(whole[name].abs().max() > 0 for name in whole if "lora_B" in name)  # the adapters trained
    # the merged weights' sparsity (adapters merged from sharded factors, a collective) is the one-process number
    for key in ("sparsity/1e-06", "sparsity/0.001", "sparsity/0.001/attention"):
        assert sharded_sparsity[key] == pytest.approx(whole_sparsity[key], abs=1e-4), key
    assert whole_sparsity["sparsity/1e-06/attention"] < 1.0 and whole_sparsity["sparsity/1e-06/norms"] == 1.0


@pytest.mark.slow  # two fits of about 75 s each
def test_fsdp2_with_two_sharded_teachers_trains_like_one_process(tmp_path):
    """Two in-process teachers averaged (teacher: Several(..., Average)), both sharded like the
    student under FSDP2 (teacher_placement: shard) over two processes: the student ends where one process ends."""
    (whole, _), (sharded, _) = run("single-teachers", tmp_path / "single"), run("fsdp2-teachers", tmp_path / "fsdp2")
    assert sharded.keys() == whole.keys()
    for name, value in whole.items():
        torch.testing.assert_close(sharded[name], value, atol=1e-6, rtol=0, msg=name)


@pytest.mark.slow  # two fits of about 75 s each
def test_fsdp2_reduces_gradients_once_per_accumulated_step(tmp_path):
    """Steps of 2 accumulated micro-batches under FSDP2 reduce-scatter gradients on the last micro-batch
    only (``set_requires_gradient_sync``): half the reduce-scatters of a run that reduces every micro-batch,
    and the same student."""
    (accumulated, _), (synced, _) = run("fsdp2-accum-count", tmp_path / "once"), run("fsdp2-accum-count-sync", tmp_path / "every")
    for name, value in synced.items():
        torch.testing.assert_close(accumulated[name], value, atol=1e-6, rtol=0, msg=name)
    for rank in (0, 1):
        once = json.loads((tmp_path / "once" / f"reduce_scatters-rank{rank}.json").read_text())
        every = json.loads((tmp_path / "every" / f"reduce_scatters-rank{rank}.json").read_text())
        assert every > 0 and once * 2 == every, (rank, once, every)


def test_a_logged_train_value_is_the_mean_over_the_ranks_of_each_steps_last_micro_batch(tmp_path):
    """Two DDP processes, each step in 2 micro-batches (``-accum``), every step logged (``-log``): ``train/loss`` and
    the diagnostics in metrics.jsonl are, at step s, the mean over the ranks of what each rank logged in step s's last
    micro-batch (before: rank 0's value alone), as README.md says."""
    out = tmp_path / "out"
    run("ddp-accum-log", out)
    logged = {}
    for rank in (0, 1):
        for line in (out / f"logged-rank{rank}.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record["name"] in ("train/grad_norm", "train/skipped_steps"):  # of the all-reduced gradients: alike on every rank
                continue
            logged.setdefault((record["name"], record["steps_before"] + 1), {})[rank] = record["value"]  # a later micro-batch wins
    written = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        written.update({(name, row["step"]): value for name, value in row.items() if name.startswith("train/")})
    names = {"train/loss", "train/kl_forward", "train/kl_reverse", "train/completion_length"}
    assert {(name, step) for name in names for step in (1, 2)} <= set(logged) and set(logged) <= set(written)
    assert any(values[0] != pytest.approx(values[1]) for (name, _), values in logged.items() if name == "train/loss")
    for key, values in logged.items():
        assert written[key] == pytest.approx((values[0] + values[1]) / 2, rel=1e-5), key


VAL_WORKER = Path(__file__).with_name("val_ranks_worker.py")


def validate(layout: str, out: Path) -> tuple[list[dict], list[str]]:
    """tests/val_ranks_worker.py on ``layout`` (5 val examples): each rank's results and the ids of every sample record."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(VAL_WORKER), str(out), layout], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads(path.read_text()) for path in sorted(out.glob("results-rank*.json"))]
    ids = [json.loads(line)["id"] for path in (out / "samples").glob("val-*.jsonl") for line in path.read_text().splitlines()]
    return ranks, sorted(ids)


@pytest.mark.parametrize("layout", ["ddp", pytest.param("fsdp2", marks=pytest.mark.slow)])
def test_validation_over_two_ranks_counts_each_of_five_examples_once_as_one_process_does(layout, tmp_path):
    """5 val examples over 2 ranks: rank 1's share is padded with example 0 (so both ranks decode 2 batches, which a
    sharded model's collective forwards need), and the repeat is decoded but not counted: val/accuracy and pass@k equal
    one process's exactly, and samples/ holds each example's samples once. Before, Lightning's DistributedSampler padded
    the same way and example 0 counted twice (accuracy 3.5 / 6 instead of 2.5 / 5)."""
    from val_ranks_worker import SCORES

    (single,), single_ids = validate("single", tmp_path / "single")
    ranks, ids = validate(layout, tmp_path / layout)
    expected = {"val/accuracy": sum(SCORES) / 5, "val/pass@1": sum(s >= 1.0 for s in SCORES) / 5, "val/pass@2": sum(s >= 1.0 for s in SCORES) / 5}
    assert single["metrics"] == pytest.approx(expected, abs=1e-7)
    assert [rank["metrics"] for rank in ranks] == [single["metrics"]] * 2  # exactly, on both ranks
    assert [rank["batches"] for rank in ranks] == [2, 2]
    assert ids == single_ids == sorted(f"add-val-{i}" for i in range(5) for _ in range(2))  # 2 samples each
