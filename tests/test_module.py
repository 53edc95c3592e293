"""DistillModule used from Python, as in a notebook: custom components, logging, optimisation."""

import json

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from kdlab.data import Rollout, prompt_token_ids
from kdlab.objectives import ForwardKL
from kdlab.rollouts import RolloutPolicy, StudentRollouts, TeacherDatasetRollouts, TeacherRollouts
from kdlab.stages import DistillModule
from kdlab.tasks import Addition


class HalfHalfRollouts(RolloutPolicy):
    """A notebook-style policy: the first half of the batch from the teacher, the rest from the student."""

    def sample(self, prompts, context):
        teacher = TeacherRollouts().sample(prompts, context)
        student = StudentRollouts().sample(prompts, context)
        half = len(prompts) // 2
        width = max(teacher.completion_ids.shape[1], student.completion_ids.shape[1])
        pad = lambda x, value: torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)
        ids = torch.cat([pad(teacher.completion_ids, context.pad_token_id)[:half], pad(student.completion_ids, context.pad_token_id)[half:]])
        mask = torch.cat([pad(teacher.completion_mask, False)[:half], pad(student.completion_mask, False)[half:]])
        self.record("teacher_share", half / len(prompts))
        return Rollout(prompts, ids, mask)


class ReportingKL(ForwardKL):
    def forward(self, student_logits, teacher_logits, mask):
        loss = super().forward(student_logits, teacher_logits, mask)
        self.record("my_diagnostic", loss * 2)
        return loss


def make_module(tiny_pair, **kwargs):
    defaults = dict(task=Addition(num_train=16, num_val=4), max_completion_tokens=8, batch_size=4, val_examples=4)
    defaults.update(kwargs)
    return DistillModule(*tiny_pair, **defaults)


def trainer(tmp_path, steps, **kwargs):
    return pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=TensorBoardLogger(tmp_path),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def test_custom_components_plug_in_and_their_reports_reach_tensorboard(tiny_pair, tmp_path):
    module = make_module(tiny_pair, rollout=HalfHalfRollouts(), objective=ReportingKL())
    run = trainer(tmp_path, steps=2, limit_val_batches=0)
    run.fit(module)
    events = EventAccumulator(run.log_dir)
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "train/teacher_share" in tags and "train/my_diagnostic" in tags
    assert events.Scalars("train/teacher_share")[0].value == 0.5
    loss, reported = events.Scalars("train/loss")[0].value, events.Scalars("train/my_diagnostic")[0].value
    assert reported == pytest.approx(2 * loss, rel=1e-5)


def test_distillation_lowers_the_kl_on_a_fixed_batch(tiny_pair, tmp_path):
    module = make_module(tiny_pair, lr=3e-3, warmup_steps=0, task=Addition(num_train=4, num_val=4))
    batch = module.task.examples("train")
    rollout = module.make_rollout(batch, seed=0)

    def kl():
        with torch.no_grad():
            s, t = module.distillation_logits(rollout)
            return ForwardKL()(s, t, rollout.completion_mask).item()

    before = kl()
    trainer(tmp_path, steps=30, limit_val_batches=0).fit(module)
    assert kl() < 0.75 * before


