"""Run by tests/test_grpo.py as its own program: Lightning re-launches it once per rank (2 gloo processes, DDP).

    python tests/grpo_ranks_worker.py OUT_DIR

One GRPO step of the packaged random tiny policy on addition, 2 prompts x 4 completions per rank; every DAPO loss
call writes this rank's own completion tokens and the ``T`` it divided by to ``OUT_DIR/tokens-rank<r>.json``, and
every ``train/`` and ``rlvr/`` value this rank hands to ``self.log`` (before Lightning reduces it over the ranks) goes
to ``OUT_DIR/logged-rank<r>.json``; the step is logged (``log_every_n_steps=1``) to ``OUT_DIR/metrics.jsonl``."""

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy

import kdlab.stages.grpo as grpo
from kdlab.stages import GRPOModule
from kdlab.tasks import Addition

POLICY = "kdlab://tiny/student"  # a trained tiny model: its completions end at different lengths


def main(out: Path) -> None:
    calls = []
    loss = grpo.dapo_loss

    def recording(logprobs, old, advantages, mask, *args, num_tokens=None, **kwargs):
        calls.append({"own": int(mask.sum()), "divided_by": num_tokens})
        return loss(logprobs, old, advantages, mask, *args, num_tokens=num_tokens, **kwargs)

    grpo.dapo_loss = recording
    task = Addition(num_train=8, num_val=0, num_test=0)
    calls_task = []
    task.score = lambda example, text: float(calls_task.append(0) or len(calls_task) % 2)  # every other completion right
    module = GRPOModule(POLICY, task, group_size=4, batch_size=2, max_completion_tokens=8, lr=1e-3, warmup_steps=0, temperature=1.0)
    logged, log = {}, module.log

    def recording(name, value, *args, **kwargs):
        if name.startswith(("train/", "rlvr/")):
            logged[name] = float(value)
        return log(name, value, *args, **kwargs)

    module.log = recording
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend="gloo"), max_steps=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                         num_sanity_val_steps=0, default_root_dir=str(out), log_every_n_steps=1)
    trainer.fit(module)
    (out / f"tokens-rank{trainer.global_rank}.json").write_text(json.dumps(calls))
    (out / f"logged-rank{trainer.global_rank}.json").write_text(json.dumps(logged))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
