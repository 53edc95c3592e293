import math
import re

import pytest
import torch

from kdlab.objectives import ForwardKL, GeneralizedJSD, KLObjective, ReverseKL, SampledForwardKL, SampledReverseKL, TotalVariation
from kdlab.objectives.kl import kl_diagnostics
from kdlab.objectives.reduction import token_weights

B, T, V = 3, 5, 11


def logits(seed, shape=(B, T, V), scale=2.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def ragged_mask():
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, :5] = True
    mask[1, 1:3] = True  # 2 tokens
    mask[2, 4] = True  # 1 token
    return mask


def kl_reference(p_logits, q_logits):
    """KL(p || q) per position, written with torch.distributions (independent of kdlab's formula)."""
    p = torch.distributions.Categorical(logits=p_logits)
    q = torch.distributions.Categorical(logits=q_logits)
    return torch.distributions.kl_divergence(p, q)


def sequence_mean(per_token, mask):
    per_seq = [per_token[b][mask[b]].mean() for b in range(mask.shape[0]) if mask[b].any()]
    return torch.stack(per_seq).mean()


@pytest.mark.parametrize("objective", [ForwardKL(), ReverseKL(), GeneralizedJSD(0.3), TotalVariation()])
def test_divergence_of_a_distribution_with_itself_is_zero(objective):
    s = logits(0)
    assert objective(s, s.clone(), ragged_mask()).item() == pytest.approx(0.0, abs=1e-12)


def test_forward_and_reverse_kl_match_torch_distributions_with_the_paper_reduction():
    s, t, mask = logits(1), logits(2), ragged_mask()
    assert ForwardKL()(s, t, mask).item() == pytest.approx(sequence_mean(kl_reference(t, s), mask).item(), rel=1e-9)
    assert ReverseKL()(s, t, mask).item() == pytest.approx(sequence_mean(kl_reference(s, t), mask).item(), rel=1e-9)


def test_token_reduction_is_the_mean_over_all_masked_tokens():
    s, t, mask = logits(3), logits(4), ragged_mask()
    expected = kl_reference(t, s)[mask].mean()
    assert ForwardKL(reduction="token")(s, t, mask).item() == pytest.approx(expected.item(), rel=1e-9)
    # the two reductions really differ on ragged lengths
    assert abs(ForwardKL()(s, t, mask).item() - expected.item()) > 1e-3


def test_forward_kl_gradient_is_student_minus_teacher_probabilities_times_weight():
    s, t, mask = logits(5).requires_grad_(True), logits(6), ragged_mask()
    ForwardKL()(s, t, mask).backward()
    weights = token_weights(mask, dtype=torch.float64)[..., None]
    expected = (torch.softmax(s.detach(), -1) - torch.softmax(t, -1)) * weights
    torch.testing.assert_close(s.grad, expected, rtol=1e-9, atol=1e-12)
    assert weights[0, 0, 0].item() == pytest.approx(1 / (5 * 3))


@pytest.mark.parametrize("objective", [ForwardKL(chunk_size=2), ReverseKL(chunk_size=3), GeneralizedJSD(0.7, chunk_size=1)])
def test_chunked_equals_naive_autograd_in_value_and_gradient(objective):
    s, t, mask = logits(7, dtype=torch.float32), logits(8, dtype=torch.float32), ragged_mask()
    s_chunked = s.clone().requires_grad_(True)
    value = objective(s_chunked, t, mask)
    value.backward()
    s_naive = s.clone().requires_grad_(True)
    weights = token_weights(mask)
    naive = (objective.token_loss(s_naive.reshape(-1, V), t.reshape(-1, V)).reshape(B, T) * weights).sum()
    naive.backward()
    assert value.item() == pytest.approx(naive.item(), abs=1e-6)
    torch.testing.assert_close(s_chunked.grad, s_naive.grad, atol=1e-6, rtol=1e-5)


