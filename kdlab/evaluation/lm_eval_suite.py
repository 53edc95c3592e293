"""The paper's forgetting suite through lm-evaluation-harness, run on the student held in memory.

:func:`evaluate_suite` wraps the model object the run is training in lm-eval's ``HFLM`` (which keeps
a reference to it: no reload from disk, no second copy of the weights) and scores each entry of a
suite with ``lm_eval.simple_evaluate``. Scores come back in points (0-100).

Traps this module handles, so callers need not:

* ``HFLM(pretrained=<model>)`` puts the model in eval mode and ``simple_evaluate`` re-seeds Python's,
  NumPy's and torch's global generators; both are put back afterwards, so measuring never changes
  training.
* lm-eval's ``limit`` is one number per ``simple_evaluate`` call and applies to each *leaf* task
  (the first ``limit`` documents, in the dataset's order), and one call may not name a task twice (a group and
  its member); so each suite entry gets its own call. For a group (``mmlu_pro``) the limit applies per subject.
  A dataset in some order (by category, by source) gives its first documents, not a sample: an entry with a
  ``seed`` scores ``limit`` documents drawn at random from each leaf task instead (:func:`document_samples`,
  lm-eval's ``samples``), the same ones for every model scored with that seed.
* A relative ``data_files`` path in a task YAML goes straight to ``datasets.load_dataset``, which
  resolves it against the working directory, not the YAML's folder (``include:`` and
  ``!function`` *are* resolved next to the YAML).
* HumanEval runs model-written code. lm-eval refuses unless ``confirm_run_unsafe_code=True``, and
  its ``code_eval`` metric (Hugging Face ``evaluate``, fetched from the Hub on first use) refuses
  unless the environment has ``HF_ALLOW_CODE_EVAL=1``; ``allow_code_execution=True`` sets both.
  Run it only where executing untrusted code is acceptable (a sandbox or a throwaway container).

Needs ``pip install 'kdlab[eval]'`` (lm-eval with its Hugging Face back end, which imports
``accelerate``; IFEval also needs ``langdetect``, ``immutabledict`` and ``nltk``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

INSTALL_HINT = "pip install 'kdlab[eval]'"


@dataclass(frozen=True)
class LMEvalTask:
    """One entry of a forgetting suite.

    Args:
        task: an lm-eval task or group name (``lm-eval ls tasks``, or a YAML under the include path);
            a group is scored by its aggregate metric.
        limit: N documents of each leaf task (per subject for a group); null = all of them.
        metric: the key of lm-eval's result row, ``<metric>,<filter>``: ``acc,none``,
            ``exact_match,custom-extract``, ``pass@1,create_test``.
        scale: points per unit of the metric: 100 for a fraction in [0, 1], 1 for a metric that is
            already in points (EQ-Bench's ``eqbench``).
        executes_code: the task runs model-written code (HumanEval); it needs ``allow_code_execution``.
        seed: null: the first ``limit`` documents (lm-eval's ``limit``); a number: ``limit`` documents drawn
            without replacement from each leaf task with that seed (:func:`document_samples`), so a dataset's
            order does not choose them. The paper's suite draws with seed 0.
    """

    task: str
    limit: int | None = None
    metric: str = "acc,none"
    scale: float = 100.0
    executes_code: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"LMEvalTask.limit must be >= 1 or null, got {self.limit} (task {self.task!r})")
        if not self.scale > 0:
            raise ValueError(f"LMEvalTask.scale must be > 0, got {self.scale} (task {self.task!r})")


MMLU_PRO_SUBJECTS = (
    "biology", "business", "chemistry", "computer_science", "economics", "engineering", "health",
    "history", "law", "math", "other", "philosophy", "physics", "psychology",
)  # fmt: skip

# The paper's seven tasks and sample sizes. lm-eval's ``mmlu_pro`` group is the 14 subject tasks
# ``mmlu_pro_<subject>`` above; its aggregate is size-weighted, and with 200 documents from each
# subject that is the unweighted mean over subjects.
PAPER_SUITE: dict[str, LMEvalTask] = {
    "mmlu_pro": LMEvalTask("mmlu_pro", 200, "exact_match,custom-extract", seed=0),
    "truthfulqa_mc1": LMEvalTask("truthfulqa_mc1", 200, "acc,none", seed=0),
    "ifeval": LMEvalTask("ifeval", 200, "prompt_level_strict_acc,none", seed=0),
    "humaneval_instruct": LMEvalTask("humaneval_instruct", 164, "pass@1,create_test", executes_code=True, seed=0),
    "eq_bench": LMEvalTask("eq_bench", 171, "eqbench,none", scale=1.0, seed=0),
    "bbq": LMEvalTask("bbq", 200, "acc,none", seed=0),
    "toxigen": LMEvalTask("toxigen", 200, "acc,none", seed=0),
}  # seed 0: documents drawn at random, not a dataset's first ones (the paper gives the counts, not which)


def import_lm_eval(setting: str = "lm-eval") -> Any:
    """``lm_eval`` with its Hugging Face back end loaded, or an ImportError naming the extra to install."""
    try:
        import lm_eval
        import lm_eval.models.huggingface  # noqa: F401  (imports accelerate: the back end's own dependency)
        import lm_eval.tasks  # noqa: F401
    except ImportError as error:
        raise ImportError(f"{setting} needs lm-evaluation-harness with its Hugging Face back end ({error}); install it with {INSTALL_HINT}") from error
    return lm_eval


@functools.lru_cache(maxsize=4)
def _task_manager(include_path: str | None) -> Any:
    lm_eval = import_lm_eval()
    return lm_eval.tasks.TaskManager(include_path=include_path)


def task_manager(include_path: str | Path | None = None) -> Any:
    """lm-eval's ``TaskManager`` over its own tasks plus the YAMLs under ``include_path``.

    Building one indexes some 15,000 YAML files (seconds), so one is kept per include path for the
    life of the process; a YAML added to the folder later is not seen.
    """
    if include_path is not None and not Path(include_path).is_dir():
        raise FileNotFoundError(f"lm-eval include path {str(include_path)!r} is not a folder")
    return _task_manager(None if include_path is None else str(Path(include_path).resolve()))


def as_task(entry: LMEvalTask | Mapping[str, Any] | tuple | list) -> LMEvalTask:
    """An :class:`LMEvalTask` from itself, a mapping of its fields, or a ``(task, limit, metric, ...)`` tuple."""
    if isinstance(entry, LMEvalTask):
        return entry
    if isinstance(entry, Mapping):
        return LMEvalTask(**entry)
    return LMEvalTask(*entry)


def resolve_suite(spec: str | list[str] | Mapping[str, Any], setting: str = "tasks") -> dict[str, LMEvalTask]:
    """``"paper"`` -> :data:`PAPER_SUITE`; a list of its keys -> those entries; a mapping -> its entries."""
    if isinstance(spec, str):
        spec = list(PAPER_SUITE) if spec == "paper" else [spec]
    if isinstance(spec, Mapping):
        suite = {str(name): as_task(entry) for name, entry in spec.items()}
    else:
        unknown = [name for name in spec if name not in PAPER_SUITE]
        if unknown:
            raise ValueError(
                f"{setting}: {unknown} are not in the paper's suite {sorted(PAPER_SUITE)}; give 'paper', a list of "
                "those names, or a mapping name -> {task, limit, metric} for any lm-eval task"
            )
        suite = {name: PAPER_SUITE[name] for name in spec}
    if not suite:
        raise ValueError(f"{setting} must name at least one task")
    return suite


def validate_suite(
    suite: Mapping[str, LMEvalTask],
    include_path: str | Path | None = None,
    allow_code_execution: bool = False,
    setting: str = "tasks",
) -> Any:
    """Check every task name against lm-eval's index (and the include path); return the TaskManager."""
    manager = task_manager(include_path)
    known = set(manager.all_tasks)
    for name, entry in suite.items():
        if entry.task not in known:
            where = f"lm-eval's tasks or the YAMLs under {str(include_path)!r}" if include_path else "lm-eval's tasks"
            raise ValueError(f"{setting}: unknown lm-eval task {entry.task!r} (entry {name!r}): not among {where}; `lm-eval ls tasks` lists them")
        if entry.executes_code and not allow_code_execution:
            raise ValueError(
                f"{setting}: {name!r} ({entry.task}) executes model-written code; set allow_code_execution "
                "(OODForgetting.lm_eval_allow_code_execution) to true to run it (it sets HF_ALLOW_CODE_EVAL=1 and "
                "lm-eval's confirm_run_unsafe_code), and only where running untrusted code is acceptable"
            )
    return manager


def wrap_model(model: torch.nn.Module, tokenizer: Any, batch_size: int = 8) -> Any:
    """lm-eval's ``HFLM`` around ``model`` itself (not a copy), on the model's own device.

    Note: ``HFLM`` switches ``model`` to eval mode; :func:`evaluate_suite` restores the mode.
    """
    lm_eval = import_lm_eval()
    return lm_eval.models.huggingface.HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)


def _plain_class(model: torch.nn.Module) -> type:
    """``model``'s own class, not the one ``fully_shard`` (FSDP2) makes by subclassing it."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return type(model)
    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` is FSDP1-wrapped or has FSDP2/tensor-parallel (DTensor) parameters."""
    from kdlab.models.export import fsdp1_wrapped

    return fsdp1_wrapped(model) or any(hasattr(p, "full_tensor") for p in model.parameters())


@contextlib.contextmanager
def whole_model(model: torch.nn.Module, device: torch.device | str, keep: bool = True) -> Iterator[torch.nn.Module | None]:
    """A whole, unsharded model with ``model``'s current weights, for code that must run one process's
    forwards alone (lm-eval): ``model`` itself when it is not sharded; for an FSDP1- or FSDP2-sharded
    one, a plain copy of its Hugging Face class built on ``device`` (the parameters' dtype, LoRA adapters
    merged) from the full tensors of :func:`~kdlab.models.export.merged_weights`, freed on leaving.
    ``None`` where ``keep`` is false.

    Gathering a sharded model is a collective: enter it on every rank, ``keep`` true on the one that
    evaluates. The copy costs that rank one more full copy of the model while the block runs (and, under
    FSDP1, the gathered parameters while it is filled)."""
    if not is_sharded(model):
        yield model if keep else None
        return
    import copy

    from kdlab.models.export import merged_weights
    from kdlab.objectives.logits import innermost_model

    base = innermost_model(model)
    plain, targets, filled, unknown, failure = None, {}, set(), [], None
    if keep:
        try:  # a failure here is raised only after the gather below, which the other ranks are in
            dtype = next(model.parameters()).dtype
            with torch.device(device):
                plain = _plain_class(base)(copy.deepcopy(base.config))
            for parameter in plain.parameters():  # buffers (rotary inv_freq) keep the dtype they are built in
                parameter.data = parameter.data.to(dtype)
            if getattr(base, "generation_config", None) is not None:
                plain.generation_config = copy.deepcopy(base.generation_config)
            plain.requires_grad_(False).eval()
            targets = dict(plain.named_parameters(remove_duplicate=False)) | dict(plain.named_buffers(remove_duplicate=False))
        except Exception as error:
            failure = error
    with torch.no_grad():
        for name, tensor in merged_weights(model):  # consumed whole on every rank: it gathers
            target = targets.get(name)
            if plain is None:
                continue
            if target is None or target.shape != tensor.shape:
                unknown.append(name)
                continue
            target.copy_(tensor)
            filled.add(target.data_ptr())
    if failure is not None:
        raise failure
    if plain is not None:
        missing = [name for name, p in plain.named_parameters() if p.data_ptr() not in filled]
        if unknown or missing:
            raise ValueError(f"whole_model: the gathered weights do not fit a plain {type(plain).__name__} "
                             f"(unknown or of another shape {unknown[:3]}, missing {missing[:3]})")
    try:
        yield plain
    finally:
        del plain, targets
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()


@contextlib.contextmanager
def _preserved_rng(device: torch.device) -> Iterator[None]:
    """Put back the global Python, NumPy and torch generators (which simple_evaluate re-seeds)."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def evaluate_suite(
    model: torch.nn.Module,
    tokenizer: Any,
    tasks: str | list[str] | Mapping[str, Any],
    include_path: str | Path | None = None,
    batch_size: int = 8,
    allow_code_execution: bool = False,
    apply_chat_template: bool = False,
) -> dict[str, float]:
    """Score ``model`` on each suite entry; returns ``{entry name: score in points}``.

    Args:
        model: a Hugging Face causal LM, used in place (same object, same device, same weights).
        tokenizer: its tokenizer.
        tasks: ``"paper"``, a list of :data:`PAPER_SUITE` keys, or a mapping name -> :class:`LMEvalTask`
            (or its fields as a mapping, or a ``(task, limit, metric)`` tuple).
        include_path: a folder of extra lm-eval task YAMLs.
        batch_size: lm-eval's batch size (requests per forward pass).
        allow_code_execution: let code-executing tasks (HumanEval) run model-written code.
        apply_chat_template: render prompts with the tokenizer's chat template (lm-eval's flag).

    Each entry is one ``simple_evaluate`` call with its own ``limit``; the model's train/eval mode
    and the global random generators are as they were afterwards. One process runs the whole suite on
    ``model`` alone (lm-eval's own data parallelism is not used): call it on one rank with an unsharded
    model (:func:`whole_model`); :class:`~kdlab.callbacks.OODForgetting` does so on global rank 0 and
    broadcasts the scores. A process whose ``LOCAL_RANK`` is not 0 gets NaN, since lm-eval builds its
    results only on local rank 0.
    """
    import_lm_eval("evaluate_suite")  # a missing install is the first thing to say
    suite = resolve_suite(tasks, "evaluate_suite.tasks")
    manager = validate_suite(suite, include_path, allow_code_execution, "evaluate_suite.tasks")
    was_training = model.training
    try:
        lm = wrap_model(model, tokenizer, batch_size)
        return score_suite(lm, suite, manager, allow_code_execution, apply_chat_template)
    finally:
        model.train(was_training)


def document_samples(lm_eval: Any, manager: Any, entry: LMEvalTask) -> dict[str, list[int]]:
    """``{leaf task name: sorted document indices}`` for lm-eval's ``samples``: ``entry.limit`` indices drawn without
    replacement from each leaf task of ``entry.task`` (every subject of a group) by a generator seeded with
    ``entry.seed`` and the leaf's name, all of them when the task has no more; the same for every model."""
    leaves: dict[str, int] = {}

    def walk(node: Any) -> None:
        for value in node.values():
            if isinstance(value, Mapping):  # a group: its members
                walk(value)
            else:
                leaves[value.task_name] = len(value.eval_docs)

    walk(lm_eval.tasks.get_task_dict([entry.task], manager))
    return {name: sorted(random.Random(f"{entry.seed}-{name}").sample(range(count), min(entry.limit, count)))
            for name, count in leaves.items()}


def score_suite(
    lm: Any,
    suite: Mapping[str, LMEvalTask],
    manager: Any,
    allow_code_execution: bool = False,
    apply_chat_template: bool = False,
) -> dict[str, float]:
    """Score an lm-eval model object ``lm`` (``HFLM`` around a model in memory or a folder, lm-eval's
    ``VLLM``) on each entry of a resolved ``suite`` (:func:`resolve_suite`, checked by
    :func:`validate_suite`, which returns ``manager``); ``{entry name: score in points}``.

    The one implementation of the suite: :func:`evaluate_suite` (the in-loop callback) and
    :mod:`kdlab.evaluation.forgetting` (off the training loop) both call it. Each entry is one
    ``simple_evaluate`` call with its own ``limit`` (or its drawn documents, an entry with a ``seed``); the global random generators are as they were
    afterwards. A process whose results lm-eval does not assemble (not its rank 0) gets NaN."""
    lm_eval = import_lm_eval("score_suite")
    if allow_code_execution and any(entry.executes_code for entry in suite.values()):
        os.environ["HF_ALLOW_CODE_EVAL"] = "1"  # Hugging Face evaluate's code_eval checks this at import
    scores: dict[str, float] = {}
    device = torch.device(getattr(lm, "device", None) or "cpu")
    with _preserved_rng(device), torch.no_grad():
        for name, entry in suite.items():
            drawn = entry.seed is not None and entry.limit is not None
            output = lm_eval.simple_evaluate(
                model=lm,
                tasks=[entry.task],
                limit=None if drawn else entry.limit,
                samples=document_samples(lm_eval, manager, entry) if drawn else None,
                task_manager=manager,
                log_samples=False,
                bootstrap_iters=0,  # no standard errors: only the point estimate is reported
                apply_chat_template=apply_chat_template,
                confirm_run_unsafe_code=allow_code_execution,
            )
            if output is None:  # lm-eval assembles results only on its rank 0; other ranks report nothing
                scores[name] = float("nan")
                continue
            row = output["results"][entry.task]
            if entry.metric not in row:
                metrics = sorted(key for key in row if "," in key and "_stderr" not in key)
                raise KeyError(f"lm-eval task {entry.task!r} (entry {name!r}) has no metric {entry.metric!r}; it reports {metrics}")
            scores[name] = entry.scale * float(row[entry.metric])
    return scores
