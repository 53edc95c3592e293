"""The session guard in ``tests/conftest.py`` fails a test session that leaves a file in the repository,
also inside a folder that already exists (the stray ``samples/val-step000003.jsonl`` was one)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")
STRAY_TEST = '''
from pathlib import Path

def test_writes_a_run_file():
    (Path(__file__).parents[1] / "samples" / "val-step000003.jsonl").write_text("{}")
'''
CLEAN_TEST = '''
def test_writes_nothing(tmp_path):
    (tmp_path / "val.jsonl").write_text("{}")
'''


def session(repo: Path, test: str) -> subprocess.CompletedProcess:
    """A pytest session in a fresh git checkout ``repo`` (with a committed ``samples/`` folder) running ``test``."""
    (repo / "tests").mkdir(parents=True)
    (repo / "samples").mkdir()
    (repo / "samples" / "kept.jsonl").write_text("{}")
    shutil.copy(CONFTEST, repo / "tests" / "conftest.py")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "."], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "start"], cwd=repo, check=True)
    (repo / "tests" / "test_it.py").write_text(test)  # untracked before the session: not a stray
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=repo,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_file_written_into_an_existing_folder_fails_the_session(tmp_path):
    result = session(tmp_path / "repo", STRAY_TEST)
    assert result.returncode != 0
    assert "tests wrote ['samples/val-step000003.jsonl'] into the repository" in result.stdout


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_session_writing_under_tmp_path_passes(tmp_path):
    result = session(tmp_path / "repo", CLEAN_TEST)
    assert result.returncode == 0, result.stdout[-2000:]