def test_warmup_then_constant_learning_rate(tiny_pair, tmp_path):
    module = make_module(tiny_pair, lr=1e-3, warmup_steps=4)
    seen = []

    class RecordLR(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.append(optimizer.param_groups[0]["lr"])

    trainer(tmp_path, steps=6, limit_val_batches=0, callbacks=[RecordLR()]).fit(module)
    assert seen == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    optimizer = module.optimizers().optimizer
    assert optimizer.defaults["betas"] == (0.9, 0.999) and optimizer.defaults["weight_decay"] == 0.0
    assert optimizer.defaults["eps"] == 1e-8


def test_only_the_student_is_optimised_and_the_teacher_never_moves(tiny_pair, tmp_path):
    module = make_module(tiny_pair, lr=1e-2)
    teacher_before = {k: v.clone() for k, v in module.teacher.state_dict().items()}
    student_before = {k: v.clone() for k, v in module.student.state_dict().items()}
    trainer(tmp_path, steps=2, limit_val_batches=0).fit(module)
    assert all(torch.equal(v, module.teacher.state_dict()[k]) for k, v in teacher_before.items())
    assert any(not torch.equal(v, module.student.state_dict()[k]) for k, v in student_before.items())


def test_a_batch_without_completion_tokens_is_skipped_with_a_warning(tiny_pair):
    module = make_module(tiny_pair, rollout=EmptyRollouts())
    with pytest.warns(UserWarning, match="no completion token"):
        assert module.training_step(module.task.examples("train")[:2], 0) is None


class EmptyRollouts(RolloutPolicy):
    def sample(self, prompts, context):
        return Rollout(prompts, torch.zeros(len(prompts), 0, dtype=torch.long), torch.zeros(len(prompts), 0, dtype=torch.bool))


def test_teacher_and_student_get_their_own_prompts(tiny_pair):
    class TeacherHint(Addition):
        def teacher_messages(self, example):
            messages = self.student_messages(example)
            messages[-1] = {"role": "user", "content": messages[-1]["content"] + f" (hint: {example['a'] + example['b']})"}
            return messages

    module = make_module(tiny_pair, task=TeacherHint(num_train=4))
    rollout = module.make_rollout(module.task.examples("train")[:2], seed=0)
    student_text = module.student_tokenizer.decode(rollout.prompts.student_ids[0][rollout.prompts.student_mask[0].bool()])
    teacher_text = module.teacher_tokenizer.decode(rollout.prompts.teacher_ids[0][rollout.prompts.teacher_mask[0].bool()])
    assert "hint" in teacher_text and "hint" not in student_text
    # both models are scored on the same completion tokens
    s, t = module.distillation_logits(rollout)
    assert s.shape == t.shape == (2, rollout.completion_ids.shape[1], module.token_columns)


@pytest.mark.parametrize("fused", [False, True, None], ids=["logits", "fused", "default"])
def test_distillation_logits_predict_the_completion_tokens(tiny_pair, fused):
    """The logits returned at position c must be the model's prediction of completion token c, on the
    logits path and on the fused hidden-state path (the default wherever it is valid, as here)."""
    from kdlab.objectives import HeadLogits

    module = make_module(tiny_pair, fused_lm_head=fused)
    rollout = module.make_rollout(module.task.examples("train")[:3], seed=1)
    module.student_temperature = 1.0
    s, _ = module.distillation_logits(rollout)
    assert isinstance(s, HeadLogits) == (fused is not False)
    if isinstance(s, HeadLogits):
        s = (s.hidden @ s.weight.T) * s.scale
    inputs = rollout.model_inputs("student")
    full = module.student(**inputs).logits[..., : module.token_columns]
    prompt_width = rollout.prompts.student_ids.shape[1]
    for c in range(rollout.completion_ids.shape[1]):
        torch.testing.assert_close(s[:, c], full[:, prompt_width + c - 1], atol=1e-5, rtol=1e-5)


def test_prompt_longer_than_the_limit_names_the_example(tiny_pair):
    module = make_module(tiny_pair, max_prompt_tokens=5)
    with pytest.raises(ValueError, match="add-train-0.*max_prompt_tokens=5"):
        module.make_rollout(module.task.examples("train")[:1], seed=0)


def test_an_empty_prompt_names_the_example(tiny_pair, monkeypatch):
    """A prompt of no tokens (a task whose rendering is empty, a tokenizer adding no BOS) leaves no position to
    predict the first completion token (packed, every completion token read the output predicting the next one):
    encoding it names the example, before any decode; a hand-built packed batch without a prompt is refused too."""
    from kdlab.data import left_pad, right_pad
    from kdlab.rollouts.packing import Packed, PackedBatch

    module = make_module(tiny_pair)
    monkeypatch.setattr(module.task, "render", lambda tokenizer, messages: "")
    with pytest.raises(ValueError, match="Addition example 'add-train-0': the student prompt has no tokens"):
        module.make_rollout(module.task.examples("train")[:1], seed=0)
    prompts, _ = left_pad([[5, 6, 7], []], 0)
    completions, completion_mask = right_pad([[10, 11], [20, 21]], 0)
    mask = torch.cat([prompts.new_tensor([[1, 1, 1], [0, 0, 0]]).bool(), completion_mask], 1)
    with pytest.raises(ValueError, match="PackedBatch: sequence 1 has no prompt token"):
        PackedBatch.build(torch.cat([prompts, completions], 1), mask, 2, Packed(64))


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"teacher_temperature": -0.5}, "teacher_temperature"),
        ({"student_temperature": 0.0}, "student_temperature"),
        ({"val_temperature": -1.0}, "val_temperature"),
        ({"lr": 0.0}, "lr"),
        ({"batch_size": 0}, "batch_size"),
        ({"teacher_temperature": 1e-8}, "teacher_temperature"),  # the logged KL read 4.0, or 0 at 1e-30
        ({"betas": (0.9, 1.5)}, "betas"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"eps": -1.0}, "eps"),
    ],
)
def test_bad_module_settings_name_the_key(tiny_pair, kwargs, key):
    with pytest.raises(ValueError, match=f"DistillModule.{key}"):
        make_module(tiny_pair, **kwargs)


