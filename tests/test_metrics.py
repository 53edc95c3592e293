import math

import pytest
import torch

from kdlab.evaluation.metrics import MeanScore, PassAtK, detect_language, pass_at_k, spanish_share, strip_language_neutral, update_sparsity


def test_pass_at_k_matches_the_binomial_formula_by_hand():
    assert pass_at_k(10, 0, 1) == 0.0
    assert pass_at_k(10, 10, 10) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 3, 10) == 1.0  # n - c < k
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - math.comb(7, 5) / math.comb(10, 5))
    assert pass_at_k(200, 13, 10) == pytest.approx(1 - math.comb(187, 10) / math.comb(200, 10))


@pytest.mark.parametrize("n, c, k", [(5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_pass_at_k_metric_averages_over_problems():
    metric = PassAtK(ks=(1, 2))
    metric.update([True, False, False, False])  # c = 1 of 4
    metric.update(torch.tensor([[True, True, False, False], [False] * 4]))
    result = metric.compute()
    assert result[1].item() == pytest.approx((0.25 + 0.5 + 0.0) / 3)
    assert result[2].item() == pytest.approx((pass_at_k(4, 1, 2) + pass_at_k(4, 2, 2) + 0.0) / 3)
    with pytest.raises(ValueError, match="k=2"):
        PassAtK(ks=(2,)).update([True])


def test_mean_score_is_the_mean_over_every_score_added_and_an_empty_update_adds_nothing():
    metric = MeanScore()
    assert metric.compute().item() == 0.0
    metric.update([1.0, 0.5])
    metric.update([])  # a batch that was all padding
    metric.update(torch.tensor([0.0]))
    assert metric.compute().item() == pytest.approx(0.5)
    assert metric.compute().dtype == torch.float64
    metric.reset()
    assert metric.compute().item() == 0.0


def test_update_sparsity_counts_entries_that_moved_less_than_tau_by_hand():
    # float64 so that 1e-6 is stored exactly and the "strictly below" boundary is testable
    before = {"a": torch.zeros(10, dtype=torch.float64), "b": torch.zeros(2, 5, dtype=torch.float64)}
    after = {name: value.clone() for name, value in before.items()}
    after["a"][:3] = 1e-3  # 3 moved a lot
    after["b"][0, :2] = 5e-7  # 2 moved below 1e-6 but above 1e-8
    after["b"][1, 0] = 1e-6  # exactly tau: not strictly below
    assert update_sparsity(before, after, 1e-6) == pytest.approx(16 / 20)
    assert update_sparsity(before, after, 1e-8) == pytest.approx(14 / 20)


def test_update_sparsity_validates_its_inputs():
    with pytest.raises(ValueError, match="threshold"):
        update_sparsity({"a": torch.zeros(1)}, {"a": torch.zeros(1)}, 0.0)
    with pytest.raises(ValueError, match="names differ"):
        update_sparsity({"a": torch.zeros(1)}, {"b": torch.zeros(1)}, 1e-6)
    with pytest.raises(ValueError, match="shape"):
        update_sparsity({"a": torch.zeros(1)}, {"a": torch.zeros(2)}, 1e-6)


def test_language_neutral_parts_are_stripped():
    text = "<think>first add 6 and 1 to get 7</think><answer>6+1=7,7*3=21</answer> \\boxed{42} $x^2$ ```print(x)```, 5%."
    assert strip_language_neutral(text) == "first add and to get"


def test_real_language_detection_of_english_and_spanish_reasoning():
    english = "<think>first add 6 and 1 to get 7, then multiply 7 and 3 to get 21</think><answer>6+1=7,7*3=21</answer>"
    spanish = "<think>primero sumo 6 y 1 para obtener 7, luego multiplico 7 y 3 para obtener 21</think><answer>6+1=7,7*3=21</answer>"
    assert detect_language(english) == "en"
    assert detect_language(spanish) == "es"
    assert detect_language("<answer>6+1=7</answer>") is None
    assert spanish_share([english, spanish, spanish, "<answer>1</answer>"]) == 0.5


def test_dollar_amounts_are_prose_and_only_maths_between_dollars_is_neutral():
    """kdlab.evaluation.metrics.looks_like_maths: the prose between two dollar amounts is kept and judged, so a mostly
    English sentence with a Spanish fragment is English; maths between dollar signs (and $$...$$) is still removed."""
    dollars = "<think>Tom pays $5 for apples and then he also pays $3 for pears, so in total he pays $8.</think><answer>8</answer>"
    assert strip_language_neutral(dollars) == "Tom pays for apples and then he also pays for pears so in total he pays"
    mostly_english = "<think>Tom paga $5 por manzanas and then he also pays for pears and the total is $8 dollars.</think>"
    assert detect_language(mostly_english) == "en"
    from kdlab.evaluation.metrics import looks_like_maths

    assert looks_like_maths("x^2 + 2ab") and looks_like_maths(r"6.02 \times 10^{23} \text{ mol}^{-1}") and looks_like_maths(r"\frac{a}{b}")
    assert not looks_like_maths("5 for apples and then he also pays ")
    assert strip_language_neutral(r"It costs $5 and we solve $x+1=6$ then $$\frac{x}{2} = y$$ done") == "It costs and we solve then done"


def test_latex_maths_delimiters_are_neutral_whatever_words_the_maths_holds():
    """\\(...\\), \\[...\\] and equation-like environments are maths, never currency: their \\text{...} words are not
    judged, so a Spanish response writing its maths in English \\text is Spanish (they were judged: English)."""
    inline = r"Entonces calculamos: \(\text{total price} = \text{unit price} \times \text{quantity}\)"
    display = r"Calculamos el área así: \[ \text{area of the triangle} = \frac{\text{base times height}}{2} \]"
    environment = r"Calculamos el área así: \begin{align*} \text{area of the triangle} &= 5 \end{align*} y listo"
    assert [strip_language_neutral(text) for text in (inline, display, environment)] == [
        "Entonces calculamos", "Calculamos el área así", "Calculamos el área así y listo"]
    assert [detect_language(text) for text in (inline, display, environment)] == ["es"] * 3
    assert strip_language_neutral(r"an unclosed \( stays as words") == "an unclosed stays as words"


def test_too_little_language_is_not_judged_and_counts_as_not_spanish():
    """kdlab.evaluation.metrics.MIN_WORDS: py3langid calls a lone English word Spanish; a response left with fewer
    than two words once maths, tags and answers are removed has no language (None) and is not primarily Spanish,
    while two words are judged."""
    from kdlab.evaluation.metrics import _identifier

    lone = ["Done", "Total", "Correct", "Result"]
    assert [_identifier(("en", "es")).classify(word)[0] for word in lone] == ["es"] * 4  # why there is a minimum
    terse = [f"<think>3+5=8, 8*4=32. {word}.</think><answer>3+5=8,8*4=32</answer>" for word in lone + ["Listo"]]
    assert [detect_language(text) for text in terse] == [None] * 5
    assert detect_language("<think>3+5=8. Final answer</think>") == "en" and detect_language("¿Cómo cómo?") == "es"
    spanish = "<think>Primero sumamos los números y luego multiplicamos por cuatro.</think><answer>3+5=8,8*4=32</answer>"
    assert spanish_share([terse[-1], spanish]) == 0.5  # the terse Spanish one is one of the responses, not a Spanish one
    from kdlab.evaluation.metrics import MIN_WORDS

    assert MIN_WORDS == 2
    assert detect_language("Derecho") is None and detect_language("A c d c c") is None  # the style study's short answers (docs/real_model.md)


def test_bf16_frozen_counts_predict_which_entries_a_bf16_adam_step_leaves_alone():
    """Adam's first step is lr * sign(g) exactly: in bf16 it leaves unchanged every entry the rounding
    prediction calls frozen, and (for entries not on a power of two, where the spacings differ) only those."""
    from kdlab.evaluation.metrics import bf16_frozen_counts

    torch.manual_seed(0)
    weight = torch.nn.Parameter((torch.randn(4096) * torch.logspace(-4, 0, 4096)).to(torch.bfloat16))
    before = weight.detach().clone()
    for lr in (1e-5, 1e-3):
        weight.data.copy_(before)
        optimizer = torch.optim.AdamW([weight], lr=lr, weight_decay=0.0)
        weight.grad = torch.randn(4096).to(torch.bfloat16)
        optimizer.step()
        unchanged = weight.detach() == before
        frozen, total = bf16_frozen_counts({"w": before}, lr)
        assert total == 4096 and 0 < frozen < total
        wide = before.float()
        both = ((wide + lr).to(torch.bfloat16) == before) & ((wide - lr).to(torch.bfloat16) == before)
        assert int(both.sum()) == frozen and bool(unchanged[both].all())  # frozen entries did not move
        power_of_two = torch.frexp(before.float()).mantissa.abs() == 0.5
        assert torch.equal(unchanged[~power_of_two], both[~power_of_two])
    assert bf16_frozen_counts({"w": torch.tensor([1.0, 0.01, 0.0, 100.0])}, 1e-3) == (2, 4)  # 1 and 100; 0 always moves
    with pytest.raises(ValueError, match="step must be > 0"):
        bf16_frozen_counts({"w": before}, 0.0)
