"""The objectives, their diagnostics and the fused LM head compute in fp32 whatever the caller's autocast
(Lightning's ``bf16-mixed`` runs ``training_step`` under ``torch.autocast``): loss, gradients and the four
logged diagnostics are the same with and without a bf16 autocast region (issue #26).

The shapes reproduce what was found: at V = 32,000, T = 64 and logits scaled x4, bf16 ``bmm`` / ``mv``
moved ReverseKL's loss by 7e-4 relative, the teacher entropy by 7e-4 and its gradient by 1.6% of its
largest entry; the fused head under autocast raised (bf16 products written into fp32 buffers)."""

import pytest
import torch

from kdlab.objectives import ForwardKL, GeneralizedJSD, HeadLogits, ReverseKL, SampledForwardKL, SampledReverseKL, TotalVariation
from kdlab.objectives.kernels import DIAGNOSTICS
from kdlab.objectives.kl import kl_diagnostics, sampled_logprobs
from kdlab.objectives.logprobs import token_logprobs

T, V, H = 64, 32_000, 64
RTOL = 1e-4


def bf16_autocast(enabled=True):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)


@pytest.fixture(scope="module")
def pair():
    g = torch.Generator().manual_seed(0)
    student = torch.randn(1, T, V, generator=g) * 4
    teacher = torch.randn(1, T, V, generator=g) * 4
    return student, teacher, torch.ones(1, T, dtype=torch.bool)


def assert_close(actual, expected, name):
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=0, msg=lambda m: f"{name}: {m}")


def assert_gradient_close(actual, expected, name):
    """Equal to ``RTOL`` of the gradient's largest entry (entries near 0 have no relative precision)."""
    error = (actual.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    assert error <= RTOL * scale, f"{name}: off by {error:.3g}, {error / scale:.3g} of its largest entry"


def run_objective(objective, student, teacher, mask, autocast):
    objective.reseed(7)
    student = student.clone().requires_grad_(True)
    with bf16_autocast(autocast):
        loss = objective(student, teacher, mask)
        diagnostics = objective.take_diagnostics()
        loss.backward()
    return loss.detach(), student.grad, diagnostics


OBJECTIVES = [ForwardKL(), ReverseKL(), GeneralizedJSD(0.5), TotalVariation(), SampledForwardKL(), SampledReverseKL()]


@pytest.mark.parametrize("objective", OBJECTIVES, ids=lambda o: type(o).__name__)
def test_loss_gradient_and_diagnostics_are_the_same_under_bf16_autocast(objective, pair):
    plain = run_objective(objective, *pair, autocast=False)
    mixed = run_objective(objective, *pair, autocast=True)
    assert mixed[0].dtype == torch.float32
    assert_close(mixed[0], plain[0], "loss")
    assert_gradient_close(mixed[1], plain[1], "gradient")
    assert set(mixed[2]) == set(DIAGNOSTICS)
    for name in DIAGNOSTICS:
        assert_close(mixed[2][name], plain[2][name], name)


@pytest.mark.parametrize("objective", [ForwardKL(), ReverseKL()], ids=lambda o: type(o).__name__)
def test_the_returned_kl_is_its_own_logged_diagnostic_under_bf16_autocast(objective, pair):
    loss, _, diagnostics = run_objective(objective, *pair, autocast=True)
    logged = diagnostics["kl_forward" if isinstance(objective, ForwardKL) else "kl_reverse"]
    assert_close(loss, logged, "loss vs its logged KL")


def test_bf16_logits_give_the_same_fp32_results_under_autocast(pair):
    """A bf16-mixed model hands the objective bf16 logits: they are upcast block by block either way."""
    student, teacher, mask = pair
    student, teacher = student[:, :16].bfloat16(), teacher[:, :16].bfloat16()
    plain = run_objective(ReverseKL(), student, teacher, mask[:, :16], autocast=False)
    mixed = run_objective(ReverseKL(), student, teacher, mask[:, :16], autocast=True)
    assert mixed[1].dtype == torch.bfloat16
    assert_close(mixed[0], plain[0], "loss")
    assert_gradient_close(mixed[1], plain[1], "gradient")
    for name in DIAGNOSTICS:
        assert_close(mixed[2][name], plain[2][name], name)


def test_kl_diagnostics_and_sampled_logprobs_are_the_same_under_bf16_autocast(pair):
    student, teacher, mask = pair
    ids = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(1))
    with bf16_autocast():
        mixed = kl_diagnostics(student, teacher, mask), sampled_logprobs(student, ids)
    plain = kl_diagnostics(student, teacher, mask), sampled_logprobs(student, ids)
    for name in DIAGNOSTICS:
        assert_close(mixed[0][name], plain[0][name], name)
    assert_close(mixed[1], plain[1], "sampled log-probs")


