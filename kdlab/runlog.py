"""A run's folder, its metrics file, its evaluation samples and what it prints.

Every number a run logs reaches ``<log_dir>/metrics.jsonl`` through one Lightning logger,
:class:`MetricsFile`: the stages' ``self.log`` values (at Lightning's ``log_every_n_steps``) and the
callbacks' numbers (:func:`log_metrics`) alike, one ``{"step": ..., "<name>": value}`` object per call.
Each stage attaches it beside the Trainer's own loggers (TensorBoard by default) when it is set up, so
a sweep is tabulated from one file per run (:mod:`kdlab.study.runs`) and TensorBoard shows the same
numbers. The file is appended to and flushed on every call: a killed run keeps every line it logged,
and a resumed run continues the same file (:func:`kdlab.cli.resume.trim_logs` first drops the lines
written after its checkpoint).

Steps: every number a run logs is at the optimiser steps taken (``trainer.global_step``): TensorBoard,
``metrics.jsonl``, the progress lines, the end summary, ``samples/<split>-stepNNNNNN.jsonl`` and the
callbacks' lines (:func:`log_metrics`) all say step 150 after 150 optimiser steps.
:func:`log_at_optimiser_steps` makes Lightning's ``self.log`` lines (they carry ``epoch``) follow it: by
itself Lightning records them at its logger step, which counts the steps before the current one (the
``train/loss`` and ``val/accuracy`` of step 150 at 149). Their lines in ``metrics.jsonl`` carry
``"steps": "optimiser"``; runs written before carry no such mark, and :func:`metrics_lines` with
``optimiser_steps=True`` moves their Lightning lines one step on, so old and new runs read alike.

What a run prints, from ``kdlab fit`` or a notebook's ``Trainer.fit`` alike (every
:class:`~kdlab.stages.base.TaskStage` adds :class:`Console` and calls :func:`quiet`):

* :func:`quiet`: no "Loading weights" bars (transformers), no Lightning tips to install litlogger or
  litmodels, no deprecation warning Lightning's own tree utilities raise under torch 2.13.
* :class:`Console`: prints the run directory when fit starts, a line every N steps when no progress bar
  shows (a log file), Lightning's default bar counted in optimiser steps (:func:`step_progress_bar`), and
  at the end a summary of each headline metric, named, before -> after where it was measured twice."""

from __future__ import annotations

import json
import logging
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities import rank_zero_only

METRICS_FILE = "metrics.jsonl"
STEPS_MARK = ("steps", "optimiser")  # on a Lightning line of metrics.jsonl: its step is the optimiser step count


class MetricsFile(Logger):
    """A Lightning logger that appends every ``log_metrics`` call to ``<directory>/metrics.jsonl``
    (rank 0 only). It does not pick a folder of its own: ``directory`` is the run's log directory
    (:func:`run_directory`), and ``name``/``version`` are empty so a checkpoint folder derived from it
    is ``<directory>/checkpoints``. Hyperparameters are not written: the CLI saves ``config.yaml``."""

    def __init__(self, directory: str | Path) -> None:
        super().__init__()
        self.directory = Path(directory)
        self.optimiser_steps = False  # set by log_at_optimiser_steps: Lightning's lines then carry STEPS_MARK

    @property
    def name(self) -> str:
        return ""

    @property
    def version(self) -> str:
        return ""

    @property
    def save_dir(self) -> str:
        return str(self.directory)

    @property
    def log_dir(self) -> str:
        return str(self.directory)

    @property
    def path(self) -> Path:
        return self.directory / METRICS_FILE

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if step is None:
            raise ValueError("MetricsFile.log_metrics needs a step: every line of metrics.jsonl names one")
        values: dict[str, Any] = {name: float(value) for name, value in metrics.items()}
        if self.optimiser_steps and "epoch" in values:
            values[STEPS_MARK[0]] = STEPS_MARK[1]
        self.directory.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({"step": int(step), **values}) + "\n")

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        return None


def run_directory(trainer: pl.Trainer) -> str:
    """The run's log directory. Call it on every rank: ``Trainer.log_dir`` is a collective broadcast."""
    return trainer.log_dir or trainer.default_root_dir


def metrics_file(trainer: pl.Trainer) -> MetricsFile:
    """The trainer's :class:`MetricsFile`, appended to ``trainer.loggers`` on first use (in the run's
    directory). Call it on every rank: it reads :func:`run_directory`."""
    for logger in trainer.loggers:
        if isinstance(logger, MetricsFile):
            return logger
    logger = MetricsFile(run_directory(trainer))
    trainer.loggers = [*trainer.loggers, logger]
    return logger


def log_at_optimiser_steps(trainer: pl.Trainer) -> None:
    """Send Lightning's own ``self.log`` lines to every logger at ``trainer.global_step`` (the optimiser
    steps taken) instead of its logger step, one lower during fit (the module docstring's "Steps"), and
    mark them so in the run's :class:`MetricsFile`. Idempotent; call it on every rank after
    :func:`metrics_file`."""
    for logger in trainer.loggers:
        if isinstance(logger, MetricsFile):
            logger.optimiser_steps = True
    connector = trainer._logger_connector
    if getattr(connector, "_kdlab_optimiser_steps", False):
        return
    lightning_log_metrics = connector.log_metrics

    def log_metrics(metrics, step=None):
        if metrics and step is None and "step" not in metrics:  # the lines of self.log (Lightning adds epoch to them)
            metrics = {**metrics, "epoch": trainer.current_epoch}
            step = trainer.global_step
        lightning_log_metrics(metrics, step=step)

    connector.log_metrics = log_metrics
    connector._kdlab_optimiser_steps = True


