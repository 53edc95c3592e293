"""Resuming from a checkpoint reproduces an uninterrupted run bit for bit (CPU, one process): model,
optimiser, scheduler, data order and position, rollout sampling and sampled-KL streams; in the middle
of an epoch and at its end."""

import json
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from kdlab.objectives import SampledForwardKL
from kdlab.rollouts import MixtureRollouts, StudentRollouts, TeacherRollouts
from kdlab.stages import DistillModule
from kdlab.tasks import Addition

POLICIES = {"offpolicy": TeacherRollouts, "onpolicy": StudentRollouts, "mixture": lambda: MixtureRollouts(0.3)}
STEPS_PER_EPOCH = 4  # 8 prompts, batch 2


def module(tiny_pair, policy):
    task = Addition(num_train=8, num_val=0)
    return DistillModule(*tiny_pair, task, rollout=POLICIES[policy](), objective=SampledForwardKL(),
                         max_completion_tokens=6, batch_size=2, lr=1e-3, warmup_steps=2)


def fit(model, steps, root, every, ckpt_path=None):
    checkpoint = ModelCheckpoint(dirpath=str(root / "ckpt"), save_last=True, every_n_train_steps=every)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, default_root_dir=str(root), callbacks=[checkpoint])
    trainer.fit(model, ckpt_path=ckpt_path)


@pytest.mark.parametrize("stop", [3, STEPS_PER_EPOCH], ids=["mid-epoch", "epoch-end"])
@pytest.mark.parametrize("policy", POLICIES)
def test_resume_is_bit_exact(tiny_pair, tmp_path, policy, stop):
    total = 2 * STEPS_PER_EPOCH + 1  # crosses an epoch boundary after the resume
    pl.seed_everything(0)
    uninterrupted = module(tiny_pair, policy)
    fit(uninterrupted, total, tmp_path / "full", every=stop)
    pl.seed_everything(0)
    fit(module(tiny_pair, policy), stop, tmp_path / "part", every=stop)
    pl.seed_everything(123)  # a new process does not inherit the first one's global random state
    resumed = module(tiny_pair, policy)
    fit(resumed, total, tmp_path / "part", every=stop, ckpt_path=str(tmp_path / "part" / "ckpt" / "last.ckpt"))
    for a, b in zip(uninterrupted.student.parameters(), resumed.student.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("policy", [pytest.param(name, marks=() if name == "offpolicy" else pytest.mark.slow) for name in POLICIES])
def test_a_run_killed_with_sigkill_resumes_to_the_same_weights(tmp_path, policy):
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).with_name("kill_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(out, mode):
        return subprocess.run([sys.executable, str(worker), str(out), mode, policy], capture_output=True, text=True, env=env, timeout=600)

    assert run(tmp_path / "a", "full").returncode == 0
    killed = run(tmp_path / "b", "killed")
    assert killed.returncode == -signal.SIGKILL  # really killed, after its step-4 checkpoint
    resumed = run(tmp_path / "b", "resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    full, after = (torch.load(p, weights_only=True) for p in (tmp_path / "a" / "full.pt", tmp_path / "b" / "resume.pt"))
    for name, value in full.items():
        assert torch.equal(value, after[name]), name


def test_a_crash_while_writing_a_checkpoint_leaves_the_previous_one_usable(tiny_pair, tmp_path, monkeypatch):
    """Checkpoints are written to a temporary file and renamed: a save that dies half-way through its
    bytes leaves last.ckpt as it was, loadable with weights_only=True, and the run resumes from it."""
    from fsspec.implementations.local import LocalFileOpener

    pl.seed_everything(0)
    fit(module(tiny_pair, "offpolicy"), 2, tmp_path, every=1)
    last = tmp_path / "ckpt" / "last.ckpt"
    before = last.read_bytes()

    real_write = LocalFileOpener.write

    def dies_half_way(self, data):
        real_write(self, bytes(data)[: len(data) // 2])
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(LocalFileOpener, "write", dies_half_way)
    with pytest.raises(OSError, match="simulated"):
        fit(module(tiny_pair, "offpolicy"), 3, tmp_path, every=1, ckpt_path=str(last))
    monkeypatch.undo()
    assert last.read_bytes() == before
    assert not any(p.name.startswith("epoch=0-step=3") for p in last.parent.iterdir())  # no half-written file
    state = torch.load(last, weights_only=True)
    assert state["global_step"] == 2
    resumed = module(tiny_pair, "offpolicy")
    fit(resumed, 3, tmp_path / "again", every=1, ckpt_path=str(last))


def test_checkpoints_saved_at_validation_end_record_the_data_position(tiny_pair, tmp_path):
    """ModelCheckpoint saves after validation (the trainer is then validating inside fit): the data
    position must still be recorded, or a resume would replay the epoch's first batches."""
    pl.seed_everything(0)
    model = module(tiny_pair, "offpolicy")
    model.task = Addition(num_train=8, num_val=2)
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)  # saves on validation end
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, default_root_dir=tmp_path, enable_progress_bar=False,
                         enable_model_summary=False, val_check_interval=3, num_sanity_val_steps=0, limit_val_batches=1, callbacks=[checkpoint])
    trainer.fit(model)
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert state["kdlab_data_position"] == {"epoch": 0, "batches_done": 3, "batch_size": 2, "num_replicas": 1}


def test_a_finished_runs_last_ckpt_holds_its_final_step_when_the_save_period_does_not_divide_max_steps(tiny_pair, tmp_path):
    """Checkpoints every 2 steps, max_steps 3: FinalCheckpoint makes the step-periodic ModelCheckpoint save step 3 too,
    so last.ckpt holds the final step (before: step 2) and continuing the finished run to 5 steps trains steps 4 and 5
    only (before: 3 to 5, step 3 replayed)."""
    from kdlab.callbacks import FinalCheckpoint

    class Batches(pl.Callback):
        trained = 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.trained += 1

    def fit_to(steps, ckpt_path=None):
        counted = Batches()
        checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True, every_n_train_steps=2)
        trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                             limit_val_batches=0, default_root_dir=str(tmp_path), callbacks=[checkpoint, FinalCheckpoint(), counted])
        trainer.fit(module(tiny_pair, "offpolicy"), ckpt_path=ckpt_path)
        return counted.trained

    fit_to(3)
    last = tmp_path / "ckpt" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 3
    assert torch.load(tmp_path / "ckpt" / "epoch=0-step=3.ckpt", weights_only=True)["global_step"] == 3
    assert fit_to(5, ckpt_path=str(last)) == 2
    assert torch.load(last, weights_only=True)["global_step"] == 5


