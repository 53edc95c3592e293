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
