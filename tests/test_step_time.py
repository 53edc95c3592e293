"""``kdlab estimate``'s time model (issue #45, item 4; :mod:`kdlab.study.step_time`, :mod:`kdlab.study.run_time`) and
its SFT / GRPO memory (:mod:`kdlab.study.setups`): the op counts recounted on Qwen2, the lm-eval costs read back
from lm-eval's task files, the arithmetic against an independent computation, LoRA's parameter count against
peft's, and the presets the estimate made change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kdlab.study import step_time
from kdlab.study.run_time import LM_EVAL_COST
from kdlab.study.setups import lora_params
from kdlab.study.shapes import PUBLISHED, shape_of_config

ROOT = Path(__file__).parents[1]


class OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def counted(fn) -> int:
    mode = OpCount()
    with mode:
        fn()
    return mode.count


def qwen2(layers: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                         vocab_size=300)
    return Qwen2ForCausalLM(config), config


def test_the_op_counts_are_those_pytorch_dispatches_for_qwen2():
    """Each constant is the difference between 1- and 2-layer models (per layer) or what remains (outside)."""
    from kdlab.objectives import ForwardKL
    from kdlab.rollouts.decoding import IncrementalLM, sample_tokens
    from kdlab.stages.optim import FiniteAdamW

    per: dict[int, dict[str, float]] = {}
    for layers in (1, 2):
        model, _ = qwen2(layers)
        model.eval()
        ids, mask = torch.randint(0, 300, (4, 10)), torch.ones(4, 10, dtype=torch.bool)

        def decode(tokens):
            decoder = IncrementalLM(model, ids, mask, 300, 1.0)
            return counted(lambda: sample_tokens(decoder, 4, tokens, [299], 0, torch.Generator().manual_seed(0)))

        model.train()
        x = torch.randint(0, 300, (2, 16))
        holder = {}
        forward = counted(lambda: holder.setdefault("out", model(x).logits.sum()))
        backward = counted(lambda: holder["out"].backward())
        optimiser = FiniteAdamW(model.parameters(), lr=1e-3)

        def step():
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimiser.step()

        step()  # the first step creates AdamW's state
        tensors = len(list(model.parameters()))
        per[layers] = {"decode": (decode(13) - decode(5)) / 8,  # 8 tokens: one finished-rows check (every 8 tokens)
                        "forward": forward, "backward": backward, "optimiser": counted(step), "tensors": tensors}
    one, two = per[1], per[2]
    assert two["decode"] - one["decode"] == step_time.OPS_DECODE_LAYER
    assert one["decode"] - step_time.OPS_DECODE_LAYER == step_time.OPS_DECODE_OUTSIDE
    assert two["forward"] - one["forward"] == step_time.OPS_FORWARD_LAYER and one["forward"] - step_time.OPS_FORWARD_LAYER == step_time.OPS_FORWARD_OUTSIDE
    assert two["backward"] - one["backward"] == step_time.OPS_BACKWARD_LAYER
    assert one["backward"] - step_time.OPS_BACKWARD_LAYER == step_time.OPS_BACKWARD_OUTSIDE
    assert (two["optimiser"] - one["optimiser"]) / (two["tensors"] - one["tensors"]) == step_time.OPS_OPTIMISER_TENSOR
    assert two["tensors"] - one["tensors"] == step_time.TENSORS_PER_LAYER[True]  # Qwen2: q, k, v biases
    objective = ForwardKL()
    chunks = []
    for rows in (256, 512):
        student, teacher = torch.randn(1, rows, 300, requires_grad=True), torch.randn(1, rows, 300)
        chunks.append(counted(lambda: objective(student, teacher, torch.ones(1, rows, dtype=torch.bool)).backward()))
    assert chunks[1] - chunks[0] == step_time.OPS_OBJECTIVE_CHUNK


def _lm_eval_setting(folder: Path, name: str, key: str):
    """``key`` of lm-eval task ``name``: from the YAML that declares ``task: name`` (or, for a group, its first
    subject ``name_*``), else from the files it ``include``s."""
    import re

    files = sorted(folder.rglob("*.yaml"))
    declared = [f for f in files if re.search(rf"^task: \"?{re.escape(name)}\"?\s*$", f.read_text(encoding="utf-8"), re.M)]
    declared = declared or [f for f in files if re.search(rf"^task: \"?{re.escape(name)}_\w+\"?\s*$", f.read_text(encoding="utf-8"), re.M)]
    path = sorted(declared, key=lambda f: f.parent != folder / name)[0]  # the task's own top-level folder first (tasks/mmlu_pro)
    while True:
        text = path.read_text(encoding="utf-8")
        found = re.search(rf"^\s*{key}: *\"?([^\"\s]+)", text, re.M)
        if found:
            return found.group(1)
        include = re.search(r"^include: *\"?([^\"\s]+)", text, re.M)
        assert include, (name, key, path)
        path = path.parent / include.group(1)


def test_lm_eval_costs_are_lm_evals_own_task_settings():
    """``output_type`` and ``max_gen_toks`` of every suite task as lm-eval's own task files set them."""
    lm_eval = pytest.importorskip("lm_eval")
    from kdlab.evaluation.lm_eval_suite import PAPER_SUITE

    assert set(LM_EVAL_COST) == set(PAPER_SUITE)
    folder = Path(lm_eval.__file__).parent / "tasks"
    for name, (_, kind, generated, _) in LM_EVAL_COST.items():
        assert _lm_eval_setting(folder, PAPER_SUITE[name].task, "output_type") == kind, name
        if kind == "generate_until":
            assert int(_lm_eval_setting(folder, PAPER_SUITE[name].task, "max_gen_toks")) == generated, name


