"""``kdlab sweep``: grid expansion and names, print mode, and real tiny sweeps that skip, resume and fail."""

import json
import re
import shlex
import shutil
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from lightning.pytorch import Callback

import kdlab.cli.lightning
from kdlab.cli.main import main
from kdlab.study.grid import Sweep, expand, fit_args, load_sweep, short_keys

ROOT = Path(__file__).parents[1]
SMOKE = str(ROOT / "experiments" / "tiny" / "smoke.yaml")
FKL = {"class_path": "kdlab.objectives.ForwardKL"}
RKL = {"class_path": "kdlab.objectives.ReverseKL"}
TEACHER = {"class_path": "kdlab.rollouts.TeacherRollouts"}
STUDENT = {"class_path": "kdlab.rollouts.StudentRollouts"}
FAST = {  # one optimiser step of one micro-batch, no validation, a last.ckpt to resume from
    "trainer.max_steps": 1,
    "trainer.limit_val_batches": 0,  # no validation (a run shorter than its interval would validate after its last step)
    "trainer.accumulate_grad_batches": 1,
    "trainer.enable_progress_bar": False,
    "trainer.enable_model_summary": False,
    "trainer.callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"save_last": True}}],
    "model.max_completion_tokens": 4,
}


@pytest.fixture(autouse=True)
def clean_argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["kdlab"])


@pytest.fixture
def fits(monkeypatch):
    """The argument lists of every in-process ``kdlab fit`` the sweep starts."""
    calls, real = [], kdlab.cli.lightning.run_lightning
    monkeypatch.setattr(kdlab.cli.lightning, "run_lightning", lambda args, **kw: calls.append(list(args)) or real(args, **kw))
    return calls


def write_sweep(tmp_path, grid, seeds=(42,), **extra):
    data = {"base": SMOKE, "output": str(tmp_path / "out"), "grid": grid, "seeds": list(seeds), "overrides": FAST, **extra}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def statuses(tmp_path):
    return {run["name"]: run["status"] for run in json.loads((tmp_path / "out" / "sweep.json").read_text())["runs"]}


# ---- expansion, names, arguments --------------------------------------------------------------
def test_grid_expands_to_product_times_seeds_with_readable_names(tmp_path):
    grid = {"model.rollout": [TEACHER, STUDENT], "model.objective": [FKL, RKL], "model.lr": [1.0e-3, 5.0e-3]}
    runs = expand(Sweep(base=SMOKE, output=str(tmp_path), grid=grid, seeds=[42, 43, 44]))
    names = [run.name for run in runs]
    assert len(runs) == 24 == len(set(names))
    assert names[0] == "rollout=TeacherRollouts-objective=ForwardKL-lr=0.001-seed=42"
    assert "rollout=StudentRollouts-objective=ReverseKL-lr=0.005-seed=43" in names
    assert [run.seed for run in runs] == [42] * 8 + [43] * 8 + [44] * 8  # seed by seed
    assert runs[1].settings == {"model.rollout": TEACHER, "model.objective": FKL, "model.lr": 0.005}
    assert expand(Sweep(base=SMOKE, output=str(tmp_path), grid=grid, seeds=[42, 43, 44]))[5].name == names[5]  # deterministic


def test_names_stay_unique_short_and_filesystem_safe(tmp_path):
    mixture = {"class_path": "kdlab.rollouts.MixtureRollouts", "init_args": {"lam": -0.5}}
    grid = {
        "model.rollout": [mixture, "kdlab.rollouts.StudentRollouts"],
        "model.task.init_args.path": ["data/a b", "data_a_b", "x" * 300],  # the first two read the same once made safe
    }
    names = [run.name for run in expand(Sweep(base=SMOKE, output=str(tmp_path), grid=grid))]
    assert len(set(names)) == len(names) == 6
    assert all(re.fullmatch(r"[A-Za-z0-9._=+-]+", name) and len(name) <= 160 for name in names)
    assert names[0].startswith("rollout=MixtureRollouts_lam=-0.5-path=data_a_b-seed=42-")  # hash-suffixed
    assert names[3].startswith("rollout=StudentRollouts-path=data_a_b-")
    keys = ["model.rollout.init_args.lam", "model.task.init_args.lam", "model.lr"]
    assert short_keys(keys) == {"model.rollout.init_args.lam": "rollout.lam", "model.task.init_args.lam": "task.lam", "model.lr": "lr"}