def test_empty_training_split_is_a_clear_error(tiny_pair):
    module = make_module(tiny_pair, task=Addition(num_train=0))
    with pytest.raises(ValueError, match="'train' split is empty"):
        module.train_dataloader()


def test_teacher_only_instruction_and_demonstration_reach_only_the_teacher():
    task = Addition(num_train=2, teacher_instruction="Razona solo en español.", teacher_demonstration=True, teacher_system_prompt="T")
    example = task.examples("train")[0]
    student, teacher = task.student_messages(example), task.teacher_messages(example)
    assert student[0]["content"] == Addition.default_system_prompt and teacher[0]["content"] == "T"
    assert "español" in teacher[-1]["content"] and "español" not in student[-1]["content"]
    assert task.reference_completion(example) in teacher[-1]["content"]
    assert task.reference_completion(example) not in student[-1]["content"]


def test_validation_logs_pass_at_k_from_several_samples(tiny_pair, tmp_path):
    class HalfRight(Addition):
        def score(self, example, completion):
            return float(example["id"].endswith(("0", "2")))  # problems 0 and 2 solved by every sample

    module = make_module(tiny_pair, task=HalfRight(num_train=4, num_val=4), eval_samples=3, eval_ks=(1, 3))
    run = trainer(tmp_path, steps=1)
    (results,) = run.validate(module)
    assert results["val/accuracy"] == pytest.approx(0.5)
    assert results["val/pass@1"] == pytest.approx(0.5) and results["val/pass@3"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="eval_ks"):
        make_module(tiny_pair, eval_samples=2, eval_ks=(1, 3))


def test_generated_teacher_data_feeds_off_policy_training(tiny_pair, tmp_path):
    from kdlab.models import ModelSpec
    from kdlab.rollouts.teacher_data import generate_teacher_data

    class EvenVerified(Addition):
        def score(self, example, completion):
            return float(int(example["id"].rsplit("-", 1)[1]) % 2 == 0)

    task = EvenVerified(num_train=6)
    output = tmp_path / "teacher.jsonl"
    summary = generate_teacher_data(ModelSpec(tiny_pair[1]), task, str(output), max_new_tokens=5, samples_per_prompt=2, verified_only=True)
    assert summary == {"prompts": 6, "samples": 12, "kept": 6, "accuracy": 0.5}
    module = make_module(tiny_pair, task=EvenVerified(num_train=6), rollout=TeacherDatasetRollouts(str(output)), batch_size=8)
    (batch,) = list(module.train_dataloader())
    assert sorted(ex["id"] for ex in batch) == ["add-train-0", "add-train-2", "add-train-4"]
    module.log = lambda *args, **kwargs: None
    loss = module.training_step(batch, 0)
    # recomputed without kdlab's rollouts, padding or objective: each kept teacher completion (plus the end
    # token, it ended) read by both models after their own prompt; forward KL(pi_T || pi_S) at T_T = 0.5,
    # T_S = 1, averaged over each completion's tokens, then over completions
    rows = {}
    for row in map(json.loads, output.read_text().splitlines()):
        rows.setdefault(row["id"], row)  # two samples per prompt: TeacherDatasetRollouts trains on the first
    per_sequence = []
    for example in batch:
        row = rows[example["id"]]
        completion = module.student_tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
        completion = (completion + [module.end_ids[0]] if row["ended"] else completion)[: module.max_completion_tokens]
        logprobs = {}
        for role, model, tokenizer, temperature in (("student", module.student, module.student_tokenizer, 1.0),
                                                    ("teacher", module.teacher, module.teacher_tokenizer, 0.5)):
            prompt = prompt_token_ids(module.task, tokenizer, example, role, 2048)
            with torch.no_grad():
                logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1, : module.token_columns]
            logprobs[role] = torch.log_softmax(logits.double() / temperature, -1)
        teacher, student = logprobs["teacher"], logprobs["student"]
        per_sequence.append((teacher.exp() * (teacher - student)).sum(-1).mean())
    assert loss.item() == pytest.approx(torch.stack(per_sequence).mean().item(), rel=1e-4)


