"""What ``kdlab fit`` prints that is the command's own: the CPU threads it chose.

* :func:`choose_cpu_threads`: on a machine without a GPU and without ``OMP_NUM_THREADS`` set, torch's
  intra-op threads are one per CPU this process may use that other work is not keeping busy at the
  start (half a second of ``/proc/stat``, not the load average, which also counts a run that has just
  ended): every usable CPU on an idle machine, every time. The line it prints names the rule.

What every run prints, from ``kdlab fit`` or a notebook's ``Trainer.fit`` alike (the run directory,
progress, the end summary, no noise), is :mod:`kdlab.runlog`'s (``Console``, ``quiet``); imported here too.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from kdlab.runlog import DESCRIPTIONS, Console, describe, quiet, step_progress_bar, summary  # noqa: F401  (their home is kdlab.runlog)


_CHOSEN: list[str] = []  # the line of this process's choice: made once, so runs in one process match


def cgroup_cpu_limit() -> float | None:
    """The CPU quota of this process's control group (a container's ``--cpus``) in CPUs, or None when
    there is none (cgroup v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``)."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def usable_cpus() -> tuple[list[int], int, str]:
    """The CPUs this process may use (its affinity mask: ``taskset``, a scheduler's allocation), how many
    threads they allow (their number, capped by the control group's CPU quota rounded down, at least 1)
    and the words that say so."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    allowed, why = len(cpus), f"{len(cpus)} CPUs this process may use"
    limit = cgroup_cpu_limit()
    if limit is not None and int(limit) < allowed:
        allowed = max(1, int(limit))
        why += f", capped by its CPU quota of {limit:g}"
    return cpus, allowed, why


BUSY_SAMPLE_S = 0.5  # how long choose_cpu_threads watches the CPUs
BUSY_SHARE = 0.5  # a CPU busier than this over the sample counts as taken


def _cpu_times(cpus: list[int]) -> dict[int, tuple[int, int]] | None:
    """``cpu -> (busy, total)`` jiffies of the given CPUs from ``/proc/stat`` (None without it)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    times = {}
    for line in lines:
        name, *fields = line.split() or [""]
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus and len(fields) >= 5:
            values = [int(value) for value in fields[:8]]  # user nice system idle iowait irq softirq steal
            times[int(name[3:])] = (sum(values) - values[3] - values[4], sum(values))
    return times or None


def _own_jiffies() -> float:
    """CPU time this process (all its threads) has used, in ``/proc/stat``'s clock ticks."""
    times = os.times()
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return (times.user + times.system) * ticks


def busy_cpus(cpus: list[int], seconds: float = BUSY_SAMPLE_S) -> int | None:
    """How many of ``cpus`` other work keeps busy now: those busier than :data:`BUSY_SHARE` over
    ``seconds`` (``/proc/stat``), or None where that cannot be read. Unlike the load average it does not
    count work that has just ended, and the time this process's own threads used meanwhile (its main
    thread sleeps; a library's threads may not) is taken off the busiest CPUs first: it is not other work
    (a first run on an idle machine said "1 of them busy now")."""
    before, own = _cpu_times(cpus), _own_jiffies()
    if before is None:
        return None
    time.sleep(seconds)
    after, own = _cpu_times(cpus) or {}, _own_jiffies() - own
    shares = []
    for cpu, (was_busy, was_total) in before.items():
        now_busy, now_total = after.get(cpu, (was_busy, was_total))
        if now_total > was_total:
            shares.append([now_busy - was_busy, now_total - was_total])
    for share in sorted(shares, key=lambda share: -share[0]):
        taken = min(own, share[0])
        share[0], own = share[0] - taken, own - taken
    return sum(busy / total > BUSY_SHARE for busy, total in shares)


PARALLEL_RUNS = "KDLAB_PARALLEL_RUNS"
"""The environment variable by which ``kdlab sweep``'s ``processes`` mode tells each fit it starts how many runs it
runs at a time (``max_parallel``)."""


def parallel_runs() -> int:
    """How many runs share this machine's CPUs (:data:`PARALLEL_RUNS`), 1 when unset; a value that is not a positive
    integer is an error naming the variable."""
    value = os.environ.get(PARALLEL_RUNS, "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{PARALLEL_RUNS} must be a positive integer (the runs sharing the CPUs), got {value!r}")
    return int(value)


def choose_cpu_threads() -> str | None:
    """Set torch's CPU threads when nothing chose them (no GPU, no ``OMP_NUM_THREADS``); returns the line
    to print, which names the rule, or None on a GPU machine. With ``OMP_NUM_THREADS`` set, its count stands (torch
    runs with it) and the line says so: ``[kdlab] CPU threads: 1 (OMP_NUM_THREADS=1)``.

    The rule: one thread per CPU this process may use (:func:`usable_cpus`; divided by :func:`parallel_runs` when
    ``kdlab sweep`` starts several runs together, which would otherwise each see the machine idle and take every
    CPU, oversubscribing it) that is
    not busy with other work at the start (:func:`busy_cpus`: more than half busy over half a second), at least one. On an
    idle machine that is every usable CPU, every time: the 1-minute load average this used to read also
    counted the previous run (1 thread one time, 2 the next). On a busy machine it leaves the taken CPUs
    alone (oversubscribed threads made 20 tiny steps take 124 s against 42 s with one thread). The
    thread count can change the last bits of floating-point results: ``OMP_NUM_THREADS`` fixes it. The
    choice is made once per process, so runs of one process keep one count."""
    import torch

    if torch.cuda.is_available():
        return None
    chosen = os.environ.get("OMP_NUM_THREADS")
    if chosen:
        if chosen.strip().isdigit() and int(chosen) > 0:
            torch.set_num_threads(int(chosen))  # what torch read at start-up; again in case it was set since
        return f"[kdlab] CPU threads: {torch.get_num_threads()} (OMP_NUM_THREADS={chosen})"
    if _CHOSEN:
        return _CHOSEN[0]
    cpus, allowed, why = usable_cpus()
    runs = parallel_runs()
    if runs > 1:
        allowed = max(1, allowed // runs)
        why += f", shared by {runs} runs that kdlab sweep runs at a time"
    busy = busy_cpus(cpus)
    threads = max(1, min(allowed, len(cpus) - (busy or 0)))
    taken = "none of them busy now" if not busy else f"{busy} of them busy now with other work"
    if busy is None:
        taken = "their use not measured (no /proc/stat)"
    torch.set_num_threads(threads)
    _CHOSEN.append(f"[kdlab] CPU threads: {threads} ({why}, {taken}; OMP_NUM_THREADS=N sets N)")
    return _CHOSEN[0]
