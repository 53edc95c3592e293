"""From a trained stage back to a Hugging Face model: stage-checkpoint weights (a LoRA run's adapters merged with
the settings the checkpoint records), weights by Hugging Face name (FSDP, activation-checkpointing and compile
wrappers stripped), LoRA adapters merged, full parameters gathered from FSDP shards, and :func:`export_pretrained`
(what stage exports and vLLM weight pushes use)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

STAGE_PREFIXES = ("student.", "model.")


LORA_SETTINGS = "kdlab_lora"
"""The checkpoint key under which a stage records its trained model's LoRA settings (:func:`lora_settings`), so
:func:`load_stage_weights` can merge the adapters (their scale ``alpha / r`` is not in the tensors)."""


def lora_settings(model: torch.nn.Module) -> dict[str, Any] | None:
    """``{"r", "lora_alpha", "target_modules"}`` of the LoRA adapter on ``model`` (a peft model, or one inside FSDP1 or
    compile wrappers, which pass attributes on), in peft's names and plain values (a weights-only checkpoint holds
    them); ``None`` for a model without adapters."""
    configs = getattr(model, "peft_config", None)
    if not configs:
        return None
    if len(configs) != 1:
        raise ValueError(f"the trained model holds {len(configs)} peft adapters ({sorted(configs)}); kdlab trains and merges one")
    config = next(iter(configs.values()))
    targets = config.target_modules
    return {"r": int(config.r), "lora_alpha": config.lora_alpha, "target_modules": targets if isinstance(targets, str) else sorted(targets)}


def peft_wrapped(model: torch.nn.Module, config: Any) -> torch.nn.Module:
    """``peft.get_peft_model(model, config)``: ``model`` with LoRA layers injected (in place) under a peft model."""
    import warnings

    from peft import get_peft_model

    with warnings.catch_warnings():
        # peft (0.21) asks the model for transformers' deprecated ``is_gradient_checkpointing`` alias, which warns
        # (FutureWarning) on every LoRA run; the answer is the same, the warning is peft's to fix, not the user's
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, config)


def load_stage_weights(model: torch.nn.Module, checkpoint: str, role: str = "model") -> None:
    """Copy the trained model of a kdlab stage checkpoint into ``model`` (in place, its dtype kept). A LoRA run's
    checkpoint (adapters and their settings, :data:`LORA_SETTINGS`) is loaded into ``model`` wrapped with the same
    adapters, which are then merged into its weights (``W + s B A``, as exports and vLLM pushes merge them) and
    removed: ``model`` stays a plain Hugging Face model.

    Raises naming ``<role>.checkpoint`` and the file when it is missing, unreadable, holds no kdlab stage, holds
    LoRA adapters without their settings (a checkpoint written before kdlab recorded them) or does not fit.
    """
    where = f"{role}.checkpoint {checkpoint!r}"
    if not Path(checkpoint).is_file():
        raise FileNotFoundError(f"{where}: no such file")
    try:
        saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
        state = saved["state_dict"]
    except Exception as error:  # a truncated file, a pickle of foreign classes, no state_dict
        raise OSError(f"{where}: not a readable Lightning checkpoint ({type(error).__name__}: {str(error)[:200]})") from error
    for prefix in STAGE_PREFIXES:
        weights = {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}
        if not weights:
            continue
        target = model
        if any("lora_" in key for key in weights):
            target = _with_checkpoint_adapters(model, saved.get(LORA_SETTINGS), where, prefix)
        expected = target.state_dict()
        missing = sorted(set(expected) - set(weights))
        unexpected = sorted(set(weights) - set(expected))
        shapes = [k for k in set(expected) & set(weights) if expected[k].shape != weights[k].shape]
        if missing or unexpected or shapes:
            raise ValueError(
                f"{where}: its {prefix.rstrip('.')!r} weights do not fit the model at {role}.path "
                f"(missing {missing[:3]}, unexpected {unexpected[:3]}, other shapes {shapes[:3]})"
            )
        target.load_state_dict({k: v.to(expected[k].dtype) for k, v in weights.items()})
        if target is not model:
            _merge_in_place(target)
        return
    raise ValueError(f"{where}: holds no kdlab stage weights (no keys starting with {' or '.join(STAGE_PREFIXES)})")


def _with_checkpoint_adapters(model: torch.nn.Module, settings: dict[str, Any] | None, where: str, prefix: str) -> torch.nn.Module:
    """``model`` under the LoRA adapters a checkpoint's ``settings`` describe (injected in place), or an error saying
    why they cannot be merged and what works instead."""
    if settings is None:  # every stage records them now (kdlab.stages.checkpointing): a checkpoint from before
        advice = ("written before kdlab recorded them: wrap the model at the path with kdlab.stages.lora.apply_lora and the run's "
                  f"lora settings, load the checkpoint's {prefix!r} tensors into it, write it with kdlab.models.export_pretrained "
                  "and use that folder as the path" + (" (an SFTModule run's SFTModule.export_dir folder is one)" if prefix == "model." else ""))
        raise ValueError(f"{where}: holds LoRA adapters without their settings (their scale alpha / r is not in the tensors), so "
                         f"they cannot be merged; {advice}")
    try:
        from peft import LoraConfig
    except ImportError as error:
        raise ImportError(f"{where}: holds LoRA adapters, and merging them needs peft: pip install 'kdlab[lora]'") from error
    return peft_wrapped(model, LoraConfig(**settings))


def _merge_in_place(adapted: torch.nn.Module) -> None:
    """Add each adapter's delta to its base weight (:func:`_lora_delta`, as :func:`merged_weights` does) and replace the
    adapter layers by their base layers (peft's ``unload``), in the model ``adapted`` wraps."""
    with torch.no_grad():
        for adapters in _lora_layers(adapted).values():
            weight = adapters[0][0].get_base_layer().weight
            weight += _lora_delta(adapters).to(weight.dtype)
    adapted.unload()


# Wrappers that training adds to parameter names, outermost first; vLLM's load_weights wants the plain
# Hugging Face names (model.layers.0.self_attn.q_proj.weight, lm_head.weight).
_WRAPPERS = re.compile(r"(^|\.)(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod|module)\.")


def hf_weight_name(name: str) -> str | None:
    """The plain Hugging Face name of a trained parameter (what ``from_pretrained`` and vLLM load), or
    ``None`` for a LoRA adapter tensor (adapters are merged, see :func:`merged_weights`).

    ``_fsdp_wrapped_module.model.layers.0.mlp.up_proj.weight`` -> ``model.layers.0.mlp.up_proj.weight``;
    ``base_model.model.model.embed_tokens.weight`` (peft) -> ``model.embed_tokens.weight``;
    ``model.layers.0.self_attn.q_proj.base_layer.weight`` (peft) -> ``model.layers.0.self_attn.q_proj.weight``.
    """
    if "lora_" in name:
        return None
    previous = None
    while previous != name:  # wrappers may nest (compile around FSDP around checkpointing)
        previous, name = name, _WRAPPERS.sub(r"\1", name)
    if name.startswith("base_model.model."):
        name = name[len("base_model.model.") :]
    return name.replace(".base_layer.", ".")


def merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(Hugging Face name, full tensor)`` for every parameter and buffer of ``model`` (rotary
    ``inv_freq`` buffers excluded), without changing ``model``.

    Sharded (DTensor) parameters are gathered one at a time (``full_tensor``), so at most one full
    tensor is alive on top of the shards; an FSDP1-wrapped model is gathered whole while the generator
    runs (:func:`full_parameters`; consume it fully, on every rank). LoRA-wrapped layers yield
    ``W + delta`` under the base weight's name, ``delta`` from peft's ``get_delta_weight`` computed when
    that weight is reached and freed before the next (:func:`_lora_layers`, :func:`_lora_delta`): one
    weight's delta at a time, never all of them; DoRA and other variants are refused before anything
    is yielded.
    """
    summoned = fsdp1_wrapped(model)
    with full_parameters(model):
        lora = _lora_layers(model)
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            target = hf_weight_name(name)
            if target is None or target.endswith("inv_freq"):
                continue
            full = _full(tensor).detach()
            if target in lora:
                full = full + _lora_delta(lora[target]).to(full.dtype)
            elif summoned:  # a view of FSDP1's gathered flat parameter, freed when the context exits
                full = full.clone()
            yield target, full
            del full  # the consumer's copy is the only one left while the next weight is built


def fsdp1_wrapped(model: torch.nn.Module) -> bool:
    """Whether ``model`` is, or holds, an FSDP1 (``FullyShardedDataParallel``) module."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(module, FullyShardedDataParallel) for module in model.modules())


def full_parameters(model: torch.nn.Module):
    """A context in which an FSDP1-wrapped ``model``'s parameters are whole and in their own shapes
    (``summon_full_params``, a collective: call it on every rank); outside FSDP1 it does nothing (DTensor
    parameters are gathered one at a time by :func:`merged_weights` instead)."""
    import contextlib

    if not fsdp1_wrapped(model):
        return contextlib.nullcontext()
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel.summon_full_params(model, writeback=False, recurse=True)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly DTensor-sharded) parameter; a collective when sharded."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _lora_layers(model: torch.nn.Module) -> dict[str, list[tuple[torch.nn.Module, str]]]:
    """``{Hugging Face weight name: [(peft LoRA layer, adapter name), ...]}`` of each layer's active,
    unmerged adapters (``fan_in_fan_out`` layouts and embedding adapters included); no tensor is built.

    Raises ``ValueError`` naming the layer for an adapter whose merge is not ``W + delta`` (DoRA and
    other peft LoRA variants): merge it with peft (``merge_and_unload``) first.
    """
    layers: dict[str, list[tuple[torch.nn.Module, str]]] = {}
    for name, module in model.named_modules():
        if not (hasattr(module, "get_delta_weight") and hasattr(module, "base_layer")):
            continue
        adapters = set(getattr(module, "lora_A", {})) | set(getattr(module, "lora_embedding_A", {}))
        merged = set(getattr(module, "merged_adapters", []))  # already inside the base weight
        for adapter in getattr(module, "active_adapters", []):
            if adapter not in adapters or adapter in merged:
                continue
            if getattr(module, "use_dora", {}).get(adapter, False) or adapter in getattr(module, "lora_variant", {}):
                raise ValueError(
                    f"LoRA adapter {adapter!r} on {name} is a variant (DoRA or another) whose merge is not W + B A; "
                    "kdlab cannot merge it on the fly: call peft's merge_and_unload() and export that model"
                )
            layers.setdefault(hf_weight_name(f"{name}.weight"), []).append((module, adapter))
    return layers


