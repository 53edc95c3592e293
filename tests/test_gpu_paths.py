"""Memory and communication of the paths that matter on a GPU, shown on the CPU (issue #45): a LoRA merge
(export, vLLM push) holds one weight's delta at a time; GRPO's accumulated micro-batches reduce FSDP2
gradients once per mini-batch; docs/scaling.md's multi-node commands parse."""

import re
import shlex
import weakref
from pathlib import Path

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


def test_grpo_reduces_fsdp2_gradients_on_a_mini_batchs_last_micro_batch_only(tiny_pair, tmp_path, monkeypatch):
    """GRPO accumulates its micro-batches itself (manual optimisation): each backward but a mini-batch's
    last runs with FSDP2 gradient sync off (tests/test_distributed.py counts the reduce-scatters of the
    automatic path over 2 processes)."""
    import lightning.pytorch as pl

    import kdlab.stages.grpo as grpo_stage
    from kdlab.stages import GRPOModule
    from kdlab.tasks import Addition

    module = GRPOModule(tiny_pair[0], Addition(num_train=4, num_val=0, num_test=0), group_size=4, batch_size=2, mini_batches=2,
                        micro_batch_size=2, max_completion_tokens=4, lr=1e-3, warmup_steps=0)
    events = []
    monkeypatch.setattr(grpo_stage, "require_gradient_sync", lambda models, sync: events.append(("sync", sync, models[0] is module.student)))
    backward = module.manual_backward
    monkeypatch.setattr(module, "manual_backward", lambda loss, *a, **k: events.append("backward") or backward(loss, *a, **k))
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, default_root_dir=tmp_path,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module)
    # one rollout batch: 8 rows, 2 mini-batches of 4 rows, 2 micro-batches of 2 rows each
    step = [("sync", False, True), "backward", ("sync", True, True), "backward"]
    assert events == step * 2


ROOT = Path(__file__).parents[1]


def documented_fit_commands(path: Path) -> list[list[str]]:
    """The arguments from ``fit`` on of every ``kdlab fit`` / ``python -m kdlab.cli fit`` command in the
    ``bash`` blocks of ``path`` (continuation lines joined, comments dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(encoding="utf-8"), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if "fit" in words and {"kdlab", "kdlab.cli"} & set(words[: words.index("fit")]):
                commands.append(words[words.index("fit"):])
    return commands


MULTI_NODE = documented_fit_commands(ROOT / "docs" / "scaling.md")


def test_scaling_documents_multi_node_commands():
    assert len(MULTI_NODE) >= 3 and all("--trainer.num_nodes=2" in command for command in MULTI_NODE)


@pytest.mark.parametrize("command", MULTI_NODE, ids=lambda command: command[-3].split("/")[-1] if len(command) > 3 else "?")
def test_the_multi_node_commands_parse_into_the_papers_batch(command, monkeypatch, capsys):
    """docs/scaling.md's multi-node commands parse as written (``--print_config``: no model is loaded) and
    give 2 nodes x 8 devices x 1 prompt x 2 micro-batches = the paper's 32 prompts per step; under FSDP2
    the data-parallel size is all 16 ranks."""
    import yaml

    from kdlab.cli.main import main

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("sys.argv", ["kdlab"])
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--print_config"], raise_parse_errors=True)
    assert exit_info.value.code in (0, None)
    config = yaml.safe_load(capsys.readouterr().out)
    trainer, model = config["trainer"], config["model"]["init_args"] if "init_args" in config["model"] else config["model"]
    ranks = trainer["num_nodes"] * trainer["devices"]
    assert ranks * model["batch_size"] * trainer["accumulate_grad_batches"] == 32
    strategy = trainer["strategy"]
    if isinstance(strategy, dict) and strategy["class_path"].endswith("ModelParallelStrategy"):
        assert strategy["init_args"]["data_parallel_size"] == ranks


def test_the_kl_objectives_extra_memory_is_bounded_by_the_logits_gradient_or_a_few_blocks():
    """peers.md's first complaint (OOM from full-vocabulary logits, fp32 copies of ``(B, T, V)``): ForwardKL's
    forward and backward on fp32 logits allocate one ``(B, T, V)`` gradient and a few blocks beside it (nothing
    with ``consume=True``, which writes the gradient into the logits' storage), and on the fused head only
    ``(chunk, V)`` blocks; the textbook KL (log-softmax of both, their difference, its gradient) holds several copies."""
    from kdlab.objectives import ForwardKL
    from kdlab.objectives.lazy import HeadLogits

    generator = torch.Generator().manual_seed(0)
    batch, length, vocab, hidden = 4, 1024, 4096, 32  # 16 chunks of 256 positions
    logits_bytes = batch * length * vocab * 4
    teacher = torch.randn(batch, length, vocab, generator=generator)
    mask = torch.ones(batch, length, dtype=torch.bool)

    def peak(loss, *inputs) -> int:
        with LiveBytes([teacher, mask, *inputs]) as counter:
            loss().backward()
        return counter.peak

    student = torch.randn(batch, length, vocab, generator=generator, requires_grad=True)
    chunked = peak(lambda: ForwardKL()(student, teacher, mask), student)
    base = torch.randn(batch, length, vocab, generator=generator, requires_grad=True)
    consumed = base.clone()  # a model's logits: made before, their gradient reaching ``base`` through a clone
    in_place = peak(lambda: ForwardKL()(consumed, teacher, mask, consume=True), base, consumed)
    h = torch.randn(batch, length, hidden, generator=generator, requires_grad=True)
    head = torch.randn(vocab, hidden, generator=generator, requires_grad=True)
    fused = peak(lambda: ForwardKL()(HeadLogits(h, head), teacher, mask), h, head)
    textbook = torch.randn(batch, length, vocab, generator=generator, requires_grad=True)

    def naive():
        log_p, log_q = torch.log_softmax(teacher, -1), torch.log_softmax(textbook, -1)
        return (log_p.exp() * (log_p - log_q)).sum(-1).mean()

    reference = peak(naive, textbook)
    assert chunked < 1.5 * logits_bytes < 3 * logits_bytes < reference, (chunked, reference, logits_bytes)
    assert in_place < logits_bytes / 2, (in_place, logits_bytes)  # blocks only: the gradient takes the logits' storage
    chunk_bytes = 256 * vocab * 4  # one (chunk, V) fp32 block
    assert fused < 4 * chunk_bytes == logits_bytes / 4, (fused, logits_bytes)
