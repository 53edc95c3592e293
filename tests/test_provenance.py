"""A study's provenance: ``kdlab report`` names the parts whose runs come from several commits or a dirty tree
(kdlab.provenance.commit_mix, on the verdicts page), and the study scripts refuse to start from a dirty tree unless
KDLAB_ALLOW_DIRTY=1."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kdlab.provenance import commit_mix

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["experiments/tiny/study.sh", "experiments/smollm2/style_study.sh", "experiments/reasoning/study.sh"]


def info(run: Path, commit: str, dirty: bool) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "run_info.json").write_text(json.dumps({"git_commit": commit, "git_dirty": dirty}))


def test_commit_mix_names_commits_dirty_runs_and_missing_records(tmp_path):
    for i in range(3):
        info(tmp_path / f"a{i}", "a" * 40, False)
    assert commit_mix([tmp_path / f"a{i}" for i in range(3)]) == ""  # one clean commit: nothing to say
    info(tmp_path / "b", "b" * 40, True)
    (tmp_path / "c").mkdir()
    runs = [tmp_path / f"a{i}" for i in range(3)] + [tmp_path / "b", tmp_path / "c"]
    assert commit_mix(runs) == "2 commits (aaaaaaa x 3, bbbbbbb x 1); 1 of 4 runs from a dirty tree; 1 runs without run_info.json"
    assert commit_mix([tmp_path / "c"]) == ""  # no record at all (runs written before run_info.json): nothing to compare


def test_the_verdicts_page_names_a_part_of_mixed_commits(tmp_path):
    from test_verdicts import make_grid

    from kdlab.study.runs import collect
    from kdlab.study.verdicts import write_verdicts

    make_grid(tmp_path, lambda *a: 0.5, lambda *a: 0.0)
    for index, run in enumerate(sorted((tmp_path / "distill").glob("*-*"))):
        info(run, "1234567" + "0" * 33 if index % 2 else "abcdef0" + "0" * 33, index == 0)
    runs, _ = collect([tmp_path])
    write_verdicts(tmp_path, runs, tmp_path / "out")
    page = (tmp_path / "out" / "verdicts.md").read_text()
    assert "## Provenance\n\n- distill: 2 commits (1234567 x 12, abcdef0 x 12); 1 of 24 runs from a dirty tree\n" in page


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_study_script_refuses_a_dirty_tree_unless_told(tmp_path, script):
    """A copy of the script and experiments/steps.sh in a fresh git repository, a `kdlab` on PATH that only says it
    ran: an untracked file makes the tree dirty, the script exits 2 before any step; KDLAB_ALLOW_DIRTY=1 runs it."""
    for name in (script, "experiments/steps.sh"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "kdlab").write_text("#!/bin/sh\necho kdlab \"$@\"\n")
    (tmp_path / "bin" / "kdlab").chmod(0o755)
    (tmp_path / ".gitignore").write_text("runs/\nbin/\n")
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "GIT_CONFIG_GLOBAL": "/dev/null"}
    git = lambda *args: subprocess.run(["git", *args], cwd=tmp_path, env=env, check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "study")
    (tmp_path / "uncommitted.txt").write_text("an edit\n")
    refused = subprocess.run(["bash", script], cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert refused.returncode == 2 and "KDLAB_ALLOW_DIRTY=1" in refused.stderr
    assert not (tmp_path / "runs").exists()  # no step ran
    allowed = subprocess.run(["bash", script], cwd=tmp_path, env={**env, "KDLAB_ALLOW_DIRTY": "1"}, capture_output=True, text=True, check=False)
    assert "kdlab sweep --config" in allowed.stdout and list((tmp_path / "runs").rglob("wall_times.jsonl"))
