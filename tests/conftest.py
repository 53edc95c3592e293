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


@pytest.fixture(autouse=True, scope="session")
def tests_write_nothing_into_the_repository():
    """A Trainer without a logger writes its run files (run_info.json, checkpoints) to its
    default_root_dir, the working directory unless a test passes tmp_path: fail the session if a test did."""
    from pathlib import Path

    root = Path(__file__).parents[1]
    before = {path.name for path in root.iterdir()}
    yield
    stray = sorted({path.name for path in root.iterdir()} - before - {".pytest_cache", ".hypothesis", "runs", "lightning_logs"})
    assert not stray, f"tests wrote {stray} into the repository root; give their Trainer default_root_dir=tmp_path"