def test_masked_positions_contribute_nothing_to_value_or_gradient():
    s, t, mask = logits(9).requires_grad_(True), logits(10), ragged_mask()
    garbage_t = t.clone()
    garbage_t[~mask] = 1e4 * torch.randn_like(garbage_t[~mask])
    value = ReverseKL()(s, garbage_t, mask)
    value.backward()
    assert value.item() == pytest.approx(ReverseKL()(s.detach(), t, mask).item(), rel=1e-12)
    assert torch.all(s.grad[~mask] == 0)
    assert torch.all(s.grad[mask].abs().sum(-1) > 0)


def test_bf16_input_accumulates_in_fp32_and_returns_grad_in_input_dtype():
    s32, t32, mask = logits(11, dtype=torch.float32), logits(12, dtype=torch.float32), ragged_mask()
    s = s32.bfloat16().requires_grad_(True)
    value = ForwardKL()(s, t32.bfloat16(), mask)
    value.backward()
    assert value.dtype == torch.float32 and s.grad.dtype == torch.bfloat16
    reference = ForwardKL()(s32.bfloat16().float(), t32.bfloat16().float(), mask)
    assert value.item() == pytest.approx(reference.item(), rel=1e-6)


def test_generalized_jsd_refuses_a_beta_too_near_an_end_for_fp32_and_is_fp32_accurate_at_the_nearest_it_takes():
    """Within BETA_EDGE of 0 or 1 the fp32 loss divides a vanishing KL by beta (or 1 - beta): at 1e-6 it was 30%
    off fp64. The nearest beta taken is within 1% of fp64 in value and gradient on teacher and student logits a
    little apart; nearer ones are refused, naming the setting and the exact endpoint to use instead."""
    for beta, end in ((1e-4, "0 (ForwardKL exactly)"), (1 - 1e-5, "1 (ReverseKL exactly)")):
        with pytest.raises(ValueError, match=rf"GeneralizedJSD.beta={beta} is within 0.001 of .* use {re.escape(end)}"):
            GeneralizedJSD(beta)
    generator = torch.Generator().manual_seed(0)
    s64 = 3 * torch.randn(16, 500, dtype=torch.float64, generator=generator)
    t64 = s64 + 0.3 * torch.randn(16, 500, dtype=torch.float64, generator=generator)
    for beta in (GeneralizedJSD.BETA_EDGE, 1 - GeneralizedJSD.BETA_EDGE):
        values, grads = [], []
        for dtype in (torch.float64, torch.float32):
            s = s64.detach().to(dtype).clone().requires_grad_(True)
            value = GeneralizedJSD(beta).token_loss(s, t64.to(dtype)).sum()
            value.backward()
            values.append(value.item()), grads.append(s.grad.double())
        assert values[1] == pytest.approx(values[0], rel=1e-2)
        assert (grads[1] - grads[0]).norm() < 1e-2 * grads[0].norm()


def test_generalized_jsd_endpoints_are_the_kls_and_it_is_continuous():
    s, t, mask = logits(13), logits(14), ragged_mask()
    fkl, rkl = ForwardKL()(s, t, mask).item(), ReverseKL()(s, t, mask).item()
    assert GeneralizedJSD(0.0)(s, t, mask).item() == pytest.approx(fkl, rel=1e-12)
    assert GeneralizedJSD(1.0)(s, t, mask).item() == pytest.approx(rkl, rel=1e-12)
    for edge, kl in ((0.0, fkl), (1.0, rkl)):  # approaching each end (as near as beta may be) the value tends to its KL
        gaps = [abs(GeneralizedJSD(abs(edge - step))(s, t, mask).item() - kl) for step in (1e-1, 1e-2, GeneralizedJSD.BETA_EDGE)]
        assert gaps[0] > gaps[1] > gaps[2] and gaps[2] < 0.1 * kl, (edge, gaps)
    # 0.5 is four times the textbook JSD with an even mixture
    p, q = torch.softmax(t, -1), torch.softmax(s, -1)
    m = 0.5 * (p + q)
    jsd = 0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (q * (q / m).log()).sum(-1)
    assert GeneralizedJSD(0.5)(s, t, mask).item() == pytest.approx(4 * sequence_mean(jsd, mask).item(), rel=1e-9)