def rewrite_file(path: str | Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` through a temporary file beside it and a rename: an interruption
    leaves the old file or the new one, never half of one."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    partial.replace(path)


def log_metrics(trainer: pl.Trainer, metrics: dict[str, float], step: int | None = None) -> None:
    """Send ``metrics`` at ``step`` (default: the global step) to every logger of the trainer, the
    run's :class:`MetricsFile` included. Call it on every rank."""
    metrics_file(trainer)
    step = trainer.global_step if step is None else step
    values = {name: float(value) for name, value in metrics.items()}
    for logger in trainer.loggers:
        logger.log_metrics(values, step=step)


def write_samples(trainer: pl.Trainer, split: str, records: list[dict[str, Any]]) -> Path:
    """Write one evaluation's per-example ``records`` (JSON objects) to
    ``<log_dir>/samples/<split>-step<global step, 6 digits>[-rank<r>].jsonl`` and return that path; under
    several processes each rank writes the shard it evaluated. Call it on every rank (it reads
    :func:`run_directory`). :func:`kdlab.cli.resume.trim_logs` drops the files of steps after a checkpoint."""
    rank = f"-rank{trainer.global_rank}" if trainer.world_size > 1 else ""
    path = Path(run_directory(trainer)) / "samples" / f"{split}-step{trainer.global_step:06d}{rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def metrics_lines(path: str | Path, optimiser_steps: bool = False) -> Iterator[tuple[int, str, float]]:
    """``(step, name, value)`` for every scalar of a ``metrics.jsonl`` file, in file order (none if it
    does not exist), at the step the line records; with ``optimiser_steps`` at the number of optimiser
    steps taken, and without Lightning's ``epoch``: the step a line records, except a Lightning line (it
    carries ``epoch``) written before kdlab logged at optimiser steps (no ``"steps": "optimiser"``), one
    later (the module docstring's "Steps")."""
    path = Path(path)
    if not path.is_file():
        return
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            step = int(row.pop("step"))
            marked = row.pop(STEPS_MARK[0], None) == STEPS_MARK[1]
            if optimiser_steps and "epoch" in row:
                step += 0 if marked else 1
                row.pop("epoch")
            for name, value in row.items():
                yield step, name, float(value)


# ---- what a run prints ------------------------------------------------------------------------
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


DESCRIPTIONS = {
    "val/accuracy": "held-out accuracy: mean score of eval_samples completions per val_examples prompt",
    "val/pass@": "held-out pass@k over eval_samples completions per prompt",
    "coverage/": "Coverage callback: pass@k on its own task and draw",
    "ood/mean_delta": "OODForgetting: mean change on the earlier skills, in points",
    "ood/mean": "OODForgetting: mean accuracy on the earlier skills, in percent",
    "sparsity/": "UpdateSparsity: share of parameters that moved less than tau",
    "style/log_odds_spanish_share": "StyleLogOdds: share of prompts where the Spanish answer is likelier than the English",
    "style/log_odds_delta": "StyleLogOdds: change of the log-odds since the start of fit, nats per token",
    "style/log_odds": "StyleLogOdds: log-odds of a Spanish over an English correct answer, nats per token",
    "style/": "StyleTransfer: share of responses primarily in Spanish",
    "rlvr/reward_mean": "RLVR: mean reward of the step's rollouts",
    "train/loss": "training loss of the last step's last micro-batch, mean over the ranks",
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
    log_odds = name.startswith("style/log_odds") and not name.startswith("style/log_odds_spanish_share")
    if name.startswith(("ood/", "rlvr/", "train/")) or log_odds or (name.startswith("heldout_kl/") and not name.endswith("_closed")):
        return f"{value:.4g}"
    return f"{100 * value:.1f}%"


def summary(log_dir: str | Path, final: dict[str, float], step: int) -> list[str]:
    """Lines naming each headline metric with its first and last value (``metrics.jsonl``) or its final
    value (``final``: the trainer's last logged values at ``step``, e.g. ``val/accuracy``). Every step is
    the number of optimiser steps taken (:func:`metrics_lines` with ``optimiser_steps``)."""
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

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Lightning's default Rich bar (``Epoch 0/-2`` under ``max_steps``) becomes :func:`step_progress_bar`'s."""
        from lightning.pytorch.callbacks import RichProgressBar

        for index, callback in enumerate(trainer.callbacks):
            if type(callback) is RichProgressBar:
                bar = trainer.callbacks[index] = step_progress_bar()()
                bar.setup(trainer, pl_module, stage)

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
        step = trainer.global_step
        if step == 0 or step == self._last_printed or step % self._interval(trainer) or trainer.progress_bar_callback is not None:
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
