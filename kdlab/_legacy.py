"""kdlab 0.1's import paths (the flat layout), kept importable: every public name 0.1 exported at a module
path still imports from it, with a ``FutureWarning`` that names its new path.

:data:`MOVED` is the one table of where each old name went. Three kinds of old path are in it:

* a module that is now another module (``"kdlab.grpo": {"kdlab.stages.grpo": "*"}``): importing the old
  path returns the new module itself (same classes, no second copy, so ``class_path: kdlab.grpo.GRPOModule``
  in an old config is :class:`kdlab.stages.GRPOModule`), with a warning the first time it is imported. A
  name that left that module too is listed beside the ``"*"`` and served by a module ``__getattr__``;
* a module split over several (``kdlab.report``): the old path imports as a stand-in module whose
  ``__getattr__`` finds each name where it went (``kdlab.report.read_run`` -> ``kdlab.study.runs.read_run``);
* a module path that is now a package (:data:`PACKAGES`, ``kdlab.models``): the names the package lacks,
  which its ``__getattr__`` (PEP 562) resolves through :func:`moved_attribute`.

kdlab 0.3's ``kdlab.stages.multi_teacher`` and ``kdlab.stages.teachers`` (now :mod:`kdlab.teachers`) are kept the same
way. Names are space-separated; ``old=new`` is a name that was renamed. Nothing here is imported until an old
name is used. ``tests/test_legacy_imports.py`` checks every name of ``tests/fixtures/kdlab_0_1_names.json``
(written by ``scripts/legacy_names.py`` from kdlab 0.1's source). Not kept: ``from kdlab.cli import main``,
which was a function and is now the module :mod:`kdlab.cli.main` (the function is ``kdlab.cli.main.main``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

WHOLE = "*"

MOVED: dict[str, dict[str, str]] = {
    # modules that are now another module
    "kdlab.module": {"kdlab.stages.distill": WHOLE},
    "kdlab.stage": {"kdlab.stages.base": WHOLE, "kdlab.stages.sharding": "decoder_layer_classes", "kdlab.stages.loaders": "EpochShuffle ResumableLoader"},
    "kdlab.grpo": {"kdlab.stages.grpo": WHOLE},
    "kdlab.sft": {"kdlab.stages.sft": WHOLE, "kdlab.stages.optim": "SCHEDULES"},
    "kdlab.vllm_engine": {"kdlab.rollouts.vllm": WHOLE, "kdlab.rollouts.policies": "importance_weights",
                          "kdlab.rollouts.vllm_sampling": "VLLM_TEMPERATURES"},
    "kdlab.heldout_kl": {"kdlab.callbacks.heldout_kl": WHOLE},
    "kdlab.metrics": {"kdlab.evaluation.metrics": WHOLE},
    "kdlab.kl_kernels": {"kdlab.objectives.kernels": WHOLE, "kdlab.objectives.lazy": "gather_rows"},
    "kdlab.lm_eval_suite": {"kdlab.evaluation.lm_eval_suite": WHOLE},
    "kdlab.config_errors": {"kdlab.cli.config_errors": WHOLE},
    "kdlab.console": {"kdlab.cli.console": WHOLE},
    "kdlab.pipeline": {"kdlab.study.pipeline": WHOLE},
    "kdlab.teacher_data": {"kdlab.rollouts.teacher_data": WHOLE},
    "kdlab.verdicts": {"kdlab.study.verdicts": WHOLE, "kdlab.study.labels": "NOT_DISTINGUISHABLE NOT_REPRODUCED REPRODUCED t_quantile verdict_word"},
    # modules split over several
    "kdlab.checkpointing": {
        "kdlab.callbacks.checkpoints": "FinalCheckpoint",
        "kdlab.cli.resume": "log_position resume_version trim_logs",
    },
    "kdlab.decoding": {
        "kdlab.rollouts.decoding": "IncrementalLM NextLogprobs StopCheck sample_tokens stop_strings_check top_p_logprobs",
        "kdlab.objectives.logits": "completion_head_logits completion_logits full_head_weight fused_head_unsupported innermost_model",
    },
    "kdlab.optim": {"kdlab.stages.optim": "FiniteAdamW warmup_factor=lr_multiplier"},
    "kdlab.pruning": {
        "kdlab.models.pruning": "RECORD decoder_layers prune_layers select_layers",
        "kdlab.cli.prune": "prune_checkpoint",
    },
    "kdlab.report": {
        "kdlab.study.runs": "COLUMN_KEYS DONE_MARKERS MAIN_METRICS PASS_AT_K PER_RUN_KEYS RunResult STYLE_METRICS "
                            "collect read_metrics read_run read_samples run_directories run_status without_defaults",
        "kdlab.study.groups": "Group ROLLOUT_ORDER cell group_runs lr_levels",
        "kdlab.study.paper": "PAPER PAPER_LR PAPER_NOTES PAPER_RESULTS PaperResult",
        "kdlab.study.stats": "bootstrap_contrast bootstrap_interval wilson_interval",
        "kdlab.study.report": "default_output main write_report",
        "kdlab.study.figures": "error_bars note_if_equal",
        "kdlab.study.tables": "markdown_table write_csv",
        "kdlab.runlog": "metrics_lines",
    },
    "kdlab.sweep": {
        "kdlab.study.grid": "FILE_KEYS MODES RESERVED Run Sweep expand fit_args load_sweep read_mapping_file short_keys value_label",
        "kdlab.study.sweep": "RunFailed main run_sweep",
    },
    "kdlab.stages.multi_teacher": {
        "kdlab.teachers.choice": "Average ByField RowSubset TeacherChoice combine",
        "kdlab.teachers.legacy": "TeacherEntry",
    },
    "kdlab.stages.teachers": {"kdlab.teachers.model": "vocabulary_columns"},
    "kdlab.teacher_cache": {
        "kdlab.rollouts.teacher_cache": "TAIL_FLOOR TeacherCache TopKLogprobs expand_topk top_k_logprobs write_cache",
        "kdlab.rollouts.teacher_data": "build_teacher_cache",
    },
    # packages at an old module path: the names they lack
    "kdlab.callbacks": {
        "kdlab.callbacks.sparsity": "MODULE_GROUPS module_group",
        "kdlab.callbacks.periodic": "module_teacher",
        "kdlab.runlog": "run_directory report=log_metrics",
    },
    "kdlab.cli": {  # not "main": that is the module kdlab.cli.main now
        "kdlab.cli.main": "COMMANDS HELP entry top_help",
        "kdlab.cli.lightning": "HUB_ID LIGHTNING_COMMANDS check_hub_paths config_paths names_model_class overlay_hint",
        "kdlab.cli.help_text": "clean_help",
    },
    "kdlab.evaluation": {
        "kdlab.evaluation.scoring": "accuracy generate=completion_texts",
        "kdlab.rollouts.decoding": "completion_records sample_completions",
    },
    "kdlab.models": {
        "kdlab.models.loading": "ASSETS DTYPES INSTALLED_SCHEME INSTALL_HINTS PACKAGE_SCHEME drop_quantizer "
                                "enable_activation_checkpointing end_token_ids output_rows resolve_path shared_vocab_size",
        "kdlab.models.export": "STAGE_PREFIXES fsdp1_wrapped full_parameters hf_weight_name load_stage_weights merged_weights",
    },
    "kdlab.objectives": {
        "kdlab.objectives.kl": "forward_kl_per_token kl_diagnostics reverse_kl_per_token sampled_logprobs",
        "kdlab.objectives.reduction": "REDUCTIONS chunked_token_loss token_weights",
    },
    "kdlab.rollouts": {"kdlab.rollouts.policies": "read_completions", "kdlab.rollouts.mixture": "validate_mixture"},
}

SINCE_0_1 = frozenset({"kdlab.stages.multi_teacher", "kdlab.stages.teachers"})
"""Old paths of names that moved after kdlab 0.1 (kept the same way; the 0.1 name list does not hold them)."""

PACKAGES = frozenset({"kdlab.callbacks", "kdlab.cli", "kdlab.evaluation", "kdlab.models", "kdlab.objectives", "kdlab.rollouts"})


def whole(old: str) -> str | None:
    """The module the old module path now is, or None where its names went to several."""
    return next((new for new, names in MOVED[old].items() if names == WHOLE), None)


def names(old: str) -> dict[str, tuple[str, str]]:
    """The old module's names listed one by one: old name -> (new module, new name)."""
    found = {}
    for new, listed in MOVED[old].items():
        if listed != WHOLE:
            for entry in listed.split():
                name, _, renamed = entry.partition("=")
                found[name] = (new, renamed or name)
    return found


