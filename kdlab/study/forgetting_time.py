"""The wall time of the lm-eval forgetting suite measured off the training loop (``kdlab forgetting``, a sweep's
``forgetting:`` key; :mod:`kdlab.evaluation.forgetting`), for ``kdlab estimate --forgetting SWEEP.yaml``.

Off the loop the suite scores saved weights in a process of its own: the student the run started from
("before") and the run's final weights ("after"), each one pass of the suite (:data:`~kdlab.study.run_time.LM_EVAL_COST`'s
requests, lengths at their caps), data-parallel over ``devices`` GPUs (the sweep's ``forgetting.devices``, default
the run's GPUs): each GPU scores ``ceil(requests / devices)`` of every task. Per GPU and task:

* back end ``auto`` or ``vllm`` (``auto`` is vLLM where it is installed with CUDA: a GPU run is assumed to have it):
  the weights in ``dtype`` (``auto``: bfloat16), lm-eval hands vLLM a task's requests at once (``batch_size="auto"``)
  and vLLM runs at most :data:`VLLM_MAX_NUM_SEQS` of them together, so a generation task is ``ceil(share / 256)``
  decodes of up to 256 rows, each :func:`~kdlab.study.step_time.decode_seconds` with the ``vllm`` back end (CUDA
  graphs: device time only, the published decode efficiency of :data:`~kdlab.study.step_time.HARDWARE`); a
  multiple-choice task is one forward over its ``share x CHOICES`` prompts (FLOPs at ``train_efficiency``);
* back end ``hf``: lm-eval's Hugging Face model, in batches of ``batch_size``, each decode with kdlab's per-token
  host cost (as the in-loop suite, :func:`~kdlab.study.run_time.lm_eval_seconds`, but in ``dtype``).

The before score is measured once per student and suite and reused by every run of the grid that starts from it
(:class:`~kdlab.evaluation.before_cache.BeforeCache`): a run's share is ``before / runs per student``, where the
grid's runs per student are its runs (grid product x seeds) over its distinct students (the product of the
grid keys under ``model.student`` or ``model.policy``; 1 when the grid does not vary the student). The after score
is one pass per run. Not counted: exporting the weights to a Hugging Face folder, starting the engine (loading the
weights, capturing CUDA graphs), lm-eval's own work (tokenising, scoring, HumanEval's code execution).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kdlab.study.run_time import CHOICES, LM_EVAL_COST, suite_names
from kdlab.study.setups import BYTES, Setup
from kdlab.study.step_time import Hardware, decode_seconds, forward_seconds

VLLM_MAX_NUM_SEQS = 256
VLLM_SOURCE = ("vLLM's engine argument --max-num-seqs, the most sequences one iteration runs, default 256 "
               "(https://docs.vllm.ai/en/v0.8.5/serving/engine_args.html)")
STUDENT_KEYS = ("model.student", "model.policy")  # grid keys (and keys below them) that change the student a run starts from


@dataclass
class OffLoop:
    """The off-loop suite's seconds for one run: ``before`` (one pass on the start student), shared by
    ``runs_per_student`` runs, and ``after`` (one pass on the run's final weights)."""

    before: float
    after: float
    runs_per_student: int
    backend: str
    devices: int

    @property
    def before_share(self) -> float:
        return self.before / self.runs_per_student

    def evaluations(self) -> dict[str, float]:
        """:class:`~kdlab.study.run_time.RunTime` evaluations: the run's share of the before pass, and its after pass."""
        return {f"forgetting before (off the loop, 1/{self.runs_per_student})": self.before_share,
                "forgetting after (off the loop)": self.after}


def suite_pass_seconds(setup: Setup, tasks: Any, hardware: Hardware, backend: str = "vllm", dtype: str = "bfloat16",
                       devices: int = 1, batch_size: int = 8) -> float:
    """One pass of the suite ``tasks`` on the student (``setup.student``'s shape) on each of ``devices`` GPUs (module docstring)."""
    if backend not in ("vllm", "hf"):
        raise ValueError(f"forgetting.backend: kdlab estimate models vllm (auto) and hf, got {backend!r}")
    size, total = BYTES[dtype], 0.0
    kind, rows = ("vllm", VLLM_MAX_NUM_SEQS) if backend == "vllm" else ("kdlab", batch_size)
    for name in suite_names(tasks, "forgetting.tasks"):
        requests, output, generated, prompt = LM_EVAL_COST[name]
        share = -(-requests // devices)
        if output == "generate_until":
            full, rest = divmod(share, rows)
            total += full * decode_seconds(setup.student, size, rows, prompt, generated, kind, hardware)
            total += decode_seconds(setup.student, size, rest, prompt, generated, kind, hardware) if rest else 0.0
        elif backend == "vllm":
            total += forward_seconds(setup.student, share * CHOICES * prompt, hardware)
        else:
            forwards = -(-share * CHOICES // batch_size)
            total += forwards * forward_seconds(setup.student, batch_size * prompt, hardware)
    return total


def runs_per_student(grid: dict[str, list[Any]], seeds: list[int]) -> int:
    """The runs of a grid (its product x seeds) that start from one student (module docstring)."""
    runs = math.prod(len(values) for values in grid.values()) * len(seeds)
    students = math.prod(len(values) for key, values in grid.items() if any(key == k or key.startswith(k + ".") for k in STUDENT_KEYS))
    return runs // students


def off_loop(setup: Setup, forgetting: dict[str, Any], grid: dict[str, list[Any]], seeds: list[int], hardware: Hardware) -> OffLoop:
    """A sweep's ``forgetting`` key (tasks, backend, dtype, devices, batch_size) for a run of its ``grid`` x ``seeds``."""
    backend = {"auto": "vllm"}.get(forgetting.get("backend", "auto"), forgetting.get("backend", "auto"))
    dtype = forgetting.get("dtype", "auto")
    dtype = "bfloat16" if dtype == "auto" else dtype
    if dtype not in BYTES:
        raise ValueError(f"forgetting.dtype: one of {sorted(BYTES)} or auto, got {dtype!r}")
    devices = forgetting.get("devices") or setup.world
    one = suite_pass_seconds(setup, forgetting.get("tasks"), hardware, backend, dtype, devices, int(forgetting.get("batch_size") or 8))
    return OffLoop(one, one, runs_per_student(grid, seeds), backend, devices)
