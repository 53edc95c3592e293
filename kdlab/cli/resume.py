"""Resume into the same logs.

Resuming (``kdlab fit --config X.yaml --ckpt_path <run>/checkpoints/<file>.ckpt``) continues in the run
directory the checkpoint came from (:func:`resume_version`), after :func:`trim_logs` removed what the
interrupted run logged after the checkpoint was written, so the run's TensorBoard scalars,
``metrics.jsonl`` and ``samples/`` end up as an uninterrupted run's, step for step. ``metrics.jsonl`` and
event files are rewritten through a temporary file and a rename (:func:`kdlab.runlog.rewrite_file`)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any


# ---- resuming into the same run directory ----------------------------------------------------------
def resume_version(save_dir: str | Path, name: str, ckpt_path: str | Path) -> int | None:
    """N when ``ckpt_path`` lies inside ``<save_dir>/<name>/version_N/`` (the logger's run directory),
    else None: a resumed run then continues in that directory instead of opening ``version_{N+1}``."""
    try:
        relative = Path(ckpt_path).resolve().relative_to((Path(save_dir) / name).resolve())
    except ValueError:
        return None
    match = re.fullmatch(r"version_(\d+)", relative.parts[0]) if len(relative.parts) > 1 else None
    return int(match.group(1)) if match else None


def log_position(ckpt_path: str | Path) -> dict[str, Any] | None:
    """The ``kdlab_log_position`` a checkpoint file recorded (see ``TaskStage.on_save_checkpoint``), read
    with ``weights_only=True`` and memory-mapped; None for a directory (a sharded checkpoint), a
    checkpoint without one, or a weights-only one such as ``final.ckpt`` (the fit then stops at the
    restore, :class:`~kdlab.callbacks.checkpoints.FinalCheckpoint`, before anything is trimmed)."""
    import torch

    path = Path(ckpt_path)
    if not path.is_file():
        return None
    checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if "optimizer_states" not in checkpoint:  # weights only (final.ckpt): it cannot resume, the logs stay as they are
        return None
    return checkpoint.get("kdlab_log_position")


def trim_logs(log_dir: str | Path, position: dict[str, Any]) -> dict[str, int]:
    """Remove from ``log_dir`` what a run logged after the checkpoint at ``position`` was written and a
    run resumed from it logs again: scalars written after the save for a step after the checkpoint's
    (TensorBoard events, ``metrics.jsonl`` lines) and ``samples/*-stepNNNNNN*.jsonl`` files written after
    the save for such a step. A step after the checkpoint's is one beyond ``position["global_step"]`` (the
    optimiser steps it holds, every number's step since kdlab logs at optimiser steps:
    :func:`kdlab.runlog.log_at_optimiser_steps`); for Lightning's lines of a run from before that (they
    carry ``epoch`` and no ``"steps": "optimiser"``; events when ``position`` lacks ``"steps"``) one at or
    beyond ``position["step"]``, the logger step of the next batch. Lines and events from before the save
    stay, so do values logged after it that the resumed run does not repeat (the checkpoint batch's own
    scalars). Returns the counts removed."""
    from kdlab.runlog import STEPS_MARK, rewrite_file

    log_dir = Path(log_dir)
    saved, step, global_step = float(position["time"]), int(position["step"]), int(position["global_step"])
    first_late_event = global_step + 1 if position.get(STEPS_MARK[0]) == STEPS_MARK[1] else step
    removed = {"events": 0, "metrics_lines": 0, "samples": 0}
    for events in sorted(log_dir.glob("events.out.tfevents.*")):
        removed["events"] += _trim_event_file(events, saved, first_late_event)
    metrics = log_dir / "metrics.jsonl"
    if metrics.is_file():
        data = metrics.read_bytes()
        head, tail = data[: int(position["metrics_bytes"])], data[int(position["metrics_bytes"]) :]
        kept = []
        for line in tail.decode("utf-8", errors="replace").splitlines(keepends=True):
            try:
                row = json.loads(line)
                old_lightning_line = "epoch" in row and row.get(STEPS_MARK[0]) != STEPS_MARK[1]
                late = int(row["step"]) >= step if old_lightning_line else int(row["step"]) > global_step
            except (ValueError, KeyError, TypeError):
                late = False
            removed["metrics_lines"] += late
            if not late:
                kept.append(line)
        if removed["metrics_lines"]:
            rewrite_file(metrics, head + "".join(kept).encode("utf-8"))
    for sample in sorted((log_dir / "samples").glob("*.jsonl")):
        match = re.search(r"-step(\d+)", sample.name)
        if match and int(match.group(1)) > global_step and sample.stat().st_mtime > saved:
            sample.unlink()
            removed["samples"] += 1
    return removed


def _trim_event_file(path: Path, saved: float, step: int) -> int:
    """Rewrite one TensorBoard event file without its events written after ``saved`` (wall time) at a
    step >= ``step``; returns how many were dropped (the file is untouched when none)."""
    from tensorboard.backend.event_processing.event_file_loader import (
        RawEventFileLoader,
    )
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    records = list(RawEventFileLoader(str(path)).Load())
    kept = []
    for record in records:
        event = Event.FromString(record)
        if not (event.wall_time > saved and event.step >= step and event.HasField("summary")):
            kept.append(record)
    if len(kept) == len(records):
        return 0
    temporary = path.with_name(path.name + ".trimmed")
    with temporary.open("wb") as handle:
        writer = RecordWriter(handle)
        for record in kept:
            writer.write(record)
        writer.flush()
    temporary.replace(path)
    return len(records) - len(kept)
