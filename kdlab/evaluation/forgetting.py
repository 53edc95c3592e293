"""The lm-eval forgetting suite off the training loop: ``kdlab forgetting --run <run dir>``.

:class:`~kdlab.callbacks.OODForgetting` measures forgetting inside ``fit`` (rank 0, on the student as
it trains). This module measures the same suite on *saved* weights in a process of its own, after the
run: the run's ``checkpoints/final.ckpt`` ("after") and the student it started from ("before"). Both
schedulers call the one implementation of the suite, :func:`~kdlab.evaluation.lm_eval_suite.score_suite`,
and log the same names to the run's ``metrics.jsonl`` (``ood/<entry>_before`` and ``ood/mean_before`` at
step 0; ``ood/<entry>``, ``ood/mean`` and ``ood/mean_delta`` at the run's last step), so ``kdlab report``
reads either alike.

How it runs:

* the weights are written as a Hugging Face folder (:func:`~kdlab.models.export.export_pretrained`,
  in ``dtype``: ``bfloat16`` where CUDA is available, else the weights' own ``float32``) and scored
  through lm-eval's vLLM back end where vLLM is installed and CUDA is available, its Hugging Face
  back end otherwise (``backend``: ``auto``, ``hf`` or ``vllm``);
* data-parallel over ``devices`` GPUs of one machine (default: the run's ``trainer.devices`` when it is
  a number, else 1): vLLM through lm-eval's ``data_parallel_size`` (one engine per GPU,
  dispatched by lm-eval through Ray, which must be installed); the Hugging Face back end by starting
  ``devices`` processes with ``torch.distributed.run``, one GPU each (lm-eval's ``HFLM`` splits each
  task's requests over them through Accelerate and assembles the results on rank 0, which writes them;
  it does so only where it sees more than one GPU, and a run in which lm-eval saw fewer processes than
  were started fails rather than score everything on each);
* the "before" score depends only on the student's weights and the suite's settings, so it is kept
  in a :class:`~kdlab.evaluation.before_cache.BeforeCache` (``cache_dir``) keyed by a hash of the student's
  effective weights, LoRA adapters merged (:func:`~kdlab.evaluation.before_cache.weights_digest`) and of the settings
  (:meth:`SuiteSettings.key`: entries, batch size, chat template, the include path's file contents, back end, dtype and lm-eval's version): every run
  of a grid that starts from the same student reuses one measurement.

A run is measured once: ``<run>/forgetting.json`` records the scores and the keys, and a second call
returns them without scoring again (``force`` scores again, adding new lines to ``metrics.jsonl``).
A run whose ``metrics.jsonl`` already holds in-loop ``ood/mean`` is refused: its numbers would be
logged twice.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kdlab.evaluation.lm_eval_suite import (
    import_lm_eval,
    resolve_suite,
    score_suite,
    validate_suite,
)

BACKENDS = ("auto", "hf", "vllm")
DTYPES = ("auto", "bfloat16", "float16", "float32")
RESULT_FILE = "forgetting.json"
TRAINED_ROLES = ("student", "policy")  # DistillModule's and GRPOModule's trained model, in config.yaml


@dataclasses.dataclass
class SuiteSettings:
    """The lm-eval suite and how it is scored: what :class:`~kdlab.callbacks.OODForgetting`'s ``lm_eval_*``
    settings hold, as one object both schedulers share.

    Args:
        tasks: ``"paper"``, a list of :data:`~kdlab.evaluation.lm_eval_suite.PAPER_SUITE` keys, or a mapping
            name -> :class:`~kdlab.evaluation.lm_eval_suite.LMEvalTask` (or its fields); resolved on construction.
        include_path: a folder of extra lm-eval task YAMLs.
        batch_size: lm-eval's batch size (Hugging Face back end).
        allow_code_execution: let HumanEval run model-written code.
        apply_chat_template: render prompts with the model's chat template.
    """

    tasks: Any
    include_path: str | None = None
    batch_size: int = 8
    allow_code_execution: bool = False
    apply_chat_template: bool = False

    def __post_init__(self) -> None:
        self.tasks = resolve_suite(self.tasks, "forgetting.tasks")
        if type(self.batch_size) is not int or self.batch_size < 1:
            raise ValueError(f"forgetting.batch_size must be an int >= 1, got {self.batch_size!r}")
        if self.include_path is not None:
            if not Path(self.include_path).is_dir():
                raise ValueError(f"forgetting.include_path must be a folder of lm-eval task YAMLs, got {self.include_path!r}")
            self.include_path = str(Path(self.include_path).resolve())

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], setting: str = "forgetting") -> SuiteSettings:
        """From a mapping of this class's fields (a sweep's ``forgetting`` key, a suite file); errors name the key."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{setting} must be a mapping of {', '.join(SUITE_KEYS)}, got {data!r}")
        unknown = [key for key in data if key not in SUITE_KEYS]
        if unknown:
            raise ValueError(f"{setting}: unknown key {unknown[0]!r} (the suite's keys: {', '.join(SUITE_KEYS)})")
        if "tasks" not in data:
            raise ValueError(f"{setting}: the key 'tasks' is missing")
        return cls(**data)

    def as_mapping(self) -> dict[str, Any]:
        """JSON-ready fields (what :meth:`from_mapping` reads back)."""
        return {
            "tasks": {name: dataclasses.asdict(entry) for name, entry in self.tasks.items()},
            "include_path": self.include_path,
            "batch_size": self.batch_size,
            "allow_code_execution": self.allow_code_execution,
            "apply_chat_template": self.apply_chat_template,
        }

    def validate(self) -> Any:
        """Check the task names against lm-eval's index; returns lm-eval's ``TaskManager``."""
        return validate_suite(self.tasks, self.include_path, self.allow_code_execution, "forgetting.tasks")

    def key(self, backend: str, dtype: str) -> str:
        """A hash of everything besides the weights that a score depends on (see the module docstring)."""
        lm_eval = import_lm_eval("forgetting")
        description = self.as_mapping() | {
            "include_files": _folder_digest(self.include_path),
            "backend": backend,
            "dtype": dtype,
            "lm_eval": getattr(lm_eval, "__version__", "unknown"),
        }
        description.pop("include_path")  # where the files are does not change a score; what they hold does
        description.pop("allow_code_execution")
        return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()