def head_inputs(dtype):
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(1, T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    return hidden, weight


def run_head_objective(objective, hidden, weight, teacher, mask, autocast):
    hidden, weight = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    with bf16_autocast(autocast):
        loss = objective(HeadLogits(hidden, weight, 0.5), teacher, mask)
        diagnostics = objective.take_diagnostics()
        loss.backward()
    return loss.detach(), hidden.grad, weight.grad, diagnostics


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-head", "bf16-head"])
@pytest.mark.parametrize("objective", [ForwardKL(), ReverseKL()], ids=lambda o: type(o).__name__)
def test_the_fused_head_is_the_same_under_bf16_autocast(objective, dtype, pair):
    """Loss, diagnostics and both gradients of the fused hidden-state + LM-head path (the hidden states'
    dtype for the products, fp32 after them; see ``HeadLogits``) do not depend on the caller's autocast.
    The teacher is fused too, so both sides' products are covered."""
    _, teacher_logits, mask = pair
    hidden, weight = head_inputs(dtype)
    t_hidden, t_weight = head_inputs(dtype)
    teacher = HeadLogits(t_hidden.flip(1), t_weight.flip(0), 0.5)
    plain = run_head_objective(objective, hidden, weight, teacher, mask, autocast=False)
    mixed = run_head_objective(objective, hidden, weight, teacher, mask, autocast=True)
    assert mixed[0].dtype == torch.float32 and mixed[1].dtype == dtype and mixed[2].dtype == dtype
    assert_close(mixed[0], plain[0], "loss")
    assert_gradient_close(mixed[1], plain[1], "gradient w.r.t. the hidden states")
    assert_gradient_close(mixed[2], plain[2], "gradient w.r.t. the head")
    for name in DIAGNOSTICS:
        assert_close(mixed[3][name], plain[3][name], name)
    kl = mixed[3]["kl_forward" if isinstance(objective, ForwardKL) else "kl_reverse"]
    assert_close(mixed[0], kl, "loss vs its logged KL")


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
def test_token_logprobs_are_the_same_under_bf16_autocast(fused):
    """GRPO's chunked log-probs: values, entropies and gradients (w.r.t. the logits, or the hidden
    states and head) with and without autocast."""
    hidden, weight = head_inputs(torch.float32)
    logits = (hidden @ weight.T)[:, :16]  # computed outside autocast: the caller's logits are given
    ids = torch.randint(0, V, (1, 16), generator=torch.Generator().manual_seed(3))

    def run(autocast):
        inputs = [hidden[:, :16].clone(), weight.clone()] if fused else [logits.clone()]
        for tensor in inputs:
            tensor.requires_grad_(True)
        with bf16_autocast(autocast):
            source = HeadLogits(*inputs, 0.5) if fused else inputs[0]
            chosen, entropy = token_logprobs(source, ids, temperature=2.0)
            (chosen * torch.linspace(-1, 1, 16)).sum().backward()
        return chosen.detach(), entropy, [tensor.grad for tensor in inputs]

    plain, mixed = run(False), run(True)
    assert_close(mixed[0], plain[0], "log-probs")
    assert_close(mixed[1], plain[1], "entropies")
    for got, expected in zip(mixed[2], plain[2]):
        assert_gradient_close(got, expected, "gradient")


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
def test_a_bf16_mixed_training_step_logs_the_fp32_diagnostics_of_its_logits(tiny_pair, tmp_path, fused):
    """A real ``precision="bf16-mixed"`` step on the CPU (Lightning's autocast around ``training_step``):
    the logged loss and diagnostics equal an fp32 recomputation, outside autocast, from the very logits
    (or hidden states and head) the objective was given."""
    import lightning.pytorch as pl

    from kdlab.stages import DistillModule
    from kdlab.tasks import Addition

    module = DistillModule(*tiny_pair, task=Addition(num_train=4, num_val=4), max_completion_tokens=8,
                           batch_size=4, val_examples=4, fused_lm_head=fused)
    objective, seen = module.objective, {}
    forward = objective.forward

    def keep_inputs(student, teacher, mask, **kwargs):
        copy = lambda x: HeadLogits(x.hidden.detach().clone(), x.weight.detach().clone(), x.scale) if isinstance(x, HeadLogits) else x.detach().clone()
        seen.update(student=copy(student), teacher=copy(teacher), mask=mask.clone(), autocast=torch.is_autocast_enabled("cpu"))
        return forward(student, teacher, mask, **kwargs)  # consume=True may overwrite the student logits

    objective.forward = keep_inputs
    logged = {}
    module.log = lambda name, value, **kwargs: logged.setdefault(name, value.detach().clone() if isinstance(value, torch.Tensor) else value)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", precision="bf16-mixed", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0,
                         default_root_dir=tmp_path)
    trainer.fit(module)
    assert isinstance(seen["student"], HeadLogits) == fused
    assert seen["autocast"], "Lightning's bf16-mixed step ran without autocast: this test checks nothing"
    expected = kl_diagnostics(seen["student"], seen["teacher"], seen["mask"], objective.reduction, objective.chunk_size)
    for name in DIAGNOSTICS:
        assert_close(logged[f"train/{name}"], expected[name], name)
    assert_close(logged["train/loss"], expected["kl_forward"], "loss (ForwardKL)")


def test_an_fp32_student_has_gradients_after_a_no_grad_rollout_under_bf16_autocast(tiny_pair):
    """Lightning runs training_step under autocast, so the rollout's no-grad decode caches bf16 casts of
    the student's fp32 weights; the training forward after it must still reach every weight."""
    from kdlab.stages import DistillModule
    from kdlab.tasks import Addition

    module = DistillModule(*tiny_pair, task=Addition(num_train=8, num_val=2), max_completion_tokens=4, batch_size=2, fused_lm_head=False)
    batch = module.task.examples("train")[:2]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rollout = module.make_rollout(batch, seed=0)
        student, teacher = module.distillation_logits(rollout)
        loss = module.objective(student, teacher, rollout.completion_mask)
    loss.backward()
    grads = [p.grad for p in module.student.parameters() if p.requires_grad]
    assert all(g is not None for g in grads) and any(bool(g.abs().sum() > 0) for g in grads)
