"""One batched decode per optimiser step: the prompts of every micro-batch of an accumulation group are
decoded together, then each micro-batch trains on its own rows; losses and gradients are those of
decoding each micro-batch alone (to 1e-6), with one decode call instead of one per micro-batch."""

import lightning.pytorch as pl
import pytest
import torch

from kdlab.data import Rollout
from kdlab.rollouts import StudentRollouts
from kdlab.rollouts.decoding import sample_tokens
from kdlab.stages import DistillModule
from kdlab.stages.loaders import ResumableLoader
from kdlab.tasks import Addition


class GreedyStudentRollouts(StudentRollouts):
    """A notebook-style policy: the student's greedy completions, so the text does not depend on the random
    stream and the two decode groupings must give the same completions; counts its decode calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def sample(self, prompts, context):
        self.calls.append(len(prompts))
        ids, mask, entropy = sample_tokens(
            context.decoder("student", prompts), len(prompts), context.max_new_tokens, context.eos_token_ids,
            context.pad_token_id, None, greedy=True, device=prompts.student_ids.device, all_done=context.all_done,
        )
        return Rollout(prompts, ids, mask, entropy)


class Record(pl.Callback):
    """Each micro-batch's loss and the accumulated gradient of each optimiser step."""

    def __init__(self) -> None:
        self.losses, self.grads = [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.grads.append({name: p.grad.clone() for name, p in module.student.named_parameters() if p.grad is not None})


def run(tiny_pair, tmp_path, rollout, steps=2, accumulate=8, **kwargs):
    module = DistillModule(
        *tiny_pair, task=Addition(num_train=64, num_val=4), rollout=rollout, max_completion_tokens=6, batch_size=1,
        val_examples=4, warmup_steps=0, fused_lm_head=False, **kwargs,
    )
    record = Record()
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0, accumulate_grad_batches=accumulate,
        callbacks=[record], default_root_dir=tmp_path,
    )
    trainer.fit(module)
    return record


def test_one_batched_decode_per_optimiser_step_gives_the_losses_and_gradients_of_decoding_each_micro_batch(tiny_pair, tmp_path):
    alone, together = GreedyStudentRollouts(), GreedyStudentRollouts()
    a = run(tiny_pair, tmp_path / "alone", alone, rollout_micro_batches=1)
    b = run(tiny_pair, tmp_path / "together", together)  # default: the whole accumulation group
    assert alone.calls == [1] * 16 and together.calls == [8, 8]  # decode calls: one per micro-batch vs one per step
    assert len(a.losses) == len(b.losses) == 16
    torch.testing.assert_close(torch.tensor(b.losses), torch.tensor(a.losses), rtol=1e-6, atol=1e-6)
    assert len(a.grads) == len(b.grads) == 2
    for step_a, step_b in zip(a.grads, b.grads):
        assert step_a.keys() == step_b.keys() and step_a
        for name in step_a:
            torch.testing.assert_close(step_b[name], step_a[name], rtol=1e-6, atol=1e-6)


def test_a_decode_can_serve_part_of_an_optimiser_step(tiny_pair, tmp_path):
    policy = GreedyStudentRollouts()
    run(tiny_pair, tmp_path, policy, steps=1, accumulate=4, rollout_micro_batches=2)
    assert policy.calls == [2, 2]


def test_sampled_student_rollouts_decode_once_per_step(tiny_pair, tmp_path, monkeypatch):
    calls = []
    original = StudentRollouts.sample

    def counted(self, prompts, context):
        calls.append(len(prompts))
        return original(self, prompts, context)

    monkeypatch.setattr(StudentRollouts, "sample", counted)
    record = run(tiny_pair, tmp_path, StudentRollouts(), steps=2, accumulate=4)
    assert calls == [4, 4] and len(record.losses) == 8


def test_a_decode_group_that_does_not_divide_the_accumulation_is_refused_before_training(tiny_pair, tmp_path):
    with pytest.raises(ValueError, match=r"DistillModule.rollout_micro_batches=3 must divide trainer.accumulate_grad_batches=8"):
        run(tiny_pair, tmp_path, GreedyStudentRollouts(), steps=1, rollout_micro_batches=3)
    with pytest.raises(ValueError, match=r"rollout_micro_batches must be >= 1"):
        run(tiny_pair, tmp_path, GreedyStudentRollouts(), steps=1, rollout_micro_batches=0)