def test_total_variation_matches_half_l1_and_is_bounded():
    s, t, mask = logits(15), logits(16), ragged_mask()
    tv = 0.5 * (torch.softmax(s, -1) - torch.softmax(t, -1)).abs().sum(-1)
    value = TotalVariation()(s, t, mask).item()
    assert value == pytest.approx(sequence_mean(tv, mask).item(), rel=1e-12)
    assert 0 < value <= 1


@pytest.mark.parametrize("sampled, exact", [(SampledForwardKL, ForwardKL), (SampledReverseKL, ReverseKL)])
def test_sampled_estimators_match_the_exact_gradient_in_expectation(sampled, exact):
    s, t = logits(17, shape=(1, 1, 6)), logits(18, shape=(1, 1, 6))
    mask = torch.ones(1, 1, dtype=torch.bool)
    s_exact = s.clone().requires_grad_(True)
    exact()(s_exact, t, mask).backward()
    # one row repeated 40,000 times = 40,000 independent draws at one position
    n = 40_000
    s_rep = s.expand(1, n, 6).clone().requires_grad_(True)
    objective = sampled(seed=3, reduction="token")
    objective(s_rep, t.expand(1, n, 6), torch.ones(1, n, dtype=torch.bool)).backward()
    estimate = s_rep.grad.sum(dim=1)
    torch.testing.assert_close(estimate, s_exact.grad[0], atol=0.02, rtol=0)
    # and a single draw is not the exact gradient (the test above could not pass by accident)
    assert (s_rep.grad[0, 0] * n - s_exact.grad[0, 0]).abs().max() > 0.05


def test_sampled_objectives_are_reproducible_from_their_seed():
    s, t, mask = logits(19), logits(20), ragged_mask()
    a, b, c = SampledForwardKL(seed=1), SampledForwardKL(seed=1), SampledForwardKL(seed=2)
    assert a(s, t, mask).item() == b(s, t, mask).item()
    assert a(s, t, mask).item() != c(s, t, mask).item()  # a has moved on; c uses another stream
    a.reseed(7), b.reseed(7)
    assert a(s, t, mask).item() == b(s, t, mask).item()


def test_empty_mask_warns_and_gives_zero_not_nan():
    s = logits(21).requires_grad_(True)
    with pytest.warns(UserWarning, match="selects no token"):
        value = ForwardKL()(s, logits(22), torch.zeros(B, T, dtype=torch.bool))
    value.backward()
    assert value.item() == 0.0 and torch.all(s.grad == 0)


def test_teacher_zero_probability_tokens_do_not_produce_nan():
    s, t = logits(23).requires_grad_(True), logits(24)
    t[..., 0] = float("-inf")
    value = ForwardKL()(s, t, ragged_mask())
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(s.grad).all()


def test_kl_diagnostics_match_the_objectives():
    s, t, mask = logits(25), logits(26), ragged_mask()
    diag = kl_diagnostics(s, t, mask, chunk_size=2)
    assert diag["kl_forward"].item() == pytest.approx(ForwardKL()(s, t, mask).item(), rel=1e-6)
    assert diag["kl_reverse"].item() == pytest.approx(ReverseKL()(s, t, mask).item(), rel=1e-6)
    entropy = torch.distributions.Categorical(logits=s).entropy()
    assert diag["student_entropy"].item() == pytest.approx(sequence_mean(entropy, mask).item(), rel=1e-6)


def test_a_notebook_subclass_needs_only_token_loss():
    class SquaredProbDistance(KLObjective):
        def token_loss(self, student_logits, teacher_logits):
            return ((torch.softmax(student_logits, -1) - torch.softmax(teacher_logits, -1)) ** 2).sum(-1)

    s, t, mask = logits(27).requires_grad_(True), logits(28), ragged_mask()
    value = SquaredProbDistance(chunk_size=2)(s, t, mask)
    value.backward()
    assert value.item() > 0 and s.grad[mask].abs().sum() > 0


@pytest.mark.parametrize(
    "build, key",
    [
        (lambda: ForwardKL(reduction="batch"), "reduction"),
        (lambda: ForwardKL(chunk_size=0), "chunk_size"),
        (lambda: GeneralizedJSD(beta=1.5), "beta"),
    ],
)
def test_bad_settings_name_the_key(build, key):
    with pytest.raises(ValueError, match=key):
        build()


