"""``UpdateSparsity``: the share of the student's parameters that training left (nearly) unchanged,
overall and per module group (attention, MLP, embeddings, norms), against the weights at fit start or a
reference checkpoint; works on FSDP-sharded parameters."""

from __future__ import annotations

import re
from collections.abc import Sequence

import lightning.pytorch as pl
import torch

from kdlab.callbacks.periodic import PeriodicCallback
from kdlab.evaluation.metrics import sparsity_counts
from kdlab.models.loading import ModelSpec
from kdlab.runlog import log_metrics

# ---- update sparsity ---------------------------------------------------------------------------
MODULE_GROUPS = (
    ("embeddings", re.compile(r"embed|lm_head|wte|wpe")),
    ("norms", re.compile(r"norm|ln_")),
    ("attention", re.compile(r"attn|attention")),
    ("mlp", re.compile(r"mlp|feed_forward|ffn")),
)


def module_group(name: str) -> str:
    """``attention``, ``mlp``, ``embeddings``, ``norms`` or ``other`` for a parameter name."""
    for group, pattern in MODULE_GROUPS:
        if pattern.search(name):
            return group
    return "other"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds of a (possibly DTensor-sharded) parameter."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _shard_like(full: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
    """The part of ``full`` that this rank holds of ``parameter`` (all of it when not sharded)."""
    if hasattr(parameter, "to_local") and hasattr(parameter, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full.to(parameter.device), parameter.device_mesh, parameter.placements).to_local()
    return full


class UpdateSparsity(PeriodicCallback):
    """Logs ``sparsity/<tau>``: the fraction of student parameters with ``|theta - theta_init| < tau``.

    The initial parameters are copied off the accelerator when fit starts (on a resumed run they are
    reloaded from the student's original path, since the run's start is not in the checkpoint).
    Also logs ``sparsity/<tau>/<group>`` for attention, MLP, embeddings and norms. Under sharded
    training each rank counts its own shard and the counts are summed, so the number is the same
    as unsharded.

    Args:
        thresholds: the taus (paper: 1e-6 main, 1e-8 appendix), each > 0.
        every_n_steps: also measure every N optimiser steps; the end of fit is always measured.
        reference: measure against this model instead of the run's starting weights, e.g. the
            original student in an RLVR stage that starts from a distilled checkpoint (a model path,
            ``kdlab://...``, or a :class:`~kdlab.models.loading.ModelSpec` with ``checkpoint``).
    """

    def __init__(self, thresholds: Sequence[float] = (1e-6, 1e-8), every_n_steps: int | None = None,
                 reference: ModelSpec | str | None = None) -> None:
        super().__init__(every_n_steps)
        if not thresholds or any(not tau > 0 for tau in thresholds):
            raise ValueError(f"UpdateSparsity.thresholds must be positive numbers, got {list(thresholds)}")
        self.thresholds = tuple(float(tau) for tau in thresholds)
        self.reference = reference
        self.initial: dict[str, torch.Tensor] | None = None

    @staticmethod
    def parameters(pl_module: pl.LightningModule) -> dict[str, torch.Tensor]:
        model = getattr(pl_module, "student", pl_module)
        return {name: _local(p.detach()) for name, p in model.named_parameters()}

    def on_fit_start(self, trainer, pl_module) -> None:
        from kdlab.models.export import hf_weight_name
        from kdlab.models.loading import ModelSpec, load_causal_lm

        current = self.parameters(pl_module)
        if self.reference is not None or (trainer.ckpt_path and hasattr(pl_module, "student_spec")):
            if self.reference is None:
                spec, role = pl_module.student_spec, "student"
            else:
                spec, role = (ModelSpec(self.reference) if isinstance(self.reference, str) else self.reference), "UpdateSparsity.reference"
            original = dict(load_causal_lm(spec, role).named_parameters())
            # the trained model may be wrapped (peft, compile): match by plain Hugging Face names; LoRA
            # adapters have no counterpart in the original and are left out of the count
            self.initial = {}
            for name, parameter in pl_module.student.named_parameters():
                source = original.get(name) if name in original else original.get(hf_weight_name(name) or "")
                if source is None:
                    continue
                if source.shape != parameter.shape:  # a DTensor reports its global shape
                    raise ValueError(f"{role} {spec.path!r}: parameter {name!r} has shape {tuple(source.shape)}, the trained model {tuple(parameter.shape)}")
                self.initial[name] = _shard_like(source.detach(), parameter).to(current[name].dtype)
            if not self.initial:
                raise ValueError(f"{role} {spec.path!r}: none of its parameters match the trained model's")
        else:
            self.initial = {name: p.to("cpu", copy=True) for name, p in current.items()}

    def measure(self, trainer, pl_module) -> None:
        current = {name: value for name, value in self.parameters(pl_module).items() if name in self.initial}
        metrics = {}
        groups = sorted({module_group(name) for name in current})
        for tau in self.thresholds:
            counts = {}
            for group in groups:
                names = [n for n in current if module_group(n) == group]
                counts[group] = sparsity_counts({n: self.initial[n] for n in names}, {n: current[n] for n in names}, tau)
            small = torch.tensor([float(sum(c[0] for c in counts.values()))] + [float(counts[g][0]) for g in groups], dtype=torch.float64)
            total = torch.tensor([float(sum(c[1] for c in counts.values()))] + [float(counts[g][1]) for g in groups], dtype=torch.float64)
            small = trainer.strategy.reduce(small.to(pl_module.device), reduce_op="sum").cpu()
            total = trainer.strategy.reduce(total.to(pl_module.device), reduce_op="sum").cpu()
            key = f"sparsity/{tau:g}"
            metrics[key] = (small[0] / total[0]).item()
            for index, group in enumerate(groups, start=1):
                metrics[f"{key}/{group}"] = (small[index] / total[index]).item()
        log_metrics(trainer, metrics)
