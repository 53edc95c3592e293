"""End-to-end: ``kdlab fit --config`` on the packaged tiny pair, for every rollout policy x objective."""

from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from kdlab.cli import main

SMOKE = str(Path(__file__).parents[1] / "experiments" / "tiny" / "smoke.yaml")

ROLLOUTS = {
    "offpolicy": ["--model.rollout=kdlab.rollouts.TeacherRollouts"],
    "onpolicy": ["--model.rollout=kdlab.rollouts.StudentRollouts"],
    "mixture": ["--model.rollout=kdlab.rollouts.MixtureRollouts", "--model.rollout.lam=0.5"],
}
OBJECTIVES = {
    "fkl": ["--model.objective=kdlab.objectives.ForwardKL"],
    "rkl": ["--model.objective=kdlab.objectives.ReverseKL"],
    "sfkl": ["--model.objective=kdlab.objectives.SampledForwardKL"],
    "srkl": ["--model.objective=kdlab.objectives.SampledReverseKL"],
    "jsd": ["--model.objective=kdlab.objectives.GeneralizedJSD", "--model.objective.beta=0.5"],
    "tv": ["--model.objective=kdlab.objectives.TotalVariation"],
}


@pytest.fixture(autouse=True)
def clean_argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["kdlab"])


def fit(tmp_path, *extra):
    args = [
        "fit",
        f"--config={SMOKE}",
        "--trainer.max_steps=2",
        "--trainer.val_check_interval=4",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        *extra,
    ]
    return main(args)


def scalars(log_dir):
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("rollout", ROLLOUTS)
def test_fit_runs_end_to_end_for_each_rollout_and_objective(tmp_path, rollout, objective):
    cli = fit(tmp_path, *ROLLOUTS[rollout], *OBJECTIVES[objective])
    assert cli.trainer.global_step == 2
    logged = scalars(cli.trainer.log_dir)
    for tag in ("train/loss", "train/kl_forward", "train/kl_reverse", "train/grad_norm", "train/completion_length", "val/accuracy"):
        assert tag in logged, tag
        assert all(torch.isfinite(torch.tensor(logged[tag])))
    assert "train/rollout_entropy" in logged  # every policy here samples online
    checkpoints = list(Path(cli.trainer.log_dir, "checkpoints").glob("*.ckpt"))
    assert checkpoints
    assert Path(cli.trainer.log_dir, "config.yaml").is_file()


def test_checkpoint_holds_the_student_but_not_the_teacher_and_reloads(tmp_path):
    cli = fit(tmp_path)
    checkpoint = Path(cli.trainer.log_dir, "checkpoints", "final.ckpt")
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    assert any(k.startswith("student.") for k in state)
    assert not any(k.startswith("teacher.") for k in state)
    fresh = cli.model.__class__(cli.model.student_spec, cli.model.teacher_spec, cli.model.task)
    fresh.load_state_dict(state)
    for name, value in fresh.student.state_dict().items():
        assert torch.equal(value, cli.model.student.state_dict()[name])


def test_evaluation_writes_per_example_jsonl(tmp_path):
    cli = fit(tmp_path)
    files = sorted(Path(cli.trainer.log_dir, "samples").glob("val-*.jsonl"))
    assert files
    lines = files[-1].read_text().splitlines()
    assert len(lines) == 8 and '"completion"' in lines[0] and '"score"' in lines[0]


def test_validate_and_test_subcommands(tmp_path):
    for command in ("validate", "test"):
        cli = main([command, f"--config={SMOKE}", f"--trainer.logger.init_args.save_dir={tmp_path}"])
        assert f"{command[:4] if command == 'test' else 'val'}/accuracy" in cli.trainer.callback_metrics


def test_print_config_lists_every_component_knob(capsys):
    with pytest.raises(SystemExit):
        main(["fit", f"--config={SMOKE}", "--model.rollout=kdlab.rollouts.MixtureRollouts", "--print_config"])
    printed = capsys.readouterr().out
    for key in ("lam:", "alpha:", "clip:", "teacher_temperature:", "chunk_size:", "max_digits:"):
        assert key in printed, key


def test_unknown_key_and_bad_value_fail_before_training(tmp_path, capsys):
    with pytest.raises(SystemExit):
        fit(tmp_path, "--model.rollout=kdlab.rollouts.MixtureRollouts", "--model.rollout.lamda=0.5")
    assert "lamda" in capsys.readouterr().err
    with pytest.raises((SystemExit, ValueError)) as error:
        fit(tmp_path, "--model.rollout=kdlab.rollouts.MixtureRollouts", "--model.rollout.lam=3.0")
    message = str(error.value) + capsys.readouterr().err
    assert "lam must be in [-2, 2]" in message
    assert not list(Path(tmp_path).rglob("*.ckpt"))