SUITE_KEYS = tuple(field.name for field in dataclasses.fields(SuiteSettings))


def _folder_digest(folder: str | None) -> dict[str, str]:
    if folder is None:
        return {}
    root = Path(folder)
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(root.rglob("*")) if path.is_file()}


def choose_backend(requested: str = "auto") -> str:
    """``hf`` or ``vllm``: ``auto`` takes vLLM where it is installed and CUDA is available."""
    if requested not in BACKENDS:
        raise ValueError(f"forgetting.backend must be one of {', '.join(BACKENDS)}, got {requested!r}")
    has_vllm = importlib.util.find_spec("vllm") is not None
    if requested == "auto":
        return "vllm" if has_vllm and torch.cuda.is_available() else "hf"
    if requested == "vllm" and not has_vllm:
        raise ImportError("forgetting.backend 'vllm' needs vLLM: pip install 'kdlab[vllm]'")
    return requested


def choose_dtype(requested: str = "auto") -> str:
    """``auto``: ``bfloat16`` where CUDA is available, else ``float32``."""
    if requested not in DTYPES:
        raise ValueError(f"forgetting.dtype must be one of {', '.join(DTYPES)}, got {requested!r}")
    if requested == "auto":
        return "bfloat16" if torch.cuda.is_available() else "float32"
    return requested