class NaNOnSteps(ForwardKL):
    """Returns NaN on the given (0-based) calls: a stand-in for the paper's reverse-KL blow-ups."""

    def __init__(self, bad_calls):
        super().__init__()
        self.bad_calls, self.calls = set(bad_calls), 0

    def forward(self, student_logits, teacher_logits, mask):
        loss = super().forward(student_logits, teacher_logits, mask)
        self.calls += 1
        return loss * float("nan") if self.calls - 1 in self.bad_calls else loss


def test_non_finite_step_is_skipped_without_touching_weights_or_optimiser_state(tiny_pair, tmp_path):
    module = make_module(tiny_pair, objective=NaNOnSteps({1}), lr=1e-2, warmup_steps=0)
    snapshots = []

    class Snapshot(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            state = trainer.optimizers[0].state
            moments = [s["exp_avg"].clone() for s in state.values()]
            snapshots.append(([p.detach().clone() for p in pl_module.student.parameters()], moments))

    run = trainer(tmp_path, steps=3, limit_val_batches=0, callbacks=[Snapshot()], gradient_clip_val=1.0)
    run.fit(module)
    (params0, moments0), (params1, moments1), (params2, _) = snapshots
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))  # step 1 was skipped
    assert all(torch.equal(a, b) for a, b in zip(moments0, moments1))
    assert not all(torch.equal(a, b) for a, b in zip(params1, params2))  # training went on
    assert all(torch.isfinite(p).all() for p in params2)
    assert run.optimizers[0].skipped == 1
    assert run.callback_metrics["train/skipped_steps"] == 1.0


def test_too_many_bad_steps_in_a_row_stop_the_run_with_a_clear_message(tiny_pair, tmp_path):
    module = make_module(tiny_pair, objective=NaNOnSteps({1, 2, 3}), max_bad_steps=3)
    with pytest.raises(RuntimeError, match=r"step 4: 3 consecutive.*objective NaNOnSteps.*Last good checkpoint"):
        trainer(tmp_path, steps=10, limit_val_batches=0).fit(module)


def accumulated_gradients(tiny_pair, tmp_path, batch_size, accumulate, objective):
    task = Addition(num_train=8)
    data = tmp_path / "teacher.jsonl"
    rows = [{"id": ex["id"], "completion": f"<answer>{ex['a'] * 7 ** i}</answer>"} for i, ex in enumerate(task.examples("train"))]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))  # ragged completion lengths
    module = make_module(tiny_pair, task=task, rollout=TeacherDatasetRollouts(str(data)), objective=objective, batch_size=batch_size)
    grads = []

    class Record(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads.extend(p.grad.detach().clone() for p in pl_module.student.parameters())

    trainer(tmp_path / f"{batch_size}x{accumulate}", steps=1, limit_val_batches=0, accumulate_grad_batches=accumulate, callbacks=[Record()]).fit(module)
    return grads


def test_batch_8_equals_batch_2_with_4_accumulation_steps(tiny_pair, tmp_path):
    """The paper's per-sequence reduction makes gradient accumulation exact."""
    whole = accumulated_gradients(tiny_pair, tmp_path, 8, 1, ForwardKL())
    accumulated = accumulated_gradients(tiny_pair, tmp_path, 2, 4, ForwardKL())
    for a, b in zip(whole, accumulated):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)


def test_token_reduction_is_not_invariant_to_accumulation_with_ragged_lengths(tiny_pair, tmp_path):
    """Why the paper's reduction is the default: a token mean per micro-batch weights short completions up."""
    whole = accumulated_gradients(tiny_pair, tmp_path, 8, 1, ForwardKL(reduction="token"))
    accumulated = accumulated_gradients(tiny_pair, tmp_path, 2, 4, ForwardKL(reduction="token"))
    assert max((a - b).abs().max().item() for a, b in zip(whole, accumulated)) > 1e-5


