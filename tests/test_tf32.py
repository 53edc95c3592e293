"""TF32 (issue #45): a CUDA fit turns it on before any callback's first ("before") evaluation, so before and after
are measured at one precision, and the exact KLs' dot products never use it.

No GPU here: the stage's setting is made to act on the CPU (``use_float32_matmul_precision`` given a CUDA device)
and the precision torch reports is read where it matters: while a real :class:`Coverage` callback decodes its
"before" measurement, and inside the row-wise dot products of the KL kernels."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

import kdlab.stages.base as stage_base
from kdlab.callbacks import Coverage
from kdlab.objectives import ForwardKL, ReverseKL
from kdlab.stages import DistillModule
from kdlab.tasks import Addition


@pytest.fixture
def precision():
    kept = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(kept)


def test_tf32_is_on_when_the_callbacks_measure_before_training(tiny_pair, tmp_path, monkeypatch, precision):
    real = stage_base.use_float32_matmul_precision
    monkeypatch.setattr(stage_base, "use_float32_matmul_precision", lambda device, value="high": real(torch.device("cuda", 0), value))
    from kdlab.callbacks import periodic

    seen, decode = [], periodic.completion_texts
    monkeypatch.setattr(periodic, "completion_texts", lambda *a, **k: seen.append(torch.get_float32_matmul_precision()) or decode(*a, **k))
    module = DistillModule(*tiny_pair, Addition(num_train=4, num_val=2), max_completion_tokens=3, batch_size=2, val_examples=2)
    coverage = Coverage(Addition(num_val=2), ks=(1,), samples=1, examples=2, name="add", every_n_steps=1)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, callbacks=[coverage], limit_val_batches=0,
                         enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(module)
    assert len(seen) >= 2 and set(seen) == {"high"}  # the measurement before training and the one after it


@pytest.mark.parametrize("objective", [ForwardKL, ReverseKL])
def test_the_exact_kls_dot_products_run_in_full_fp32_under_tf32(objective, monkeypatch, precision):
    seen = []
    for owner, name in ((torch.linalg, "vecdot"), (torch, "bmm")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _real=real, **k: seen.append(torch.get_float32_matmul_precision()) or _real(*a, **k))
    torch.set_float32_matmul_precision("high")
    generator = torch.Generator().manual_seed(0)
    student = torch.randn(2, 3, 50, generator=generator, requires_grad=True)
    teacher = torch.randn(2, 3, 50, generator=generator)
    loss = objective()(student, teacher, torch.ones(2, 3, dtype=torch.bool))
    loss.backward()
    assert seen and set(seen) == {"highest"}
    assert torch.get_float32_matmul_precision() == "high"  # the caller's setting is back
