"""One sweep run launched as several processes: the tasks of a SLURM job step (``srun``, ``--ntasks-per-node`` =
``trainer.devices``) or of ``torchrun``, each running the same ``kdlab sweep --run NAME`` (or a pipeline's ``--run``
line). Lightning makes them one multi-process fit; what comes before and after the fit must happen once.

:func:`current` tells this process's rank among them, from the environments Lightning itself detects
(``TorchElasticEnvironment``, then ``SLURMEnvironment``); :func:`agree_on_start` lets rank 0 prepare the run's folder
and choose the checkpoint to resume from while the other ranks wait for its choice and check it against the folder
before they fit. The choice travels in a small file, so every rank must see the sweep's output folder (a shared file
system, as multi-node checkpoints need anyway).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

WAIT_S = 900.0  # how long a rank other than 0 waits for rank 0's choice (rank 0 may be moving a large folder aside)
SKEW_S = 300.0  # a note written this long before this process started is an earlier launch's, whatever its id
STARTED = time.time()  # about when this process started (this module is imported before any run is prepared)


@dataclass(frozen=True)
class Launch:
    """This process's ``rank`` of ``world`` processes started together for one run, and an ``id`` that tells this
    launch from an earlier one of the same run (a requeued job keeps its job id; its restart count moves on)."""

    rank: int = 0
    world: int = 1
    id: str = ""

    @property
    def several(self) -> bool:
        return self.world > 1


def current() -> Launch:
    """This process's place in a multi-process launch Lightning detects (torchrun's ``RANK``/``WORLD_SIZE``, else
    SLURM's ``SLURM_PROCID``/``SLURM_NTASKS`` outside an interactive job), or a launch of one."""
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    env = os.environ
    if TorchElasticEnvironment.detect():
        return Launch(int(env["RANK"]), int(env["WORLD_SIZE"]),
                      f"torchrun {env.get('TORCHELASTIC_RUN_ID', '')} {env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')} "
                      f"restart {env.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    if SLURMEnvironment.detect() and int(env.get("SLURM_NTASKS", "1")) > 1:
        return Launch(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                      f"slurm {env.get('SLURM_JOB_ID', '')}.{env.get('SLURM_STEP_ID', '')} restart {env.get('SLURM_RESTART_COUNT', '0')}")
    return Launch()


def refuse_several(command: str) -> None:
    """``ValueError`` when this process is one of several launched together: each would run ``command``'s whole grid."""
    me = current()
    if me.several:
        raise ValueError(f"{command} was started as {me.world} processes ({me.id}), each of which would run the whole grid: "
                         "give each launch one run, with --run (what print mode's lines do)")


def agree_on_start(launch: Launch, note: Path, prepare: Callable[[], str | None], newest: Callable[[], str | None]) -> str | None:
    """The checkpoint every rank of ``launch`` resumes from (None: a fresh start). Rank 0 calls ``prepare`` (which may
    move the run's folder aside) and writes its answer to ``note`` with the launch's id; every other rank waits for that
    note (at most :data:`WAIT_S`), then checks it against ``newest()``, the newest checkpoint it finds itself, so that a
    note left by an earlier launch with the same id can only fail loudly, never make ranks resume from different
    states. Raises ``RuntimeError`` naming the note. A launch of one process just calls ``prepare``."""
    if not launch.several:
        return prepare()
    if launch.rank == 0:
        try:
            resume = prepare()
        except Exception as error:  # the other ranks stop waiting at once, naming rank 0's failure
            _write_note(note, {"launch": launch.id, "error": f"{type(error).__name__}: {error}"})
            raise
        _write_note(note, {"launch": launch.id, "resume": resume})
        return resume
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            told = json.loads(note.read_text(encoding="utf-8")) if note.stat().st_mtime >= STARTED - SKEW_S else None
        except (OSError, ValueError):
            told = None
        if told is not None and told.get("launch") == launch.id:
            if "error" in told:
                raise RuntimeError(f"rank 0 failed to prepare the run ({told['error']}; {note})")
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {launch.rank} of {launch.world} waited {WAIT_S:.0f} s for rank 0 to write {note} "
                               f"(launch {launch.id!r}); is rank 0 running, and does every rank see that folder?")
        time.sleep(0.5)
    if told["resume"] != newest():
        raise RuntimeError(f"{note} (launch {launch.id!r}) says rank 0 resumes from {told['resume']}, but rank {launch.rank} finds "
                           f"{newest()}: a note from an earlier launch with the same id? Remove it and launch again")
    return told["resume"]


def finish(launch: Launch, note: Path) -> None:
    """Rank 0 removes its note once the fit is over, finished or not (a later launch must not read it)."""
    if launch.rank == 0 and launch.several:
        note.unlink(missing_ok=True)


def _write_note(note: Path, content: dict) -> None:
    note.parent.mkdir(parents=True, exist_ok=True)
    partial = note.with_name(note.name + ".partial")
    partial.write_text(json.dumps(content), encoding="utf-8")
    partial.replace(note)


DISTRIBUTED_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                         "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                         "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE")


def child_environment() -> dict[str, str]:
    """This process's environment without the launch's distributed variables (torchrun's ranks and rendezvous), for a
    process rank 0 starts on its own after the fit (the forgetting measurement), which would otherwise join, or wait
    for, ranks that have already exited."""
    return {key: value for key, value in os.environ.items() if key not in DISTRIBUTED_VARIABLES}
