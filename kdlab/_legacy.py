"""Module paths of kdlab 0.1's flat layout that configs name in ``class_path``, kept importable.

``kdlab.grpo.GRPOModule`` in an old YAML resolves to :class:`kdlab.stages.GRPOModule`: importing an old
path returns the new module object itself (same classes, no second copy), registered under the old name.
New configs use the new paths (``kdlab.stages.GRPOModule``, ``kdlab.rollouts.VLLMRollouts``, ...)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

MOVED = {
    "kdlab.module": "kdlab.stages.distill",
    "kdlab.stage": "kdlab.stages.base",
    "kdlab.grpo": "kdlab.stages.grpo",
    "kdlab.sft": "kdlab.stages.sft",
    "kdlab.vllm_engine": "kdlab.rollouts.vllm",
    "kdlab.heldout_kl": "kdlab.callbacks.heldout_kl",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old names of :data:`MOVED` and loads each as the module it moved to."""

    def __init__(self) -> None:
        self.specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def find_spec(self, name, path=None, target=None):
        if name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec):
        module = importlib.import_module(MOVED[spec.name])
        self.specs[spec.name] = module.__spec__  # the import machinery sets __spec__ to the old name's; exec_module restores it
        return module

    def exec_module(self, module):  # nothing to run: the module executed under its new name
        module.__spec__ = self.specs[module.__spec__.name]


def install() -> None:
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Alias())  # before path finders: an old file left in a checkout must not win
