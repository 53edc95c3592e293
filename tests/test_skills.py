import pytest

from kdlab.tasks import Addition
from kdlab.tasks.skills import Counting, Reversal, Sorting


@pytest.mark.parametrize("task_class", [Addition, Sorting, Reversal, Counting])
def test_reference_completions_score_one_and_wrong_answers_zero(task_class):
    task = task_class(num_train=50, num_val=5, num_test=5, seed=3)
    examples = task.examples("train")
    assert len(examples) == 50 and len({ex["id"] for ex in examples}) == 50
    for example in examples:
        assert task.score(example, task.reference_completion(example)) == 1.0
        assert task.score(example, "<answer>wrong</answer>") == 0.0
        assert task.score(example, "") == 0.0
    assert task_class(num_train=50, seed=3).examples("train") == examples
    assert task_class(num_train=50, seed=4).examples("train") != examples


def test_skill_answers_by_hand():
    assert Sorting().answer({"values": [3, 1, 2]}) == "1 2 3"
    assert Reversal().answer({"word": "abc"}) == "c b a"
    assert Counting().answer({"word": "abca", "letter": "a"}) == "2"


def test_negative_split_size_names_the_key():
    with pytest.raises(ValueError, match="Sorting.num_val"):
        Sorting(num_val=-1)


def test_answer_from_last_number_reads_the_last_integer_anywhere():
    from kdlab.tasks import Addition, Counting
    from kdlab.tasks.base import last_integer

    counting = Counting(num_val=4, answer_from="last_number")
    example = counting.examples("val")[0]
    right = example["word"].count(example["letter"])
    assert counting.score(example, f"I count the letters... so there are {right}.") == 1.0
    assert counting.score(example, f"<answer>{right}</answer>") == 1.0  # the tag's number is also the last one
    assert counting.score(example, f"{right}, no wait, {right + 1}") == 0.0  # the last number decides
    assert counting.score(example, "no number") == 0.0 and not counting.well_formed("no number")
    assert Counting(num_val=4).score(example, f"so there are {right}.") == 0.0  # the default still needs the tag
    addition = Addition(num_val=2, answer_from="last_number")
    sum_ = addition.examples("val")[0]
    assert addition.score(sum_, f"The sum is {sum_['a'] + sum_['b']:,}.") == 1.0  # thousands commas ignored
    assert last_integer("x" * 200_000) is None and last_integer("7" * 65) is None and last_integer(b"3") is None
    assert last_integer("from -3 to 12") == 12 and last_integer("down to -3") == -3
    # math_answers.last_number's reading: a decimal is no integer (it read the 5 of 2.5), commas only in groups of three
    assert last_integer("The sum is 2.5") is None and last_integer("The sum is 5.0.") == 5
    assert last_integer("1,2") is None and last_integer("12,345 apples") == 12345 and last_integer("down to \u22123") == -3
    assert addition.score(sum_, f"The sum is {sum_['a'] + sum_['b']}.5") == 0.0


def test_addition_reads_ascii_digits_only_and_scores_anything_else_0():
    """Addition's docstring: a tagged answer is a run of ASCII digits; "²" (whose int() raised, aborting the
    evaluation), Arabic-Indic and full-width digits, signs and periods score 0, and scoring never raises."""
    from kdlab.evaluation.scoring import accuracy

    task = Addition()
    example = {"id": "x", "a": 1, "b": 1}
    assert task.score(example, "<answer> 2 </answer>") == 1.0
    for body in ("²", "٢", "２", "+2", "2.", "1²"):
        assert task.score(example, f"<answer>{body}</answer>") == 0.0, body
    assert accuracy(task, [example], ["<answer>²</answer>"]) == 0.0
    assert task.score({"id": "y", "a": 10**63, "b": 0}, f"<answer>{10**63}</answer>") == 1.0  # 64 digits
    assert task.score({"id": "z", "a": 10**64, "b": 0}, f"<answer>{10**64}</answer>") == 0.0  # 65: too long


def test_answer_from_is_checked_and_named():
    from kdlab.tasks import Addition, Reversal

    with pytest.raises(ValueError, match="Reversal.answer_from 'last_number' needs a numeric answer"):
        Reversal(answer_from="last_number")
    with pytest.raises(ValueError, match=r"Addition.answer_from must be one of \('tag', 'last_number'\), got 'number'"):
        Addition(answer_from="number")


@pytest.mark.parametrize("task_class", [Sorting, Reversal, Counting])
def test_lengths_set_the_drawn_size_and_the_default_draws_are_unchanged(task_class):
    default, explicit = task_class(num_train=50), task_class(num_train=50, lengths=task_class.default_lengths)
    assert default.examples("train") == explicit.examples("train")
    longer = task_class(num_train=50, lengths=(11, 13)).examples("train")
    sizes = {len(e.get("values", e.get("word", ""))) for e in longer}
    assert sizes <= {11, 12, 13} and len(sizes) > 1
    with pytest.raises(ValueError, match=rf"{task_class.__name__}.lengths must be"):
        task_class(lengths=(4, 2))


def test_the_default_lengths_are_the_documented_ranges():
    assert (Sorting.default_lengths, Reversal.default_lengths, Counting.default_lengths) == ((3, 6), (3, 7), (4, 9))
    assert {len(e["values"]) for e in Sorting(num_train=300).examples("train")} == set(range(3, 7))
    # the first draws of each default stream, as drawn before ``lengths`` existed (the packaged worlds were trained on them)
    assert [e["values"] for e in Sorting(num_train=2).examples("train")] == [[7, 0, 1, 3], [8, 6, 7]]
    assert [e["word"] for e in Reversal(num_train=2).examples("train")] == ["hebefad", "egcc"]
    assert [(e["word"], e["letter"]) for e in Counting(num_train=2).examples("train")] == [("daba", "c"), ("cdcbdbda", "a")]