# ---- through the CLI: a resumed run's logs are the uninterrupted run's ------------------------------
SMOKE = str(Path(__file__).parents[1] / "experiments" / "tiny" / "smoke.yaml")
LOGGED = [  # validation at step 4, checkpoints every 2 steps, a callback writing metrics.jsonl every 2 steps
    "--trainer.max_steps=6", "--trainer.val_check_interval=4", "--trainer.accumulate_grad_batches=1", "--trainer.log_every_n_steps=1",
    "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint", "--trainer.callbacks.save_last=true",
    "--trainer.callbacks.every_n_train_steps=2",
    "--trainer.callbacks+=kdlab.callbacks.UpdateSparsity", "--trainer.callbacks.every_n_steps=2",
    # pass@1 before training (step 0) and at the end: a resumed run must not log a second "before"
    "--trainer.callbacks+=kdlab.callbacks.Coverage", '--trainer.callbacks.task={"class_path": "kdlab.tasks.Addition", "init_args": {"num_val": 4}}',
    "--trainer.callbacks.ks=[1]", "--trainer.callbacks.samples=1", "--trainer.callbacks.examples=4", "--trainer.callbacks.max_new_tokens=8",
]


def cli_fit(save_dir, *extra):
    from kdlab.cli.main import main

    return main(["fit", f"--config={SMOKE}", *LOGGED, f"--trainer.logger.init_args.save_dir={save_dir}", *extra])