def test_a_decoded_token_costs_the_larger_of_host_and_device_on_a_gpu_and_their_sum_on_a_cpu():
    shape = PUBLISHED["Qwen/Qwen2.5-1.5B-Instruct"]
    h200 = step_time.HARDWARE["H200"]
    host = (28 * step_time.OPS_DECODE_LAYER + step_time.OPS_DECODE_OUTSIDE) * 10e-6
    kv = 32 * 2304 * 2 * 28 * 256 * 2
    streamed = shape.params * 2 + kv  # at the weight-streaming rate
    between = 32 * 28 * step_time.OPS_DECODE_LAYER * 1536 * 2 + 32 * 28 * 8 * 12 * 2304 + 12 * 32 * 151936 * 4  # ops' arrays, scores, sampling
    device = max(streamed / (4.8e12 * 0.94) + between / 4.8e12, 2 * shape.params * 32 / (989e12 * 0.40))
    assert step_time.decode_token_seconds(shape, 2, 32, 2304, "kdlab", h200) == pytest.approx(max(host, device))
    assert step_time.decode_token_seconds(shape, 2, 32, 2304, "vllm", h200) == pytest.approx(device)
    cpu = step_time.Hardware("cpu", 1e11, 1e10, 5e-6, 1.0, 1.0, overlapped=False)
    cpu_device = max((streamed + between) / 1e10, 2 * shape.params * 32 / 1e11)
    assert step_time.decode_token_seconds(shape, 2, 32, 2304, "kdlab", cpu) == pytest.approx((28 * step_time.OPS_DECODE_LAYER + step_time.OPS_DECODE_OUTSIDE) * 5e-6 + cpu_device)
    with pytest.raises(ValueError, match="decode back end must be kdlab, vllm or served, got 'hf'"):
        step_time.decode_token_seconds(shape, 2, 32, 2304, "hf", h200)


