"""A dense decoder-only transformer's sizes (:class:`Shape`) from its config, read without weights, or from the
published configs of the paper's models (:data:`PUBLISHED`, for folders that do not exist yet): what ``kdlab
estimate``'s arithmetic (:mod:`kdlab.study.estimate`) needs of each model."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Shape:
    """A dense decoder-only transformer's sizes (what the arithmetic needs of a config)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    source: str = ""
    context: int = 0  # max_position_embeddings (what vLLM's default budget keeps room for)

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        q = self.heads * self.head_dim
        bias = q + 2 * self.kv_dim if self.qkv_bias else 0
        return 2 * self.hidden * q + 2 * self.hidden * self.kv_dim + 3 * self.hidden * self.intermediate + 2 * self.hidden + bias

    @property
    def root_params(self) -> int:
        """Embeddings, the head when untied, the final norm: what sits outside the decoder layers."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.root_params + self.layers * self.layer_params

    @property
    def largest_tensor(self) -> int:  # elements of the largest parameter
        return max(self.vocab * self.hidden, self.hidden * self.intermediate)


def _published(hidden, layers, heads, kv_heads, intermediate, vocab, tied, qkv_bias, name, context) -> Shape:
    return Shape(hidden, layers, heads, kv_heads, hidden // heads, intermediate, vocab, tied, qkv_bias, f"published config of {name}", context)


PUBLISHED = {
    "Qwen/Qwen2.5-1.5B-Instruct": _published(1536, 28, 12, 2, 8960, 151936, True, True, "Qwen/Qwen2.5-1.5B-Instruct", 32768),
    "Qwen/Qwen2.5-7B-Instruct": _published(3584, 28, 28, 4, 18944, 152064, False, True, "Qwen/Qwen2.5-7B-Instruct", 32768),
    "meta-llama/Llama-3.2-1B-Instruct": _published(2048, 16, 32, 8, 8192, 128256, True, False, "meta-llama/Llama-3.2-1B-Instruct", 131072),
    "meta-llama/Llama-3.1-8B-Instruct": _published(4096, 32, 32, 8, 14336, 128256, False, False, "meta-llama/Llama-3.1-8B-Instruct", 131072),
}
"""The paper's models' published ``config.json`` numbers, for configs that cannot be read here (no hub offline;
the task-trained teachers' folders do not exist yet)."""
ALIASES = {
    "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B-Instruct", "qwen1.5b": "Qwen/Qwen2.5-1.5B-Instruct",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct", "qwen7b": "Qwen/Qwen2.5-7B-Instruct",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B-Instruct", "llama1b": "meta-llama/Llama-3.2-1B-Instruct",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct", "llama8b": "meta-llama/Llama-3.1-8B-Instruct",
}
"""Names in a path (a hub id, or a teacher folder such as ``./teachers/qwen7b-countdown3``) -> the published model."""
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def shape_of_config(config: Any, source: str) -> Shape:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, heads = int(text.hidden_size), int(text.num_attention_heads)
    tied = bool(getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False)))
    bias = bool(getattr(text, "attention_bias", False)) or getattr(text, "model_type", "") == "qwen2"
    return Shape(hidden, int(text.num_hidden_layers), heads, int(getattr(text, "num_key_value_heads", None) or heads),
                 int(getattr(text, "head_dim", None) or hidden // heads), int(getattr(text, "intermediate_size", None) or 4 * hidden),
                 int(text.vocab_size), tied, bias, source, int(getattr(text, "max_position_embeddings", 0) or 0))


def published_shape(path: str) -> Shape | None:
    """The published shape a path names (exactly, or by a model name in its last component), else ``None``."""
    exact, last = {name.lower(): shape for name, shape in PUBLISHED.items()}, path.rstrip("/").rsplit("/", 1)[-1].lower()
    if path.lower().rstrip("/") in exact:
        return exact[path.lower().rstrip("/")]
    for alias, name in ALIASES.items():
        if re.search(rf"(?<![\w.]){re.escape(alias)}(?![\w.])", last.replace("_", "-")) or last.startswith(alias):
            return PUBLISHED[name]
    return None


def model_shape(spec: Any, role: str) -> Shape:
    """``spec``'s (a :class:`~kdlab.models.loading.ModelSpec`) shape from its config, read without weights
    (a hub id only from the local cache), else from :data:`PUBLISHED`; pruned to ``spec.layers``."""
    from kdlab.models.loading import load_config

    shape, error = None, None
    try:
        if HUB_ID.match(spec.path) and not Path(spec.path).exists():  # a hub id: its config from the local cache only
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(spec.path, revision=spec.revision, local_files_only=True)
            shape = shape_of_config(config, f"config of {spec.path} (local cache)")
        else:
            shape = shape_of_config(load_config(spec, role), f"config of {spec.path}")
    except Exception as exc:  # noqa: BLE001 - unreadable here: the published table may know it
        error, shape = exc, published_shape(spec.path)
        shape = shape and replace(shape, source=f"{shape.source} ({role}.path {spec.path!r} not readable here)")
    if shape is None:
        raise ValueError(f"{role}.path {spec.path!r}: its config cannot be read here ({type(error).__name__}: {str(error)[:160]}) "
                         f"and it is none of the published shapes kdlab estimate knows ({', '.join(PUBLISHED)})")
    if spec.layers is not None:
        from kdlab.models.pruning import select_layers

        kept = len(select_layers(spec.layers, shape.layers, f"{role}.layers"))
        shape = replace(shape, layers=kept, source=f"{shape.source}, layers {spec.layers!r}: {kept} kept")
    return shape
