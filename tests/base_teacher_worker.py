"""Run by tests/test_distill_lora.py as its own program, once per rank (2 gloo processes on the CPU).

    python tests/base_teacher_worker.py OUT_DIR RANK PORT

A LoRA DistillModule whose teacher is the student's own base (``BaseModelTeacher``), wrapped by kdlab's FSDP1 path
(:func:`kdlab.stages.sharding.wrap_fsdp1`, what ``configure_model`` runs under ``strategy: fsdp``; the strategy's
wrapping context given ``device_id=cpu``, as tests/distributed_worker.py's CPUFSDPStrategy does). With non-zero
adapters it writes completions, reads both models' logits on them and backpropagates the loss, and writes
``OUT_DIR/rank<r>.json``: how far the teacher's and the student's logits are from the plain base model's (read
again from its path, unsharded) and how many adapter tensors got a gradient."""

import json
import os
import sys
import types
import warnings
from pathlib import Path

import torch
import torch.distributed as dist


def main(out: Path, rank: int, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import enable_wrap

    from kdlab.models.loading import ModelSpec, load_causal_lm
    from kdlab.objectives.logits import completion_logits
    from kdlab.rollouts.policies import TeacherRollouts
    from kdlab.stages.distill import DistillModule
    from kdlab.stages.lora import LoraSpec
    from kdlab.stages.sharding import wrap_fsdp1
    from kdlab.tasks import Addition
    from kdlab.teachers import BaseModelTeacher

    student = "kdlab://tiny-random/student"
    task = Addition(max_digits=2, system_prompt="", num_train=16, num_val=4, num_test=0, seed=0)
    m = DistillModule(student, BaseModelTeacher(), task, rollout=TeacherRollouts(), batch_size=2, max_completion_tokens=6,
                      val_examples=4, val_batch_size=4, lora=LoraSpec(r=4, alpha=8))
    torch.manual_seed(0)  # the same adapters on both ranks
    for name, p in m.student.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    m._trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(mixed_precision=None, root_device=torch.device("cpu")),
                                       precision="32-true", world_size=2, global_step=0, fit_loop=None)
    with enable_wrap(wrapper_cls=FullyShardedDataParallel, use_orig_params=True, device_id=torch.device("cpu")):
        wrap_fsdp1(m)
    assert isinstance(m.student, FullyShardedDataParallel)
    rollout = m.make_rollout(task.examples("train")[:2], 0)
    student_logits, teacher_logits = m.distillation_logits(rollout)
    loss = m.objective(student_logits, teacher_logits, rollout.completion_mask)
    loss.backward()
    grads = sum(1 for name, p in m.student.named_parameters() if "lora_" in name and p.grad is not None and p.grad.abs().sum() > 0)
    base = load_causal_lm(ModelSpec(student)).eval()
    columns, length = m.token_columns, rollout.completion_ids.shape[1]
    with torch.no_grad():
        expected = completion_logits(base, rollout.model_inputs("teacher"), length, columns) / m.teacher_temperature
    teacher = teacher_logits.logits() if hasattr(teacher_logits, "logits") else teacher_logits
    report = {"teacher_vs_base": (teacher - expected).abs().max().item(),
              "student_vs_base": (student_logits.detach() - expected * m.teacher_temperature).abs().max().item(),
              "adapter_grads": grads, "trainable": all(p.requires_grad for name, p in m.student.named_parameters() if "lora_" in name)}
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
