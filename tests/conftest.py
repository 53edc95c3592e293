import os

import pytest
import torch

# Tiny models run fastest on one thread, and two test processes must not fight over 2 cores.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

STUDENT = "kdlab://tiny-random/student"
TEACHER = "kdlab://tiny-random/teacher"


@pytest.fixture(scope="session")
def tiny_pair():
    """(student ModelSpec path, teacher ModelSpec path) of the packaged random tiny Qwen2 pair."""
    return STUDENT, TEACHER


def untracked_files(root) -> set[str] | None:
    """Paths (relative to ``root``) of every untracked, non-ignored file in the git checkout at ``root``,
    including files inside folders that already exist; ``None`` when ``root`` is not a git checkout."""
    import subprocess

    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "-z"], cwd=root,
                             capture_output=True, check=True).stdout.decode("utf-8", "surrogateescape")
    except (OSError, subprocess.CalledProcessError):
        return None
    return {entry[3:] for entry in out.split("\0") if entry.startswith("?? ")}


@pytest.fixture(autouse=True, scope="session")
def tests_write_nothing_into_the_repository():
    """A Trainer without a logger writes its run files (run_info.json, samples/, checkpoints) to its
    default_root_dir, the working directory unless a test passes tmp_path: fail the session if a test
    left a new file anywhere in the repository (git's untracked files, so also inside folders that
    already exist; ignored paths such as runs/ are not counted). Outside a git checkout, new entries of
    the repository root are checked."""
    from pathlib import Path

    root = Path(__file__).parents[1]
    before, before_root = untracked_files(root), {path.name for path in root.iterdir()}
    yield
    if before is not None:
        after = untracked_files(root) or set()
        stray = sorted(after - before)
    else:
        stray = sorted({path.name for path in root.iterdir()} - before_root - {".pytest_cache", ".hypothesis", "runs", "lightning_logs"})
    assert not stray, (
        f"tests wrote {stray} into the repository; give their Trainer default_root_dir=tmp_path (or a logger under "
        "tmp_path). (A file another process created in the checkout during the session is counted too.)"
    )