def lm_for_folder(folder: str | Path, settings: SuiteSettings, backend: str, dtype: str, devices: int = 1) -> Any:
    """lm-eval's model object over the Hugging Face folder ``folder`` (one process; vLLM: ``devices`` engines)."""
    import_lm_eval("forgetting")
    if backend == "vllm":
        from lm_eval.models.vllm_causallms import VLLM

        return VLLM(pretrained=str(folder), dtype=dtype, batch_size="auto", data_parallel_size=devices, tensor_parallel_size=1)
    from lm_eval.models.huggingface import HFLM

    device = "cuda" if torch.cuda.is_available() else "cpu"  # under torch.distributed.run Accelerate picks each rank's GPU
    return HFLM(pretrained=str(folder), dtype=dtype, batch_size=settings.batch_size, device=device)


def score_folder(folder: str | Path, settings: SuiteSettings, backend: str, dtype: str, devices: int = 1) -> dict[str, float]:
    """The suite's scores of the model in the Hugging Face folder ``folder``, ``{entry: points}``."""
    manager = settings.validate()
    if backend == "hf" and devices > 1:
        return _score_in_processes(folder, settings, dtype, devices)
    lm = lm_for_folder(folder, settings, backend, dtype, devices)
    try:
        return score_suite(lm, settings.tasks, manager, settings.allow_code_execution, settings.apply_chat_template)
    finally:  # the "after" model gets a fresh engine or copy in the same process: free this one first
        del lm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _score_in_processes(folder: str | Path, settings: SuiteSettings, dtype: str, devices: int) -> dict[str, float]:
    """The Hugging Face back end over ``devices`` processes (``torch.distributed.run``; :func:`_worker`), one
    GPU each: lm-eval's ``HFLM`` splits requests over Accelerate's processes only where it sees more than one
    GPU, so on a CPU the processes would each score everything, and this raises instead."""
    with tempfile.TemporaryDirectory(prefix="kdlab-forgetting-") as scratch:
        job = Path(scratch) / "job.json"
        out = Path(scratch) / "scores.json"
        job.write_text(json.dumps({"folder": str(folder), "settings": settings.as_mapping(), "dtype": dtype, "out": str(out)}), encoding="utf-8")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={devices}", "-m", __name__, str(job)]
        completed = subprocess.run(command, check=False)
        if completed.returncode != 0 or not out.is_file():
            raise RuntimeError(f"forgetting: the {devices}-process lm-eval run failed (exit status {completed.returncode}; command {' '.join(command)})")
        result = json.loads(out.read_text(encoding="utf-8"))
        if result["world_size"] != devices:  # each process would have scored everything alone
            raise RuntimeError(f"forgetting: lm-eval saw {result['world_size']} processes of the {devices} started (Accelerate did not join them)")
        return result["scores"]


def _worker(job_file: str) -> None:
    """One rank of :func:`_score_in_processes`: lm-eval splits each task's requests over the ranks; rank 0
    writes the scores and the number of processes lm-eval saw."""
    job = json.loads(Path(job_file).read_text(encoding="utf-8"))
    settings = SuiteSettings.from_mapping(job["settings"])
    manager = settings.validate()
    lm = lm_for_folder(job["folder"], settings, "hf", job["dtype"])
    scores = score_suite(lm, settings.tasks, manager, settings.allow_code_execution, settings.apply_chat_template)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(job["out"]).write_text(json.dumps({"scores": scores, "world_size": lm.world_size}), encoding="utf-8")


def score_model(model: torch.nn.Module, tokenizer: Any, settings: SuiteSettings, backend: str, dtype: str, devices: int = 1,
                scratch: str | Path | None = None) -> dict[str, float]:
    """Write ``model`` (in ``dtype``) and ``tokenizer`` as a Hugging Face folder under ``scratch`` (a
    temporary folder by default), score it (:func:`score_folder`) and remove the folder."""
    from kdlab.models.export import export_pretrained
    from kdlab.models.loading import DTYPES as TORCH_DTYPES

    folder = Path(tempfile.mkdtemp(prefix="kdlab-forgetting-model-", dir=scratch))
    try:
        export_pretrained(model.to(TORCH_DTYPES[dtype]), tokenizer, folder)
        return score_folder(folder, settings, backend, dtype, devices)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":  # a rank of the multi-process Hugging Face back end
    _worker(sys.argv[1])
