"""Memory and communication of the paths that matter on a GPU, shown on the CPU (issue #45): a LoRA merge
(export, vLLM push) holds one weight's delta at a time."""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kdlab.models.export import merged_weights
from kdlab.models.loading import ModelSpec, load_causal_lm


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages that operators create inside the mode and that are still alive
    (``live``), and the most alive at once (``peak``); storages that existed before are not counted."""

    def __init__(self, existing: list[torch.Tensor]):
        super().__init__()
        self.known = {tensor.untyped_storage().data_ptr() for tensor in existing}
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if size and key not in self.known:
                    self.known.add(key)
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, key, size)
        return out

    def _freed(self, key, size):
        self.live -= size
        self.known.discard(key)


def test_a_lora_merge_holds_one_weights_delta_at_a_time(tiny_pair):
    peft = pytest.importorskip("peft")
    model = load_causal_lm(ModelSpec(tiny_pair[0]))
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=projections))
    for name, parameter in wrapped.named_parameters():
        if "lora_B" in name:
            parameter.data.normal_()
    adapted = {name.replace(".base_layer", "") for name, module in wrapped.named_modules() if name.endswith("base_layer")}
    weight_bytes = {name: module.weight.nbytes for name, module in wrapped.named_modules() if name in adapted}
    existing = [*wrapped.parameters(), *wrapped.buffers()]
    with LiveBytes(existing) as counter:
        for _, tensor in merged_weights(wrapped):  # consumed as a vLLM push does: each tensor dropped after use
            del tensor
    largest, total = max(weight_bytes.values()), sum(weight_bytes.values())
    assert len(weight_bytes) > 10 and total > 6 * largest  # building every delta at once would show
    # one merged weight, its delta and one intermediate (B A before scaling) at most
    assert 0 < counter.peak <= 3 * largest, (counter.peak, largest, total)
    assert counter.live == 0