def _lora_delta(adapters: list[tuple[torch.nn.Module, str]]) -> torch.Tensor:
    """The summed delta (the weight's shape) of one weight's adapters, from peft's own ``get_delta_weight``
    (gathered whole when its factors are sharded: a collective)."""
    delta = None
    with torch.no_grad():  # not around a yield: grad mode is thread state the consumer would inherit
        for module, adapter in adapters:
            part = _full(module.get_delta_weight(adapter))
            delta = part if delta is None else delta + part
    return delta


def export_pretrained(model: torch.nn.Module, tokenizer: Any, directory: str | Path, write: bool = True) -> None:
    """Write ``model`` (LoRA adapters merged into its weights) and ``tokenizer`` as a standard Hugging
    Face folder that any later stage, vLLM or ``from_pretrained`` can load. ``model`` is left as it was
    (a peft model keeps its adapters). Under sharding call it on every rank (gathering the weights is
    a collective) with ``write`` true on one."""
    fsdp1 = fsdp1_wrapped(model)
    sharded = any(hasattr(p, "full_tensor") for p in model.parameters()) or fsdp1
    if not hasattr(model, "get_base_model") and not sharded:
        if write:
            model.save_pretrained(directory)
    else:
        from safetensors.torch import save_file

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        from kdlab.objectives.logits import innermost_model

        base = innermost_model(base)  # the Hugging Face model inside FSDP1 / compile wrappers
        # what a checkpoint holds (not the non-persistent buffers); under FSDP1 every merged name, the only
        # non-persistent buffers of the supported models being the rotary inv_freq ones merged_weights drops
        expected = None if fsdp1 else {name for name in (hf_weight_name(key) for key in base.state_dict()) if name is not None}
        state, seen = {}, set()
        for name, tensor in merged_weights(model):
            if expected is None or name in expected:
                shared = tensor.data_ptr() in seen  # tied embeddings: safetensors stores each tensor once
                seen.add(tensor.data_ptr())
                state[name] = (tensor.clone() if shared else tensor).contiguous()
        if not write:
            return
        Path(directory).mkdir(parents=True, exist_ok=True)
        base.config.save_pretrained(directory)
        if getattr(base, "generation_config", None) is not None:
            base.generation_config.save_pretrained(directory)
        save_file(state, str(Path(directory) / "model.safetensors"), metadata={"format": "pt"})
    if write:
        tokenizer.save_pretrained(directory)