def test_fit_arguments_put_parents_first_and_log_to_the_run_directory(tmp_path):
    mixture = {"class_path": "kdlab.rollouts.MixtureRollouts"}
    sweep = Sweep(base=SMOKE, output=str(tmp_path), grid={"model.rollout.init_args.lam": [0.5], "model.rollout": [mixture]}, seeds=[43], overrides={"trainer.max_steps": 2})
    (run,) = expand(sweep)
    assert run.name == "lam=0.5-rollout=MixtureRollouts-seed=43"
    args = fit_args(sweep, run, ckpt_path="last.ckpt")
    assert args[:3] == ["fit", f"--config={SMOKE}", "--trainer.max_steps=2"]
    assert args.index('--model.rollout={"class_path": "kdlab.rollouts.MixtureRollouts"}') < args.index("--model.rollout.init_args.lam=0.5")
    assert "--seed_everything=43" in args and args[-1] == "--ckpt_path=last.ckpt"
    (logger,) = [json.loads(a.split("=", 1)[1]) for a in args if a.startswith("--trainer.logger=")]
    assert logger["init_args"] == {"save_dir": str(tmp_path), "name": run.name, "version": ""}


def test_the_smoke_sweep_file_expands_to_runs_the_fit_cli_accepts(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # its paths are relative to the repository root
    sweep = load_sweep("experiments/tiny/sweep_smoke.yaml")
    runs = expand(sweep)
    assert len(runs) == 16 and len({run.name for run in runs}) == 16
    for run in (runs[0], runs[-1]):  # between them every grid value and seed appears
        with pytest.raises(SystemExit) as exit_info:
            main([*fit_args(sweep, run), "--print_config"])
        assert exit_info.value.code in (0, None)
        printed = yaml.safe_load(capsys.readouterr().out)
        assert printed["trainer"]["logger"]["init_args"]["name"] == run.name
        assert printed["model"]["rollout"]["class_path"] == run.settings["model.rollout"]["class_path"]
        assert printed["seed_everything"] == run.seed


# ---- bad sweep files ---------------------------------------------------------------------------
BAD = {
    "missing base file": ({"base": "no/such.yaml"}, r"sweep\.base: no such file 'no/such.yaml'"),
    "missing output": ({"output": None}, r"the key 'output' is missing"),
    "empty grid list": ({"grid": {"model.lr": []}}, r"sweep\.grid\['model\.lr'\] must be a non-empty list"),
    "unknown mode": ({"mode": "parallel"}, r"sweep\.mode must be one of sequential, processes, print, slurm, got 'parallel'"),
    "seeds not ints": ({"seeds": [42, "43"]}, r"sweep\.seeds must be a non-empty list of ints"),
    "seeds not a list": ({"seeds": 42}, r"sweep\.seeds must be a non-empty list of ints, got 42"),
    "unknown key": ({"seed": [1]}, r"unknown key 'seed'"),
    "reserved key": ({"grid": {"seed_everything": [1, 2]}}, r"sweep\.grid\['seed_everything'\] is set by the sweep"),
    "key in grid and overrides": ({"overrides": {"model.lr": 0.1}}, r"sweep\.overrides\['model\.lr'\] is also a grid key"),
    "dashes in a key": ({"grid": {"--model.lr": [0.1]}}, r"sweep\.grid: '--model\.lr' is not a dotted fit key"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_sweep_files_name_the_key(tmp_path, case):
    change, message = BAD[case]
    data = {"base": SMOKE, "output": str(tmp_path / "out"), "grid": {"model.lr": [0.1]}, **change}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in data.items() if v is not None}))
    with pytest.raises(ValueError, match=message):
        load_sweep(path)


def test_bad_sweep_file_on_the_command_line_is_a_usage_error(tmp_path, capsys):
    path = write_sweep(tmp_path, {"model.lr": [0.1]}, mode="parallel")
    with pytest.raises(SystemExit) as exit_info:
        main(["sweep", "--config", str(path)])
    assert exit_info.value.code == 2 and "sweep.mode" in capsys.readouterr().err


