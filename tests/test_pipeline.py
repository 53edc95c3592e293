"""kdlab pipeline: distill -> RLVR chains start from the distilled weights and are tracked together."""

from pathlib import Path

import pytest
import torch
import yaml

from kdlab.cli.main import main
from kdlab.study.grid import expand
from kdlab.study.pipeline import load_pipeline

ROOT = Path(__file__).parents[1]


def smoke_file(tmp_path, **changes):
    data = yaml.safe_load((ROOT / "experiments/tiny/pipeline_smoke.yaml").read_text())
    data["output"] = str(tmp_path / "out")
    for stage in ("distill", "rlvr"):
        data[stage]["base"] = str(ROOT / data[stage]["base"])
    data.update(changes)
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_rlvr_starts_from_each_distilled_checkpoint_and_chains_are_tracked(tmp_path, capsys):
    path = smoke_file(tmp_path)
    main(["pipeline", "--config", str(path)])
    out = tmp_path / "out"
    distilled = sorted(p.name for p in (out / "distill").iterdir() if p.is_dir())
    assert distilled == ["rollout=StudentRollouts-seed=42", "rollout=TeacherRollouts-seed=42"]
    for name in distilled:
        run = out / "rlvr" / name / "seed=42"
        config = yaml.safe_load((run / "config.yaml").read_text())
        start = out / "distill" / name / "checkpoints" / "final.ckpt"
        assert config["model"]["init_args"]["policy"]["checkpoint"] == str(start)
        # the random policy never earns a reward, so GRPO does not move it: RLVR ends where distillation ended
        distill_state = torch.load(start, weights_only=True)["state_dict"]
        rlvr_state = torch.load(run / "checkpoints" / "final.ckpt", weights_only=True)["state_dict"]
        student = {k: v for k, v in distill_state.items() if k.startswith("student.")}
        assert student.keys() == rlvr_state.keys() - {k for k in rlvr_state if not k.startswith("student.")}
        assert all(torch.equal(student[k], rlvr_state[k]) for k in student)
    table = (out / "pipeline.md").read_text()
    assert table.count("| rollout=") == 2 and "rlvr reward_mean" in table and "rlvr sparsity/1e-06" in table
    rows = (out / "pipeline.csv").read_text().splitlines()
    assert len(rows) == 3
    # a second run finds every run done
    capsys.readouterr()
    main(["pipeline", "--config", str(path)])
    assert ": fit" not in capsys.readouterr().out


@pytest.mark.parametrize("distilled, line", [(1, "[pipeline] 1 chain tracked in "), (2, "[pipeline] 2 chains tracked in ")])
def test_the_pipelines_chain_count_is_pluralised(tmp_path, capsys, monkeypatch, distilled, line):
    """The last line says "1 chain" and "2 chains" (kdlab.study.tables.counted); it read "1 chains" before. The runs are
    faked: ``distilled`` of the smoke pipeline's two distillation runs finish, each giving one RLVR chain."""
    import kdlab.study.pipeline
    from kdlab.study.pipeline import run_pipeline

    path = smoke_file(tmp_path)
    pipeline = load_pipeline(path)

    def run_sweep(sweep, pipeline_file, command=None):
        records = [{"name": run.name, "status": "done", "error": None} for run in expand(sweep)]
        if sweep.output == pipeline.distill.output:
            for record in records[distilled:]:
                record.update(status="failed", error="boom")
        return records

    monkeypatch.setattr(kdlab.study.pipeline, "run_sweep", run_sweep)
    run_pipeline(pipeline, str(path))
    assert line in capsys.readouterr().out


def test_bad_pipeline_files_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="unknown key 'stages'"):
        load_pipeline(smoke_file(tmp_path, stages=[]))
    with pytest.raises(ValueError, match="the pipeline sets it to each distilled checkpoint"):
        data = yaml.safe_load(smoke_file(tmp_path).read_text())
        data["rlvr"]["overrides"]["model.policy.checkpoint"] = "x.ckpt"
        (tmp_path / "p2.yaml").write_text(yaml.safe_dump(data))
        load_pipeline(tmp_path / "p2.yaml")
    with pytest.raises(ValueError, match="unknown key rlvr.outputs"):
        data = yaml.safe_load(smoke_file(tmp_path).read_text())
        data["rlvr"]["outputs"] = "x"
        (tmp_path / "p3.yaml").write_text(yaml.safe_dump(data))
        load_pipeline(tmp_path / "p3.yaml")


