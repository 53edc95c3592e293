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
    """The ``kdlab_log_position`` a checkpoint file recorded (see ``CheckpointedStage.on_save_checkpoint``), read
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


# ---- what a fit may start from ----------------------------------------------------------------------
LIGHTNING_CKPT_KEYWORDS = ("last", "best", "hpc", "registry")  # --ckpt_path values Lightning resolves itself


def check_ckpt_path(ckpt_path: str | None) -> None:
    """Refuse ``--ckpt_path`` naming a missing file, or a file that is not a PyTorch checkpoint (torch saves a
    zip archive: a truncated file or another kind fails here), naming the option, before any weights load.
    A folder (a sharded checkpoint), a URL and Lightning's keywords pass (Lightning reads them)."""
    import zipfile

    from kdlab.errors import ConfigError

    if not ckpt_path or "://" in str(ckpt_path) or str(ckpt_path).split(":")[0] in LIGHTNING_CKPT_KEYWORDS:
        return
    path = Path(ckpt_path)
    if path.is_dir():
        return
    if not path.exists():
        raise ConfigError(f"ckpt_path={str(ckpt_path)!r}: no such file or folder")
    if not zipfile.is_zipfile(path):
        raise ConfigError(f"ckpt_path={str(ckpt_path)!r} is not a PyTorch checkpoint (not the zip archive torch.save writes: "
                          f"truncated, or another kind of file)")


def saved_hyperparameters(ckpt_path: str | Path) -> bool:
    """Whether a checkpoint file holds a module's saved hyperparameters, read memory-mapped (nothing but the
    small entries is read from disk)."""
    import torch

    checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)
    return bool(checkpoint.get("hyper_parameters"))


def check_fresh_run_directory(checkpoints: Path) -> None:
    """Refuse a fit without ``--ckpt_path`` whose checkpoint folder already holds checkpoints (an explicit
    logger version, ``logger: false``, or a sweep's folder run again): Lightning would write over them, and the
    new run's files would mix with the old run's."""
    from kdlab.errors import ConfigError

    found = sorted(path.name for path in checkpoints.glob("*.ckpt")) if checkpoints.is_dir() else []
    if found:
        shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
        resumable = [name for name in found if name != "final.ckpt"]
        how = f"resume it with --ckpt_path={checkpoints / resumable[0]}" if resumable else "it finished (final.ckpt)"
        raise ConfigError(f"{checkpoints} already holds checkpoints of another fit ({shown}): {how}, or start this run in a new folder "
                          f"(another --trainer.logger.init_args.version or name, or --trainer.default_root_dir)")