def logged(run_dir):
    """Every TensorBoard scalar as (step, value) in logging order, metrics.jsonl, and samples/ by name."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    def written(path):  # events.out.tfevents.<seconds>.<host>.<pid>.<writer number>: by name, writer 10 sorts before 9
        parts = path.name.split(".")
        return int(parts[3]), int(parts[-1])

    scalars = {}
    for path in sorted(Path(run_dir).glob("events.out.tfevents.*"), key=written):  # in the order the files were written
        events = EventAccumulator(str(path), size_guidance={SCALARS: 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in events.Scalars(tag))
    metrics = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    samples = {p.name: p.read_text() for p in sorted(Path(run_dir, "samples").glob("*.jsonl"))}
    return scalars, metrics, samples


def interrupted_at(monkeypatch, step, hook="training_step"):
    """Ctrl-C (KeyboardInterrupt) inside ``hook`` (the training or validation step) after ``step`` optimiser steps."""
    real = getattr(DistillModule, hook)

    def interrupted(self, batch, batch_idx):
        if self.global_step == step and not self.trainer.sanity_checking:
            raise KeyboardInterrupt
        return real(self, batch, batch_idx)

    monkeypatch.setattr(DistillModule, hook, interrupted)


@pytest.fixture(autouse=True)
def clean_argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["kdlab"])


EVERY_BATCHES = ("--trainer.check_val_every_n_epoch=null",)  # validation counted in batches of the whole run (the quickstart's)


@pytest.mark.parametrize("stop, hook, resume_from, settings", [
    (3, "training_step", "on_exception.ckpt", ()), (5, "training_step", "last.ckpt", ()), (4, "validation_step", "on_exception.ckpt", ()),
    (3, "training_step", "on_exception.ckpt", EVERY_BATCHES), (4, "validation_step", "on_exception.ckpt", EVERY_BATCHES),
], ids=["on_exception", "older-last", "in-validation", "on_exception-run-batches", "in-validation-run-batches"])
def test_a_resumed_cli_run_logs_what_the_uninterrupted_run_logs_step_for_step(tmp_path, monkeypatch, capsys, stop, hook, resume_from, settings):
    """Ctrl-C at a step (or during the validation at step 4), then ``--ckpt_path`` of the on-exception
    checkpoint (nothing logged after it) or of an older last.ckpt (step 4: the interrupted run logged
    step 5 after it): the resumed run continues
    in the same version_N and its TensorBoard scalars (each at the uninterrupted run's step, once),
    metrics.jsonl and samples/ equal the uninterrupted run's; Ctrl-C named the checkpoint to resume from.
    Fails with Lightning's own resume (every train/* scalar one step late after an on-exception
    checkpoint, duplicated steps after an older one, a new version_1; with ``check_val_every_n_epoch: null``,
    validation one micro-batch early: Lightning restores its run-wide batch count one ahead)."""
    import signal

    full = cli_fit(tmp_path / "full", *settings)
    interrupted_at(monkeypatch, stop, hook)
    try:
        with pytest.raises(SystemExit):
            cli_fit(tmp_path / "part", *settings)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Lightning ignores further Ctrl-C after one
    monkeypatch.undo()
    monkeypatch.setattr("sys.argv", ["kdlab"])
    run_dir = tmp_path / "part" / "tiny-smoke" / "version_0"
    err = capsys.readouterr().err
    assert f"interrupted at step {stop}" in err and f"--ckpt_path={run_dir / 'checkpoints' / 'on_exception.ckpt'}" in err
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = cli_fit(tmp_path / "part", *settings, f"--ckpt_path={run_dir / 'checkpoints' / resume_from}")
    assert Path(resumed.trainer.log_dir) == run_dir and not (run_dir.parent / "version_1").exists()
    assert not [w for w in caught if "not resumable" in str(w.message)]  # the sampler resumes mid-epoch
    assert not [w for w in caught if "exists and is not empty" in str(w.message)]  # its own checkpoints are expected
    expected, got = logged(full.trainer.log_dir), logged(run_dir)
    assert {"train/loss", "train/kl_forward", "val/accuracy", "sparsity/1e-06", "coverage/addition/pass@1"} <= set(got[0])
    assert [step for step, _ in got[0]["coverage/addition/pass@1"]] == [0, 6]  # one "before", one "after"
    for tag, points in expected[0].items():
        assert got[0].get(tag) == points, tag
    assert set(got[0]) == set(expected[0])
    assert got[1] == expected[1]  # metrics.jsonl
    assert got[2] == expected[2] and list(got[2]) == ["val-step000004.jsonl"]
    for a, b in zip(full.model.student.parameters(), resumed.model.student.parameters()):
        assert torch.equal(a, b)


def test_a_stale_on_exception_checkpoint_is_removed_when_a_resumed_fit_ends_normally_and_kept_by_a_fresh_one(tmp_path):
    """ExceptionCheckpoint's docstring: a resumed fit's normal end removes on_exception.ckpt, so an old one never
    wins the sweep's newest-checkpoint resume; a fresh fit never removes one it found (another run's only state)."""
    import lightning.pytorch as pl

    from kdlab.callbacks import ExceptionCheckpoint

    trainer = pl.Trainer(default_root_dir=tmp_path, logger=False, accelerator="cpu")
    callback = ExceptionCheckpoint()
    callback.setup(trainer, None, "fit")
    stale = Path(callback.ckpt_path)
    assert stale.parent == tmp_path / "checkpoints"
    stale.parent.mkdir(parents=True)
    stale.write_text("old")
    callback.teardown(trainer, None, "fit")
    assert stale.exists()
    trainer.ckpt_path = str(stale.parent / "last.ckpt")
    callback.teardown(trainer, None, "fit")
    assert not stale.exists()


def test_a_fresh_fit_into_a_folder_holding_checkpoints_is_refused_and_a_resume_must_keep_the_runs_settings(tmp_path):
    """A fit without --ckpt_path whose checkpoint folder holds files (here the same version_0 again) is refused
    before training, naming the file that resumes it; its files stay. Resuming with a changed lr, batch size or
    device count is refused naming each change (the checkpoint's optimiser and data position would win);
    a longer max_steps resumes."""
    from kdlab.cli.config_errors import ConfigError

    first = cli_fit(tmp_path, "--trainer.max_steps=2")
    checkpoints = Path(first.trainer.log_dir) / "checkpoints"
    before = {path.name: path.stat().st_mtime_ns for path in checkpoints.iterdir()}
    with pytest.raises(ConfigError, match=r"already holds checkpoints of another fit .*: resume it with --ckpt_path=.*epoch=0-step=2.ckpt"):
        cli_fit(tmp_path, "--trainer.max_steps=2", "--trainer.logger.init_args.version=0")
    assert {path.name: path.stat().st_mtime_ns for path in checkpoints.iterdir()} == before
    config = (Path(first.trainer.log_dir) / "config.yaml").read_text()
    last = f"--ckpt_path={checkpoints / 'last.ckpt'}"
    with pytest.raises(ConfigError, match=r"model.batch_size: 4 -> 16; model.lr: 0.001 -> 0.5.*keeps the checkpoint's optimiser"):
        cli_fit(tmp_path, "--trainer.max_steps=4", "--model.lr=0.5", "--model.batch_size=16", last)
    with pytest.raises(ConfigError, match=r"trainer.accumulate_grad_batches: 1 -> 2"):
        cli_fit(tmp_path, "--trainer.max_steps=4", "--trainer.accumulate_grad_batches=2", last)
    assert (Path(first.trainer.log_dir) / "config.yaml").read_text() == config  # the refused resumes left it alone
    assert cli_fit(tmp_path, "--trainer.max_steps=4", last).trainer.global_step == 4


def test_a_data_position_from_another_batch_size_or_process_count_is_refused_mid_epoch():
    from kdlab.errors import ConfigError
    from kdlab.stages.loaders import check_data_position

    saved = {"epoch": 0, "batches_done": 3, "batch_size": 4, "num_replicas": 1}
    check_data_position(saved, 4, 1)
    check_data_position({**saved, "batches_done": 0}, 16, 2)  # at an epoch's start nothing is skipped
    check_data_position({"epoch": 0, "batches_done": 3}, 16, 2)  # saved before these were recorded
    with pytest.raises(ConfigError, match=r"3 batches into epoch 0 with other data settings \(batch_size 4 -> 16, processes 1 -> 2\)"):
        check_data_position(saved, 16, 2)


def test_a_missing_or_broken_ckpt_path_is_named_before_any_model_loads(tmp_path, monkeypatch):
    from kdlab.cli.config_errors import ConfigError
    from kdlab.models import loading

    monkeypatch.setattr(loading, "load_causal_lm", lambda *a, **k: pytest.fail("a model loaded"))
    broken = tmp_path / "broken.ckpt"
    broken.write_bytes(b"PK\x03\x04 not a whole archive")
    for path, message in ((tmp_path / "nope.ckpt", "no such file or folder"), (broken, "is not a PyTorch checkpoint"),
                          (Path(SMOKE), "is not a PyTorch checkpoint")):
        with pytest.raises(ConfigError, match=message):
            cli_fit(tmp_path, f"--ckpt_path={path}")
    assert not list(tmp_path.rglob("version_*"))


def test_final_ckpt_is_written_after_every_end_of_fit_evaluation_so_a_run_failing_in_one_reads_unfinished(tmp_path):
    """final.ckpt, the done marker of kdlab report and sweep, comes after the callbacks' on_train_end (an
    evaluation there that fails, or a kill while it runs, leaves no final.ckpt: the run reads unfinished)."""
    import lightning.pytorch as pl

    from kdlab.callbacks import FinalCheckpoint
    from kdlab.study.runs import DONE_MARKERS, run_status

    class FailingEvaluation(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            raise RuntimeError("the end-of-fit evaluation failed")

    module = DistillModule("kdlab://tiny-random/student", "kdlab://tiny-random/teacher", task=Addition(num_train=4),
                           max_completion_tokens=4, batch_size=2, val_examples=2)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, limit_val_batches=0, callbacks=[FinalCheckpoint(), FailingEvaluation()])
    with pytest.raises(RuntimeError, match="end-of-fit evaluation failed"):
        trainer.fit(module)
    assert not (tmp_path / "checkpoints" / "final.ckpt").exists()
    assert "checkpoints/final.ckpt" in DONE_MARKERS and run_status(tmp_path, {"trainer": {"max_steps": 1}}, {})[0].startswith("unfinished")


@pytest.mark.parametrize("size, seed, replicas, rank, epoch, order", [
    (10, 42, 1, 0, 0, [8, 4, 0, 7, 5, 2, 6, 1, 9, 3]),
    (10, 42, 3, 1, 2, [7, 9, 1, 8]),
    (3, 5, 8, 7, 1, [1]),
])
def test_epoch_shuffle_on_distributed_sampler_keeps_the_orders_of_earlier_runs(size, seed, replicas, rank, epoch, order):
    """EpochShuffle became DistributedSampler plus the mid-epoch skip; these orders were drawn by the
    hand-written sampler it replaced, so runs resumed across the change see the same data."""
    from kdlab.stages.loaders import EpochShuffle

    sampler = EpochShuffle(size, seed, replicas, rank)
    sampler.set_epoch(epoch)
    assert list(sampler) == order
    sampler.skip = 1
    assert list(sampler) == order[1:] and list(sampler) == order  # the skip applies to one pass only


def test_final_ckpt_is_weights_only_so_a_fit_resumes_from_last_ckpt_which_links_to_the_full_state(tmp_path):
    """final.ckpt holds the weights (the next stage reads them), not the optimiser: --ckpt_path of it fails
    at the restore naming the files that resume, and leaves the run's logs alone; last.ckpt, a link to
    the newest full state, continues the finished run in the same version_N. With checkpoints every 2 steps and
    max_steps 5, the newest full state is the final step's (saved though 2 does not divide 5)."""
    from kdlab.cli.config_errors import ConfigError

    first = cli_fit(tmp_path, "--trainer.max_steps=5")
    run_dir = Path(first.trainer.log_dir)
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "last.ckpt").is_symlink() and (checkpoints / "last.ckpt").resolve().name == "epoch=0-step=5.ckpt"
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 5
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    with pytest.raises(ConfigError, match=r"final.ckpt' holds the weights only \(no optimiser state\), so it cannot resume a fit; "
                                          r"resume from a full state \(.*last.ckpt.*--model.student.checkpoint=.*final.ckpt"):
        cli_fit(tmp_path, f"--ckpt_path={checkpoints / 'final.ckpt'}")
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics  # nothing trimmed
    resumed = cli_fit(tmp_path, f"--ckpt_path={checkpoints / 'last.ckpt'}")
    assert resumed.trainer.global_step == 6 and Path(resumed.trainer.log_dir) == run_dir
    assert (checkpoints / "last.ckpt").resolve().name == "epoch=0-step=6.ckpt"
    assert torch.load(checkpoints / "final.ckpt", weights_only=True)["global_step"] == 6