BAD_GRIDS = {  # a key no fit has, and a value of the wrong type after a good one
    "misspelt key": ({"model.lrr": [1.0e-3, 2.0e-3]}, {},
                     "run lrr=0.001-seed=42: model.lrr: no such key for kdlab fit (did you mean 'model.lr'?)"),
    "bad value": ({"model.lr": [1.0e-3, "fast"]}, {}, "run lr=fast-seed=42: model.lr: Expected a <class 'float'>. Got value: fast"),
    "misspelt override": ({"model.lr": [1.0e-3]}, {"trainer.max_step": 1},
                          "run lr=0.001-seed=42: trainer.max_step: no such key for kdlab fit (did you mean 'trainer.max_steps'?)"),
}


@pytest.mark.parametrize("case", BAD_GRIDS)
@pytest.mark.parametrize("mode", ["sequential", "processes", "print"])
def test_a_bad_grid_key_or_value_fails_in_one_line_before_any_run_starts(tmp_path, capsys, fits, case, mode):
    """No fit in this process (``fits``), and no output folder: no sweep.json, no run folder or fit.log of a process."""
    grid, overrides, message = BAD_GRIDS[case]
    path = write_sweep(tmp_path, grid, overrides={**FAST, **overrides}, mode=mode)
    with pytest.raises(SystemExit) as exit_info:
        main(["sweep", "--config", str(path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and fits == []
    assert err.splitlines() == [f"kdlab sweep: error: {message}"]  # one line: no usage, no traceback
    assert not (tmp_path / "out").exists()


def test_a_bad_value_in_one_run_fails_its_run_line_in_one_line_before_it_fits(tmp_path, capsys, fits):
    path = write_sweep(tmp_path, {"model.lr": [1.0e-3, "fast"]})
    with pytest.raises(SystemExit) as exit_info:
        main(["sweep", "--config", str(path), "--run", "lr=fast-seed=42"])
    assert exit_info.value.code == 2 and fits == []
    assert capsys.readouterr().err.splitlines() == [
        "kdlab sweep: error: run lr=fast-seed=42: model.lr: Expected a <class 'float'>. Got value: fast"]


# ---- print mode --------------------------------------------------------------------------------
def test_print_mode_writes_one_command_per_run_that_runs_it(tmp_path, capsys, fits):
    path = write_sweep(tmp_path, {"model.objective": [FKL, RKL], "model.lr": [1.0e-3, 5.0e-3]}, seeds=[42, 43], mode="print")
    main(["sweep", "--config", str(path)])
    lines = capsys.readouterr().out.splitlines()
    out = tmp_path / "out"
    assert lines == (out / "commands.sh").read_text().splitlines() and len(lines) == 8
    names = [run.name for run in expand(load_sweep(path))]
    for line, name in zip(lines, names):
        assert shlex.split(line) == ["python", "-m", "kdlab.cli", "sweep", "--config", str(path), "--run", name]
    assert sorted(p.name for p in out.iterdir()) == ["commands.sh", "sweep.json"] and not fits
    assert set(statuses(tmp_path).values()) == {"pending"}

    main(shlex.split(lines[2])[3:])  # what one scheduler task runs
    assert len(fits) == 1 and (out / names[2] / "DONE").is_file()
    main(shlex.split(lines[2])[3:])  # a second launch of a done run does nothing
    assert len(fits) == 1
    capsys.readouterr()
    main(["sweep", "--config", str(path)])
    assert len(capsys.readouterr().out.splitlines()) == 7 and statuses(tmp_path)[names[2]] == "skipped"
    assert (out / "commands.sh").read_text().splitlines() == lines  # line N is still run N (a requeued array index)


# ---- real tiny sweeps --------------------------------------------------------------------------
def test_sequential_sweep_runs_then_skips_then_recovers_interrupted_runs(tmp_path, fits):
    path = write_sweep(tmp_path, {"model.objective": [FKL, RKL]})
    main(["sweep", "--config", str(path)])
    out = tmp_path / "out"
    first, second = names = ["objective=ForwardKL-seed=42", "objective=ReverseKL-seed=42"]
    assert len(fits) == 2
    for name in names:  # the logger's directory is exactly <output>/<name>
        run_dir = out / name
        assert (run_dir / "config.yaml").is_file() and list(run_dir.glob("events.out.tfevents.*"))
        assert (run_dir / "checkpoints" / "last.ckpt").is_file() and not list(run_dir.glob("version_*"))
        assert json.loads((run_dir / "DONE").read_text())["global_step"] == 1
    config = yaml.safe_load((out / second / "config.yaml").read_text())
    assert config["model"]["objective"]["class_path"] == "kdlab.objectives.ReverseKL" and config["seed_everything"] == 42
    assert json.loads((out / second / "run_info.json").read_text())["argv"][1] == "fit"  # the run's own command line
    assert statuses(tmp_path) == {first: "done", second: "done"}

    finished = {name: (out / name / "DONE").stat().st_mtime_ns for name in names}
    main(["sweep", "--config", str(path)])  # everything done: nothing runs
    assert len(fits) == 2 and finished == {name: (out / name / "DONE").stat().st_mtime_ns for name in names}
    assert statuses(tmp_path) == {first: "skipped", second: "skipped"}

    (out / first / "DONE").unlink()  # interrupted after its last checkpoint: resumed from it
    (out / second / "DONE").unlink()  # interrupted before any checkpoint: started again from scratch
    shutil.rmtree(out / second / "checkpoints")
    (out / second / "leftover").write_text("from the interrupted attempt")
    main(["sweep", "--config", str(path)])
    # its newest checkpoint: last.ckpt or the file of its last step it links to (same state, same time)
    assert len(fits) == 4 and any(a.startswith("--ckpt_path=") and a.endswith(("last.ckpt", "step=1.ckpt")) for a in fits[2])
    assert json.loads((out / first / "DONE").read_text())["resumed_from"].endswith(("last.ckpt", "step=1.ckpt"))
    assert json.loads((out / second / "DONE").read_text())["resumed_from"] is None
    assert not (out / second / "leftover").exists()


@pytest.mark.parametrize("runs, summary, failure", [(1, "[sweep] 1 run: 0 done now", "1 of 1 run failed"),
                                                     (2, "[sweep] 2 runs: 1 done now", "1 of 2 runs failed")])
def test_the_sweeps_counts_are_pluralised(tmp_path, capsys, monkeypatch, runs, summary, failure):
    """The summary and failure lines say "1 run" and "2 runs" (kdlab.study.tables.counted); the lines read "1 runs"
    before. Print mode's line counts its commands the same way."""
    import kdlab.study.sweep

    path = write_sweep(tmp_path, {"model.lr": [1.0e-3, 2.0e-3][:runs]})
    records = [{"name": run.name, "status": "done", "error": None} for run in expand(load_sweep(path))]
    records[0].update(status="failed", error="boom")
    monkeypatch.setattr(kdlab.study.sweep, "run_sweep", lambda sweep, config: records)
    with pytest.raises(SystemExit):
        main(["sweep", "--config", str(path)])
    captured = capsys.readouterr()
    assert summary in captured.out and failure in captured.err
    monkeypatch.undo()
    main(["sweep", "--config", str(path), "--mode", "print"])
    assert f"[sweep] {runs} {'command' if runs == 1 else 'commands'} in " in capsys.readouterr().err


def test_a_failing_run_is_reported_and_the_sweep_goes_on(tmp_path, capsys, fits):
    path = write_sweep(tmp_path, {"model.lr": [-1.0, 1.0e-3]})  # lr -1 fails when the module is built
    with pytest.raises(SystemExit) as exit_info:
        main(["sweep", "--config", str(path)])
    assert exit_info.value.code == 1
    assert "1 of 2 runs failed" in capsys.readouterr().err
    runs = {run["name"]: run for run in json.loads((tmp_path / "out" / "sweep.json").read_text())["runs"]}
    assert runs["lr=-1.0-seed=42"]["status"] == "failed" and "lr must be a finite number > 0" in runs["lr=-1.0-seed=42"]["error"]
    assert runs["lr=0.001-seed=42"]["status"] == "done" and (tmp_path / "out" / "lr=0.001-seed=42" / "DONE").is_file()


def test_processes_mode_runs_fits_in_subprocesses(tmp_path, capsys, monkeypatch):
    """... and the runs it starts together share the CPUs: each fit takes its share, not every idle CPU."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    path = write_sweep(tmp_path, {"model.lr": [-1.0, 1.0e-3]}, mode="processes", max_parallel=2)
    with pytest.raises(SystemExit) as exit_info:
        main(["sweep", "--config", str(path)])
    assert exit_info.value.code == 1
    out = tmp_path / "out"
    assert statuses(tmp_path) == {"lr=-1.0-seed=42": "failed", "lr=0.001-seed=42": "done"}
    assert "lr must be a finite number > 0" in (out / "lr=-1.0-seed=42" / "fit.log").read_text()
    assert (out / "lr=0.001-seed=42" / "DONE").is_file() and (out / "lr=0.001-seed=42" / "config.yaml").is_file()
    assert "shared by 2 runs that kdlab sweep runs at a time" in (out / "lr=0.001-seed=42" / "fit.log").read_text()


class CtrlCAtStart(Callback):
    """Presses Ctrl+C as training starts (Lightning then ignores SIGINT and calls sys.exit(1))."""

    def on_train_start(self, trainer, pl_module):
        raise KeyboardInterrupt


def test_ctrl_c_stops_the_sweep_and_running_it_again_continues(tmp_path, fits):
    interrupting = {**FAST, "trainer.callbacks": [*FAST["trainer.callbacks"], {"class_path": f"{__name__}.CtrlCAtStart"}]}
    path = write_sweep(tmp_path, {"model.lr": [1.0e-3, 5.0e-3]}, overrides=interrupting)
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as exit_info:
        main(["sweep", "--config", str(path)])
    assert exit_info.value.code == 130 and signal.getsignal(signal.SIGINT) is handler  # Ctrl+C works again
    assert statuses(tmp_path) == {"lr=0.001-seed=42": "interrupted", "lr=0.005-seed=42": "pending"} and len(fits) == 1
    main(["sweep", "--config", str(write_sweep(tmp_path, {"model.lr": [1.0e-3, 5.0e-3]}))])
    assert statuses(tmp_path) == {"lr=0.001-seed=42": "done", "lr=0.005-seed=42": "done"} and len(fits) == 3


def test_a_run_stopped_by_sigterm_exits_non_zero_and_is_not_marked_done(tmp_path):
    """A cluster's time limit sends SIGTERM: Lightning stops with SIGTERMException, a SystemExit of status 0.
    kdlab fit saves on_exception.ckpt and exits 143, so kdlab sweep records the run as failed (no DONE)
    and a rerun resumes it."""
    import subprocess
    import time

    from kdlab.study.sweep import _Sweeper

    path = write_sweep(tmp_path, {"model.lr": [1.0e-3]}, mode="processes")
    sweeper = _Sweeper(load_sweep(path), str(path))
    run, record = sweeper.pending()[0]
    run_dir = sweeper.output / run.name
    run_dir.mkdir(parents=True)
    args = [a for a in fit_args(sweeper.sweep, run, None) if not a.startswith("--trainer.max_steps")] + ["--trainer.max_steps=2000"]
    log = (run_dir / "fit.log").open("w")
    process = subprocess.Popen([sys.executable, "-m", "kdlab.cli", *args], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while "[kdlab] step" not in (run_dir / "fit.log").read_text() and time.time() < deadline:
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    returncode = process.wait(timeout=120)
    log.close()
    assert returncode == 128 + signal.SIGTERM, (run_dir / "fit.log").read_text()[-2000:]
    assert list(run_dir.rglob("on_exception.ckpt")) and not list(run_dir.rglob("final.ckpt"))
    sweeper._finish_process(run, record, returncode, time.time())
    assert record["status"] == "failed" and not (run_dir / "DONE").exists()


class SigtermAtStart(Callback):
    """What Lightning raises when the process gets SIGTERM (a SystemExit of status 0)."""

    def on_train_start(self, trainer, pl_module):
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        raise SIGTERMException


def test_sigterm_stops_a_sequential_sweep_instead_of_starting_the_next_run(tmp_path, fits):
    stopping = {**FAST, "trainer.callbacks": [*FAST["trainer.callbacks"], {"class_path": f"{__name__}.SigtermAtStart"}]}
    path = write_sweep(tmp_path, {"model.lr": [1.0e-3, 5.0e-3]}, overrides=stopping)
    with pytest.raises(SystemExit) as exit_info:
        main(["sweep", "--config", str(path)])
    assert exit_info.value.code == 130
    assert statuses(tmp_path) == {"lr=0.001-seed=42": "interrupted", "lr=0.005-seed=42": "pending"} and len(fits) == 1
    assert not (tmp_path / "out" / "lr=0.001-seed=42" / "DONE").exists()


def test_a_rerun_resumes_from_the_newest_full_state_never_final(tmp_path):
    import os

    from kdlab.study.run_folder import prepare as _prepare

    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "on_exception.ckpt").write_text("x")
    assert _prepare(tmp_path / "run") == str(checkpoints / "on_exception.ckpt")  # a SIGTERM'd run saved only this
    (checkpoints / "last.ckpt").write_text("x")
    os.utime(checkpoints / "on_exception.ckpt", (1, 1))
    assert _prepare(tmp_path / "run") == str(checkpoints / "last.ckpt")
    os.utime(checkpoints / "last.ckpt", (0, 0))
    assert _prepare(tmp_path / "run") == str(checkpoints / "on_exception.ckpt")
    (checkpoints / "epoch=0-step=60.ckpt").write_text("x")  # a ModelCheckpoint without save_last
    (checkpoints / "final.ckpt").write_text("x")  # weights only: never resumed from
    assert _prepare(tmp_path / "run") == str(checkpoints / "epoch=0-step=60.ckpt")
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    assert _prepare(tmp_path / "empty") is None and not (tmp_path / "empty").exists()  # no file: nothing to keep
    (tmp_path / "weights" / "checkpoints").mkdir(parents=True)
    (tmp_path / "weights" / "checkpoints" / "final.ckpt").write_text("x")
    (tmp_path / "weights" / "metrics.jsonl").write_text('{"step": 1, "train/loss": 2.0}\n')
    assert _prepare(tmp_path / "weights") is None and not (tmp_path / "weights").exists()  # free for a fresh start...
    (aside,) = tmp_path.glob("weights.unresumable-*")  # ...and nothing lost: moved aside, never deleted
    assert (aside / "checkpoints" / "final.ckpt").read_text() == "x" and (aside / "metrics.jsonl").is_file()


def test_a_run_killed_during_its_end_of_fit_evaluations_resumes_from_its_last_step_and_evaluates_again(tmp_path, fits):
    """A ModelCheckpoint without save_last wrote epoch=0-step=1.ckpt; the run was killed outright after fit's last
    step (no DONE, no on_exception.ckpt; here also an evaluation line left corrupt). The rerun resumes from that
    file instead of starting over, and the end-of-fit evaluation runs again: its new line is the one read."""
    from kdlab.study.runs import read_metrics

    ood = {"class_path": "kdlab.callbacks.OODForgetting", "init_args": {
        "tasks": [{"class_path": "kdlab.tasks.Addition", "init_args": {"num_val": 4}}], "examples": 2, "max_new_tokens": 4}}
    overrides = {**FAST, "trainer.val_check_interval": 1, "trainer.callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint"}, ood]}
    path = write_sweep(tmp_path, {"model.objective": [FKL]}, overrides=overrides)
    main(["sweep", "--config", str(path)])
    run_dir = tmp_path / "out" / "objective=ForwardKL-seed=42"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["epoch=0-step=1.ckpt", "final.ckpt"]
    measured = read_metrics(run_dir)["ood/mean_delta"]
    metrics = (run_dir / "metrics.jsonl").read_text()
    assert metrics.count('"ood/mean_delta": ') == 1
    (run_dir / "DONE").unlink()
    (run_dir / "metrics.jsonl").write_text(metrics.replace('"ood/mean_delta": ', '"ood/mean_delta": 999'))
    main(["sweep", "--config", str(path)])
    assert len(fits) == 2 and fits[1][-1] == f"--ckpt_path={run_dir / 'checkpoints' / 'epoch=0-step=1.ckpt'}"
    assert json.loads((run_dir / "DONE").read_text())["resumed_from"].endswith("epoch=0-step=1.ckpt")
    assert read_metrics(run_dir)["ood/mean_delta"] == measured


# ---- slurm mode (submitit; its local executor stands in for the cluster) ------------------------
def test_slurm_mode_runs_each_run_as_a_submitit_job_and_resumes_nothing_done(tmp_path, monkeypatch, capsys):
    pytest.importorskip("submitit")
    monkeypatch.chdir(ROOT)  # jobs start where the sweep started: SMOKE's relative paths resolve from here
    path = write_sweep(tmp_path, {"model.objective": [FKL, RKL]}, mode="slurm", max_parallel=2, slurm={"cluster": "local", "timeout_min": 10})
    main(["sweep", "--config", str(path)])
    runs = json.loads((tmp_path / "out" / "sweep.json").read_text())["runs"]
    assert [r["status"] for r in runs] == ["done", "done"]
    assert all(r["job_id"] for r in runs) and len({r["job_id"] for r in runs}) == 2  # one job per run
    for r in runs:  # each job ran kdlab fit: the run's own directory, its checkpoint and the sweep's DONE summary
        run_dir = tmp_path / "out" / r["name"]
        assert (run_dir / "DONE").is_file() and (run_dir / "checkpoints" / "final.ckpt").is_file()
        assert json.loads((run_dir / "DONE").read_text())["global_step"] == 1
    assert list((tmp_path / "out" / "slurm").glob("*_log.out"))  # submitit's job logs
    capsys.readouterr()
    main(["sweep", "--config", str(path)])  # run again: both done, nothing is submitted
    assert "submitted" not in capsys.readouterr().out
    assert statuses(tmp_path) == {r["name"]: "skipped" for r in runs}


def test_slurm_settings_submitit_does_not_know_fail_before_any_job(tmp_path, monkeypatch, capsys):
    pytest.importorskip("submitit")
    monkeypatch.chdir(ROOT)
    path = write_sweep(tmp_path, {"model.objective": [FKL]}, mode="slurm", slurm={"cluster": "local", "slurm_partiton": "gpu"})
    with pytest.raises(SystemExit) as exit_info:
        main(["sweep", "--config", str(path)])
    assert exit_info.value.code == 2 and re.search(r"sweep.slurm: .*partiton", capsys.readouterr().err)
    assert not (tmp_path / "out" / "slurm").exists() or not list((tmp_path / "out" / "slurm").iterdir())


def test_a_failing_slurm_job_is_recorded_and_the_sweep_exits_1(tmp_path, monkeypatch, capsys):
    pytest.importorskip("submitit")
    monkeypatch.chdir(ROOT)
    path = write_sweep(tmp_path, {"model.lr": [-1.0]}, mode="slurm", slurm={"cluster": "local"})
    with pytest.raises(SystemExit) as exit_info:
        main(["sweep", "--config", str(path)])
    assert exit_info.value.code == 1
    run = json.loads((tmp_path / "out" / "sweep.json").read_text())["runs"][0]
    assert run["status"] == "failed" and run["error"].startswith(f"job {run['job_id']}: ")
    assert "lr" in capsys.readouterr().err and not (tmp_path / "out" / run["name"] / "DONE").exists()


def test_an_in_process_fit_keeps_the_console_scripts_path_for_lightnings_other_processes(tmp_path, monkeypatch):
    """Lightning starts a multi-device fit's other processes as ``python <sys.argv[0]> fit ...`` when the program is
    a console script: ``kdlab`` alone resolved to ./kdlab (the package folder) and those processes failed."""
    from kdlab.study import sweep as sweep_module

    seen = []
    monkeypatch.setattr(kdlab.cli.lightning, "run_lightning", lambda args, **kw: seen.append(list(sys.argv)) or SimpleNamespace(
        trainer=SimpleNamespace(global_step=1, state=SimpleNamespace(finished=True))))
    monkeypatch.setattr("sys.argv", ["/opt/venv/bin/kdlab", "sweep", "--config", "x.yaml"])
    sweep_module._fit_in_process(["fit", "--config", "a.yaml"])
    monkeypatch.setattr("sys.argv", [str(tmp_path / "__main__.py"), "sweep"])  # python -m kdlab.cli: Lightning uses -m
    sweep_module._fit_in_process(["fit", "--config", "a.yaml"])
    assert seen == [["/opt/venv/bin/kdlab", "fit", "--config", "a.yaml"], ["kdlab", "fit", "--config", "a.yaml"]]
