"""What ``kdlab fit`` prints: where the run goes, how it progresses, what it measured, and no noise.

* :func:`quiet`: no "Loading weights" bars (transformers), no Lightning tips to install litlogger or
  litmodels, no deprecation warning Lightning's own tree utilities raise under torch 2.13.
* :func:`choose_cpu_threads`: on a machine without a GPU and without ``OMP_NUM_THREADS`` set, torch's
  intra-op threads are one per CPU this process may use that other work is not keeping busy at the
  start (half a second of ``/proc/stat``, not the load average, which also counts a run that has just
  ended): every usable CPU on an idle machine, every time. The line it prints names the rule.
* :class:`Console`: prints the run directory and thread count when fit starts, a line every N steps
  when the output is not a terminal (no progress bar reaches a log file), and at the end a summary of
  each headline metric, named, before -> after where it was measured twice.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "💡 Tip:" not in record.getMessage()


def quiet() -> None:
    """Silence the noise a user cannot act on (see the module docstring)."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_DropTips())
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")
    try:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    except ImportError:
        pass


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


def busy_cpus(cpus: list[int], seconds: float = BUSY_SAMPLE_S) -> int | None:
    """How many of ``cpus`` other work keeps busy now: those busier than :data:`BUSY_SHARE` over
    ``seconds`` (``/proc/stat``; this process sleeps meanwhile), or None where that cannot be read.
    Unlike the load average it does not count work that has just ended."""
    before = _cpu_times(cpus)
    if before is None:
        return None
    time.sleep(seconds)
    after = _cpu_times(cpus) or {}
    busy = 0
    for cpu, (was_busy, was_total) in before.items():
        now_busy, now_total = after.get(cpu, (was_busy, was_total))
        if now_total > was_total and (now_busy - was_busy) / (now_total - was_total) > BUSY_SHARE:
            busy += 1
    return busy


def choose_cpu_threads() -> str | None:
    """Set torch's CPU threads when nothing chose them (no GPU, no ``OMP_NUM_THREADS``); returns the line
    to print, which names the rule, or None when the user or a GPU decides.

    The rule: one thread per CPU this process may use (:func:`usable_cpus`) that is not busy with other
    work at the start (:func:`busy_cpus`: more than half busy over half a second), at least one. On an
    idle machine that is every usable CPU, every time: the 1-minute load average this used to read also
    counted the previous run (1 thread one time, 2 the next). On a busy machine it leaves the taken CPUs
    alone (oversubscribed threads made 20 tiny steps take 124 s against 42 s with one thread). The
    thread count can change the last bits of floating-point results: ``OMP_NUM_THREADS`` fixes it. The
    choice is made once per process, so runs of one process keep one count."""
    import torch

    if os.environ.get("OMP_NUM_THREADS") or torch.cuda.is_available():
        return None
    if _CHOSEN:
        return _CHOSEN[0]
    cpus, allowed, why = usable_cpus()
    busy = busy_cpus(cpus)
    threads = max(1, min(allowed, len(cpus) - (busy or 0)))
    taken = "none of them busy now" if not busy else f"{busy} of them busy now with other work"
    if busy is None:
        taken = "their use not measured (no /proc/stat)"
    torch.set_num_threads(threads)
    _CHOSEN.append(f"[kdlab] CPU threads: {threads} ({why}, {taken}; OMP_NUM_THREADS=N sets N)")
    return _CHOSEN[0]


DESCRIPTIONS = {
    "val/accuracy": "held-out accuracy: mean score of eval_samples completions per val_examples prompt",
    "val/pass@": "held-out pass@k over eval_samples completions per prompt",
    "coverage/": "Coverage callback: pass@k on its own task and draw",
    "ood/mean_delta": "OODForgetting: mean change on the earlier skills, in points",
    "ood/mean": "OODForgetting: mean accuracy on the earlier skills, in percent",
    "sparsity/": "UpdateSparsity: share of parameters that moved less than tau",
    "style/": "StyleTransfer: share of responses primarily in Spanish",
    "rlvr/reward": "RLVR: mean reward of the step's rollouts",
    "train/loss": "training loss of the last step",
    "heldout_kl/forward_closed": "HeldOutKL: share of the starting forward-KL gap to the teacher closed (1 - after / before)",
    "heldout_kl/forward": "HeldOutKL: KL(teacher || student) on held-out teacher text, nats per token",
    "heldout_kl/reverse": "HeldOutKL: KL(student || teacher) on held-out teacher text, nats per token",
}


def describe(name: str) -> str | None:
    """What a headline metric is, or None for the metrics the summary leaves out."""
    if name.count("/") > 2 or name.endswith("_before") or (name.startswith("sparsity/") and name.count("/") > 1):
        return None
    for prefix, text in DESCRIPTIONS.items():
        if name == prefix or (prefix.endswith(("/", "@")) and name.startswith(prefix)):
            return text
    return None


def _value(name: str, value: float) -> str:
    if name.startswith(("ood/", "rlvr/", "train/")) or (name.startswith("heldout_kl/") and not name.endswith("_closed")):
        return f"{value:.4g}"
    return f"{100 * value:.1f}%"