def test_a_resume_does_not_read_its_checkpoint_whole_before_the_restore(tmp_path, monkeypatch):
    """LightningCLI reads the whole --ckpt_path file (by its path) for hyperparameters kdlab's stages never save;
    kdlab opens it memory-mapped instead, so only the restore itself (through an open file) reads it whole."""
    first = cli_fit(tmp_path, "--trainer.max_steps=2")
    last = Path(first.trainer.log_dir) / "checkpoints" / "last.ckpt"
    whole = []
    real = torch.load

    def load(path, *args, **kwargs):
        if Path(str(path)).resolve() == last.resolve() and not kwargs.get("mmap"):
            whole.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    assert cli_fit(tmp_path, "--trainer.max_steps=3", f"--ckpt_path={last}").trainer.global_step == 3
    assert whole == []


def test_changed_settings_sees_components_switched_and_ignores_spellings_and_operational_keys():
    from kdlab.cli.resume import changed_settings

    base = {"model": {"lr": 1e-3, "objective": None, "val_batch_size": 8,
                      "teacher": {"class_path": "kdlab.teachers.Served", "init_args": {"server": {"url": "http://a:1", "top_k": 20}}},
                      "rollout": {"class_path": "kdlab.rollouts.StudentRollouts"}},
            "trainer": {"devices": "auto", "precision": "32", "accumulate_grad_batches": 1}}

    def changed(**model):
        return changed_settings(base, {**base, "model": {**base["model"], **model}})

    assert changed(objective={"class_path": "kdlab.objectives.ReverseKL"}) == ["model.objective: None -> 'kdlab.objectives.ReverseKL'"]
    assert changed_settings({**base, "model": {**base["model"], "objective": {"class_path": "kdlab.objectives.ReverseKL"}}}, base) == [
        "model.objective: 'kdlab.objectives.ReverseKL' -> None"]
    assert changed(rollout={"class_path": "kdlab.rollouts.policies.StudentRollouts"}) == []  # one class, two spellings
    assert changed(val_batch_size=32, teacher={"class_path": "kdlab.teachers.Served", "init_args": {"server": {"url": "http://b:2", "top_k": 20}}}) == []
    assert changed(teacher={"class_path": "kdlab.teachers.Served", "init_args": {"server": {"url": "http://a:1", "top_k": 5}}}) == [
        "model.teacher.init_args.server.top_k: 20 -> 5"]
    assert changed_settings(base, {**base, "trainer": {"devices": 8, "precision": "32-true", "accumulate_grad_batches": 1}}) == []
    assert changed_settings(base, {**base, "trainer": {"devices": 8, "precision": "bf16-mixed", "accumulate_grad_batches": 1}}) == [
        "trainer.precision: '32-true' -> 'bf16-mixed'"]


