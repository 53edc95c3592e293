"""How a stage's models are sharded over data-parallel ranks, and the gradient norm and clipping that
sharding changes. :class:`~kdlab.stages.base.TaskStage` calls these from ``configure_model`` and its
training steps; the stage decides *which* models are sharded (``sharded_models``), this module *how*.

* FSDP2 (Lightning's ``ModelParallelStrategy``): :func:`shard_fsdp2`; gradients reduced once per accumulated
  step (:func:`require_gradient_sync`, which Lightning does for DDP only).
* FSDP1 (``strategy: fsdp``, Lightning's ``FSDPStrategy``, CUDA only): :func:`wrap_fsdp1`.
* Single device and DDP: nothing to do.
* Any other strategy (DeepSpeed's ZeRO among them) is refused by :func:`check_strategy` before any work: kdlab
  neither shards for it nor knows how it holds the head, the teacher or the gradients."""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def check_strategy(strategy: Any) -> None:
    """Refuse a Lightning strategy kdlab does not train under, naming it and the ones it does: single device, DDP,
    FSDP1 (``strategy: fsdp``) and FSDP2 (``ModelParallelStrategy``). DeepSpeed subclasses DDP in Lightning, so it
    is named first: its ZeRO stages would partition what kdlab reads whole (the head for the fused objective, the
    gradients for ``train/grad_norm``) without kdlab knowing."""
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

    name = type(strategy).__name__
    if "DeepSpeed" in name or not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy, FSDPStrategy, ModelParallelStrategy)):
        raise ValueError(f"trainer.strategy: kdlab does not train under {name}; use one device, ddp, fsdp (FSDP1) or "
                         "lightning.pytorch.strategies.ModelParallelStrategy (FSDP2, the ZeRO-3 equivalent kdlab shards for)")


def decoder_layer_classes(model: torch.nn.Module) -> set[str]:
    """Class names of ``model``'s decoder layers (a transformers model's ``_no_split_modules``): the
    units FSDP shards one at a time."""
    return set(getattr(model, "_no_split_modules", None) or [])


