"""LoRA adapters for a stage's trained model (``LoraSpec``, :func:`apply_lora`): the paper trains its
teachers with r = alpha = 256 on every attention and MLP projection. Used by SFT, GRPO and distillation;
exports, vLLM pushes and a later stage loading a checkpoint merge the adapters (:mod:`kdlab.models.export`). :class:`~kdlab.teachers.base_model.AdaptersDisabled`
(the base model under the adapters, for a teacher that is the student's own base) lives with that teacher."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kdlab.models.export import peft_wrapped
from kdlab.teachers.base_model import AdaptersDisabled  # noqa: F401 - its home is the base-model teacher


@dataclass
class LoraSpec:
    """LoRA adapters through ``peft`` (``pip install kdlab[lora]``); the paper's teachers: r = alpha = 256."""

    r: int = 256
    alpha: int = 256
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )

    def __post_init__(self) -> None:
        if self.r < 1 or self.alpha < 1:
            raise ValueError(f"lora.r and lora.alpha must be >= 1, got r={self.r}, alpha={self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("lora.target_modules must name at least one module (e.g. q_proj, v_proj)")


def apply_lora(model: torch.nn.Module, spec: LoraSpec) -> torch.nn.Module:
    """``model`` (a Hugging Face causal LM) wrapped by peft with ``spec``'s adapters, after :func:`check_targets`."""
    check_targets(model, spec.target_modules)
    try:
        from peft import LoraConfig
    except ImportError as error:
        raise ImportError("lora needs peft: pip install 'kdlab[lora]'") from error
    return peft_wrapped(model, LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=spec.target_modules))


# what the class names of the layers peft's LoRA adapts contain: torch's Linear, Embedding and convolutions,
# transformers' Conv1D (GPT-2's transposed Linear), quantised Linears (Linear8bitLt, Linear4bit...)
ADAPTABLE = ("Linear", "Embedding", "Conv")


def check_targets(model: torch.nn.Module, targets: list[str]) -> None:
    """Refuse ``lora.target_modules`` that would not adapt what they say, before peft wraps anything. peft's rule for
    a list: a module matches a target when its name is the target or ends with ``.<target>``. Refused, naming the
    entries: an entry matching no module (a typo next to a valid name would otherwise be ignored), one matching a
    module peft cannot adapt (``model``: the whole decoder), and one on a tied input embedding or LM head
    (``tie_word_embeddings``): the two are one tensor, which :func:`kdlab.models.export.merged_weights` (exports,
    vLLM weight pushes) yields once, so a head adapter's change would be dropped and an embedding adapter's would
    become the head's too."""
    modules = dict(model.named_modules())
    matches = {target: [name for name in modules if name == target or name.endswith(f".{target}")] for target in targets}
    unmatched = [target for target, names in matches.items() if not names]
    if unmatched:
        raise ValueError(f"lora.target_modules: {unmatched} match no module of the model (a module matches when its name is the entry "
                         "or ends with '.<entry>', e.g. q_proj)")
    for target, names in matches.items():
        for name in names:
            if not any(kind in type(modules[name]).__name__ for kind in ADAPTABLE):
                raise ValueError(f"lora.target_modules: {target!r} matches {name} ({type(modules[name]).__name__}), not a layer peft adapts "
                                 "(a Linear, Embedding or convolution); name its projections instead (e.g. q_proj)")
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not (embeddings is not None and head is not None and tied_weights(embeddings.weight, getattr(head, "weight", None))):
        return
    tied = [(target, name) for target, names in matches.items() for name in names if modules[name] is embeddings or modules[name] is head]
    if tied:
        target, name = tied[0]
        raise ValueError(f"lora.target_modules: {target!r} adapts {name}, whose weight is tied to the "
                         f"{'LM head' if modules[name] is embeddings else 'input embedding'} (tie_word_embeddings): exports and vLLM weight "
                         "pushes write the tied tensor once, so the adapter's change would be lost or applied to both; remove "
                         f"{target!r} from lora.target_modules")


def tied_weights(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether ``a`` and ``b`` are one tensor (one parameter, or one storage; meta tensors only by identity)."""
    return b is not None and (a is b or (a.device.type != "meta" and a.data_ptr() == b.data_ptr()))