def test_shape_mismatch_is_reported():
    with pytest.raises(ValueError, match="same"):
        ForwardKL()(logits(1), logits(2, shape=(B, T, V + 1)), ragged_mask())
    assert math.isfinite(ForwardKL()(logits(1), logits(2), ragged_mask()).item())


@pytest.mark.parametrize("objective", [ForwardKL(), ReverseKL(), TotalVariation()])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_closed_form_gradient_equals_autograd_of_the_same_formula(objective, dtype):
    """The one-pass path (closed-form loss and gradient from the shared row statistics) must train
    exactly the loss the formula defines (no silent fast path): same value, same gradient as autograd
    through ``token_loss``, on a nearly impossible teacher token and on ragged masks."""
    from kdlab.objectives.reduction import chunked_token_loss, token_weights

    s, t, mask = logits(29, dtype=dtype), logits(30, dtype=dtype), ragged_mask()
    t[0, 1, 2] = -50.0  # a nearly impossible teacher token
    weights = token_weights(mask, "sequence", dtype)
    results = []
    for closed in (False, True):
        s_leaf = s.clone().requires_grad_(True)
        value = chunked_token_loss(
            None if closed else objective.token_loss, s_leaf, t, weights, 2, objective.rows_loss_and_grad if closed else None
        )
        value.backward()
        results.append((value.detach(), s_leaf.grad))
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-6}
    torch.testing.assert_close(results[1][0], results[0][0], **tol)
    torch.testing.assert_close(results[1][1], results[0][1], **tol)
    assert results[1][1][~mask].abs().sum() == 0


@pytest.mark.parametrize("make", [lambda: ForwardKL(chunk_size=3), lambda: ReverseKL(chunk_size=3), lambda: GeneralizedJSD(0.3, chunk_size=3), lambda: TotalVariation(chunk_size=5)])
def test_fused_hidden_state_path_equals_the_logits_path(make):
    """HeadLogits(hidden, W, 1/T) gives the same loss, hidden-state gradient and head gradient as
    materialised logits (hidden @ W.T) / T, for closed-form and autograd objectives alike."""
    from kdlab.objectives import HeadLogits
    from kdlab.objectives.kl import kl_diagnostics

    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 5, 8, generator=generator, dtype=torch.float64)
    weight = torch.randn(11, 8, generator=generator, dtype=torch.float64)
    teacher = torch.randn(2, 5, 11, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    results = []
    for fused in (False, True):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        student = HeadLogits(h, w, scale=0.5) if fused else (h @ w.T) * 0.5
        loss = make()(student, teacher, mask)
        loss.backward()
        diagnostics = kl_diagnostics(student.detach(), teacher, mask)
        results.append((loss.detach(), h.grad, w.grad, diagnostics))
    (loss_a, h_a, w_a, d_a), (loss_b, h_b, w_b, d_b) = results
    torch.testing.assert_close(loss_b, loss_a)
    torch.testing.assert_close(h_b, h_a)
    torch.testing.assert_close(w_b, w_a)
    for key in d_a:
        torch.testing.assert_close(d_b[key], d_a[key])


def test_fused_path_with_a_frozen_head_returns_no_head_gradient():
    from kdlab.objectives import HeadLogits

    hidden = torch.randn(1, 3, 4, requires_grad=True)
    weight = torch.randn(6, 4)  # frozen (as under LoRA)
    ForwardKL()(HeadLogits(hidden, weight), torch.randn(1, 3, 6), torch.ones(1, 3, dtype=torch.bool)).backward()
    assert hidden.grad is not None and weight.grad is None


def reference_diagnostics(s, t, mask):
    """kl_forward, kl_reverse and both entropies with torch.distributions, sequence-reduced."""
    ps, pt = torch.distributions.Categorical(logits=s), torch.distributions.Categorical(logits=t)
    values = [torch.distributions.kl_divergence(pt, ps), torch.distributions.kl_divergence(ps, pt), ps.entropy(), pt.entropy()]
    return dict(zip(("kl_forward", "kl_reverse", "student_entropy", "teacher_entropy"), (sequence_mean(v, mask) for v in values)))


class OwnSquaredDistance(KLObjective):
    """A notebook subclass: only token_loss (the autograd path)."""

    def token_loss(self, student_logits, teacher_logits):
        return ((torch.softmax(student_logits, -1) - torch.softmax(teacher_logits, -1)) ** 2).sum(-1)


@pytest.mark.parametrize(
    "objective",
    [ForwardKL(chunk_size=4), ReverseKL(chunk_size=4), GeneralizedJSD(0.3, chunk_size=4), TotalVariation(chunk_size=4),
     SampledForwardKL(chunk_size=4), SampledReverseKL(chunk_size=4), OwnSquaredDistance(chunk_size=4)],
    ids=lambda o: type(o).__name__,
)
@pytest.mark.parametrize("block_elements", [1, 3 * V, 1 << 30], ids=["row", "3rows", "chunk"])
def test_every_objective_reports_exact_diagnostics_from_its_own_pass(objective, block_elements, monkeypatch):
    """The loss pass gives the exact KLs and entropies (reduced like the loss, not importance-weighted),
    whatever the block size; the separate kl_diagnostics pass is never needed."""
    import kdlab.objectives.kernels as kernels

    monkeypatch.setattr(kernels, "CPU_BLOCK_ELEMENTS", block_elements)
    s, t, mask = logits(41).requires_grad_(True), logits(42), ragged_mask()
    objective(s, t, mask, sequence_weights=torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)).backward()
    diagnostics = objective.take_diagnostics()
    for name, value in reference_diagnostics(s.detach(), t, mask).items():
        torch.testing.assert_close(diagnostics[name], value, rtol=1e-9, atol=1e-12, msg=name)
    assert objective.take_diagnostics() == {}  # taken once