def shard_fsdp2(models: list[torch.nn.Module], mesh, precision: str) -> None:
    """``fully_shard`` each decoder layer and then each model over the data-parallel ``mesh``; with
    ``precision == "bf16-mixed"`` parameters are gathered in bf16 and gradients reduced in fp32
    (``MixedPrecisionPolicy``), the fp32 master weights staying sharded."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options = {"mesh": mesh}
    if precision == "bf16-mixed":  # FSDP2 takes mixed precision as a sharding policy
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for model in models:
        blocks = decoder_layer_classes(model)
        for module in model.modules():
            if type(module).__name__ in blocks:
                fully_shard(module, **options)
        fully_shard(model, **options)


def require_gradient_sync(models: list[torch.nn.Module], sync: bool) -> None:
    """Whether the next backwards of each FSDP2-sharded model in ``models`` reduce-scatter its gradients
    (``set_requires_gradient_sync``, every unit). Off on the micro-batches of an accumulated step that are
    not its last: their gradients are summed unsharded on each rank (the reduce dtype, fp32 under
    ``bf16-mixed``) and reduced once, with the last micro-batch's, so a step of ``k`` micro-batches
    communicates once instead of ``k`` times. The price is a whole unsharded gradient per rank between the
    first and last micro-batch. Models that are not FSDP2 modules are left alone (DDP: Lightning's
    ``no_sync``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return
    for model in models:
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(sync)


@contextlib.contextmanager
def gathered_for_decoding(models: list[torch.nn.Module]):
    """Inside the block, each FSDP-sharded model in ``models`` (FSDP2 or FSDP1) keeps its parameters gathered
    between forwards: decoding calls a model once per token, and resharding after each call would all-gather
    every layer again for the next token (for a 7B teacher, ~15 GB moved per token per rank). The gather
    happens once per unit, at the first forward. On leaving, every unit is resharded and gets back its
    settings: under FSDP2 :func:`shard_fsdp2`'s (the layers reshard after their forward, the model's root unit
    does not: FSDP2's own default for a root, which the fused LM head relies on: it reads the root's gathered
    head after the forward); under FSDP1 each unit's own sharding strategy (its units are told not to free
    their gathered weights after a forward, as ``SHARD_GRAD_OP`` does, and freed on leaving; the root, which
    FSDP1 never frees after a forward, is left as it is). The block's peak memory is each model's full weights
    in their gathered dtype, as a replicated model would hold. Models that are not FSDP modules are left alone."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        FSDPModule = ()  # noqa: N806
    roots = [model for model in models if isinstance(model, FSDPModule)]
    held = _fsdp1_units(models)
    for root in roots:
        root.set_reshard_after_forward(False)
    if held:
        from torch.distributed.fsdp._flat_param import HandleShardingStrategy

        for unit, _ in held:
            unit._handle._sharding_strategy = HandleShardingStrategy.SHARD_GRAD_OP  # no free after forward
    try:
        yield
    finally:
        for root in roots:
            for unit in root.modules():
                if isinstance(unit, FSDPModule):
                    unit.set_reshard_after_forward(unit is not root, recurse=False)
                    unit.reshard()
        if held:
            from torch.distributed.fsdp._runtime_utils import _reshard

            for unit, strategy in held:
                unit._handle._sharding_strategy = strategy
                initialised = hasattr(unit._handle.flat_param, "_full_param_padded")  # a unit never run has nothing to free
                if initialised and not unit._is_root and not unit._handle.needs_unshard():  # gathered in the block: free it
                    _reshard(unit, unit._handle, True)


def _fsdp1_units(models: list[torch.nn.Module]) -> list[tuple[torch.nn.Module, Any]]:
    """``(unit, its handle's sharding strategy)`` of every FSDP1 unit with parameters inside ``models``."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return []
    units, seen = [], set()
    for model in models:
        for unit in model.modules():
            if isinstance(unit, FullyShardedDataParallel) and unit._handle is not None and id(unit) not in seen:
                seen.add(id(unit))
                units.append((unit, unit._handle._sharding_strategy))
    return units


def wrap_fsdp1(stage: Any) -> None:
    """For a :class:`~kdlab.stages.base.TaskStage` ``stage``: wrap each decoder layer and then each of ``stage.sharded_models()`` with the strategy's own
    settings (Lightning's manual wrapping: ``torch.distributed.fsdp.wrap.wrap`` inside the strategy's
    context), so layers are gathered one at a time and the rest (embeddings, head) form the model's own
    unit. Lightning wraps nothing more once a submodule is wrapped, so the trained model is wrapped
    whole here: its gradients are then all reduced. Frozen models that are not sharded are moved to the
    device (FSDP1 moves only the module tree it wraps).

    Mixed precision: with ``trainer.precision: bf16-mixed`` every unit computes in bf16 but reduces
    gradients and keeps buffers in fp32 (:func:`fsdp1_mixed_precision`), as the FSDP2 path does;
    Lightning's own FSDP1 default would reduce gradients in bf16 and cast buffers such as the rotary
    ``inv_freq`` to bf16. A ``mixed_precision`` given to the strategy (``FSDPStrategy(mixed_precision=...)``)
    is used as it is."""
    from torch.distributed.fsdp.wrap import wrap

    options = fsdp1_mixed_precision(stage.trainer.strategy, str(stage.trainer.precision))

    if getattr(stage, "fused_lm_head", False):
        raise ValueError("fused_lm_head reads the LM head's weight directly, which FSDP1 (strategy: fsdp) shards; "
                         "set fused_lm_head: false or use ModelParallelStrategy (FSDP2) with an unsharded head")
    sharded = stage.sharded_models()
    for model in sharded:
        blocks = decoder_layer_classes(model)
        parents = [(parent, name) for parent in model.modules() for name, child in parent.named_children() if type(child).__name__ in blocks]
        for parent, name in parents:
            parent._modules[name] = wrap(parent._modules[name], **options)
    for name, child in list(stage.named_children()):
        if any(child is model for model in sharded):
            setattr(stage, name, wrap(child, **options))  # the trained model: one FSDP root over its unwrapped rest
    for name, model in list(stage._frozen.items()):
        if any(model is other for other in sharded):
            stage._frozen[name] = wrap(model, **options)  # FSDP1 moves what it wraps to the device itself
    stage.place_frozen_models(stage.trainer.strategy.root_device)


def fsdp1_mixed_precision(strategy: Any, precision: str) -> dict[str, Any]:
    """The ``wrap`` overrides of :func:`wrap_fsdp1`: ``{"mixed_precision": MixedPrecision(bf16 parameters,
    fp32 gradient reduction, fp32 buffers)}`` for ``precision == "bf16-mixed"`` when ``strategy`` was given
    no ``mixed_precision`` of its own, else none (the strategy's setting, or Lightning's for the precision,
    applies)."""
    if precision != "bf16-mixed" or getattr(strategy, "mixed_precision", None) is not None:
        return {}
    from torch.distributed.fsdp import MixedPrecision

    return {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)}


def fsdp1_root(model: torch.nn.Module) -> torch.nn.Module | None:
    """``model`` when it is an FSDP1 root (``strategy: fsdp`` wrapped it), else ``None``."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return model if isinstance(model, FullyShardedDataParallel) else None


def global_grad_norm(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """The global L2 norm of ``model``'s gradients, a 0-dim fp32 tensor on ``device`` when it has none.
    Whole tensors and FSDP2's DTensors give it directly; under FSDP1 each rank holds a shard of every
    flat gradient, so the squared norms are summed over ranks (a collective: call it on every rank)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros((), device=device)
    if fsdp1_root(model) is None:
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    squares = torch.stack([g.float().pow(2).sum() for g in grads]).sum()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(squares)
    return squares.sqrt()