@pytest.mark.parametrize("stage, key, value, message", [
    ("distill", "model.lrr", 1.0e-3, "run distill/rollout=TeacherRollouts-seed=42: model.lrr: no such key for kdlab fit (did you mean 'model.lr'?)"),
    ("rlvr", "model.group_size", "two", "run rlvr/rollout=TeacherRollouts-seed=42/seed=42: model.group_size: Expected a <class 'int'>. Got value: two"),
])
def test_a_bad_key_or_value_in_either_stage_fails_in_one_line_before_any_run_starts(tmp_path, capsys, stage, key, value, message):
    data = yaml.safe_load(smoke_file(tmp_path).read_text())
    data[stage]["overrides"][key] = value
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SystemExit) as exit_info:
        main(["pipeline", "--config", str(path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"kdlab pipeline: error: {message}"]
    assert not (tmp_path / "out").exists()  # no distillation run started


@pytest.mark.slow
def test_rlvr_chains_run_side_by_side_with_max_parallel(tmp_path):
    """rlvr.mode processes with max_parallel 2: the two chains' RLVR runs overlap in time."""
    import json
    from datetime import datetime

    data = yaml.safe_load(smoke_file(tmp_path).read_text())
    data["rlvr"].update(mode="processes", max_parallel=2)
    path = tmp_path / "parallel.yaml"
    path.write_text(yaml.safe_dump(data))
    main(["pipeline", "--config", str(path)])
    spans = []
    for done in sorted((tmp_path / "out" / "rlvr").glob("*/seed=42/DONE")):
        record = json.loads(done.read_text())
        end = datetime.fromisoformat(record["finished"]).timestamp()
        spans.append((end - record["seconds"], end))
    assert len(spans) == 2
    (start_a, end_a), (start_b, end_b) = spans
    assert start_a < end_b and start_b < end_a  # each started before the other ended


def test_distill_dir_names_the_folder_of_the_distilled_runs(tmp_path):
    pipeline = load_pipeline(smoke_file(tmp_path, distill_dir="hard"))
    assert pipeline.distill.output == str(tmp_path / "out" / "hard")
    start = pipeline.rlvr_sweep("run-a").overrides["model.policy.checkpoint"]
    assert start == str(tmp_path / "out" / "hard" / "run-a" / "checkpoints" / "final.ckpt")
    assert pipeline.rlvr_sweep("run-a").output == str(tmp_path / "out" / "rlvr" / "run-a")
    for bad in ("a/b", "rlvr", "", 3):
        with pytest.raises(ValueError, match="'distill_dir' must be one folder name"):
            load_pipeline(smoke_file(tmp_path, distill_dir=bad))


def test_an_archived_distillation_without_its_checkpoint_is_run_again_for_rlvr(tmp_path, capsys):
    """An archive keeps no checkpoints: a finished distillation run whose RLVR stage has not finished is run
    again to write the checkpoint RLVR starts from; one whose RLVR stage finished is left alone."""
    import shutil

    from kdlab.study.pipeline import without_checkpoint

    path = smoke_file(tmp_path)
    main(["pipeline", "--config", str(path)])
    out, pipeline = tmp_path / "out", load_pipeline(path)
    assert without_checkpoint(pipeline) == []
    kept, archived = sorted(p.name for p in (out / "distill").iterdir() if p.is_dir())
    for name in (kept, archived):
        shutil.rmtree(out / "distill" / name / "checkpoints")  # as scripts/archive_runs.py keeps them
    shutil.rmtree(out / "rlvr" / archived)  # this chain's RLVR stage has not run
    assert without_checkpoint(pipeline) == [archived]
    capsys.readouterr()
    main(["pipeline", "--config", str(path)])
    assert f"{archived}: finished without checkpoints/final.ckpt" in capsys.readouterr().err
    assert (out / "distill" / archived / "checkpoints" / "final.ckpt").is_file()
    assert (out / "rlvr" / archived / "seed=42" / "DONE").is_file()
    assert not (out / "distill" / kept / "checkpoints").exists()  # its chain had finished: not run again


def test_rlvr_seeds_choose_the_distillation_runs_rlvr_starts_from(tmp_path):
    pipeline = load_pipeline(smoke_file(tmp_path, rlvr_seeds=[42]))
    assert all(pipeline.chains_from(run) for run in expand(pipeline.distill))
    assert not any(load_pipeline(smoke_file(tmp_path, rlvr_seeds=[])).chains_from(run) for run in expand(pipeline.distill))
    with pytest.raises(ValueError, match=r"'rlvr_seeds' \[7\] are not seeds of the distillation stage"):
        load_pipeline(smoke_file(tmp_path, rlvr_seeds=[7]))
    with pytest.raises(ValueError, match="'rlvr_seeds' must be a list of integer seeds"):
        load_pipeline(smoke_file(tmp_path, rlvr_seeds="42"))
    main(["pipeline", "--config", str(smoke_file(tmp_path, rlvr_seeds=[]))])  # distillation only: no chain
    assert len([p for p in (tmp_path / "out" / "distill").iterdir() if p.is_dir()]) == 2 and not (tmp_path / "out" / "rlvr").exists()


def test_rlvr_where_chooses_the_distillation_runs_by_their_grid_values(tmp_path):
    teacher = {"class_path": "kdlab.rollouts.TeacherRollouts"}
    pipeline = load_pipeline(smoke_file(tmp_path, rlvr_where={"model.rollout": teacher}))
    chosen = [run.name for run in expand(pipeline.distill) if pipeline.chains_from(run)]
    assert chosen == ["rollout=TeacherRollouts-seed=42"]
    with pytest.raises(ValueError, match=r"rlvr_where.model.lr is not a key of distill.grid"):
        load_pipeline(smoke_file(tmp_path, rlvr_where={"model.lr": 1.0e-4}))
    with pytest.raises(ValueError, match=r"rlvr_where.model.rollout=.* is not one of distill.grid.model.rollout's values"):
        load_pipeline(smoke_file(tmp_path, rlvr_where={"model.rollout": {"class_path": "kdlab.rollouts.Mixture"}}))
    with pytest.raises(ValueError, match="'rlvr_where' must be a mapping"):
        load_pipeline(smoke_file(tmp_path, rlvr_where=[1]))


def test_print_mode_lines_run_each_stage_and_an_rlvr_line_waits_for_its_distillation(tmp_path, capsys):
    """A pipeline whose stages print (a cluster's job arrays): every line is ``kdlab pipeline --run``, which runs
    that one run; an RLVR line before its distillation run finished refuses, naming the checkpoint it needs."""
    import shlex

    data = yaml.safe_load(smoke_file(tmp_path).read_text())
    data["distill"]["mode"] = data["rlvr"]["mode"] = "print"
    path = tmp_path / "print.yaml"
    path.write_text(yaml.safe_dump(data))
    main(["pipeline", "--config", str(path)])
    printed = capsys.readouterr().out.splitlines()
    out = tmp_path / "out"
    distill = (out / "distill" / "commands.sh").read_text().splitlines()
    rlvr = (out / "rlvr" / "commands.sh").read_text().splitlines()
    names = [run.name for run in expand(load_pipeline(path).distill)]
    assert [shlex.split(line)[-1] for line in distill] == [f"distill/{name}" for name in names]
    assert [shlex.split(line)[-1] for line in rlvr] == [f"rlvr/{name}/seed=42" for name in names]
    assert printed[: len(distill)] == distill and printed[len(distill): len(distill) + len(rlvr)] == rlvr
    assert all(shlex.split(line)[:6] == ["python", "-m", "kdlab.cli", "pipeline", "--config", str(path)] for line in distill + rlvr)
    assert not list(out.glob("distill/*/DONE"))  # print mode runs nothing

    with pytest.raises(SystemExit) as refused:  # the RLVR array started before the distillation one finished
        main(shlex.split(rlvr[0])[3:])
    assert refused.value.code == 1
    assert f"{out / 'distill' / names[0] / 'checkpoints' / 'final.ckpt'}" in capsys.readouterr().err
    assert not (out / "rlvr" / names[0] / "seed=42").exists()

    main(shlex.split(distill[0])[3:])
    main(shlex.split(rlvr[0])[3:])
    run = out / "rlvr" / names[0] / "seed=42"
    assert (run / "DONE").is_file()
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["model"]["init_args"]["policy"]["checkpoint"] == str(out / "distill" / names[0] / "checkpoints" / "final.ckpt")
    capsys.readouterr()
    main(shlex.split(rlvr[0])[3:])  # a done run's line does nothing
    assert "already done" in capsys.readouterr().out

    main(["pipeline", "--config", str(path)])  # written again: line N is still run N, and the finished chain is tracked
    assert (out / "distill" / "commands.sh").read_text().splitlines() == distill
    assert (out / "rlvr" / "commands.sh").read_text().splitlines() == rlvr
    assert (out / "pipeline.md").read_text().count("| rollout=") == 1
    with pytest.raises(SystemExit) as unknown:
        main(["pipeline", "--config", str(path), "--run", "rlvr/nope/seed=42"])
    assert unknown.value.code == 2 and "distill/<name> or rlvr/<distilled>/<name>" in capsys.readouterr().err
