"""LoRA adapters for a stage's trained model (``LoraSpec``, :func:`apply_lora`): the paper trains its
teachers with r = alpha = 256 on every attention and MLP projection. Used by SFT, GRPO and distillation;
exports and vLLM pushes merge the adapters (:mod:`kdlab.models.export`). :class:`~kdlab.teachers.base_model.AdaptersDisabled`
(the base model under the adapters, for a teacher that is the student's own base) lives with that teacher."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

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


def apply_lora(model: torch.nn.Module, spec: LoraSpec) -> torch.nn.Module:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as error:
        raise ImportError("lora needs peft: pip install 'kdlab[lora]'") from error
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=spec.target_modules)
    with warnings.catch_warnings():
        # peft (0.21) asks the model for transformers' deprecated ``is_gradient_checkpointing`` alias, which warns
        # (FutureWarning) on every LoRA run; the answer is the same, the warning is peft's to fix, not the user's
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, config)