def test_data_order_depends_only_on_seed_and_epoch():
    from kdlab.stages.loaders import EpochShuffle

    a, b = EpochShuffle(50, seed=3), EpochShuffle(50, seed=3)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first and sorted(list(a)) == list(range(50))
    b.set_epoch(1)  # a fresh sampler (a resumed run) at epoch 1 shuffles like the original did
    assert list(b) == list(a)
    assert list(EpochShuffle(50, seed=4)) != first


@pytest.mark.parametrize("size", [1, 2, 5, 7, 8])
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_an_evaluation_split_counts_every_example_once_over_the_ranks_which_run_as_many_batches(size, replicas):
    """The val/test loaders (:func:`evaluation_loader`) of every rank together count each example exactly once, in
    order, whether or not the number of ranks divides the split (fewer examples than ranks too); every rank gets as many
    batches, the shorter shares ending with an uncounted repeat."""
    from kdlab.stages.loaders import evaluation_loader

    examples = [{"id": f"e{i}"} for i in range(size)]
    loaders = [list(evaluation_loader(examples, 2, {"num_replicas": replicas, "rank": rank})) for rank in range(replicas)]
    assert len({len(batches) for batches in loaders}) == 1
    counted = [example["id"] for batches in loaders for batch in batches for example, keep in zip(batch, batch.counted) if keep]
    assert sorted(counted) == sorted(example["id"] for example in examples)
    assert [example["id"] for example, keep in zip(loaders[0][0], loaders[0][0].counted) if keep] == [f"e{i}" for i in range(0, min(size, 2 * replicas), replicas)]


@pytest.mark.parametrize("rollout", ["teacher", "student"])
def test_fused_lm_head_step_equals_the_logits_step(tiny_pair, rollout):
    """fused_lm_head gives the same loss and student gradients as the materialised-logits path."""
    from kdlab.rollouts import StudentRollouts, TeacherRollouts
    from kdlab.tasks import Addition

    grads, losses = [], []
    for fused in (False, True):
        policy = TeacherRollouts() if rollout == "teacher" else StudentRollouts()
        module = DistillModule(*tiny_pair, Addition(num_train=4), rollout=policy, max_completion_tokens=6, batch_size=4, fused_lm_head=fused)
        module.log = lambda *args, **kwargs: None
        loss = module.training_step(module.task.examples("train"), 0)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in module.student.parameters()])
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def test_step_seeds_follow_the_data_parallel_rank_not_the_global_rank(tiny_pair):
    """Tensor-parallel peers (same data-parallel rank, different global ranks) must draw the same rollouts;
    data-parallel replicas must draw different ones."""
    from types import SimpleNamespace

    module = DistillModule(*tiny_pair, Addition(num_train=4, num_val=0, num_test=0))

    def seed_on(global_rank: int, dp_rank: int) -> int:
        strategy = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": dp_rank})
        module._trainer = SimpleNamespace(strategy=strategy, global_rank=global_rank, current_epoch=0)
        return module.step_seed("train", 3)

    assert seed_on(global_rank=0, dp_rank=0) == seed_on(global_rank=1, dp_rank=0)
    assert seed_on(global_rank=0, dp_rank=0) != seed_on(global_rank=2, dp_rank=1)
    module._trainer = None
    assert module.data_parallel_layout() == {"num_replicas": 1, "rank": 0}