def test_a_sampled_token_draws_rows_times_vocabulary_numbers_and_a_greedy_one_none():
    """``draw_seconds``: a sampled token adds ``rows x V x draw_seconds`` (the Exp(1) numbers ``torch.multinomial``'s
    one-sample path draws, and kdlab's draw with it); a greedy token adds nothing; the GPUs' constant is 0."""
    from dataclasses import replace

    from kdlab.study.shapes import Shape
    from kdlab.study.step_time import HARDWARE, decode_seconds, decode_token_seconds

    shape = Shape(hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, intermediate=64, vocab=353)
    cpu = replace(HARDWARE["H200"], name="cpu", overlapped=False, draw_seconds=0.0)
    drawing = replace(cpu, draw_seconds=2e-8)
    for rows in (1, 100):
        plain = decode_token_seconds(shape, 4, rows, 50, "kdlab", cpu)
        assert decode_token_seconds(shape, 4, rows, 50, "kdlab", drawing) == pytest.approx(plain + rows * 353 * 2e-8)
        assert decode_token_seconds(shape, 4, rows, 50, "kdlab", drawing, sampled=False) == pytest.approx(plain)
    greedy, sampled = (decode_seconds(shape, 4, 8, 20, 10, "kdlab", drawing, sampled=s) for s in (False, True))
    assert sampled - greedy == pytest.approx(10 * 8 * 353 * 2e-8)
    assert all(hardware.draw_seconds == 0 for hardware in HARDWARE.values())


def test_a_decode_ops_time_is_the_larger_of_their_bytes_and_their_elements_at_element_seconds():
    """``element_seconds`` (a CPU's eager ops costing more than their bytes): the ops' ``rows x layers x
    OPS_DECODE_LAYER x hidden`` elements at that rate when it exceeds the bytes at ``bandwidth``; at 0 (the GPUs)
    the bytes alone, as before."""
    from dataclasses import replace

    from kdlab.study.shapes import Shape
    from kdlab.study.step_time import HARDWARE, OPS_DECODE_LAYER, decode_token_seconds

    shape = Shape(hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, intermediate=64, vocab=353)
    cpu = replace(HARDWARE["H200"], name="cpu", overlapped=False)
    elements = 100 * 2 * OPS_DECODE_LAYER * 32
    plain = decode_token_seconds(shape, 4, 100, 50, "kdlab", cpu, sampled=False)
    slow = decode_token_seconds(shape, 4, 100, 50, "kdlab", replace(cpu, element_seconds=3e-9), sampled=False)
    assert slow == pytest.approx(plain - elements * 4 / cpu.bandwidth + elements * 3e-9)
    tiny = replace(cpu, element_seconds=1e-15)  # below the bytes' rate: the bytes decide
    assert decode_token_seconds(shape, 4, 100, 50, "kdlab", tiny, sampled=False) == pytest.approx(plain)
    assert all(hardware.element_seconds == 0 for hardware in HARDWARE.values())


def test_each_evaluated_row_adds_its_host_work_to_its_evaluation():
    """``Hardware.row_seconds``: every row an evaluation scores (validation's prompts x samples, Coverage's, each
    kdlab OOD task's examples) costs that much outside its decode, once per time the evaluation runs."""
    from dataclasses import replace

    from kdlab.study.estimate import Setup
    from kdlab.study.run_time import evaluation_seconds

    shape = PUBLISHED["Qwen/Qwen2.5-1.5B-Instruct"]
    setup = Setup(student=shape, teacher=None, batch_size=4, prompt_tokens=256, completion_tokens=64, mixed=True)
    config = {"model": {"val_examples": 100, "eval_samples": 2, "val_batch_size": 10},
              "trainer": {"val_check_interval": 10, "callbacks": [
                  {"class_path": "kdlab.callbacks.Coverage", "init_args": {"examples": 50, "samples": 4, "batch_size": 25, "max_new_tokens": 32}},
                  {"class_path": "kdlab.callbacks.OODForgetting", "init_args": {"tasks": ["addition", "sorting"], "examples": 30, "max_new_tokens": 16}}]}}
    h200 = step_time.HARDWARE["H200"]
    without = evaluation_seconds(setup, config, 20, replace(h200, row_seconds=0.0))
    with_rows = evaluation_seconds(setup, config, 20, replace(h200, row_seconds=1.0))
    added = {name: with_rows[name] - without[name] for name in without}
    # validation twice (steps 10 and 20) x 100 x 2 rows; Coverage at start and end x 50 x 4; OOD before and after x 2 x 30
    assert added == pytest.approx({"validation": 2 * 200, "Coverage 1": 2 * 200, "OODForgetting 2": 2 * 60})


