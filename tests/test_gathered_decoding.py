"""Decodes keep sharded models gathered (issue #45): inside :func:`~kdlab.stages.sharding.gathered_for_decoding`
a greedy decode over 2 gloo processes all-gathers each FSDP unit once, not once per token, under FSDP1 and FSDP2
alike, decodes what the unsharded model decodes, and leaves the model resharded; every decode of a stage or a
callback (evaluation, Coverage, StyleTransfer, GRPO rollouts) runs inside the stage's block."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("gathered_worker.py")


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.mark.slow  # minutes on 2 cores: the slow tier (CI runs it)
@pytest.mark.parametrize("layout", ["fsdp1", "fsdp2"])
def test_a_decode_inside_the_block_gathers_each_unit_once(layout, tmp_path):
    port, env = free_port(), {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, str(WORKER), str(tmp_path), layout, str(rank), port], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    for process in ranks:
        _, err = process.communicate(timeout=600)
        assert process.returncode == 0, err[-3000:]
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        counts, texts = record["counts"], record["texts"]
        assert texts["gathered"] == texts["each_token"] == texts["after"] == texts["unsharded"]
        # 3 units (2 layers and the root): at most one gather each in the block, against one per layer per token
        assert 0 < counts["gathered"] <= record["units"] == 3, counts
        assert counts["each_token"] >= 2 * 12 and counts["after"] >= counts["each_token"], counts  # resharded on leaving


def test_every_decode_of_a_stage_or_a_callback_runs_inside_the_stages_gathered_block(tiny_pair, monkeypatch):
    """Evaluation, Coverage, StyleTransfer (the teacher's texts) and GRPO rollouts: each decoded token is drawn
    while the stage's block (its sharded and frozen models) is open."""
    import contextlib

    from kdlab.callbacks import Coverage
    from kdlab.rollouts import decoding, policies
    from kdlab.stages import DistillModule, GRPOModule, base
    from kdlab.tasks import Addition

    held, drawn = [], []

    @contextlib.contextmanager
    def recording(models):
        held.append(models)
        try:
            yield
        finally:
            held.pop()

    monkeypatch.setattr(base, "gathered_for_decoding", recording)
    for owner in (decoding, policies):
        real = owner.sample_tokens
        monkeypatch.setattr(owner, "sample_tokens", lambda *a, _real=real, **k: drawn.append([list(m) for m in held]) or _real(*a, **k))
    task = Addition(num_train=4, num_val=2)
    distill = DistillModule(*tiny_pair, task, max_completion_tokens=3, batch_size=2, val_examples=2)
    distill.eval_completions(task.examples("val"), 0.0, 0)
    Coverage(task, ks=(1,), samples=1, examples=2, max_new_tokens=3).sample(distill, task, task.examples("val"))
    Coverage(task, ks=(1,), samples=1, examples=2, max_new_tokens=3).sample(distill, task, task.examples("val"), role="teacher")
    grpo = GRPOModule(tiny_pair[0], task, group_size=2, batch_size=2, max_completion_tokens=3, lr=1e-3, warmup_steps=0)
    grpo.sample_groups(task.examples("train")[:1], seed=0)
    assert len(drawn) == 4
    for (models,), owner in zip(drawn, (distill, distill, distill, grpo)):
        assert any(model is owner.student for model in models)
    assert not held