@pytest.mark.parametrize("placement", ["replicate", "shard"])
def test_fsdp1_wraps_each_decoder_layer_and_each_sharded_model_whole(tiny_pair, placement):
    """Under strategy: fsdp, configure_model wraps (with whatever wrapper the strategy's context gives)
    every decoder layer, then the student whole (Lightning wraps nothing more once a submodule is
    wrapped), and the teacher only with teacher_placement: shard. FSDP1 itself needs CUDA, so a
    pass-through wrapper stands in for it here; the wrapped module still trains."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp.wrap import enable_wrap

    class Wrapped(torch.nn.Module):
        def __init__(self, module, **settings):
            super().__init__()
            self.module = module

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

        def __getattr__(self, name):  # FSDP1 forwards attribute access to the wrapped module too
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.module, name)

    module = DistillModule(*tiny_pair, Addition(num_train=4, num_val=0, num_test=0), teacher_placement=placement, batch_size=4, max_completion_tokens=4)
    strategy = FSDPStrategy()
    strategy.parallel_devices = [torch.device("cpu")]
    module._trainer = SimpleNamespace(strategy=strategy, precision="32-true")
    with enable_wrap(wrapper_cls=Wrapped):
        module.configure_model()
    assert isinstance(module.student, Wrapped)
    layers = module.student.module.model.layers
    assert len(layers) > 0 and all(isinstance(layer, Wrapped) for layer in layers)
    assert isinstance(module.teacher, Wrapped) == (placement == "shard")
    module._trainer = None
    module.log = lambda *args, **kwargs: None
    loss = module.training_step(module.task.examples("train"), 0)
    loss.backward()
    assert torch.isfinite(loss) and all(layer.module.self_attn.q_proj.weight.grad is not None for layer in layers)
    fused = DistillModule(*tiny_pair, Addition(num_train=4, num_val=0, num_test=0), fused_lm_head=True)
    fused._trainer = SimpleNamespace(strategy=strategy, precision="32-true")
    with pytest.raises(ValueError, match="fused_lm_head reads the LM head's weight directly, which FSDP1"):
        fused.configure_model()


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
def test_a_training_step_logs_the_exact_diagnostics_without_a_second_pass(tiny_pair, monkeypatch, fused):
    """The step logs kl_forward, kl_reverse and both entropies from the objective's own pass: the separate
    kl_diagnostics pass is never called, and the logged values equal that pass run on the same logits."""
    import kdlab.objectives.pairing
    from kdlab.objectives.kl import kl_diagnostics

    module = make_module(tiny_pair, fused_lm_head=fused)
    batch = module.task.examples("train")[:4]
    rollout = module.make_rollout(batch, module.step_seed("train", 0))
    module.make_rollout = lambda examples, seed, policy=None: rollout  # the same completions below
    with torch.no_grad():
        student, teacher = module.distillation_logits(rollout)
        expected = kl_diagnostics(student, teacher, rollout.completion_mask)
    logged = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, value)
    monkeypatch.setattr(kdlab.objectives.pairing, "kl_diagnostics", lambda *args, **kwargs: pytest.fail("a second diagnostics pass ran"))
    module.training_step(batch, 0)
    for name, value in expected.items():
        torch.testing.assert_close(logged[f"train/{name}"], value, rtol=1e-5, atol=1e-6, msg=name)


def test_the_logged_gradient_norm_is_the_one_before_clipping(tiny_pair, tmp_path, monkeypatch):
    """``train/grad_norm`` is the global norm Lightning then clips: with ``gradient_clip_val`` far below it the
    logged value stays the unclipped one, while the optimiser steps on gradients of the clipped norm."""
    from kdlab.stages.optim import FiniteAdamW

    seen = []
    step = torch.optim.AdamW.step  # FiniteAdamW runs the closure (backward, clipping), then this

    def recording_step(self, *args, **kwargs):
        seen.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for group in self.param_groups for p in group["params"]
                                                                 if p.grad is not None]))))
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    assert issubclass(FiniteAdamW, torch.optim.AdamW)
    logged = []

    class Norms(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            logged.append(float(trainer.callback_metrics["train/grad_norm"]))

    clip = 1e-3
    trainer(tmp_path, 2, gradient_clip_val=clip, limit_val_batches=0, callbacks=[Norms()]).fit(make_module(tiny_pair))
    assert len(logged) == len(seen) == 2
    assert all(norm > 10 * clip for norm in logged), logged
    assert seen == pytest.approx([clip] * 2, rel=1e-3)  # what the optimiser got: clipped


def test_each_model_is_prompted_with_its_own_chat_template(tiny_pair, tmp_path):
    """A teacher whose chat template differs from the student's (another model family) renders its prompts with
    its own; the student's prompts keep the student's template."""
    import shutil

    from kdlab.models.loading import resolve_path

    teacher = tmp_path / "teacher"
    shutil.copytree(resolve_path(tiny_pair[1]), teacher)
    template = teacher / "chat_template.jinja"
    assert template.exists()
    template.write_text("{{ 'zebra ' }}" + template.read_text(encoding="utf-8"), encoding="utf-8")
    module = make_module((tiny_pair[0], str(teacher)), task=Addition(num_train=4))
    prompts = module._prompts(module.task.examples("train")[:2])
    student_text = module.student_tokenizer.decode(prompts.student_ids[0][prompts.student_mask[0].bool()])
    teacher_text = module.teacher_tokenizer.decode(prompts.teacher_ids[0][prompts.teacher_mask[0].bool()])
    assert teacher_text.startswith("zebra ") and "zebra" not in student_text
    assert teacher_text[len("zebra "):] == student_text  # otherwise the same prompt


def test_the_smallest_kl_temperature_accepted_keeps_the_kl_within_1e_5_of_fp64():
    """TEMPERATURE_FLOOR's docstring: at the floor the exact KLs still hold fp64's value; far below it they do not."""
    from kdlab.objectives import ForwardKL, ReverseKL
    from kdlab.objectives.precision import TEMPERATURE_FLOOR

    generator = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 4, 5000, generator=generator) * 3, torch.randn(2, 4, 5000, generator=generator) * 3
    mask = torch.ones(2, 4, dtype=torch.bool)
    def relative_error(objective, temperature):
        exact = objective(student.double(), teacher.double() / temperature, mask)
        return float((objective(student, teacher / temperature, mask).double() - exact).abs() / exact.abs())

    assert relative_error(ForwardKL(), TEMPERATURE_FLOOR) <= 1e-5 and relative_error(ReverseKL(), TEMPERATURE_FLOOR) <= 1e-5
    assert relative_error(ForwardKL(), 1e-8) > 0.5  # what the floor refuses


def test_an_objective_overriding_forward_gets_a_head_logits_unless_the_module_is_built_without_the_fused_head(tiny_pair, tmp_path):
    """docs/custom_components.md: an overridden ``forward`` may receive the student as a lazy ``HeadLogits``
    (the default wherever the model allows it), a tensor with ``fused_lm_head=False``; ``token_loss`` always
    receives fp32 ``(n, V)`` tensors."""
    from kdlab.objectives import ForwardKL
    from kdlab.objectives.lazy import HeadLogits

    class Seen(ForwardKL):
        def __init__(self):
            super().__init__()
            self.kinds, self.rows = [], []

        def forward(self, student_logits, teacher_logits, mask, sequence_weights=None, *, consume=False):
            self.kinds.append(type(student_logits))
            return super().forward(student_logits, teacher_logits, mask, sequence_weights, consume=consume)

        def token_loss(self, student_logits, teacher_logits):
            self.rows.append((student_logits.dtype, student_logits.dim(), type(student_logits)))
            return super().token_loss(student_logits, teacher_logits)

    for fused, kind in ((None, HeadLogits), (False, torch.Tensor)):
        objective = Seen()
        module = make_module(tiny_pair, objective=objective, fused_lm_head=fused)
        trainer(tmp_path / str(fused), 1, limit_val_batches=0).fit(module)
        assert objective.kinds and all(issubclass(seen, kind) for seen in objective.kinds), objective.kinds
        assert objective.rows and set(objective.rows) == {(torch.float32, 2, torch.Tensor)}


def test_a_task_whose_score_raises_or_leaves_0_1_is_named_with_the_example(tiny_pair, tmp_path):
    """Task.score's contract (a number in [0, 1], never raising) is checked where kdlab scores: a broken task
    fails naming itself, the example and the completion, not with a bare traceback or a wrong accuracy."""
    from kdlab.evaluation.scoring import ScoreError, accuracy, scored

    class Raising(Addition):
        def score(self, example, completion):
            raise KeyError("answer")

    class Reward(Addition):
        def score(self, example, completion):
            return 2.0  # a reward, not a score

    task = Addition(num_train=2)
    example = task.examples("train")[0]
    assert scored(task, example, task.reference_completion(example)) == 1.0
    with pytest.raises(ScoreError, match=r"Raising.score on example 'add-train-0' \(completion starting '<answer>'\) raised KeyError"):
        scored(Raising(num_train=2), example, "<answer>")
    with pytest.raises(ScoreError, match=r"Reward.score on example 'add-train-0' .* returned 2.0, outside \[0, 1\]"):
        accuracy(Reward(num_train=2), [example], ["x"])
    module = make_module(tiny_pair, task=Raising(num_train=16, num_val=4))  # the stage's own evaluation checks too
    with pytest.raises(ScoreError, match=r"Raising.score on example 'add-val-0'"):
        trainer(tmp_path, 1).validate(module)
