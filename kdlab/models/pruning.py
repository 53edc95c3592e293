"""Depth pruning: keep a chosen subset of a decoder's layers (the prune-then-distill recipe of
Minitron, Sheared-LLaMA and DistilBERT's alternate-layer initialisation).

A layer selection is one of

- ``"every_other"``: layers 0, 2, 4, ... (15 of 30 for SmolLM2-135M);
- ``"every:K"``: layers 0, K, 2K, ...;
- ``"first:K"``: layers 0 .. K-1;
- an explicit increasing list of layer indices (``[0, 1, 5]`` or the string ``"0,1,5"``).

:func:`prune_layers` edits a loaded model in place (the decoder's layer list, each kept layer's
``layer_idx``, ``config.num_hidden_layers`` and ``config.layer_types``), so it saves and reloads as a
normal Hugging Face model; :func:`prune_checkpoint` (``kdlab prune``) writes such a folder with a
``pruning.json`` recording what was kept. ``ModelSpec(layers=...)`` prunes on load instead.
"""

from __future__ import annotations

import torch

RECORD = "pruning.json"
"""The file beside a pruned checkpoint saying which layers of which source it keeps."""


def select_layers(layers: str | list[int] | tuple[int, ...], num_layers: int | None, key: str = "layers") -> list[int]:
    """The kept layer indices (increasing) of a ``num_layers``-layer decoder for the selection ``layers``.

    With ``num_layers`` ``None`` only the form is checked (indices against the depth come later).
    Raises ``ValueError`` naming ``key`` for an unknown form, an empty selection, or a repeated,
    decreasing, negative or out-of-range index. A selection of every layer is allowed (no change).
    """
    if isinstance(layers, str):
        text = layers.strip()
        if text == "every_other":
            if num_layers is None:
                return []
            chosen = list(range(0, num_layers, 2))
        elif text.startswith(("every:", "first:")):
            kind, _, count = text.partition(":")
            if not count.strip().isdigit() or int(count) < 1:
                raise ValueError(f"{key}: {layers!r} needs a positive integer after '{kind}:'")
            if num_layers is None:
                return []
            k = int(count)
            if kind == "first" and k > num_layers:
                raise ValueError(f"{key}: {layers!r} asks for {k} layers, the model has {num_layers}")
            chosen = list(range(0, num_layers, k)) if kind == "every" else list(range(k))
        else:
            parts = [part.strip() for part in text.split(",")]
            if not text or not all(part.lstrip("-").isdigit() for part in parts):
                raise ValueError(
                    f"{key}: {layers!r} is not a layer selection (every_other, every:K, first:K, or a list such as 0,2,5)"
                )
            chosen = [int(part) for part in parts]
    elif isinstance(layers, (list, tuple)):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
            raise ValueError(f"{key}: layer indices must be integers, got {list(layers)!r}")
        chosen = list(layers)
    else:
        raise ValueError(f"{key}: expected a selection string or a list of layer indices, got {layers!r}")
    if not chosen:
        raise ValueError(f"{key}: the layer selection is empty; keep at least one layer")
    repeated = sorted({i for i in chosen if chosen.count(i) > 1})
    if repeated:
        raise ValueError(f"{key}: layer(s) {repeated} repeated in {chosen}; each layer can be kept once")
    if any(i < 0 for i in chosen):
        raise ValueError(f"{key}: negative layer index in {chosen}; layers count from 0")
    if chosen != sorted(chosen):
        raise ValueError(f"{key}: layers {chosen} are not in increasing order (pruning keeps the layers' order)")
    if num_layers is not None:
        outside = [i for i in chosen if i >= num_layers]
        if outside:
            raise ValueError(f"{key}: layer(s) {outside} out of range; the model has {num_layers} layers (0..{num_layers - 1})")
    return chosen


def decoder_layers(model: torch.nn.Module) -> tuple[torch.nn.Module, str, torch.nn.ModuleList]:
    """``(parent, attribute, layer list)`` of ``model``'s decoder stack: the ``ModuleList`` named
    ``layers`` with ``config.num_hidden_layers`` entries (``model.model.layers`` for Llama/Qwen2)."""
    depth = model.config.get_text_config().num_hidden_layers
    for name, module in model.named_modules():
        for attribute, child in module.named_children():
            if attribute in ("layers", "h", "layer") and isinstance(child, torch.nn.ModuleList) and len(child) == depth:
                return module, attribute, child
    raise ValueError(f"{type(model).__name__}: no decoder layer list of {depth} layers found to prune")


def prune_layers(model: torch.nn.Module, keep: list[int]) -> torch.nn.Module:
    """Keep only decoder layers ``keep`` (increasing indices) of ``model``, in place; returns ``model``.

    Kept layer j (the ``keep[j]``-th of the original) gets ``layer_idx = j`` on every submodule that
    has one (the KV cache is indexed by it); ``config.num_hidden_layers`` becomes ``len(keep)`` and
    ``config.layer_types`` (per-layer attention kinds) keeps the kept layers' entries.
    """
    parent, attribute, layers = decoder_layers(model)
    keep = select_layers(list(keep), len(layers), "layers")
    kept = torch.nn.ModuleList([layers[i] for i in keep])
    for new_index, layer in enumerate(kept):
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = new_index
    setattr(parent, attribute, kept)
    config = model.config.get_text_config()
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[i] for i in keep]
    config.num_hidden_layers = len(keep)
    return model
