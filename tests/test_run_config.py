"""A run built in Python describes itself (``kdlab.run_config``): its ``config.yaml`` names every component
by class with the arguments it was built with, ``kdlab report`` reads it, and every run's loggers get the
same description as hyperparameters (TensorBoard's HPARAMS tab). ``kdlab fit`` keeps writing its own file."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml

from kdlab.callbacks import UpdateSparsity
from kdlab.objectives import ForwardKL, KLObjective
from kdlab.run_config import ARGUMENTS, described, write_run_config
from kdlab.stages import DistillModule
from kdlab.tasks import Addition

STUDENT, TEACHER = "kdlab://tiny-random/student", "kdlab://tiny-random/teacher"


class PowerDistance(KLObjective):
    """A notebook's objective: sum_v |p_S - p_T|^power."""

    def __init__(self, power: float = 2.0, **kwargs):
        super().__init__(**kwargs)
        self.power = power

    def token_loss(self, student_logits, teacher_logits):
        return ((student_logits.softmax(-1) - teacher_logits.softmax(-1)).abs() ** self.power).sum(-1)


def hparams_in_events(run_dir: Path) -> list[str]:
    """The summary tags TensorBoard's hparams plugin holds in ``run_dir``'s event files."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    tags = []
    for events in run_dir.glob("events.out.tfevents.*"):
        for event in EventFileLoader(str(events)).Load():
            tags += [value.tag for value in event.summary.value if value.metadata.plugin_data.plugin_name == "hparams"]
    return tags


@pytest.fixture(scope="module")
def notebook_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("notebook")
    pl.seed_everything(7)
    module = DistillModule(STUDENT, TEACHER, task=Addition(num_train=8), objective=PowerDistance(power=3.0, reduction="token"),
                           max_completion_tokens=6, batch_size=2, val_examples=2, lr=3e-4)
    logger = pl.loggers.TensorBoardLogger(root, name="nb", version="")
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=logger, log_every_n_steps=1, callbacks=[UpdateSparsity(thresholds=[1e-5])],
                         enable_progress_bar=False, enable_checkpointing=False)
    torch.set_num_threads(1)
    trainer.fit(module)
    return Path(logger.log_dir)


def test_a_run_built_in_python_writes_a_config_that_names_each_component_and_its_arguments(notebook_run):
    config = yaml.safe_load((notebook_run / "config.yaml").read_text())
    assert config["seed_everything"] == 7
    model = config["model"]
    assert model["class_path"] == "kdlab.stages.distill.DistillModule"
    arguments = model["init_args"]
    assert arguments["objective"] == {"class_path": f"{__name__}.PowerDistance",
                                      "init_args": {"power": 3.0, "reduction": "token", "chunk_size": 256}}
    assert arguments["task"]["class_path"] == "kdlab.tasks.addition.Addition" and arguments["task"]["init_args"]["num_train"] == 8
    assert arguments["rollout"]["class_path"].endswith("TeacherRollouts")  # None at the call: the stage's default, named
    assert (arguments["student"], arguments["lr"], arguments["max_completion_tokens"]) == (STUDENT, 3e-4, 6)
    assert config["trainer"]["max_steps"] == 1 and config["trainer"]["precision"] == "32-true"
    sparsity = [callback for callback in config["trainer"]["callbacks"] if callback["class_path"].endswith("UpdateSparsity")]
    assert sparsity == [{"class_path": "kdlab.callbacks.sparsity.UpdateSparsity",
                         "init_args": {"thresholds": [1e-5], "every_n_steps": None, "reference": None}}]


def test_kdlab_report_reads_a_python_run_and_tensorboard_has_its_hyperparameters(notebook_run):
    from kdlab.study.runs import read_run

    run = read_run(notebook_run)
    assert (run.objective, run.task, run.rollout, run.lr, run.seed) == ("PowerDistance", "Addition", "TeacherRollouts", 3e-4, 7)
    assert run.unfinished == "", "max_steps is in the config, so the run reads as finished"
    assert "model.init_args.objective.init_args.power" in run.settings
    assert hparams_in_events(notebook_run), "TensorBoard's HPARAMS tab needs the hparams plugin's summaries"
    saved = yaml.safe_load((notebook_run / "hparams.yaml").read_text())
    assert saved["model"]["init_args"]["objective"]["init_args"]["power"] == 3.0


def test_kdlab_fits_own_config_and_a_resumed_runs_first_are_kept_a_fresh_run_replaces_one_it_finds(tmp_path):
    from lightning.pytorch.cli import LightningArgumentParser, SaveConfigCallback

    config = {"model": {"class_path": "kdlab.stages.distill.DistillModule", "init_args": {}}}
    cli_trainer = pl.Trainer(logger=False, callbacks=[SaveConfigCallback(LightningArgumentParser(), {})], enable_progress_bar=False)
    assert write_run_config(cli_trainer, config, tmp_path) is None and not (tmp_path / "config.yaml").exists()
    trainer = pl.Trainer(logger=False, enable_progress_bar=False)
    assert write_run_config(trainer, config, tmp_path) == tmp_path / "config.yaml"
    first = (tmp_path / "config.yaml").read_text()
    trainer.ckpt_path = str(tmp_path / "last.ckpt")  # resumed: the first part's description stays
    assert write_run_config(trainer, {**config, "seed_everything": 3}, tmp_path) is None
    assert (tmp_path / "config.yaml").read_text() == first
    trainer.ckpt_path = None  # a fresh run in the same folder describes itself
    assert write_run_config(trainer, {**config, "seed_everything": 3}, tmp_path) == tmp_path / "config.yaml"
    assert "seed_everything: 3" in (tmp_path / "config.yaml").read_text()


def test_numpy_and_tensor_scalars_are_written_as_their_values():
    import numpy as np

    assert described({"lr": np.float64(1e-4), "steps": np.int64(3), "x": torch.tensor(0.5), "ok": np.bool_(True)}) == {
        "lr": 1e-4, "steps": 3, "x": 0.5, "ok": True}
    assert yaml.safe_dump(described([np.float32(2.0), np.int32(1)]))


def test_a_component_keeps_its_own_arguments_not_those_of_the_stage_that_builds_it():
    module = DistillModule(STUDENT, TEACHER, task=Addition(num_train=4), max_completion_tokens=4)
    assert isinstance(module.objective, ForwardKL)
    assert getattr(module.objective, ARGUMENTS) == {"reduction": "sequence", "chunk_size": 256}  # built inside the stage's __init__
    assert described(module)["init_args"]["max_completion_tokens"] == 4
    assert described(torch.nn.Linear(2, 2)) == "torch.nn.modules.linear.Linear"  # no remembered arguments: its type