def moved_attribute(old: str, name: str, stacklevel: int = 2):
    """``old.name`` from where it went, with a ``FutureWarning`` naming that path; ``AttributeError`` for
    a name the table does not list. ``stacklevel`` counts from the caller (a module's ``__getattr__``)."""
    target = names(old).get(name) if old in MOVED else None
    if target is None:
        raise AttributeError(f"module {old!r} has no attribute {name!r}")
    module, new_name = target
    warnings.warn(f"{old}.{name} moved to {module}.{new_name}", FutureWarning, stacklevel=stacklevel + 1)
    return getattr(importlib.import_module(module), new_name)


def _stand_in(old: str) -> types.ModuleType:
    """The module a split old path imports as: no names of its own, each old one found where it went."""
    listed = sorted(names(old))
    module = types.ModuleType(old, f"kdlab 0.1's ``{old}``, split over {', '.join(MOVED[old])}.")

    def __getattr__(name: str):
        return moved_attribute(old, name)

    module.__getattr__ = __getattr__
    module.__dir__ = lambda: listed
    module.__all__ = listed
    return module


def _serve_names_that_left(module: types.ModuleType, old: str) -> None:
    """Give the new module of a whole-module alias a ``__getattr__`` for the old names that left it."""
    if not names(old) or getattr(module, "__legacy_of__", None) == old:
        return
    previous = module.__dict__.get("__getattr__")

    def __getattr__(name: str):
        if name in names(old):
            return moved_attribute(old, name)
        if previous is not None:
            return previous(name)
        raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")

    module.__getattr__ = __getattr__
    module.__legacy_of__ = old


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old module paths of :data:`MOVED` (not :data:`PACKAGES`, which exist) and loads each as
    the module it now is, or as a stand-in module."""

    def __init__(self) -> None:
        self.specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def find_spec(self, name, path=None, target=None):
        if name not in MOVED or name in PACKAGES:
            return None
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec):
        new = whole(spec.name)
        if new is None:
            return _stand_in(spec.name)
        module = importlib.import_module(new)
        _serve_names_that_left(module, spec.name)
        self.specs[spec.name] = module.__spec__  # the import machinery sets __spec__ to the old name's; exec_module restores it
        return module

    def exec_module(self, module):  # nothing to run: an alias executed under its new name, a stand-in has no code
        old = module.__spec__.name
        if old in self.specs:
            module.__spec__ = self.specs[old]
        moved = f"{old} moved to {whole(old)}" if whole(old) else f"{old}'s names moved to {', '.join(MOVED[old])}"
        warnings.warn(f"{moved}; import from there", FutureWarning, stacklevel=2)


def install() -> None:
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Alias())  # before path finders: an old file left in a checkout must not win
