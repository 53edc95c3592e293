"""Run by tests/test_distributed.py as its own program: Lightning re-launches it once per rank (gloo processes).

    python tests/val_ranks_worker.py OUT_DIR {single|ddp|fsdp2} [VAL_EXAMPLES]

Validates the packaged random tiny student (a GRPOModule, no training) on VAL_EXAMPLES (default 5) addition
prompts, 2 per batch, 2 greedy samples each, on one process (``single``) or two (``ddp``, ``fsdp2``: sharded, so
every decode forward is a collective). The task's scores depend on the example alone (:class:`Graded`), so every
layout scores the same. Each rank writes ``results-rank<r>.json``: what ``trainer.validate`` returned (the
metrics reduced over the ranks) and the number of validation batches that rank ran; the per-example records go
to ``OUT_DIR/samples/`` as every run's do."""

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from kdlab.stages import GRPOModule
from kdlab.tasks import Addition

SCORES = [1.0, 0.5, 0.0, 1.0, 0.0]
"""The score of val example i (any completion), cycled past the fifth."""


class Graded(Addition):
    def score(self, example, completion):
        return SCORES[int(example["id"].rsplit("-", 1)[1]) % len(SCORES)]


class Batches(pl.Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.batches += 1


def main(out: Path, layout: str, examples: int = 5) -> None:
    torch.set_num_threads(1)
    task = Graded(num_train=4, num_val=examples, num_test=0)
    module = GRPOModule("kdlab://tiny-random/student", task, max_completion_tokens=3, val_examples=examples, val_batch_size=2, val_temperature=0.0,
                        eval_samples=2, eval_ks=(1, 2))
    strategy = {
        "single": "auto",
        "ddp": DDPStrategy(process_group_backend="gloo"),
        "fsdp2": ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo"),
    }[layout]
    batches = Batches()
    trainer = pl.Trainer(accelerator="cpu", devices=1 if layout == "single" else 2, strategy=strategy, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(out), callbacks=[batches])
    (results,) = trainer.validate(module, verbose=False)
    (out / f"results-rank{trainer.global_rank}.json").write_text(json.dumps({"metrics": results, "batches": batches.batches}))


if __name__ == "__main__":
    arguments = sys.argv[1:] + [None]
    main(Path(arguments[0]), arguments[1], int(arguments[2] or 5))