def test_style_transfer_decodes_each_entrys_own_rows():
    """kdlab.study.run_time: StyleTransfer decodes each entry's rows (a TaskPrompts entry's own ``examples``, else the
    callback's), the student at the start and at the end: 2 x (30 + 20) rows of host work."""
    from dataclasses import replace

    from kdlab.study.estimate import Setup
    from kdlab.study.run_time import evaluation_seconds

    setup = Setup(student=PUBLISHED["Qwen/Qwen2.5-1.5B-Instruct"], teacher=None, batch_size=4, prompt_tokens=256, completion_tokens=64, mixed=True)
    entries = [{"class_path": "kdlab.callbacks.TaskPrompts", "init_args": {"task": "addition", "split": "train", "examples": 30}}, "sorting"]
    config = {"model": {}, "trainer": {"limit_val_batches": 0, "callbacks": [
        {"class_path": "kdlab.callbacks.StyleTransfer", "init_args": {"tasks": entries, "examples": 20, "max_new_tokens": 16}}]}}
    h200 = step_time.HARDWARE["H200"]
    without = evaluation_seconds(setup, config, 20, replace(h200, row_seconds=0.0))
    with_rows = evaluation_seconds(setup, config, 20, replace(h200, row_seconds=1.0))
    assert {name: with_rows[name] - without[name] for name in without} == pytest.approx({"StyleTransfer 1": 2 * 50})

def test_lora_parameters_are_those_peft_trains():
    pytest.importorskip("peft")
    from kdlab.stages.lora import LoraSpec, apply_lora

    model, config = qwen2(2)
    adapted = apply_lora(model, LoraSpec(r=8, alpha=8))
    trained = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    assert lora_params(shape_of_config(config, "tiny"), 8) == trained
    assert all(p.dtype == torch.float32 for p in adapted.parameters() if p.requires_grad)


def test_lora_adapters_are_counted_in_16_bits_under_a_16_bit_true_precision(tmp_path):
    """Under ``bf16-true`` (and ``16-true``) Lightning casts the whole student, adapters included, to 16 bits, so their
    weights, gradients and AdamW moments take 2 B; under ``32-true`` and the mixed precisions they stay fp32 (4 B).
    The fit below checks the first half on the real stage."""
    pytest.importorskip("peft")
    import lightning.pytorch as pl

    from kdlab.rollouts.policies import TeacherRollouts
    from kdlab.stages.distill import DistillModule
    from kdlab.stages.lora import LoraSpec
    from kdlab.study.estimate import estimate, setup_from_config
    from kdlab.tasks import Addition

    model = {"class_path": "kdlab.stages.DistillModule", "init_args": {"student": "kdlab://tiny/student", "teacher": "kdlab://tiny/teacher",
                                                                        "lora": {"r": 8}}}
    results = {precision: estimate(setup_from_config({"model": model, "trainer": {"accelerator": "cpu", "precision": precision}}))
               for precision in ("32-true", "bf16-mixed", "bf16-true", "16-true")}
    trainable = lora_params(results["32-true"].setup.student, 8)
    for precision, size in (("32-true", 4), ("bf16-mixed", 4), ("bf16-true", 2), ("16-true", 2)):
        terms = {term.key: term for term in results[precision].terms}
        assert terms["optimiser (AdamW)"].bytes == 2 * trainable * size, precision
        assert terms["student gradients"].bytes == trainable * size, precision
        assert f"LoRA (r 8) x {size} B" in terms["student weights"].formula, precision
    assert "LoRA (r 8) x 2 B (the 16-bit true precision casts the adapters too)" in {t.key: t for t in results["bf16-true"].terms}["student weights"].formula

    task = Addition(max_digits=2, system_prompt="", num_train=4, num_val=0, num_test=0, seed=0)
    stage = DistillModule("kdlab://tiny-random/student", "kdlab://tiny-random/teacher", task, rollout=TeacherRollouts(), batch_size=2,
                          max_completion_tokens=4, val_examples=1, warmup_steps=0, lora=LoraSpec(r=4, alpha=8))
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", precision="bf16-true", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                         default_root_dir=tmp_path)
    trainer.fit(stage)
    assert {p.dtype for p in stage.student.parameters() if p.requires_grad} == {torch.bfloat16}


