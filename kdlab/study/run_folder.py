"""A sweep run's folder between fits: the checkpoint a new fit resumes from (:func:`prepare`, :func:`newest_checkpoint`),
an unresumable folder moved aside (:func:`move_aside`), and the ``DONE`` summary a finished fit leaves
(:func:`mark_done`). :mod:`kdlab.study.sweep` and :mod:`kdlab.study.pipeline` run the fits."""

from __future__ import annotations

import json
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kdlab.study.grid import Run


def prepare(run_dir: Path) -> str | None:
    """The checkpoint to resume from: the newest full training state in ``checkpoints/`` (``on_exception.ckpt``,
    which a run stopped by an exception or SIGTERM saves, ``last.ckpt``, or a ``ModelCheckpoint`` file such as
    ``epoch=0-step=60.ckpt``, a file or a sharded checkpoint's folder; never the weights-only ``final.ckpt``), or
    None after moving what an unfinished run left behind aside (:func:`move_aside`). A run killed outright (SIGKILL, a lost machine) while
    its end-of-fit evaluations ran thus resumes from the last step's checkpoint and evaluates again, instead of
    losing its training."""
    newest = newest_checkpoint(run_dir)
    if newest is None and run_dir.exists():
        move_aside(run_dir)
    return newest


def newest_checkpoint(run_dir: Path) -> str | None:
    """The newest full training state in ``run_dir/checkpoints/`` (never ``final.ckpt``), or None; reads only."""
    folder = run_dir / "checkpoints"
    saved = [path for path in folder.glob("*.ckpt") if path.name != "final.ckpt" and path.exists()] if folder.is_dir() else []
    return str(max(saved, key=lambda path: path.stat().st_mtime)) if saved else None


def move_aside(run_dir: Path) -> Path | None:
    """Clear ``run_dir`` for a fresh start without losing what it holds: a folder with any file in it is
    renamed to ``<name>.unresumable-<UTC time>`` beside it (and said so on stderr); one with no file at all
    is removed. Returns where it went (``None``: nothing was kept)."""
    if not any(path.is_file() for path in run_dir.rglob("*")):
        shutil.rmtree(run_dir)
        return None
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    target = run_dir.with_name(f"{run_dir.name}.unresumable-{stamp}")
    run_dir.rename(target)
    print(f"kdlab sweep: {run_dir} has no checkpoint to resume from; moved aside to {target} and started afresh", file=sys.stderr, flush=True)
    return target


def write_json(path: Path, data: Any) -> None:
    partial = path.with_name(path.name + ".partial")  # never leave half a file behind on interruption
    partial.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    partial.replace(path)


def mark_done(run_dir: Path, run: Run, started: float, resumed_from: str | None, **extra: Any) -> None:
    summary = {
        "name": run.name,
        "seed": run.seed,
        "settings": run.settings,
        "resumed_from": resumed_from,
        "seconds": round(time.time() - started, 2),
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }
    write_json(run_dir / "DONE", summary)
