"""Run by tests/test_distributed.py as its own program: Lightning re-launches it once per rank.

    python tests/distributed_worker.py OUT_DIR {single|fsdp2|ddp} [STEPS [EXAMPLES [RESUME]]]

Distils the packaged random tiny pair for STEPS (default 2) steps from a fixed teacher dataset of
EXAMPLES prompts (default 8; so rollouts are the same whatever the process layout), with a global batch
of 8 prompts, and writes the full student weights (rank 0), each rank's local parameter count and the
update-sparsity report to OUT_DIR. A checkpoint is saved after every step (``OUT_DIR/checkpoints/last``);
RESUME continues from such a checkpoint.
"""

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from kdlab.callbacks import UpdateSparsity
from kdlab.module import DistillModule
from kdlab.rollouts import TeacherRollouts
from kdlab.tasks import Addition

GLOBAL_BATCH = 8


class Dump(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in pl_module.student.parameters())
        total = sum(p.numel() for p in pl_module.student.parameters())
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"local": local, "total": total}))
        if trainer.world_size > 1 and isinstance(trainer.strategy, ModelParallelStrategy):
            state = get_model_state_dict(pl_module.student, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            state = {k: v.detach().cpu() for k, v in pl_module.student.state_dict().items()}
        if trainer.is_global_zero:
            torch.save(state, self.out / "student.pt")


def main(out: Path, layout: str, steps: int = 2, examples: int = GLOBAL_BATCH, resume: str | None = None) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0)
    task = Addition(num_train=examples, num_val=0, num_test=0)
    data = out / "teacher.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"id": ex["id"], "completion": f"<answer>{ex['a'] * 7 ** i}</answer>"}) + "\n"
                                for i, ex in enumerate(task.examples("train"))))
    precision = "bf16-mixed" if layout.endswith("-bf16") else "32-true"
    layout = layout.removesuffix("-bf16")
    devices = 1 if layout == "single" else 2
    module = DistillModule(
        "kdlab://tiny-random/student", "kdlab://tiny-random/teacher", task,
        rollout=TeacherRollouts(dataset=str(data)), batch_size=GLOBAL_BATCH // devices, lr=1e-3, warmup_steps=0,
        teacher_placement="shard" if layout == "fsdp2" else "replicate",
    )
    strategy = {
        "single": "auto",
        "ddp": DDPStrategy(process_group_backend="gloo"),
        # tensor_parallel_size must be 1: its default "auto" would silently make this TP=2
        "fsdp2": ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo"),
    }[layout]
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False, precision=precision,
        gradient_clip_val=0.05,  # small enough to clip, so sharded clipping is exercised too
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=str(out),
        callbacks=[
            Dump(out),
            UpdateSparsity(thresholds=(1e-6, 1e-3)),  # counted per shard, then reduced
            ModelCheckpoint(dirpath=out / "checkpoints", save_last=True, every_n_train_steps=1),
        ],
    )
    trainer.fit(module, ckpt_path=resume)


if __name__ == "__main__":
    arguments = sys.argv[1:] + [None] * 5
    main(Path(arguments[0]), arguments[1], int(arguments[2] or 2), int(arguments[3] or GLOBAL_BATCH), arguments[4])
