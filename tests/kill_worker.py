"""Run by tests/test_resume.py as its own program:

    python tests/kill_worker.py OUT_DIR {full|killed|resume} POLICY

``full`` trains 7 steps; ``killed`` trains with a checkpoint every 2 steps and SIGKILLs itself after
step 5 (nothing is flushed or saved on the way out); ``resume`` continues from the killed run's last
checkpoint to step 7. Each finished run writes the student's weights to OUT_DIR/<mode>.pt.
"""

import os
import signal
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from kdlab.objectives import SampledReverseKL
from kdlab.rollouts import MixtureRollouts, StudentRollouts, TeacherRollouts
from kdlab.stages import DistillModule
from kdlab.tasks import Addition

POLICIES = {"offpolicy": TeacherRollouts, "onpolicy": StudentRollouts, "mixture": lambda: MixtureRollouts(-0.4)}


class KillAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main(out: Path, mode: str, policy: str) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0 if mode != "resume" else 99)
    model = DistillModule("kdlab://tiny-random/student", "kdlab://tiny-random/teacher", Addition(num_train=10, num_val=0),
                          rollout=POLICIES[policy](), objective=SampledReverseKL(), max_completion_tokens=6,
                          batch_size=2, lr=1e-3, warmup_steps=3)
    callbacks = [ModelCheckpoint(dirpath=str(out / "ckpt"), save_last=True, every_n_train_steps=2)]
    if mode == "killed":
        callbacks.append(KillAt(5))
    trainer = pl.Trainer(max_steps=7, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, default_root_dir=str(out / mode), callbacks=callbacks)
    trainer.fit(model, ckpt_path=str(out / "ckpt" / "last.ckpt") if mode == "resume" else None, weights_only=True)
    torch.save({k: v.detach().clone() for k, v in model.student.state_dict().items()}, out / f"{mode}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