def check_no_requeue_state(root: Path) -> None:
    """Under SLURM, Lightning resumes a fit given no ``--ckpt_path`` from the newest ``hpc_ckpt_<n>.ckpt`` its own
    requeue left in ``trainer.default_root_dir`` (``runs/`` for every kdlab fit by default, so any run's), without
    kdlab's checks: refuse such a fit, naming the file."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    from kdlab.errors import ConfigError

    found = sorted(root.glob("hpc_ckpt_*.ckpt")) if root.is_dir() else []
    if found and SLURMEnvironment.detect():
        raise ConfigError(f"{found[-1]} is Lightning's SLURM requeue state, and Lightning would resume this fresh fit from it, "
                          "whatever run wrote it: resume that run with --ckpt_path, or move the file away (requeue kdlab sweep's "
                          "--run line instead: it resumes each run from its own checkpoints)")


RUN_CONFIG_MARK = "# Written by "
"""How a ``config.yaml`` that :mod:`kdlab.run_config` wrote for a run built in Python begins."""

RESUMABLE_TRAINER_KEYS = ("accumulate_grad_batches", "precision", "devices", "num_nodes", "strategy")
"""Trainer settings a resumed fit must keep (the effective batch, the numerics, the data's split over processes)."""

RESUME_MAY_CHANGE = frozenset({
    # evaluation
    "val_batch_size", "val_examples", "val_temperature", "eval_samples", "eval_ks",
    # how, not what, is computed
    "chunk_size", "teacher_placement", "fused_lm_head", "micro_batch_size", "max_bad_steps", "export_dir",
    # a served teacher's connection
    "url", "timeout_s", "retries", "backoff_s", "concurrency", "request_prompts", "decode_workers", "prefetch", "api_key_env",
    # an engine's memory
    "gpu_memory_utilization", "enforce_eager",
})
"""``model`` keys (at any depth) a resumed fit may change: they change how a step is computed or evaluated, not
what it trains on (a fit resumed after a preemption or an out-of-memory error may need them changed)."""

PRECISION_SPELLINGS = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true"}


def _canonical_class(path: Any) -> Any:
    """A ``class_path`` as the class it imports to (``kdlab.objectives.ForwardKL`` and ``kdlab.objectives.kl.ForwardKL``
    are one class); a path that does not import stays as it is."""
    import importlib

    if not isinstance(path, str) or "." not in path:
        return path
    module, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return path
    return f"{found.__module__}.{found.__qualname__}" if isinstance(found, type) else path


def changed_settings(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The settings a resumed fit changed from the run's saved ``config.yaml``, each as ``key: old -> new``: every
    ``model`` key but :data:`RESUME_MAY_CHANGE`, a component given on one side and not the other (``objective:
    null`` against a class) included, each ``class_path`` compared as the class it imports to; and the
    :data:`RESUMABLE_TRAINER_KEYS`, where neither side leaves it to Lightning (``auto``). A key only one side
    has (one a newer kdlab added) is no change."""
    from kdlab.run_config import flat_settings

    old, new = flat_settings(saved.get("model") or {}, "model"), flat_settings(now.get("model") or {}, "model")

    def kept(key: str) -> bool:
        return not RESUME_MAY_CHANGE.intersection(key.split("."))

    changes = []
    for key in old:
        if not kept(key):
            continue
        if key in new:
            before, after = old[key], new[key]
            if key.endswith(".class_path") or key == "model.class_path":
                before, after = _canonical_class(before), _canonical_class(after)
            if before != after:
                changes.append(f"{key}: {old[key]!r} -> {new[key]!r}")
        elif any(other.startswith(key + ".") for other in new):  # None here, a component there
            changes.append(f"{key}: {old[key]!r} -> {new.get(key + '.class_path', '{...}')!r}")
    for key in new:
        if kept(key) and key not in old and any(other.startswith(key + ".") for other in old) and new[key] is None:
            changes.append(f"{key}: {old.get(key + '.class_path', '{...}')!r} -> None")
    for key in RESUMABLE_TRAINER_KEYS:
        before, after = (saved.get("trainer") or {}).get(key), (now.get("trainer") or {}).get(key)
        if before is None or after is None or "auto" in (before, after):
            continue
        if key == "precision":
            before, after = PRECISION_SPELLINGS.get(str(before), str(before)), PRECISION_SPELLINGS.get(str(after), str(after))
        if before != after:
            changes.append(f"trainer.{key}: {before!r} -> {after!r}")
    return changes


def check_resumed_settings(config_path: Path, now: dict[str, Any]) -> None:
    """Refuse to resume when the command changes what the run trains (:func:`changed_settings` against the run's
    ``config.yaml``): a resumed fit restores the optimiser (its learning rate and schedule), the data position and
    the weights from the checkpoint, so a changed ``lr``, batch size, device count or component would be silently
    ignored or would skip or repeat data. Settings outside those keys (``max_steps``, callbacks, logging) may change."""
    import yaml

    from kdlab.errors import ConfigError

    if not config_path.is_file():
        return
    text = config_path.read_text(encoding="utf-8")
    if text.startswith(RUN_CONFIG_MARK):  # a run started from Python: its file describes objects, not kdlab fit's settings
        return
    saved = yaml.safe_load(text) or {}
    changed = changed_settings(saved, now)
    if changed:
        raise ConfigError(f"resuming {config_path.parent} with settings its config.yaml does not have: " + "; ".join(changed[:6])
                          + ("; ..." if len(changed) > 6 else "") + ". A resumed fit keeps the checkpoint's optimiser, data position "
                          "and weights: run it with the run's own settings, or train on from its weights in a new run "
                          "(--model.student.checkpoint or --model.policy.checkpoint: <that file>)")
