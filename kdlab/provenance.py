"""What produced a run: kdlab version, git state, package versions and the command line.

Written as ``run_info.json`` beside the resolved ``config.yaml`` at the start of every fit, so a
result can be traced back to the exact code and environment.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import kdlab

PACKAGES = ("torch", "lightning", "transformers", "tokenizers", "torchmetrics", "jsonargparse", "datasets", "vllm", "peft")


def _git(*args: str) -> str | None:
    try:
        result = subprocess.run(["git", *args], cwd=Path(kdlab.__file__).parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def run_info() -> dict[str, Any]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    status = _git("status", "--porcelain")
    return {
        "kdlab": kdlab.__version__,
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": versions,
        "argv": sys.argv,
    }


def write_run_info(directory: str | Path, command: str | None = None) -> Path:
    """``run_info.json`` in ``directory``; ``command`` (``validate``, ``test``) marks a folder that an evaluation wrote,
    not a fit (:func:`evaluation_command`)."""
    path = Path(directory) / "run_info.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    info = run_info() if command is None else {**run_info(), "command": command}
    path.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return path


def evaluation_command(directory: str | Path) -> str | None:
    """``validate`` or ``test`` when ``kdlab validate|test`` wrote ``directory`` (its ``run_info.json`` says so), else None."""
    try:
        info = json.loads((Path(directory) / "run_info.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    command = info.get("command") if isinstance(info, dict) else None
    return command if command in ("validate", "test") else None


def commit_mix(run_dirs: list[str | Path]) -> str:
    """What a table's runs say of the code behind them (each run's ``run_info.json``), when it is not one clean
    commit: ``"N commits (abcdef1 x 3, ...)"``, ``"M of R runs from a dirty tree"``, ``"K runs without run_info.json"``,
    joined by "; "; "" when every run has the same commit and a clean tree."""
    commits: dict[str, int] = {}
    dirty = missing = 0
    for directory in run_dirs:
        try:
            info = json.loads((Path(directory) / "run_info.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            missing += 1
            continue
        commit = str(info.get("git_commit") or "unknown")
        commits[commit] = commits.get(commit, 0) + 1
        dirty += info.get("git_dirty") is True
    notes = []
    if len(commits) > 1:
        shown = sorted(commits.items(), key=lambda item: (-item[1], item[0]))
        notes.append(f"{len(commits)} commits (" + ", ".join(f"{c[:7]} x {n}" for c, n in shown[:3]) + (", ..." if len(shown) > 3 else "") + ")")
    if dirty:
        notes.append(f"{dirty} of {len(run_dirs) - missing} runs from a dirty tree")
    if missing and missing < len(run_dirs):
        notes.append(f"{missing} runs without run_info.json")
    return "; ".join(notes)
