"""scripts/provenance_rerun.py: a finished sweep run rerun at this commit gives byte-identical sample files, and a
changed archived sample file is reported as differing."""

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from kdlab.cli.main import main as kdlab

ROOT = Path(__file__).parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("provenance_rerun", ROOT / "scripts" / "provenance_rerun.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # four sweep fits in subprocesses
def test_a_rerun_reproduces_the_archived_samples_and_a_changed_file_is_named(tmp_path, monkeypatch):
    data = yaml.safe_load((ROOT / "experiments/tiny/sweep_smoke.yaml").read_text())
    data.update(base=str(ROOT / data["base"]), output=str(tmp_path / "runs"), seeds=[42], mode="sequential",
                grid={"model.rollout": data["grid"]["model.rollout"]})
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump(data))
    monkeypatch.chdir(ROOT)  # the script asks git for this checkout's commit
    kdlab(["sweep", "--config", str(sweep)])
    names = sorted(p.name for p in (tmp_path / "runs").iterdir() if p.is_dir())
    assert len(names) == 2 and all(list((tmp_path / "runs" / n / "samples").glob("*.jsonl")) for n in names)
    changed = tmp_path / "runs" / names[1] / "samples"
    first = sorted(changed.glob("*.jsonl"))[0]
    first.write_text(first.read_text().replace('"score": 0.0', '"score": 1.0', 1) + "\n")
    output = tmp_path / "provenance.json"
    code = load_script().main(["--sweep", str(sweep), "--runs", str(tmp_path / "runs"), "--one-per-cell",
                               "--scratch", str(tmp_path / "scratch"), "--output", str(output)])
    record = json.loads(output.read_text())
    by_run = {r["run"]: r for r in record["runs"]}
    assert by_run[names[0]]["status"] == "identical" and by_run[names[0]]["files"] >= 1
    assert by_run[names[1]]["status"] == "differs" and by_run[names[1]]["differing_files"] == [first.name]
    assert code == 1 and record["identical"] == 1 and record["checked"] == 2
    # runs already rerun at this commit (a pipeline's reruns; --every-rerun takes each one found) are compared as they are, not run a third time
    script = load_script()
    for name in names:
        info = tmp_path / "scratch" / name / "run_info.json"
        info.write_text(json.dumps({**json.loads(info.read_text()), "git_commit": script.head(), "git_dirty": False}))
    again = tmp_path / "again.json"
    script.main(["--sweep", str(sweep), "--runs", str(tmp_path / "runs"), "--every-rerun", "--reruns", str(tmp_path / "elsewhere"), "--reruns", str(tmp_path / "scratch"),
                 "--scratch", str(tmp_path / "unused"), "--output", str(again)])
    record = json.loads(again.read_text())
    assert len(record["runs"]) == 2 and [r["status"] for r in record["runs"]] == [by_run[r["run"]]["status"] for r in record["runs"]]
    assert all(r["seconds"] is None and r["rerun"].startswith(str(tmp_path / "scratch")) for r in record["runs"])
    assert not (tmp_path / "unused").exists()
    assert all(r["environment"] == {} for r in record["runs"])  # the same machine and packages
    info = tmp_path / "runs" / names[0] / "run_info.json"
    info.write_text(json.dumps({**json.loads(info.read_text()), "packages": {**json.loads(info.read_text())["packages"], "torch": "0.0"}}))
    assert script.environment_differences(tmp_path / "runs" / names[0], tmp_path / "scratch" / names[0])["packages.torch"][0] == "0.0"