@pytest.mark.parametrize("resumed, sizes", [(0, [4, 4, 2]), (6, [2, 2]), (4, [4, 2]), (9, [1])])
def test_decode_groups_line_up_with_accumulation_groups_after_a_mid_epoch_resume(resumed, sizes):
    """10 micro-batches per epoch, decode groups of 4: a run resumed ``resumed`` micro-batches in first
    completes its group, so later groups start where an uninterrupted run's do."""
    loader = ResumableLoader(list(range(10 - resumed)), batch_size=1, collate_fn=list)
    loader.decode_group, loader.resumed_batches = 4, resumed
    batches = list(loader)
    assert [len(batch.group.batches) for batch in batches if batch.index == 0] == sizes
    assert [list(b) for b in batches] == [[i] for i in range(10 - resumed)]  # the same micro-batches, in order
    again = list(loader)  # the next epoch starts at its beginning: whole groups
    assert [b.index for b in again] == [i % 4 for i in range(10 - resumed)]


def test_decoding_stops_collectively_only_when_models_are_sharded(tiny_pair):
    """Under DDP (whole models) each rank stops decoding when its own rows end: no all-reduce per token.
    Sharded models (FSDP) need every rank to take as many decoding steps, so the decision is collective."""
    from types import SimpleNamespace

    module = DistillModule(*tiny_pair, task=Addition(num_train=4, num_val=2), max_completion_tokens=4)
    decisions = []
    strategy = SimpleNamespace(reduce_boolean_decision=lambda done, all: decisions.append(done) or done)
    module._trainer = SimpleNamespace(world_size=2, strategy=strategy)
    assert module.all_done_hook() is None
    module._sharded = True
    hook = module.all_done_hook()
    assert hook(True) is True and decisions == [True]
    module._trainer = SimpleNamespace(world_size=1, strategy=strategy)
    assert module.all_done_hook() is None


def test_one_micro_batch_per_decode_draws_what_each_micro_batch_drew_alone(tiny_pair, tmp_path, monkeypatch):
    """rollout_micro_batches=1: each micro-batch's sampled completions are make_rollout's for that micro-batch
    and its own step seed, as before decode groups existed (kdlab 0.1's draws)."""
    seen = []
    original = DistillModule.micro_batch_rollout

    def recorded(self, batch, batch_idx):
        rollout = original(self, batch, batch_idx)
        again = self.make_rollout(list(batch), self.step_seed("train", batch_idx))
        seen.append((rollout.completion_ids.clone(), again.completion_ids.clone()))
        return rollout

    monkeypatch.setattr(DistillModule, "micro_batch_rollout", recorded)
    run(tiny_pair, tmp_path, StudentRollouts(), steps=1, accumulate=2, rollout_micro_batches=1)
    assert len(seen) == 2 and all(torch.equal(a, b) for a, b in seen)


def test_fsdp2_models_stay_gathered_through_a_decode_and_get_their_settings_back(tmp_path):
    """gathered_for_decoding: after the first forward inside the block the layers stay gathered (no
    all-gather per decoded token); after it every unit is sharded again, and a forward outside the block
    reshards the layers as fully_shard does, while the root stays gathered (what the fused head reads)."""
    import torch.distributed as dist
    import transformers
    from torch.distributed.tensor import DTensor, init_device_mesh

    from kdlab.stages.sharding import gathered_for_decoding, shard_fsdp2

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        config = transformers.Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1)
        model = transformers.Qwen2ForCausalLM(config)
        shard_fsdp2([model], init_device_mesh("cpu", (1,)), "32-true")
        layer, head = model.model.layers[0].mlp.up_proj, model.lm_head
        ids = torch.tensor([[1, 2, 3]])
        with torch.no_grad(), gathered_for_decoding([model]):
            model(ids)
            assert not isinstance(layer.weight, DTensor) and not isinstance(head.weight, DTensor)
            model(ids[:, :1])
            assert not isinstance(layer.weight, DTensor)
        assert isinstance(layer.weight, DTensor) and isinstance(head.weight, DTensor)
        with torch.no_grad():
            model(ids)
        assert isinstance(layer.weight, DTensor) and not isinstance(head.weight, DTensor)
    finally:
        dist.destroy_process_group()