@pytest.fixture
def in_root(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("sys.argv", ["kdlab"])


def test_the_target_run_is_its_steps_and_evaluations_and_its_step_the_sum_of_its_parts(in_root):
    from kdlab.cli.estimate import run_estimate

    target = ["--config", "experiments/paper/countdown3/base-qwen1.5b_from_qwen7b.yaml",
              "--config", "experiments/paper/countdown3/onpd_fkl-qwen1.5b_from_qwen7b.yaml"]
    result = run_estimate(target)
    time = result.time
    assert time.steps == 150 and time.seconds == pytest.approx(150 * sum(time.step.parts.values()) + sum(time.evaluations.values()))
    shape, h200 = result.setup.student, step_time.HARDWARE["H200"]
    decode = step_time.forward_seconds(shape, 32 * 2048, h200) + 512 * step_time.decode_token_seconds(shape, 2, 32, 2048 + 256, "kdlab", h200)
    assert time.step.parts["decode (student, kdlab)"] == pytest.approx(decode)
    assert set(time.evaluations) == {"validation", "Coverage 3", "Coverage 4"}  # the preset measures forgetting off the loop
    h100 = run_estimate([*target, "--gpu_kind", "H100"]).time
    assert h100.step.parts["forward and backward"] == pytest.approx(time.step.parts["forward and backward"])  # the same peak FLOPs
    assert h100.step.seconds >= time.step.seconds


def test_the_sft_teacher_presets_fit_only_with_activation_checkpointing(in_root):
    """The presets' 2 rows x 16 checkpointed fit an 80 GiB GPU; the earlier 8 rows x 4 unchecked did not."""
    from kdlab.cli.estimate import run_estimate

    preset = ["--config", "experiments/paper/teachers/sft-medreason-qwen7b.yaml"]
    fixed = run_estimate(preset)
    earlier = run_estimate([*preset, "--model.init_args.model.gradient_checkpointing=false", "--model.init_args.batch_size=8",
                            "--trainer.accumulate_grad_batches=4"])
    assert fixed.fits and not earlier.fits and earlier.largest.key == "activations"
    assert fixed.work["prompts"] == earlier.work["prompts"] == 32  # the paper's batch
    assert fixed.setup.lora_rank == 256 and fixed.setup.stage == "sft"


def test_the_estimate_check_times_a_real_tiny_fit_by_part_and_records_the_work_it_compares(tmp_path):
    """``benchmarks/estimate_check.py --smoke``: 2 steps of the tiny quickstart with 8 validation prompts. The decodes
    the clock recorded are the config's: Coverage 200 prompts x 1 sample before and after, OODForgetting 4 tasks x 100
    before and after, validation 8; every comparison is its estimate over its measurement."""
    import json
    import subprocess
    import sys

    out = tmp_path / "check.json"
    result = subprocess.run([sys.executable, "benchmarks/estimate_check.py", "--smoke", f"--out={out}"], cwd=ROOT, capture_output=True,
                            text=True, timeout=900, env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["smoke"] and record["threads"] == 1 and record["problems"] == []
    calibration = record["calibration"]
    assert calibration["op_seconds"] > 0 and calibration["flops"] > 0 and calibration["bandwidth"] > 0 and calibration["before"]["ops_counted"] > 0
    assert calibration["draw_seconds"] > 0 and calibration["element_seconds"] >= 0
    for key in ("op_seconds", "flops", "bandwidth", "row_seconds", "draw_seconds"):  # measured before and after the fits; the model takes their mean
        assert calibration[key] == pytest.approx((calibration["before"][key] + calibration["after"][key]) / 2)
        assert calibration["drift"][key] == pytest.approx(calibration["after"][key] / calibration["before"][key])
    tiny = record["pairs"]["tiny"]
    assert tiny["steps"] == 2 and len(tiny["step_times_s"]) == 2
    rows = tiny["comparisons"]
    assert set(rows) == {"step", "validation", "Coverage 1", "OODForgetting 1"}
    assert rows["Coverage 1"]["rows"] == 2 * 200 and rows["OODForgetting 1"]["rows"] == 2 * 4 * 100 and rows["validation"]["rows"] == 8
    assert calibration["row_seconds"] > 0
    for row in rows.values():
        assert row["ratio"] == pytest.approx(row["estimated_s"] / row["measured_s"])
        assert row["within_30_percent"] == (abs(row["ratio"] - 1) <= 0.30)
    for name in ("validation", "Coverage 1", "OODForgetting 1"):  # each evaluated row's host work outside its decode, counted
        row = rows[name]
        assert row["estimated_rows_s"] == pytest.approx(row["rows"] * calibration["row_seconds"])
        assert row["estimated_s"] == pytest.approx(row["estimated_decodes_s"] + row["estimated_rows_s"])
    assert record["all_within_30_percent"] == all(row["within_30_percent"] for row in rows.values())


def test_a_grpo_preset_decodes_its_prompts_times_group_size_and_trains_its_micro_batches(in_root):
    """GRPO's memory: one decode of ``batch_size x group_size`` rows (the KV cache at the caps, recomputed here), training
    ``micro_batch_size`` rows at a time; LoRA's gradients and moments are the adapters' in fp32."""
    from kdlab.cli.estimate import run_estimate
    from kdlab.study.setups import GiB

    result = run_estimate(["--config", "experiments/paper/teachers/grpo-science-qwen7b.yaml"])
    setup, shape = result.setup, result.setup.student
    assert setup.stage == "grpo" and setup.rows_per_decode == 16 * 8 and setup.batch_size == 4 and setup.checkpointing
    kv = next(term for term in result.terms if term.key == "KV cache (student)")
    assert kv.bytes == 128 * (2048 + 1024) * shape.layers * 2 * shape.kv_dim * 2
    adam = next(term for term in result.terms if term.key == "optimiser (AdamW)")
    assert adam.bytes == 2 * lora_params(shape, 256) * 4
    assert result.work["decodes"] == 1 and result.work["prompts"] == 128
    assert result.fits and result.total <= 80 * GiB


def test_the_json_carries_the_time_and_an_unknown_gpu_kind_is_a_one_line_error(in_root, capsys):
    import json

    from kdlab.cli.config_errors import ConfigError
    from kdlab.cli.main import main

    preset = ["--config", "experiments/paper/teachers/sft-countdown3-qwen7b.yaml"]
    main(["estimate", *preset, "--gpu_kind", "H100", "--json"])
    record = json.loads(capsys.readouterr().out)["time"]
    assert record["gpu_kind"] == "H100" and record["steps"] == 500 and record["evaluations_seconds"] == {}
    assert record["run_seconds"] == pytest.approx(500 * record["step_seconds"]) and set(record["step_parts"]) == {
        "forward and backward", "objective", "optimiser step"}
    with pytest.raises(ConfigError, match=r"--gpu_kind: one of \['H100', 'H200'\], got 'A100'"):
        main(["estimate", *preset, "--gpu_kind", "A100"])


def test_the_estimate_check_averages_the_weight_streaming_rate_itself():
    """benchmarks/estimate_check.py's two calibrations: the mean hardware streams weights at the mean of the two
    streaming rates (bandwidth x efficiency), not at the product of the two means."""
    import importlib.util
    import sys
    from dataclasses import replace

    from kdlab.study.step_time import Hardware

    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("estimate_check", ROOT / "benchmarks" / "estimate_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    before = Hardware("cpu", 1e11, 4.5e9, 5e-6, 1.0, 7.7e9 / 4.5e9, overlapped=False, row_seconds=1e-4)
    after = replace(before, bandwidth=27e9, decode_bandwidth_efficiency=7.7e9 / 27e9)
    mean = module.mean_hardware(before, after)
    assert mean.bandwidth == pytest.approx(15.75e9) and mean.bandwidth * mean.decode_bandwidth_efficiency == pytest.approx(7.7e9)


def test_the_row_seconds_source_quotes_the_committed_estimate_checks_range():
    """The GPUs' ``row_seconds`` source says what ``benchmarks/results/estimate_check-cpu.json`` measured per row
    outside the decodes; the range it quotes holds every evaluation there, each rounded to 0.1 ms."""
    import json
    import re

    from kdlab.study.step_time import HARDWARE

    record = json.loads((ROOT / "benchmarks/results/estimate_check-cpu.json").read_text())
    per_row = [row["outside_decodes_s"] / row["rows"] * 1e3 for pair in record["pairs"].values()
               for row in pair["comparisons"].values() if row.get("rows")]
    low, high = map(float, re.search(r"measured ([\d.]+)-([\d.]+) ms per row", HARDWARE["H200"].sources["row_seconds"]).groups())
    assert low == round(min(per_row), 1) and high == round(max(per_row), 1)


def test_the_time_models_draw_figure_is_the_committed_calibrations():
    """``kdlab.study.step_time``'s docstring says "about 19 ns a number": the committed estimate check's draw_seconds."""
    import json

    from kdlab.study import step_time

    record = json.loads((ROOT / "benchmarks/results/estimate_check-cpu.json").read_text())
    assert f"about {record['calibration']['draw_seconds'] * 1e9:.0f} ns a number" in " ".join(step_time.__doc__.split())



def _rows_counted(setup, config, steps):
    """Each evaluation's rows over the run: its seconds with one second of host work a row, minus without."""
    from dataclasses import replace

    from kdlab.study.run_time import evaluation_seconds

    h200 = step_time.HARDWARE["H200"]
    without = evaluation_seconds(setup, config, steps, replace(h200, row_seconds=0.0))
    with_rows = evaluation_seconds(setup, config, steps, replace(h200, row_seconds=1.0))
    return {name: with_rows[name] - without[name] for name in with_rows}


def test_the_in_loop_lm_eval_suite_runs_before_every_n_steps_and_at_the_end():
    """OODForgetting with lm_eval_tasks measures on PeriodicCallback's schedule as with kdlab tasks: before, every
    ``every_n_steps`` and at the end unless that is one of them (every 50 of 150 steps: 1 + 3 passes)."""
    from kdlab.study.estimate import Setup
    from kdlab.study.run_time import evaluation_seconds, lm_eval_seconds

    setup = Setup(student=PUBLISHED["Qwen/Qwen2.5-1.5B-Instruct"], teacher=None, batch_size=4, prompt_tokens=256, completion_tokens=64, mixed=True)
    h200 = step_time.HARDWARE["H200"]
    one = lm_eval_seconds(setup, ["ifeval"], 8, h200)
    for every, steps, passes in ((50, 150, 4), (None, 150, 2), (40, 150, 5)):
        config = {"model": {}, "trainer": {"limit_val_batches": 0, "callbacks": [
            {"class_path": "kdlab.callbacks.OODForgetting", "init_args": {"lm_eval_tasks": ["ifeval"], "every_n_steps": every}}]}}
        assert evaluation_seconds(setup, config, steps, h200)["OODForgetting 1"] == pytest.approx(passes * one), (every, steps)


def test_validation_is_counted_every_interval_of_batches_or_once_after_the_last_step():
    """Validation runs every ``val_check_interval`` training batches: a distillation's micro-batches (``max_steps x
    accumulate_grad_batches``), a GRPO fit's rollout batches (``max_steps / mini_batches``: each makes ``mini_batches``
    optimiser steps); an interval beyond the run's batches validates once, after the last step
    (:class:`kdlab.stages.base.ValidateLastStep`); ``limit_val_batches: 0`` never."""
    from dataclasses import replace

    from kdlab.study.estimate import Setup

    distill = Setup(student=PUBLISHED["Qwen/Qwen2.5-1.5B-Instruct"], teacher=None, batch_size=4, prompt_tokens=256, completion_tokens=64,
                    mixed=True, accumulate=2)
    grpo = replace(distill, stage="grpo", accumulate=4)  # a GRPO setup's accumulate: micro-batches of one manual step

    def validations(setup, interval, steps=20, mini_batches=None, limit=None):
        model = {"val_examples": 100, "eval_samples": 1, **({"mini_batches": mini_batches} if mini_batches else {})}
        trainer = {"val_check_interval": interval, **({"limit_val_batches": limit} if limit is not None else {})}
        return _rows_counted(setup, {"model": model, "trainer": trainer}, steps).get("validation", 0.0) / 100

    assert validations(distill, 10) == 4  # 40 micro-batches
    assert validations(distill, 30) == 1  # at batch 30
    assert validations(distill, 50) == 1  # beyond the run's 40 batches: after the last step
    assert validations(distill, 50, limit=0) == 0
    assert validations(grpo, 5) == 4  # 20 rollout batches
    assert validations(grpo, 5, mini_batches=2) == 2  # 10 rollout batches of 2 optimiser steps
    assert validations(grpo, 15, mini_batches=2) == 1  # beyond its 10 batches: after the last step
    assert validations(grpo, 3, steps=21, mini_batches=2) == 3  # 11 batches: the last one takes the run past max_steps


def test_the_style_transfer_teachers_share_is_timed_on_the_teacher_and_only_when_it_is_sampled():
    """StyleTransfer samples the teacher once, at the start, and only with ``at_start`` (True by default): its decode
    is the teacher's (its shape and dtype), not a second student's."""
    from kdlab.study.estimate import Setup
    from kdlab.study.run_time import _decodes, evaluation_seconds

    student, teacher = PUBLISHED["Qwen/Qwen2.5-1.5B-Instruct"], PUBLISHED["Qwen/Qwen2.5-7B-Instruct"]
    setup = Setup(student=student, teacher=teacher, batch_size=4, prompt_tokens=256, completion_tokens=64, mixed=True)
    h200 = step_time.HARDWARE["H200"]
    for at_start, student_passes, teacher_passes in ((True, 2, 1), (False, 1, 0)):
        config = {"model": {}, "trainer": {"limit_val_batches": 0, "callbacks": [
            {"class_path": "kdlab.callbacks.StyleTransfer", "init_args": {"tasks": ["addition"], "examples": 40, "max_new_tokens": 16,
                                                                         "batch_size": 8, "at_start": at_start}}]}}
        expected = student_passes * _decodes(setup, 40, 8, 16, h200) + teacher_passes * _decodes(setup, 40, 8, 16, h200, role="teacher")
        assert evaluation_seconds(setup, config, 20, h200)["StyleTransfer 1"] == pytest.approx(expected), at_start