def test_a_failed_fresh_fit_never_removes_a_folder_another_run_left(tmp_path):
    """A fit that stops before its first step removes the version_N folder it opened, never one that was there
    (an explicit logger version naming an earlier run's folder: its logs stay)."""
    earlier = tmp_path / "tiny-smoke" / "version_0"
    earlier.mkdir(parents=True)
    (earlier / "metrics.jsonl").write_text('{"step": 1, "train/loss": 1.0}\n')
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        cli_fit(tmp_path, "--trainer.logger.init_args.version=0", "--model.max_prompt_tokens=2")
    assert (earlier / "metrics.jsonl").is_file()


@pytest.mark.parametrize("policy", ["offpolicy", "onpolicy"])
def test_a_fit_stopped_inside_an_accumulation_window_resumes_to_the_uninterrupted_weights(tiny_pair, tmp_path, monkeypatch, policy):
    """A preemption (SIGTERM) or crash lands between micro-batches of an optimiser step far more often than at
    its end (8 micro-batches a step on one GPU in the paper's presets). The step's accumulated gradient is not
    in the checkpoint, so the resumed fit must replay the whole window, not train the step on its remaining
    micro-batches alone."""
    from kdlab.callbacks import ExceptionCheckpoint

    def trainer(root, steps):
        return pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                          limit_val_batches=0, default_root_dir=str(root), accumulate_grad_batches=2,
                          callbacks=[ExceptionCheckpoint()])

    total = 3  # 8 prompts in micro-batches of 2, two per step: two steps an epoch, the resume crosses into the next
    pl.seed_everything(0)
    uninterrupted = module(tiny_pair, policy)
    trainer(tmp_path / "full", total).fit(uninterrupted)
    real = DistillModule.training_step

    def stopped(self, batch, batch_idx):
        if self.global_step == 1 and batch_idx == 3:  # the second micro-batch of step 2: the first one is processed
            raise RuntimeError("preempted")
        return real(self, batch, batch_idx)

    monkeypatch.setattr(DistillModule, "training_step", stopped)
    pl.seed_everything(0)
    with pytest.raises(RuntimeError, match="preempted"):
        trainer(tmp_path / "part", total).fit(module(tiny_pair, policy))
    monkeypatch.undo()
    saved = tmp_path / "part" / "checkpoints" / "on_exception.ckpt"
    assert torch.load(saved, weights_only=True)["kdlab_data_position"]["batches_done"] == 2  # the window's start
    pl.seed_everything(123)
    resumed = module(tiny_pair, policy)
    trainer(tmp_path / "part", total).fit(resumed, ckpt_path=str(saved))
    for a, b in zip(uninterrupted.student.parameters(), resumed.student.parameters()):
        assert torch.equal(a, b)


