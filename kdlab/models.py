"""Loading teacher and student: any causal LM by hub name or local path, and the shared-vocabulary check.

A path that starts with ``kdlab://`` names a model shipped inside the package
(``kdlab://tiny-random/student`` is ``<kdlab>/assets/tiny-random/student``), so configs stay
valid wherever kdlab is installed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ASSETS = Path(__file__).parent / "assets"
PACKAGE_SCHEME = "kdlab://"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_path(name_or_path: str) -> str:
    """Map ``kdlab://<rel>`` to the packaged asset folder; return anything else unchanged."""
    if name_or_path.startswith(PACKAGE_SCHEME):
        return str(ASSETS / name_or_path[len(PACKAGE_SCHEME) :])
    return name_or_path


@dataclass
class ModelSpec:
    """Where a model comes from and how to load it.

    Args:
        path: a Hugging Face hub id, a local directory, or ``kdlab://...`` for a packaged model.
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
    """

    path: str
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    revision: str | None = None
    checkpoint: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"model path must be a non-empty string, got {self.path!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"model dtype must be one of {sorted(DTYPES)}, got {self.dtype!r} (path {self.path!r})")

    @property
    def resolved(self) -> str:
        return resolve_path(self.path)


def _rebuild_hint(spec: ModelSpec) -> str:
    if not spec.path.startswith(PACKAGE_SCHEME):
        return ""
    which = spec.path[len(PACKAGE_SCHEME) :].split("/")[0]
    command = "python -m kdlab.tiny random" if which == "tiny-random" else "python -m kdlab.tiny world"
    return f" (rebuild the packaged models with `{command}`)"


def _check_local(spec: ModelSpec, role: str) -> None:
    """A packaged or local path that is missing fails with a message naming it (no hub fallback)."""
    resolved = spec.resolved
    looks_local = spec.path.startswith((PACKAGE_SCHEME, "/", "./", "../", "~"))
    if looks_local and not Path(resolved).expanduser().is_dir():
        raise FileNotFoundError(f"{role}.path: no model directory at {resolved!r}{_rebuild_hint(spec)}")


def load_tokenizer(spec: ModelSpec, role: str = "model") -> Any:
    """The tokenizer stored with ``spec`` (``AutoTokenizer``), with a pad token set.

    A tokenizer without a pad token gets its EOS token as pad: padded positions are always masked,
    so the id only has to exist.
    """
    from transformers import AutoTokenizer

    _check_local(spec, role)
    tokenizer = AutoTokenizer.from_pretrained(
        spec.resolved, trust_remote_code=spec.trust_remote_code, revision=spec.revision
    )
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"{role}.path {spec.path!r}: tokenizer has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(spec: ModelSpec, role: str = "model") -> torch.nn.Module:
    """``AutoModelForCausalLM`` from ``spec``, in ``spec.dtype``, with gradient checkpointing if asked."""
    from transformers import AutoModelForCausalLM

    _check_local(spec, role)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            spec.resolved,
            dtype=DTYPES[spec.dtype],
            trust_remote_code=spec.trust_remote_code,
            revision=spec.revision,
        )
    except Exception as error:  # safetensors, torch and transformers each raise their own types
        folder = Path(spec.resolved)
        files = sorted(p.name for p in folder.glob("*.safetensors")) + sorted(p.name for p in folder.glob("*.bin")) if folder.is_dir() else []
        where = f"{folder / files[0]}" if len(files) == 1 else f"{spec.resolved} ({', '.join(files) or 'no weight files'})"
        raise OSError(f"{role}.path: could not load the model weights from {where}: {error}{_rebuild_hint(spec)}") from error
    if spec.checkpoint is not None:
        load_stage_weights(model, spec.checkpoint, role)
    if spec.gradient_checkpointing:
        enable_activation_checkpointing(model)
    return model