@pytest.mark.parametrize("block_elements", [1, 2 * V, 1 << 30], ids=["row", "2rows", "chunk"])
@pytest.mark.parametrize("make", [ForwardKL, ReverseKL, TotalVariation])
def test_block_size_changes_nothing_on_ragged_and_bf16_inputs(make, block_elements, monkeypatch):
    """Blocks read rows in place when positions are consecutive and copy them otherwise (ragged masks,
    bf16 logits); the loss and gradient are those of the autograd formula either way."""
    import kdlab.objectives.kernels as kernels

    s32, t32, mask = logits(43, dtype=torch.float32), logits(44, dtype=torch.float32), ragged_mask()
    reference = s32.clone().requires_grad_(True)
    objective = make(chunk_size=3)
    expected = (torch.stack([objective.token_loss(reference[b], t32[b]) for b in range(B)]) * token_weights(mask)).sum()
    expected.backward()
    monkeypatch.setattr(kernels, "CPU_BLOCK_ELEMENTS", block_elements)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        s = s32.to(dtype).detach().requires_grad_(True)
        value = objective(s, t32.to(dtype), mask)
        value.backward()
        if dtype == torch.float32:
            torch.testing.assert_close(value, expected.detach(), rtol=tol, atol=tol)
            torch.testing.assert_close(s.grad, reference.grad, rtol=tol, atol=tol)
        else:
            assert s.grad.dtype == torch.bfloat16 and value.dtype == torch.float32
            torch.testing.assert_close(s.grad.float(), reference.grad, rtol=0, atol=tol)
        assert s.grad[~mask].abs().sum() == 0


def test_each_row_is_read_once_per_step_for_loss_gradient_and_diagnostics():
    """One pass: a lazy teacher is asked for each completion row exactly once by the objective, which
    also yields the diagnostics (the old second full-vocabulary pass asked twice)."""
    from kdlab.objectives import LazyLogits

    class Counting(LazyLogits):
        def __init__(self, dense):
            self.dense, self.asked = dense, 0
            self.shape, self.dtype, self.device = dense.shape, dense.dtype, dense.device

        def rows(self, b, t, dtype):
            self.asked += b.shape[0]
            return self.dense[b, t].to(dtype)

        def detach(self):
            return self

    mask = ragged_mask()
    teacher = Counting(logits(45))
    s = logits(46).requires_grad_(True)
    ForwardKL(chunk_size=3)(s, teacher, mask).backward()
    assert teacher.asked == int(mask.sum())
    assert ForwardKL().take_diagnostics() == {}  # a fresh objective has none


