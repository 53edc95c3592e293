"""``kdlab prune --model M --layers every_other --output DIR``: write a depth-pruned copy of a model as a
normal Hugging Face folder, with ``pruning.json`` recording the source, the selection, the kept layer
indices and the parameter counts (:mod:`kdlab.models.pruning` does the pruning)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kdlab.models.pruning import RECORD, prune_layers, select_layers


def prune_checkpoint(*, model: str, layers: str | list[int], output: str, dtype: str = "float32", trust_remote_code: bool = False) -> dict[str, Any]:
    """``kdlab prune``: load ``model`` (any ``ModelSpec`` path, GGUF included), keep ``layers``, and write
    a Hugging Face folder at ``output`` (weights, config, generation config, tokenizer) with ``pruning.json``
    recording the source, the selection, the kept indices and the parameter counts. Returns that record.

    Args:
        model: the source model path (hub id, folder, ``kdlab://``, ``pkg://``, ``.gguf``).
        layers: the selection (``every_other``, ``every:K``, ``first:K``, or indices such as ``0,2,5``).
        output: a new or empty folder.
        dtype: weight dtype written (``float32``, ``bfloat16``, ``float16``).
        trust_remote_code: run code shipped with the source checkpoint.
    """
    from kdlab.models.export import export_pretrained
    from kdlab.models.loading import (
        ModelSpec,
        load_causal_lm,
        load_config,
        load_tokenizer,
    )

    out = Path(output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"output: {str(out)!r} exists and is not an empty folder; choose a new one")
    spec = ModelSpec(model, dtype=dtype, trust_remote_code=trust_remote_code)
    config = load_config(spec, "model")  # the selection is checked against the depth before any weight is read
    depth = config.get_text_config().num_hidden_layers
    keep = select_layers(layers, depth, "layers")
    tokenizer = load_tokenizer(spec, "model")
    network = load_causal_lm(spec, "model", config=config)
    before = sum(p.numel() for p in network.parameters())
    prune_layers(network, keep)
    after = sum(p.numel() for p in network.parameters())
    export_pretrained(network, tokenizer, out)
    record = {
        "source": model,
        "layers": layers,
        "kept": keep,
        "num_layers": {"before": depth, "after": len(keep)},
        "parameters": {"before": before, "after": after},
        "dtype": dtype,
    }
    (out / RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record