def test_generate_subcommand_writes_a_dataset_teacher_rollouts_reads(tmp_path):
    from kdlab.rollouts import read_completions

    config = tmp_path / "generate.yaml"
    config.write_text(
        "teacher: {path: kdlab://tiny-random/teacher}\n"
        "task: {class_path: kdlab.tasks.Addition, init_args: {num_train: 3}}\n"
        f"output: {tmp_path}/out/teacher.jsonl\nmax_new_tokens: 4\n"
    )
    summary = main(["generate", f"--config={config}"])
    assert summary["prompts"] == 3 and summary["kept"] == 3
    assert set(read_completions(f"{tmp_path}/out/teacher.jsonl")) == {"add-train-0", "add-train-1", "add-train-2"}


def test_unknown_class_path_is_rejected_before_training(tmp_path, capsys):
    with pytest.raises(SystemExit):
        fit(tmp_path, "--model.objective=kdlab.objectives.NoSuchKL")
    assert "NoSuchKL" in capsys.readouterr().err


def test_run_directory_records_versions_and_git_state(tmp_path):
    import json

    cli = fit(tmp_path, "--trainer.max_steps=1")
    info = json.loads(Path(cli.trainer.log_dir, "run_info.json").read_text())
    assert info["kdlab"] and info["packages"]["torch"] and info["packages"]["lightning"]
    assert "git_commit" in info and "git_dirty" in info


QUICKSTART = str(Path(__file__).parents[1] / "experiments" / "tiny" / "quickstart.yaml")


def test_quickstart_runs_offline_on_the_packaged_world(tmp_path):
    cli = main(["fit", f"--config={QUICKSTART}", "--trainer.max_steps=2", "--trainer.val_check_interval=2",
                "--model.val_examples=8", "--trainer.callbacks=[]", f"--trainer.logger.init_args.save_dir={tmp_path}"])
    assert cli.trainer.global_step == 2 and "val/accuracy" in cli.trainer.callback_metrics


@pytest.mark.slow
def test_full_quickstart_with_all_its_callbacks(tmp_path):
    cli = main(["fit", f"--config={QUICKSTART}", f"--trainer.logger.init_args.save_dir={tmp_path}"])
    rows = [__import__("json").loads(line) for line in Path(cli.trainer.log_dir, "metrics.jsonl").read_text().splitlines()]
    keys = set().union(*rows)
    assert {"coverage/countdown3/pass@1", "ood/mean_delta", "sparsity/1e-06"} <= keys


def test_fit_always_leaves_a_checkpoint_of_its_final_step(tmp_path):
    cli = fit(tmp_path, "--trainer.max_steps=3", "--trainer.limit_val_batches=0")  # stops mid-epoch, no validation
    final = Path(cli.trainer.log_dir, "checkpoints", "final.ckpt")
    state = torch.load(final, map_location="cpu", weights_only=True)
    assert state["global_step"] == 3
    for name, value in cli.model.student.state_dict().items():
        assert torch.equal(state["state_dict"][f"student.{name}"], value)


def test_a_run_that_raises_leaves_its_last_state(tmp_path):
    with pytest.raises(RuntimeError, match="consecutive"):
        fit(tmp_path, "--trainer.max_steps=5", "--trainer.limit_val_batches=0", "--model.max_bad_steps=1",
            "--model.objective=kdlab.objectives.ForwardKL", "--model.lr=1.0e+30", "--model.warmup_steps=0")
    assert list(Path(tmp_path).rglob("on_exception.ckpt"))


def test_resuming_reads_the_checkpoint_with_weights_only(tmp_path, monkeypatch):
    """kdlab fit --ckpt_path loads with torch.load(weights_only=True): no arbitrary unpickling."""
    import torch

    first = fit(tmp_path)
    checkpoint = next(Path(first.trainer.log_dir, "checkpoints").glob("final.ckpt"))
    calls = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    resumed = fit(tmp_path, "--trainer.max_steps=3", f"--ckpt_path={checkpoint}")
    assert resumed.trainer.global_step == 3
    assert calls and all(flag is True for flag in calls)


def test_the_same_config_and_seed_give_identical_metrics_and_another_seed_differs(tmp_path):
    """Two runs of one config (on-policy mixture rollouts, sampled-KL draws) log the same numbers bit for
    bit; --seed_everything changes them."""
    runs = {}
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        cli = fit(tmp_path / name, "--model.rollout=kdlab.rollouts.MixtureRollouts", "--model.rollout.lam=0.5",
                  "--model.objective=kdlab.objectives.SampledReverseKL", f"--seed_everything={seed}", "--trainer.log_every_n_steps=1")
        runs[name] = scalars(cli.trainer.log_dir)
    assert "train/loss" in runs["a"] and "train/kl_forward" in runs["a"]
    assert runs["a"] == runs["b"]
    assert runs["a"]["train/kl_forward"] != runs["c"]["train/kl_forward"]