def enable_activation_checkpointing(model: Any) -> None:
    """Non-reentrant activation checkpointing of a transformers model, and no KV cache in training
    (transformers 5 renamed gradient checkpointing to activation checkpointing; both are handled)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


STAGE_PREFIXES = ("student.", "model.")
"""Where kdlab's stages keep their trained model in a checkpoint's ``state_dict``."""


def load_stage_weights(model: torch.nn.Module, checkpoint: str, role: str = "model") -> None:
    """Copy the trained model of a kdlab stage checkpoint into ``model`` (in place, its dtype kept).

    Raises naming ``<role>.checkpoint`` and the file when it is missing, unreadable, holds no kdlab
    stage, holds LoRA adapters (merge them first: ``SFTModule.save_pretrained``) or does not fit.
    """
    where = f"{role}.checkpoint {checkpoint!r}"
    if not Path(checkpoint).is_file():
        raise FileNotFoundError(f"{where}: no such file")
    try:
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    except Exception as error:  # a truncated file, a pickle of foreign classes, no state_dict
        raise OSError(f"{where}: not a readable Lightning checkpoint ({type(error).__name__}: {str(error)[:200]})") from error
    expected = model.state_dict()
    for prefix in STAGE_PREFIXES:
        weights = {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}
        if not weights:
            continue
        if any("lora_" in key for key in weights):
            raise ValueError(f"{where}: holds LoRA adapters; export merged weights (save_pretrained) and use them as the path")
        missing = sorted(set(expected) - set(weights))
        unexpected = sorted(set(weights) - set(expected))
        shapes = [k for k in set(expected) & set(weights) if expected[k].shape != weights[k].shape]
        if missing or unexpected or shapes:
            raise ValueError(
                f"{where}: its {prefix.rstrip('.')!r} weights do not fit the model at {role}.path "
                f"(missing {missing[:3]}, unexpected {unexpected[:3]}, other shapes {shapes[:3]})"
            )
        model.load_state_dict({k: v.to(expected[k].dtype) for k, v in weights.items()})
        return
    raise ValueError(f"{where}: holds no kdlab stage weights (no keys starting with {' or '.join(STAGE_PREFIXES)})")


def shared_vocab_size(student_tokenizer: Any, teacher_tokenizer: Any, student: Any, teacher: Any) -> int:
    """Check that both models read and write the same token ids; return the vocabulary size to use.

    The vocabularies (token -> id, special tokens included) must be identical; chat templates may
    differ, since each model's prompt is rendered with its own. Logits are restricted to
    ``len(tokenizer)`` rows, which handles padded embedding matrices (Qwen2.5 1.5B has 151,936
    rows, 7B has 152,064, for the same 151,665-token tokenizer).
    """
    student_vocab, teacher_vocab = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if student_vocab != teacher_vocab:
        only_student = sorted(set(student_vocab.items()) - set(teacher_vocab.items()))[:3]
        only_teacher = sorted(set(teacher_vocab.items()) - set(student_vocab.items()))[:3]
        raise ValueError(
            "student and teacher tokenizers differ (student.path="
            f"{student_tokenizer.name_or_path!r}, teacher.path={teacher_tokenizer.name_or_path!r}; "
            f"{len(student_vocab)} vs {len(teacher_vocab)} tokens; e.g. student-only {only_student}, "
            f"teacher-only {only_teacher}). Token-level KL needs one shared vocabulary."
        )
    vocab_size = len(student_tokenizer)
    for role, model in (("student", student), ("teacher", teacher)):
        rows = model.get_output_embeddings().weight.shape[0]
        if rows < vocab_size:
            raise ValueError(f"{role} has {rows} output rows, fewer than the tokenizer's {vocab_size} tokens")
    return vocab_size


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
    runs (:func:`full_parameters`; consume it fully, on every rank). LoRA-wrapped linears yield
    ``W + scale * B A`` under the base weight's name.
    """
    summoned = fsdp1_wrapped(model)
    with full_parameters(model):
        lora = _lora_deltas(model)
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            target = hf_weight_name(name)
            if target is None or target.endswith("inv_freq"):
                continue
            full = _full(tensor).detach()
            if target in lora:
                full = full + lora[target].to(full.dtype)
            elif summoned:  # a view of FSDP1's gathered flat parameter, freed when the context exits
                full = full.clone()
            yield target, full


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


def _lora_deltas(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{Hugging Face weight name: scale * B @ A}`` of each peft LoRA linear (active adapter), else empty."""
    deltas = {}
    for name, module in model.named_modules():
        if not (hasattr(module, "lora_A") and hasattr(module, "base_layer")):
            continue
        for adapter in getattr(module, "active_adapters", []):
            if adapter not in module.lora_A:
                continue
            a, b = (_full(module.lora_A[adapter].weight), _full(module.lora_B[adapter].weight))
            delta = (b @ a) * module.scaling[adapter]
            key = hf_weight_name(f"{name}.weight")
            deltas[key] = deltas[key] + delta if key in deltas else delta
    return {k: v.detach() for k, v in deltas.items()}


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
        from kdlab.decoding import innermost_model

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
