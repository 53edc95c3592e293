"""Run by tests/test_sft.py as its own program: Lightning re-launches it once per rank (2 gloo processes, DDP).

    python tests/sft_ranks_worker.py ROWS_JSONL OUT_DIR

One SFT optimiser step of the packaged random tiny student on ROWS_JSONL (8 rows): batch_size 2 x
accumulate_grad_batches 2 x 2 ranks, the whole file in one step. Rank 0 writes the gradients the optimiser steps on
(after DDP's average over the ranks) to ``OUT_DIR/grads.pt``."""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy

from kdlab.stages import SFTModule


class Gradients(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_rank == 0:
            torch.save({name: p.grad.clone() for name, p in pl_module.model.named_parameters()}, self.out / "grads.pt")


def main(rows: str, out: Path) -> None:
    module = SFTModule("kdlab://tiny-random/student", dataset=rows, batch_size=2, warmup_steps=0, schedule="constant")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend="gloo"), max_steps=1, accumulate_grad_batches=2,
                         logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=str(out), callbacks=[Gradients(out)])
    trainer.fit(module)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
