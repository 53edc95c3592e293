"""One sweep run launched as several processes (SLURM tasks, torchrun): the launch's ranks agree on the checkpoint
to resume from, rank 0 alone prepares the run's folder and marks it done, and a whole sweep or pipeline is refused
when every process would run it."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kdlab.cli.main import main
from kdlab.study import launch

ROOT = Path(__file__).parents[1]
SMOKE = str(ROOT / "experiments" / "tiny" / "smoke.yaml")
SLURM_KEYS = ("SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_JOB_ID",
              "SLURM_STEP_ID", "SLURM_JOB_NAME", "SLURM_NODELIST", "SLURM_RESTART_COUNT")


def slurm_task(rank: int, tasks: int = 2, job: str = "4242", restart: int = 0) -> dict[str, str]:
    """The variables ``srun`` sets for task ``rank`` of ``tasks`` on one node (job step 0 of job ``job``)."""
    return {"SLURM_NTASKS": str(tasks), "SLURM_NTASKS_PER_NODE": str(tasks), "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0", "SLURM_JOB_ID": job, "SLURM_STEP_ID": "0", "SLURM_JOB_NAME": "kdlab-sweep",
            "SLURM_NODELIST": "localhost", "SLURM_RESTART_COUNT": str(restart)}


@pytest.fixture
def no_launch(monkeypatch):
    for key in (*SLURM_KEYS, "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK"):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_the_launch_is_what_lightning_detects(no_launch):
    assert launch.current() == launch.Launch()
    for key, value in slurm_task(1).items():
        no_launch.setenv(key, value)
    found = launch.current()
    assert (found.rank, found.world, found.several) == (1, 2, True) and "4242.0" in found.id
    no_launch.setenv("SLURM_RESTART_COUNT", "1")  # a requeued job keeps its id: its restart count tells the launches apart
    assert launch.current().id != found.id
    no_launch.setenv("SLURM_JOB_NAME", "interactive")  # Lightning's own escape: a SLURM job launching processes itself
    assert launch.current() == launch.Launch()
    for key, value in {"TORCHELASTIC_RUN_ID": "abc", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"}.items():
        no_launch.setenv(key, value)
    assert launch.current().rank == 3 and launch.current().world == 4 and "abc" in launch.current().id


def test_ranks_take_rank_zeros_choice_and_refuse_a_stale_or_missing_one(tmp_path, monkeypatch):
    note = tmp_path / ".launches" / "run.json"
    calls = []
    zero, one = launch.Launch(0, 2, "slurm 7.0 restart 0"), launch.Launch(1, 2, "slurm 7.0 restart 0")
    assert launch.agree_on_start(zero, note, lambda: calls.append("prepared") or "ckpt", lambda: "never read") == "ckpt"
    assert calls == ["prepared"] and json.loads(note.read_text()) == {"launch": zero.id, "resume": "ckpt"}
    assert launch.agree_on_start(one, note, lambda: calls.append("again"), lambda: "ckpt") == "ckpt" and calls == ["prepared"]
    with pytest.raises(RuntimeError, match="says rank 0 resumes from ckpt, but rank 1 finds other.ckpt"):
        launch.agree_on_start(one, note, lambda: None, lambda: "other.ckpt")  # a note an earlier launch left
    monkeypatch.setattr(launch, "WAIT_S", 0.2)
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 waited 0 s for rank 0 to write .*run\.json"):
        launch.agree_on_start(launch.Launch(1, 2, "slurm 8.0 restart 0"), note, lambda: None, lambda: None)
    launch.finish(zero, note)
    assert not note.exists()
    alone = launch.Launch()
    assert launch.agree_on_start(alone, tmp_path / "unused.json", lambda: "mine", lambda: None) == "mine"
    assert not (tmp_path / "unused.json").exists()


def sweep_file(tmp_path: Path, forgetting: dict | None = None, **overrides) -> Path:
    data = {"base": SMOKE, "output": str(tmp_path / "out"), "grid": {"model.lr": [1.0e-3]}, "seeds": [42], **({"forgetting": forgetting} if forgetting else {}), "overrides": {
        "trainer.max_steps": 1, "trainer.limit_val_batches": 0, "trainer.accumulate_grad_batches": 1, "trainer.enable_progress_bar": False,
        "trainer.enable_model_summary": False, "model.max_completion_tokens": 4, **overrides}}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_a_whole_sweep_or_pipeline_in_every_task_is_refused_naming_run(tmp_path, no_launch, capsys):
    for key, value in slurm_task(0).items():
        no_launch.setenv(key, value)
    with pytest.raises(SystemExit) as refused:
        main(["sweep", "--config", str(sweep_file(tmp_path))])
    assert refused.value.code == 2 and "was started as 2 processes" in capsys.readouterr().err and not (tmp_path / "out").exists()
    pipeline = yaml.safe_load((ROOT / "experiments" / "tiny" / "pipeline_smoke.yaml").read_text())
    pipeline["output"] = str(tmp_path / "chain")
    for stage in ("distill", "rlvr"):
        pipeline[stage]["base"] = str(ROOT / pipeline[stage]["base"])
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(pipeline))
    with pytest.raises(SystemExit) as refused:
        main(["pipeline", "--config", str(tmp_path / "pipeline.yaml")])
    assert refused.value.code == 2 and "give each launch one run, with --run" in capsys.readouterr().err


def test_rank_one_of_a_fitted_run_leaves_its_forgetting_to_rank_zero(tmp_path, no_launch, monkeypatch):
    import kdlab.study.sweep as sweep

    path = sweep_file(tmp_path, {"tasks": {"toy": {"task": "kdlab_toy_mc", "limit": 4, "metric": "acc,none"}}, "include_path": str(tmp_path)})
    run_dir = tmp_path / "out" / "lr=0.001-seed=42"
    run_dir.mkdir(parents=True)
    (run_dir / "DONE").write_text("{}")
    measured = []
    monkeypatch.setattr(sweep._Sweeper, "measure_forgetting", lambda self, run, record: measured.append(run.name))
    for key, value in slurm_task(1).items():
        no_launch.setenv(key, value)
    main(["sweep", "--config", str(path), "--run", "lr=0.001-seed=42"])
    assert measured == []
    no_launch.setenv("SLURM_PROCID", "0")
    main(["sweep", "--config", str(path), "--run", "lr=0.001-seed=42"])
    assert measured == ["lr=0.001-seed=42"]


# two processes, each a kdlab sweep --run of a 2-device DDP fit on the CPU (about 15 s alone)
def test_two_slurm_tasks_of_one_run_fit_together_and_only_rank_zero_prepares_and_marks(tmp_path):
    """What ``srun --ntasks-per-node=2 kdlab sweep --config F --run NAME`` starts: Lightning makes the two tasks one
    DDP fit; rank 0 alone moves the earlier unresumable attempt aside, writes DONE and says the run is done, and
    removes its note; a second launch of the same line does nothing on either task."""
    path = sweep_file(tmp_path, **{"trainer.devices": 2, "trainer.strategy": "ddp", "model.batch_size": 2})
    name = "lr=0.001-seed=42"
    leftover = tmp_path / "out" / name
    leftover.mkdir(parents=True)
    (leftover / "fit.log").write_text("an attempt that saved no checkpoint\n")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def start(rank: int) -> subprocess.Popen:
        env = {**os.environ, **slurm_task(rank, job="31337"), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        for key in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(key, None)
        return subprocess.Popen([sys.executable, "-m", "kdlab.cli", "sweep", "--config", str(path), "--run", name], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    tasks = [start(rank) for rank in (0, 1)]
    outputs = [task.communicate(timeout=600)[0] for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert sum(f"[sweep] {name}: done in" in out for out in outputs) == 1 and f"[sweep] {name}: done in" in outputs[0]
    assert f"[sweep] {name}: rank 1 fitted; rank 0 marks the run done" in outputs[1]
    assert f"{name}: fit (rank 0 of 2)" in outputs[0] and f"{name}: fit (rank 1 of 2)" in outputs[1]
    assert sum("moved aside" in out for out in outputs) == 1 and "moved aside" in outputs[0]
    assert len(list((tmp_path / "out").glob(f"{name}.unresumable-*"))) == 1
    assert json.loads((tmp_path / "out" / name / "DONE").read_text())["global_step"] == 1
    assert (tmp_path / "out" / name / "checkpoints" / "final.ckpt").is_file() and not list((tmp_path / "out" / ".launches").glob("*.json"))
    again = [start(rank) for rank in (0, 1)]
    outputs = [task.communicate(timeout=300)[0] for task in again]
    assert [task.returncode for task in again] == [0, 0] and all(f"[sweep] {name}: already done" in out for out in outputs)


def test_a_failure_to_prepare_or_a_stale_note_never_leaves_the_other_ranks_waiting_or_misled(tmp_path, monkeypatch):
    note = tmp_path / ".launches" / "run.json"
    zero, one = launch.Launch(0, 2, "slurm 9.0 restart 0"), launch.Launch(1, 2, "slurm 9.0 restart 0")

    def broken():
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        launch.agree_on_start(zero, note, broken, lambda: None)
    with pytest.raises(RuntimeError, match=r"rank 0 failed to prepare the run \(OSError: disk full"):  # at once, not after WAIT_S
        launch.agree_on_start(one, note, lambda: None, lambda: None)
    launch.agree_on_start(zero, note, lambda: "ckpt", lambda: None)
    monkeypatch.setattr(launch, "WAIT_S", 0.2)
    monkeypatch.setattr(launch, "STARTED", note.stat().st_mtime + launch.SKEW_S + 1)  # the note predates this process
    with pytest.raises(RuntimeError, match="waited"):  # an earlier launch's note with the same id is not read
        launch.agree_on_start(one, note, lambda: None, lambda: "ckpt")


def test_the_forgetting_process_rank_zero_starts_gets_no_distributed_variables(no_launch):
    for key, value in {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "MASTER_ADDR": "n1", "MASTER_PORT": "29500",
                       "TORCHELASTIC_RUN_ID": "x", "KDLAB_KEEP": "1"}.items():
        no_launch.setenv(key, value)
    child = launch.child_environment()
    assert child["KDLAB_KEEP"] == "1" and not set(child) & {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"}


def test_a_slurm_job_of_several_tasks_is_done_when_every_task_is(tmp_path, monkeypatch):
    """submitit's ``Job.result()`` refuses a job of several tasks (a run on several GPUs: one task per GPU), so the sweep
    reads every task's result (``results()``): before, such a finished run was recorded as failed."""
    submitit = pytest.importorskip("submitit")
    import kdlab.study.sweep as sweep

    assert "_sub_jobs" in __import__("inspect").getsource(submitit.core.core.Job.result)  # what a stand-in below mimics

    class Job:
        job_id = "77"

        def result(self):
            raise AssertionError("You should use `results()` if your job has subtasks.")

        def results(self):
            return ["done", "done"]

        def done(self):
            return True

    class Executor:
        def batch(self):
            return __import__("contextlib").nullcontext()

        def submit(self, *args):
            return Job()

    monkeypatch.setattr(sweep, "slurm_executor", lambda sweep_: Executor())
    import dataclasses

    path = sweep_file(tmp_path)
    records = sweep.run_sweep(dataclasses.replace(sweep.load_sweep(path), mode="slurm"), str(path))
    assert [r["status"] for r in records] == ["done"]