def summary(log_dir: str | Path, final: dict[str, float], step: int) -> list[str]:
    """Lines naming each headline metric with its first and last value (``metrics.jsonl``) or its final
    value (``final``: the trainer's last logged values at ``step``, e.g. ``val/accuracy``). Every step is
    the number of optimiser steps taken (:func:`kdlab.runlog.metrics_lines` with ``optimiser_steps``)."""
    from kdlab.runlog import metrics_lines

    series: dict[str, list[tuple[int, float]]] = {}
    for at, name, value in metrics_lines(Path(log_dir, "metrics.jsonl"), optimiser_steps=True):
        series.setdefault(name, []).append((at, value))
    for name, value in final.items():
        if name not in series:
            series[name] = [(step, float(value))]
    lines = []
    for name in sorted(series):
        text = describe(name)
        if text is None:
            continue
        points = series.get(f"{name}_before", [])[:1] + series[name]  # OODForgetting logs its "before" apart
        (first_step, first), (last_step, last) = points[0], points[-1]
        if len(points) > 1 and first_step != last_step:
            numbers = f"{_value(name, first)} at step {first_step} -> {_value(name, last)} at step {last_step}"
        else:
            numbers = f"{_value(name, last)} at step {last_step}"
        lines.append(f"  {name}: {numbers}  ({text})")
    return lines


class Console(pl.Callback):
    """Run directory at the start, progress lines without a terminal, a named summary at the end."""

    def __init__(self, every_n_steps: int | None = None, stream=None) -> None:
        self.every_n_steps = every_n_steps
        self.stream = stream
        self._start = 0.0
        self._last_printed = -1

    def _print(self, trainer: pl.Trainer, text: str) -> None:
        if trainer.is_global_zero:
            print(text, file=self.stream or sys.stdout, flush=True)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.monotonic()
        log_dir = trainer.log_dir or trainer.default_root_dir  # on every rank: a collective call
        resumed = f", resumed from {trainer.ckpt_path} at its step" if trainer.ckpt_path else ""
        self._print(trainer, f"[kdlab] run directory: {log_dir} (TensorBoard: tensorboard --logdir {Path(log_dir).parent}){resumed}")

    def _interval(self, trainer: pl.Trainer) -> int:
        if self.every_n_steps:
            return self.every_n_steps
        return max(1, trainer.max_steps // 20) if trainer.max_steps and trainer.max_steps > 0 else 50

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        stream = self.stream or sys.stdout
        step = trainer.global_step
        if step == 0 or step == self._last_printed or step % self._interval(trainer) or (stream.isatty() and trainer.progress_bar_callback):
            return
        self._last_printed = step
        loss = trainer.callback_metrics.get("train/loss")
        total = f"/{trainer.max_steps}" if trainer.max_steps and trainer.max_steps > 0 else ""
        elapsed = time.monotonic() - self._start
        self._print(trainer, f"[kdlab] step {step}{total}" + (f" train/loss={float(loss):.4g}" if loss is not None else "") + f" ({elapsed:.0f} s)")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        log_dir = trainer.log_dir or trainer.default_root_dir
        final = {name: float(value) for name, value in trainer.callback_metrics.items() if name.startswith(("val/", "train/loss"))}
        lines = summary(log_dir, final, trainer.global_step)
        elapsed = time.monotonic() - self._start
        self._print(trainer, "\n".join([f"[kdlab] fit finished at step {trainer.global_step} in {elapsed:.0f} s; results in {log_dir} (a step is an optimiser step: step N is after N of them)", *lines]))


def step_progress_bar():
    """A Rich progress bar counted in optimiser steps when the run is bounded by ``max_steps``:
    ``Step 73/150`` (Lightning's reads ``Epoch 0/-2`` and, after a resume, ``150/78``), without the
    logger's ``v_num``. The class is made on first use (Rich is imported only then)."""
    from lightning.pytorch.callbacks import RichProgressBar

    class StepProgressBar(RichProgressBar):
        def _by_steps(self) -> bool:
            return bool(self.trainer.max_steps and self.trainer.max_steps > 0)

        @property
        def total_train_batches(self):
            return self.trainer.max_steps if self._by_steps() else super().total_train_batches

        def _get_train_description(self, current_epoch: int) -> str:
            if self._by_steps():
                return f"{'Step':{len(self.validation_description)}}"
            epochs = self.trainer.max_epochs
            return f"Epoch {current_epoch}" + (f"/{epochs - 1}" if epochs and epochs > 0 else "")

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            super().on_train_epoch_start(trainer, pl_module)
            if self._by_steps():
                self._update(self.train_progress_bar_id, trainer.global_step)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            if self._by_steps():
                self._update(self.train_progress_bar_id, trainer.global_step)

        def get_metrics(self, trainer, pl_module):
            metrics = super().get_metrics(trainer, pl_module)
            metrics.pop("v_num", None)
            return metrics

    return StepProgressBar