@pytest.mark.parametrize("make", [ForwardKL, ReverseKL, TotalVariation, OwnSquaredDistance])
def test_consuming_the_student_logits_gives_the_same_loss_and_gradient_in_their_storage(make):
    """consume=True: the student logits' storage becomes their gradient (no second (B, T, V) tensor),
    with the same loss, gradient and diagnostics as the allocating path."""
    s, t, mask = logits(47, dtype=torch.float32), logits(48, dtype=torch.float32), ragged_mask()
    results = []
    for consume in (False, True):
        leaf = s.clone().requires_grad_(True)
        student = leaf * 1.0  # a non-leaf, as a model's output is
        handed = []
        student.register_hook(lambda grad: handed.append(grad.data_ptr()))
        objective = make(chunk_size=2)
        value = objective(student, t, mask, consume=consume)
        value.backward()
        results.append((value.detach(), leaf.grad, objective.take_diagnostics(), student, handed))
    (v0, g0, d0, s0, h0), (v1, g1, d1, s1, h1) = results
    torch.testing.assert_close(v1, v0)
    torch.testing.assert_close(g1, g0)
    for key in d0:
        torch.testing.assert_close(d1[key], d0[key])
    assert torch.equal(s0, s)  # the allocating path leaves the logits alone
    assert h1 == [s1.data_ptr()] and h0 != [s0.data_ptr()]  # the consuming path handed back the logits' own storage
    torch.testing.assert_close(s1.detach(), g0)


@pytest.mark.parametrize("make", [ForwardKL, ReverseKL])
def test_fused_path_in_bf16_matches_the_bf16_logits_path(make):
    """bf16 hidden states and head: the fused path computes its logits and gradients with bf16 matrix
    products, as the model's head and autograd do on the logits path; the two agree to bf16 precision
    and return gradients in bf16."""
    from kdlab.objectives import HeadLogits

    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 6, 16, generator=generator).to(torch.bfloat16)
    weight = (torch.randn(40, 16, generator=generator) * 0.5).to(torch.bfloat16)
    teacher = torch.randn(2, 6, 40, generator=generator).to(torch.bfloat16)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    results = []
    for fused in (False, True):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        student = HeadLogits(h, w, scale=0.5) if fused else (h @ w.T) * 0.5
        loss = make(chunk_size=4)(student, teacher, mask)
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad))
    (loss_a, h_a, w_a), (loss_b, h_b, w_b) = results
    assert h_b.dtype == w_b.dtype == torch.bfloat16
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(h_b.float(), h_a.float(), rtol=0, atol=2e-2 * h_a.abs().max().item())
    torch.testing.assert_close(w_b.float(), w_a.float(), rtol=0, atol=2e-2 * w_a.abs().max().item())


def test_the_closed_form_statistics_hold_fp64s_values_at_a_real_vocabulary_whatever_the_logit_offset():
    """The one-pass diagnostics (and the closed-form losses built on them) lose no more to fp32 than a textbook
    fp32 log_softmax does, at V = 151,936 and the paper's temperatures, with logits shifted by any constant
    (a bias of the normaliser times the log-normaliser used to make the error move with the shift)."""
    from kdlab.objectives.kernels import Workspace, row_statistics

    columns, rows = 151_936, 3
    generator = torch.Generator().manual_seed(0)

    def statistics(log_s, log_t):
        p_s, p_t = log_s.exp(), log_t.exp()
        return torch.stack(((p_t * (log_t - log_s)).sum(-1), (p_s * (log_s - log_t)).sum(-1), -(p_s * log_s).sum(-1), -(p_t * log_t).sum(-1)), 1)

    for offset in (0.0, 10.0, -20.0):
        s = torch.randn(rows, columns, generator=generator) * 3 + offset  # student at T = 1
        t = (torch.randn(rows, columns, generator=generator) * 3 + offset) / 0.5  # teacher at T = 0.5
        exact = statistics(s.double().log_softmax(-1), t.double().log_softmax(-1))
        textbook = (statistics(s.log_softmax(-1), t.log_softmax(-1)).double() - exact).abs().amax(0)
        mine = (row_statistics(s, t, Workspace(rows, columns, torch.float32, torch.device("cpu"))).diagnostics.double() - exact).abs().amax(0)
        assert (mine <= 2 * textbook + 1e-6).all(), (offset, mine.tolist(), textbook.tolist())


