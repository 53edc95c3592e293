"""LoRA adapters for a stage's trained model (``LoraSpec``, :func:`apply_lora`): the paper trains its
teachers with r = alpha = 256 on every attention and MLP projection. Used by SFT, GRPO and distillation;
exports and vLLM pushes merge the adapters (:mod:`kdlab.models.export`). :class:`AdaptersDisabled` is the
base model under the adapters, for a teacher that is the student's own base (no second model in memory)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    return get_peft_model(model, config)


class AdaptersDisabled(torch.nn.Module):
    """The base model under a peft model's LoRA adapters: every call runs ``peft_model`` with its adapters
    disabled (``peft_model.disable_adapter()``), so the base weights are read in place: no copy, no second
    model. It holds no parameters or buffers of its own and ignores mode, ``requires_grad_`` and device
    moves (the peft model is the student, which the stage trains and moves); any other attribute is the
    peft model's (``config``, ``generation_config``, ``get_output_embeddings``...). The student's dropout
    applies when it is in train mode (LoRA dropout included; kdlab's default is 0)."""

    def __init__(self, peft_model: torch.nn.Module) -> None:
        super().__init__()
        if not callable(getattr(peft_model, "disable_adapter", None)):
            raise ValueError("AdaptersDisabled needs a peft model (apply_lora's result)")
        object.__setattr__(self, "peft_model", peft_model)  # not a submodule: no parameters of its own

    def forward(self, *args, **kwargs):
        with self.peft_model.disable_adapter():
            return self.peft_model(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["peft_model"], name)

    def train(self, mode: bool = True) -> AdaptersDisabled:
        return self

    def requires_grad_(self, requires_grad: bool = True) -> AdaptersDisabled:
        return self

    def _apply(self, fn, recurse: bool = True) -> AdaptersDisabled:
        return self
