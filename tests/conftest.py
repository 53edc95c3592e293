import os
from pathlib import Path

import pytest
import torch

pytest_plugins = ["pytester"]  # tests/test_tiers.py runs small test sessions

# Tiny models run fastest on one thread, and two test processes must not fight over 2 cores.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

GPU_REASON = "needs a GPU"
"""The one reason a test may skip in CI: ``pytest.skip(f"{GPU_REASON}: ...")`` (or a ``gpu`` marker)."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under ``CI`` (set by the README's every-tier command, which ``.ci/run`` runs), a test that skips for
    any reason other than :data:`GPU_REASON` fails instead: CI runs every test this machine can run, so a
    missing package or file is an error there, not a quiet skip. Expected failures (xfail) are unchanged."""
    outcome = yield
    report = outcome.get_result()
    if not (os.environ.get("CI") and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    if item.get_closest_marker("gpu") is not None or GPU_REASON in reason:
        return
    report.outcome = "failed"
    report.longrepr = f"{item.nodeid} skipped under CI ({reason}); CI runs every test but those that need a GPU"


STUDENT = "kdlab://tiny-random/student"
TEACHER = "kdlab://tiny-random/teacher"


@pytest.fixture(scope="session")
def tiny_pair():
    """(student ModelSpec path, teacher ModelSpec path) of the packaged random tiny Qwen2 pair."""
    return STUDENT, TEACHER


LM_EVAL_FIXTURES = Path(__file__).parent / "fixtures" / "lm_eval"


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """A copy of the lm-eval fixture tasks; the tests run inside it because lm-eval resolves the YAML's relative
    data_files against the working directory. One folder per module, so lm-eval's index is built once."""
    import shutil

    return Path(shutil.copytree(LM_EVAL_FIXTURES, tmp_path_factory.mktemp("lm_eval") / "tasks"))


@pytest.fixture
def lm_eval_offline(task_dir, monkeypatch):
    """lm-eval and its libraries offline (nothing downloaded), the working directory :func:`task_dir`; a module
    opts in with ``pytestmark = pytest.mark.usefixtures("lm_eval_offline")``."""
    import datasets
    import huggingface_hub.constants

    for variable in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(variable, "1")
    # the variables are read when the libraries are imported, which may have happened already
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(task_dir)


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