def test_total_variations_value_holds_fp64s_at_a_real_vocabulary():
    """The closed form sums |p_S - p_T| plainly (``vector_norm(ord=1)`` lost ~100x more in fp32 on a CPU)."""
    columns = 151_936
    generator = torch.Generator().manual_seed(1)
    s, t = torch.randn(2, 1, columns, generator=generator) * 3, torch.randn(2, 1, columns, generator=generator) * 6
    mask = torch.ones(2, 1, dtype=torch.bool)
    exact = 0.5 * (s.double().softmax(-1) - t.double().softmax(-1)).abs().sum(-1).mean()
    textbook = (0.5 * (s.softmax(-1) - t.softmax(-1)).abs().sum(-1).mean().double() - exact).abs()
    assert (TotalVariation()(s, t, mask).double() - exact).abs() <= 2 * textbook + 1e-7
    assert (TotalVariation()(s.requires_grad_(), t, mask).double() - exact).abs() <= 2 * textbook + 1e-7  # the gradient's path


def test_record_tokens_reduces_a_per_token_statistic_over_every_chunk_while_record_keeps_the_last():
    class Weighted(KLObjective):
        def token_loss(self, student_logits, teacher_logits):
            confidence = student_logits.softmax(-1).amax(-1)
            self.record_tokens("confidence", confidence)
            self.record_tokens("confidence_max", confidence, reduce="max")
            self.record_tokens("tokens", torch.ones_like(confidence), reduce="sum")
            self.record("last_chunk", confidence.mean())
            return (student_logits.softmax(-1) - teacher_logits.softmax(-1)).pow(2).sum(-1)

    generator = torch.Generator().manual_seed(2)
    s, t = torch.randn(8, 100, V, generator=generator, requires_grad=True), torch.randn(8, 100, V, generator=generator)
    mask = torch.rand(8, 100, generator=generator) > 0.3
    objective = Weighted(chunk_size=64)
    objective(s, t, mask).backward()
    records = objective.pop_records()
    confidence = s.detach().softmax(-1).amax(-1)[mask]
    torch.testing.assert_close(records["confidence"], confidence.mean())
    torch.testing.assert_close(records["confidence_max"], confidence.max())
    assert records["tokens"] == int(mask.sum())
    assert not torch.isclose(records["last_chunk"], confidence.mean()), "record keeps one chunk's value"
    with pytest.raises(ValueError, match="reduce must be one of"):
        objective.record_tokens("x", confidence, reduce="median")


def test_a_subclass_that_overrides_token_loss_trains_on_its_own_loss_not_its_parents_closed_form():
    class DoubleForwardKL(ForwardKL):
        def token_loss(self, student_logits, teacher_logits):
            return 2 * super().token_loss(student_logits, teacher_logits)

    class ClosedToo(DoubleForwardKL):  # a closed form given with the new loss is used again
        def rows_loss_and_grad(self, stats, grad):
            losses = ForwardKL.rows_loss_and_grad(self, stats, grad)
            if grad is not None:
                grad.mul_(2)
            return 2 * losses

    s, t, mask = logits(0).requires_grad_(), logits(1), ragged_mask()
    parent = ForwardKL()(s, t, mask)
    (parent_grad,) = torch.autograd.grad(parent, s)
    for objective in (DoubleForwardKL(), ClosedToo()):
        loss = objective(s, t, mask)
        (grad,) = torch.autograd.grad(loss, s)
        torch.testing.assert_close(loss, 2 * parent)
        torch.testing.assert_close(grad, 2 * parent_grad)
    assert DoubleForwardKL().closed_form() is None and ClosedToo().closed_form() is not None and ForwardKL().closed_form() is not None
    given = DoubleForwardKL()
    given.rows_loss_and_grad = ClosedToo().rows_loss_and_grad  # a closed form given to the object is used as given
    assert given.closed_form() is given.rows_loss_and_grad
