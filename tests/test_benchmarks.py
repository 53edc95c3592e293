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