def test_a_fresh_fit_under_slurm_is_refused_where_lightnings_requeue_state_would_resume_it(tmp_path, monkeypatch):
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    from kdlab.cli.config_errors import ConfigError

    (tmp_path / "hpc_ckpt_1.ckpt").write_bytes(b"another run's state")
    monkeypatch.setattr(SLURMEnvironment, "detect", staticmethod(lambda: True))
    with pytest.raises(ConfigError, match=r"hpc_ckpt_1.ckpt is Lightning's SLURM requeue state"):
        cli_fit(tmp_path, f"--trainer.default_root_dir={tmp_path}")
    monkeypatch.setattr(SLURMEnvironment, "detect", staticmethod(lambda: False))  # outside SLURM Lightning ignores it
    assert cli_fit(tmp_path, f"--trainer.default_root_dir={tmp_path}", "--trainer.max_steps=1").trainer.global_step == 1


def test_under_a_strategy_that_restores_after_setup_a_resume_keeps_the_ood_before_and_refuses_weights_only(tiny_pair, tmp_path):
    """FSDP1 and FSDP2 (``restore_checkpoint_after_setup``) read the checkpoint after ``on_fit_start`` (``trainer.ckpt_path``
    is still None there): OODForgetting's "before" is not measured again on the resume (its state arrives later), nor
    Coverage's, and FinalCheckpoint reads the file the fit resumes from to refuse a weights-only one. A CPU stand-in
    strategy restores as late as they do."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from kdlab.callbacks import Coverage, FinalCheckpoint, OODForgetting
    from kdlab.errors import ConfigError

    class LateRestore(SingleDeviceStrategy):
        @property
        def restore_checkpoint_after_setup(self) -> bool:
            return True

    measured = []

    def run(steps, strategy="auto", ckpt_path=None):
        ood = OODForgetting([Addition(num_val=2, seed=1)], examples=2)
        ood.scores = lambda pl_module: measured.append(steps) or {"addition": float(10 * len(measured))}
        coverage = Coverage(Addition(num_val=2, seed=1), ks=(1,), samples=1, examples=2)
        coverage.scores = lambda trainer, pl_module: measured.append(f"coverage {steps}") or {"coverage/addition/pass@1": 0.5}
        checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True, every_n_train_steps=1)
        trainer = pl.Trainer(max_steps=steps, accelerator="cpu", strategy=strategy, logger=False, default_root_dir=str(tmp_path), enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=0, callbacks=[FinalCheckpoint(), ood, coverage, checkpoint])
        trainer.fit(module(tiny_pair, "offpolicy"), ckpt_path=ckpt_path)
        return ood

    pl.seed_everything(0)
    assert run(2).before == {"addition": 10.0} and measured == [2, "coverage 2", 2, "coverage 2"]  # before training, and at its end
    with pytest.raises(ConfigError, match=r"final.ckpt' holds the weights only \(no optimiser state\), so it cannot resume a fit"):
        run(3, LateRestore(torch.device("cpu")), ckpt_path=str(tmp_path / "ckpt" / "final.ckpt"))
    resumed = run(3, LateRestore(torch.device("cpu")), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert measured[4:] == [3, "coverage 3"]  # the end of the resumed fit alone
    assert resumed.before == {"addition": 10.0}  # the first run's, restored after on_fit_start

