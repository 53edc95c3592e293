"""``UpdateSparsity``: the share of the student's weights that training left (nearly) unchanged, overall and
per module group (attention, MLP, embeddings, norms), against the weights at fit start or a reference checkpoint.
It reads the effective weights by Hugging Face name (a LoRA student's merged ``W + s B A``), sharded or not."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

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


def rank_part(weight: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Part ``rank`` of ``world`` near-equal parts of ``weight`` flattened (all of it on one process): what one rank
    counts of a whole weight, so the ranks' counts add up to the weight's once."""
    return torch.tensor_split(weight.reshape(-1), world)[rank] if world > 1 else weight.reshape(-1)


class UpdateSparsity(PeriodicCallback):
    """Logs ``sparsity/<tau>``: the fraction of the student's weights with ``|w - w_0| < tau``.

    ``w`` are the student's effective weights by Hugging Face name, what an export writes
    (:func:`~kdlab.models.export.merged_weights`): for a LoRA student each adapted weight is the merged
    ``W + s B A`` (the adapter factors themselves are not counted), so the number says how much of the model the
    run changed, whatever was trained. ``w_0`` are the same weights when fit starts (a LoRA student's adapters start
    at ``B = 0``: its base), or, on a resumed run, the student's original weights reloaded from its path (the run's
    start is not in the checkpoint), or ``reference``'s weights when given; all three match weights by Hugging Face
    name. Buffers are not counted.
    Also logs ``sparsity/<tau>/<group>`` for attention, MLP, embeddings and norms.

    The weights are read one at a time, whole (under FSDP2 each is gathered, adapters merged, then freed: a
    collective, so every rank measures; under FSDP1 the student is gathered whole while it is read, as an export
    does). Each rank keeps and counts its own ``1 / world`` of each flattened weight (:func:`rank_part`) and the
    counts are summed, so the number is the same as on one process and each rank holds ``1 / world`` of ``w_0``.

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
        """``{Hugging Face weight name: this rank's part of w_0 (flat, on the CPU)}``."""

    @staticmethod
    def weights(pl_module: pl.LightningModule) -> Iterator[tuple[str, torch.Tensor]]:
        """``(Hugging Face name, whole effective weight)`` of the student, one at a time (LoRA adapters merged);
        a collective when sharded: consume it fully on every rank."""
        from kdlab.models.export import hf_weight_name, merged_weights

        model = getattr(pl_module, "student", pl_module)
        buffers = {hf_weight_name(name) for name, _ in model.named_buffers()}
        for name, weight in merged_weights(model):
            if name not in buffers:
                yield name, weight

    def on_fit_start(self, trainer, pl_module) -> None:
        from kdlab.models.loading import ModelSpec, load_causal_lm

        original, spec, role = None, None, "student"
        if self.reference is not None or (trainer.ckpt_path and hasattr(pl_module, "student_spec")):
            if self.reference is None:
                spec = pl_module.student_spec
            else:
                spec, role = (ModelSpec(self.reference) if isinstance(self.reference, str) else self.reference), "UpdateSparsity.reference"
            original = dict(load_causal_lm(spec, role).named_parameters())  # a plain Hugging Face model: its names
        rank, world = trainer.global_rank, trainer.world_size
        self.initial = {}
        for name, weight in self.weights(pl_module):
            source = weight if original is None else original.get(name)
            if source is None:  # a weight the reference does not have is left out of the count
                continue
            if source.shape != weight.shape:
                raise ValueError(f"{role} {spec.path!r}: weight {name!r} has shape {tuple(source.shape)}, the trained model {tuple(weight.shape)}")
            self.initial[name] = rank_part(source.detach(), rank, world).to("cpu", weight.dtype, copy=True)
        if not self.initial:
            raise ValueError(f"{role} {spec.path!r}: none of its weights match the trained model's")

    def measure(self, trainer, pl_module) -> None:
        rank, world = trainer.global_rank, trainer.world_size
        counts: dict[tuple[float, str], list[int]] = {}
        for name, weight in self.weights(pl_module):
            if name not in self.initial:
                continue
            part = {name: rank_part(weight, rank, world)}
            for tau in self.thresholds:
                small, total = sparsity_counts({name: self.initial[name]}, part, tau)
                count = counts.setdefault((tau, module_group(name)), [0, 0])
                count[0], count[1] = count[0] + small, count[1] + total
        groups = sorted({group for _, group in counts})
        metrics = {}
        for tau in self.thresholds:
            small = torch.tensor([float(sum(counts[tau, g][0] for g in groups))] + [float(counts[tau, g][0]) for g in groups], dtype=torch.float64)
            total = torch.tensor([float(sum(counts[tau, g][1] for g in groups))] + [float(counts[tau, g][1]) for g in groups], dtype=torch.float64)
            small = trainer.strategy.reduce(small.to(pl_module.device), reduce_op="sum").cpu()
            total = trainer.strategy.reduce(total.to(pl_module.device), reduce_op="sum").cpu()
            key = f"sparsity/{tau:g}"
            metrics[key] = (small[0] / total[0]).item()
            for index, group in enumerate(groups, start=1):
                metrics[f"{key}/{group}"] = (small[index] / total[index]).item()
        log_metrics(trainer, metrics)
