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
