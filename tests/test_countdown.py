"""Countdown: generator identities (determinism, pools, solvable targets) and the verifier on good,
wrong and hostile answers."""

from __future__ import annotations

import hashlib
import itertools
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kdlab.tasks.addition import Addition
from kdlab.tasks.countdown import Countdown, chain_to_expression, solve, verify

PROMPT_HEAD = (
    "Solve the Countdown arithmetic problem. Using the provided numbers, create an equation that equals the "
    "target. You may use the operations +, -, x, and /, and each number must be used exactly once; every "
    "division must have an integer result. Show your work in <think>...</think> tags and return the solution "
)


SPEC_POOL = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 15, 20, 25, 50, 75)


def answer(body: str) -> str:
    return f"<think>...</think>\n<answer>{body}</answer>"


# ---- generator -----------------------------------------------------------------------------------
def test_same_seed_same_examples_and_different_seeds_or_splits_differ() -> None:
    first = Countdown(num_train=200, num_val=50, num_test=50, seed=7)
    again = Countdown(num_train=200, num_val=50, num_test=50, seed=7)
    other = Countdown(num_train=200, num_val=50, num_test=50, seed=8)
    assert first.examples("train") == again.examples("train")
    assert first.examples("test") == again.examples("test")

    def problems(rows: list[dict]) -> list[tuple[list[int], int]]:
        return [(row["nums"], row["target"]) for row in rows]

    assert problems(first.examples("train")) != problems(other.examples("train"))
    assert problems(first.examples("val")) != problems(first.examples("test")[:50])


def test_a_split_does_not_depend_on_the_other_sizes() -> None:
    small = Countdown(num_train=10, num_val=5, num_test=5)
    large = Countdown(num_train=300, num_val=5, num_test=40)
    assert small.examples("val") == large.examples("val")
    assert small.examples("train") == large.examples("train")[:10]


def _problems(rows: list[dict]) -> list[tuple[tuple[int, ...], int]]:
    return [(tuple(sorted(row["nums"])), row["target"]) for row in rows]


def _digest(rows: list[dict]) -> str:
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


# SHA-256 of json.dumps of each split of Countdown(variant, num_train=5000, num_val=500, num_test=500), seed 42,
# recorded from the generator before the disjoint option existed
BEFORE_DISJOINT = {
    "countdown3": {
        "train": "e7391d1fd43d94a4094036b9438d660331744b984961c1f9491999606816593b",
        "val": "61f1d3777360297150e14fc638d68a86415399c1f5672ec27e521fdcabac44b8",
        "test": "70a2206e6635d532100ae0c979c9b7d01afe19118e987cc4c0f545f0b34d2710",
    },
    "countdown4": {
        "train": "80e7e70df49cef3b1230a60f478d49b12c464664be64f9705231dc1798be830c",
        "val": "451e8d088890b7c1506b1ab8494382f7a282d922ff8baa4acb83dd8ebd7e796f",
        "test": "d89f1f24aaca867b9f0f7d1ebe148c260a721fe3f5c0332f9cc2bf121a410562",
    },
}


@pytest.mark.parametrize("variant", ["countdown3", "countdown4"])
def test_disjoint_held_out_problems_are_never_train_problems_and_train_stays_byte_identical(variant: str) -> None:
    """The module docstring's disjoint rule: by default splits overlap (78 of the first 200 Countdown-3 val
    problems are train problems at seed 42); ``disjoint=True`` keeps drawing from the split's own stream past
    every train problem (val) and every train or val problem (test); train, and the default splits, are
    byte for byte what they were before the option existed."""
    sizes = {"num_train": 5000, "num_val": 500, "num_test": 500}
    default, disjoint = Countdown(variant=variant, **sizes), Countdown(variant=variant, disjoint=True, **sizes)
    for split in ("train", "val", "test"):
        assert _digest(default.examples(split)) == BEFORE_DISJOINT[variant][split], split
    assert disjoint.examples("train") == default.examples("train")
    train = set(_problems(default.examples("train")))
    if variant == "countdown3":
        assert sum(problem in train for problem in _problems(default.examples("val")[:200])) == 78
    val, test = disjoint.examples("val"), disjoint.examples("test")
    assert len(val) == len(test) == 500
    assert not train & set(_problems(val))
    assert not (train | set(_problems(val))) & set(_problems(test))
    if variant == "countdown3":  # within a split problems may still repeat
        assert len(set(_problems(val))) < len(val)
    assert [row["id"] for row in val] == [f"{variant}-val-{i}" for i in range(500)]
    # the same stream, the excluded draws skipped: a longer default split with those problems taken out
    longer = Countdown(variant=variant, num_train=0, num_val=2000, num_test=0).examples("val")
    kept = [row for row in longer if (tuple(sorted(row["nums"])), row["target"]) not in train]
    assert [{k: v for k, v in row.items() if k != "id"} for row in val] == [
        {k: v for k, v in row.items() if k != "id"} for row in kept[:500]
    ]


def test_disjoint_changes_nothing_without_a_train_split_and_a_stuck_split_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import kdlab.tasks.countdown as countdown

    alone = Countdown(num_train=0, num_val=50, num_test=50, disjoint=True)
    assert alone.examples("val") == Countdown(num_train=0, num_val=50, num_test=50).examples("val")
    assert countdown.MAX_SKIPPED_DRAWS == 100_000  # docs/bad_inputs.md's row
    monkeypatch.setattr(countdown, "MAX_SKIPPED_DRAWS", 0)
    with pytest.raises(ValueError, match=r"Countdown.disjoint/exclude_train_of: 0 countdown3 draws in a row for the val split were excluded train or val problems"):
        Countdown(num_train=5000, num_val=200, disjoint=True).examples("val")


def test_exclude_train_of_leaves_another_tasks_train_problems_out_of_val_and_test_and_keeps_the_rest_in_order() -> None:
    """Countdown-4E shares four-operand problems with Countdown-4 (operands 1-10, targets up to 100): the RLVR presets'
    pass@k task leaves the trained task's train problems out, and is otherwise the same stream."""
    trained = Countdown(variant="countdown4", num_train=5000, num_val=0, num_test=0, seed=42)
    train = {(tuple(sorted(row["nums"])), row["target"]) for row in trained.examples("train")}
    plain = Countdown(variant="countdown4e", num_train=0, num_val=400, num_test=400)
    held = Countdown(variant="countdown4e", num_train=0, num_val=200, num_test=200, exclude_train_of=[trained])
    for split in ("val", "test"):
        rows = held.examples(split)
        problems = [(tuple(sorted(row["nums"])), row["target"]) for row in rows]
        before = [(tuple(sorted(row["nums"])), row["target"]) for row in plain.examples(split)]
        assert any(problem in train for problem in before[:200]), split  # the exclusion has something to do
        assert not train & set(problems), split
        assert problems == [problem for problem in before if problem not in train][: len(rows)], split
    assert held.examples("train") == plain.examples("train") == []
    with pytest.raises(TypeError, match=r"Countdown.exclude_train_of\[0\] must be a Countdown task, got Addition"):
        Countdown(variant="countdown4e", exclude_train_of=[Addition()])


@pytest.mark.parametrize("variant", ["countdown3", "countdown4", "countdown4e", "countdown3s"])
def test_split_sizes_and_unique_ids(variant: str) -> None:
    task = Countdown(variant=variant, num_train=120, num_val=30, num_test=0)
    assert [len(task.examples(split)) for split in ("train", "val", "test")] == [120, 30, 0]
    ids = [row["id"] for row in task.examples("train")]
    assert len(set(ids)) == len(ids)
    assert ids[17] == f"{variant}-train-17"


@pytest.mark.parametrize(
    ("variant", "pool", "count", "top"),
    [
        ("countdown3", SPEC_POOL, 3, None),
        ("countdown4", SPEC_POOL, 4, 10_000),
        ("countdown4e", tuple(range(1, 11)), 4, 100),
        ("countdown3s", SPEC_POOL, 3, 20),
    ],
)
def test_operands_targets_and_reference_solutions(
    variant: str, pool: tuple[int, ...], count: int, top: int | None
) -> None:
    chain_task = Countdown(variant=variant, num_train=300, seed=3)
    expression_task = Countdown(variant=variant, num_train=300, seed=3, answer_format="expression")
    rows = chain_task.examples("train")
    assert rows == expression_task.examples("train")  # the format changes prompts, not problems
    shuffle = random.Random(0)
    for row in rows:
        nums, target = row["nums"], row["target"]
        assert len(nums) == count and all(n in pool for n in nums)
        assert target >= 1 and target not in nums and (top is None or target <= top)
        reference = chain_task.reference_completion(row)
        assert reference.endswith(f"<answer>{row['solution']}</answer>")
        assert verify(nums, target, reference)
        assert not verify(nums, target + 1, reference)
        assert verify(shuffle.sample(nums, len(nums)), target, reference)  # the pool is a multiset
        assert verify(nums, target, expression_task.reference_completion(row), "expression")
        assert chain_task.score(row, reference) == 1.0
    assert len({tuple(row["nums"]) for row in rows}) > 100  # operands really are drawn
    assert {n for row in rows for n in row["nums"]} == set(pool)  # ... from the whole pool
    if variant == "countdown3":
        assert any(len(set(row["nums"])) < 3 for row in rows)  # drawn with replacement


def _brute_force(nums: list[int]) -> set[int]:
    """Every value of ((p o q) o r) and (r o (p o q)) over orderings of three numbers, written out
    independently of the module's memoised search; intermediates non-negative, division exact."""

    def combine(a: int, b: int) -> set[int]:
        out = {a + b, a * b}
        if a >= b:
            out.add(a - b)
        if b and a % b == 0:
            out.add(a // b)
        return out

    values = set()
    for p, q, r in itertools.permutations(nums):
        for inner in combine(p, q):
            values |= combine(inner, r) | combine(r, inner)
    return values


@pytest.mark.parametrize("nums", [[2, 3, 4], [5, 5, 2], [75, 50, 1], [1, 1, 1], [7, 25, 12], [10, 10, 10]])
def test_solve_finds_exactly_the_brute_force_reachable_set(nums: list[int]) -> None:
    reachable = _brute_force(nums)
    for target in range(0, max(reachable) + 2):
        chain = solve(nums, target)
        assert (chain is not None) == (target in reachable), target
        if chain is not None:
            assert verify(nums, target, answer(chain))
            assert verify(nums, target, answer(chain_to_expression(chain)), "expression")


def test_solve_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="solve.nums"):
        solve([1, 2, 3, 4, 5, 6], 10)
    with pytest.raises(ValueError, match="solve.target"):
        solve([1, 2], "3")


def test_invalid_arguments_name_the_key() -> None:
    with pytest.raises(ValueError, match="Countdown.variant"):
        Countdown(variant="nope")
    with pytest.raises(ValueError, match="Countdown.answer_format"):
        Countdown(answer_format="json")
    with pytest.raises(ValueError, match="Countdown.num_val"):
        Countdown(num_val=-1)


def test_prompt_is_the_instruction_then_numbers_and_target() -> None:
    example = {"id": "x", "nums": [2, 3, 4], "target": 20, "solution": "2+3=5,5*4=20"}
    chain = Countdown().user_prompt(example)
    assert chain == (
        PROMPT_HEAD + "as compact, comma-separated equations in <answer>...</answer> tags. "
        "For example, <answer>2+3=5,5*4=20</answer>.\nNumbers: [2, 3, 4]\nTarget: 20"
    )
    expression = Countdown(answer_format="expression").user_prompt(example)
    assert expression.startswith(PROMPT_HEAD) and expression.endswith("\nNumbers: [2, 3, 4]\nTarget: 20")
    assert "<answer>(2+3)*4</answer>" in expression and "5*4=20" not in expression
    assert Countdown().student_messages(example)[0] == {
        "role": "system",
        "content": "You are a careful arithmetic solver.",
    }


def test_score_on_a_task() -> None:
    task = Countdown(num_train=5)
    example = {"id": "x", "nums": [2, 3, 4], "target": 20, "solution": "2+3=5,5*4=20"}
    assert task.score(example, answer("2+3=5,5*4=20")) == 1.0
    assert task.score(example, answer("2+3=5,5*4=21")) == 0.0
    assert task.score(example, None) == 0.0  # type: ignore[arg-type]
    expression_task = Countdown(answer_format="expression")
    assert expression_task.score(example, answer("(2+3)*4")) == 1.0
    assert expression_task.score(example, answer("2+3=5,5*4=20")) == 0.0  # formats are not mixed


# ---- chain verifier ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("nums", "target", "text"),
    [
        ([2, 3, 4], 20, "<answer>2+3=5,5*4=20</answer>"),
        ([4, 2, 3], 20, "<answer>2+3=5,5*4=20</answer>"),
        ([2, 3, 4], 20, "<answer> 2 + 3 = 5 , 5 * 4 = 20 </answer>"),
        ([2, 3, 4], 20, "<answer>\n2+3=5,\n\t5*4=20\n</answer>"),
        ([2, 3, 4], 20, "<answer>2+3=5,5x4=20</answer>"),
        ([2, 3, 4], 20, "<answer>2+3=5,5×4=20</answer>"),
        ([2, 3, 4], 20, "<answer>3+2=5,4*5=20</answer>"),
        ([2, 3, 4], 20, "<answer>1+1=2</answer> then <answer>2+3=5,5*4=20</answer>"),
        ([5, 5, 2], 20, "<answer>5+5=10,10*2=20</answer>"),
        ([5, 5, 2], 0, "<answer>5-5=0,0*2=0</answer>"),
        ([12, 3, 1], 5, "<answer>12÷3=4,4+1=5</answer>"),
        ([12, 3, 1], 5, "<answer>12/3=4,4+1=5</answer>"),
        ([6, 6, 6], 7, "<answer>6/6=1,6+1=7</answer>"),
        ([1, 1], 2, "<answer>000000000001+1=2</answer>"),  # 12 digits, leading zeros are decimal
        ([3, 5, 4], 32, "<answer>3+5=8,8*4=32.</answer>"),  # one full stop ending the answer
        ([3, 5, 4], 32, "<answer> 3+5=8, 8×4=32. </answer>"),
        ([5, 3, 4], 8, "<answer>5\u22123=2,2*4=8</answer>"),  # U+2212 minus, as × is *
    ],
)
def test_chain_accepts(nums: list[int], target: int, text: str) -> None:
    assert verify(nums, target, text) is True


@pytest.mark.parametrize(
    ("nums", "target", "text"),
    [
        ([2, 3, 4], 21, "<answer>2+3=5,5*4=20</answer>"),  # wrong final value
        ([2, 3, 4], 5, "<answer>2+3=5</answer>"),  # 4 unused
        ([2, 3, 4], 25, "<answer>2+3=5,5*5=25</answer>"),  # 5 used twice
        ([5, 2, 3], 20, "<answer>5+5=10,10*2=20</answer>"),  # only one 5 in the pool
        ([2, 3, 4], 24, "<answer>2+3=5,6*4=24</answer>"),  # 6 not in the pool
        ([2, 3, 4], 24, "<answer>2+3=6,6*4=24</answer>"),  # wrong arithmetic
        ([7, 2, 1], 4, "<answer>7/2=3,3+1=4</answer>"),  # non-exact division
        ([7, 2, 1], 4, "<answer>7/2=3.5,3.5+1=4.5</answer>"),  # decimals
        ([2, 2, 5], 5, "<answer>2-2=0,5/0=5</answer>"),  # division by zero
        ([2, 5, 4], 1, "<answer>2-5=-3,-3+4=1</answer>"),  # signed literals
        ([2, 3, 4], 20, "<answer>2+3=5,5*4=20,20+0=20</answer>"),  # trailing step on an empty pool
        ([2, 3, 4], 20, "<answer>2+3=5,5*4=20,</answer>"),  # trailing empty step
        ([2, 3, 4], 20, "<answer>2+3=5,5*4=20, done</answer>"),  # trailing garbage
        ([2, 3, 4], 20, "<answer>2+3=5,,5*4=20</answer>"),
        ([2, 3, 4], 20, "<answer>2+3+4=9</answer>"),
        ([2, 3, 4], 20, "<answer>(2+3)*4</answer>"),  # expression in chain mode
        ([2, 3, 4], 20, "<answer>2+3=5,5*4=20</answer> <answer>nope</answer>"),  # the last answer counts
        ([2, 3, 4], 20, "2+3=5,5*4=20"),  # no tags
        ([2, 3, 4], 20, "<answer>2+3=5,5*4=20"),  # unclosed
        ([2, 3, 4], 20, "<answer></answer>"),
        ([2, 3, 4], 20, "<answer>   </answer>"),
        ([2, 3, 4], 20, "<answer>2²+3=7</answer>"),  # non-ASCII digits
        ([2, 3, 4], 20, "<answer>2+3=5,5**4=20</answer>"),
        ([2], 2, "<answer></answer>"),
        ([1, 1], 2, "<answer>0000000000001+1=2</answer>"),  # 13-digit literal
        ([1, 1], 10**12, "<answer>999999999999+1=1000000000000</answer>"),  # 13-digit result
        ([3, 5, 4], 32, "<answer>3+5=8,8*4=32..</answer>"),  # only one full stop
        ([3, 5, 4], 32, "<answer>3+5=8.,8*4=32</answer>"),  # ... and only at the end
        ([3, 5, 4], 32, "<answer>.</answer>"),
        ([3, 5, 4], 36, "<answer>3+5=8,8*4=32.4</answer>"),  # a decimal is not a full stop
        ([2, 5, 4], 1, "<answer>2\u22125=\u22123,\u22123+4=1</answer>"),  # negative intermediates, U+2212 or not
        ([3, 5, 4], 2, "<answer>3\u22125=2</answer>"),  # 3-5 is not 2
        ([3, 5, 4], 32, "<answer>4\u22124=0,0+32=32.</answer>"),  # reused and not given, trailing stop or not
        ([7, 2, 1], 4, "<answer>7/2=3,3+1=4.</answer>"),  # non-exact division
    ],
)
def test_chain_rejects(nums: list[int], target: int, text: str) -> None:
    assert verify(nums, target, text) is False


@pytest.mark.parametrize(
    ("nums", "target", "text"),
    [
        ([2, 3, 4], 20, None),
        ([2, 3, 4], 20, b"<answer>2+3=5,5*4=20</answer>"),
        ([2, 3, 4], 20, 20),
        ([2, 3, 4], 20, ["<answer>2+3=5,5*4=20</answer>"]),
        (None, 20, "<answer>2+3=5,5*4=20</answer>"),
        ("234", 20, "<answer>2+3=5,5*4=20</answer>"),
        ([2, "3", 4], 20, "<answer>2+3=5,5*4=20</answer>"),
        ([2, 3.0, 4], 20, "<answer>2+3=5,5*4=20</answer>"),
        ([True, 3, 4], 20, "<answer>1+3=4,4*4=16</answer>"),
        ([], 20, "<answer>2+3=5,5*4=20</answer>"),
        ([2, 3, 4], 20.0, "<answer>2+3=5,5*4=20</answer>"),
        ([2, 3, 4], "20", "<answer>2+3=5,5*4=20</answer>"),
        ([2, 3, 4], None, "<answer>2+3=5,5*4=20</answer>"),
    ],
)
def test_wrong_argument_types_give_false(nums: object, target: object, text: object) -> None:
    assert verify(nums, target, text) is False
    assert verify(nums, target, text, "expression") is False


def test_unknown_format_gives_false() -> None:
    assert verify([2, 3, 4], 20, "<answer>2+3=5,5*4=20</answer>", "latex") is False


# ---- expression verifier -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("nums", "target", "body"),
    [
        ([1, 2, 3], 9, "(1+2)*3"),
        ([3, 2, 1], 9, " ( 1 + 2 ) x 3 "),
        ([2, 3, 4], 20, "(2+3)*4 = 20"),
        ([2, 3, 4], 14, "2+3*4"),  # precedence
        ([12, 3, 2], 2, "12/3/2"),  # left associative: (12/3)/2
        ([3, 5, 4], 2, "3-5+4"),  # a negative intermediate is ordinary arithmetic
        ([5, 5, 2], 20, "(5+5)*2"),
        ([8, 2, 2], 2, "8÷(2*2)"),
        ([1, 2, 3], 9, "((((1))+((2))))×(3)"),
        ([3, 5, 4], 2, "3\u22125+4"),  # U+2212 minus
        ([2, 3, 4], 20, "(2+3)*4 = 20."),  # one full stop ending the answer
    ],
)
def test_expression_accepts(nums: list[int], target: int, body: str) -> None:
    assert verify(nums, target, answer(body), "expression") is True


@pytest.mark.parametrize(
    ("nums", "target", "body"),
    [
        ([1, 2, 3], 10, "(1+2)*3"),  # wrong value
        ([1, 2, 3, 4], 9, "(1+2)*3"),  # missing number
        ([1, 2, 3], 18, "(1+2)*3*2"),  # extra number
        ([1, 2, 3], 9, "(1+1)*3+3"),  # a number used twice
        ([7, 2, 2], 7, "7/2*2"),  # non-exact division, even though the rational value is 7
        ([7, 0, 1], 1, "7/0+1"),  # division by zero
        ([2, 3, 4], 20, "(2+3)*4 = 21"),  # claimed value is not the target
        ([2, 3, 4], 20, "(2+3)*4 = 20 = 20"),
        ([2, 3, 4], 20, "(2+3)*4)"),  # unbalanced
        ([2, 3, 4], 20, "((2+3)*4"),
        ([2, 3, 4], 20, "(2+3)4*"),
        ([2, 3, 4], -2, "-(2+3)+4-1"),  # unary minus
        ([2, 3, 4], -2, "\u2212(2+3)+4\u22121"),  # ... written U+2212
        ([2, 3, 4], 20, "(2+3)*4.."),
        ([2, 3, 4], 20, "()"),
        ([2, 3, 4], 20, ""),
        ([2, 3, 4], 20, "2+3=5,5*4=20"),  # chain in expression mode
        ([2, 2, 2, 2, 2], 65536, "2**2**2**2**2"),
        ([10, 10, 10], 10**15, "(999999*999999)*1000000"),  # intermediate beyond 10**12
    ],
)
def test_expression_rejects(nums: list[int], target: int, body: str) -> None:
    assert verify(nums, target, answer(body), "expression") is False


def test_nesting_depth_is_capped() -> None:
    assert verify([1], 1, answer("(" * 100 + "1" + ")" * 100), "expression") is True
    assert verify([1], 1, answer("(" * 101 + "1" + ")" * 101), "expression") is False


def test_hostile_inputs_give_false_without_blowing_up() -> None:
    junk = bytes(random.Random(0).randrange(256) for _ in range(100_000)).decode("latin-1")
    hostile = [
        "<answer>" + "(" * 10_000 + "1" + ")" * 10_000 + "</answer>",
        "<answer>" + "(" * 400 + "1" + ")" * 400 + "</answer>",  # under the length cap, over the depth cap
        "<answer>2**2**2**2**2</answer>",
        "<answer>__import__('os').system('true')</answer>",
        "<answer>" + "9" * 1_000_000 + "</answer>",
        "<answer>" + "1+" * 499 + "1</answer>" * 2_000,
        "x" * 1_000_000,
        "<answer>" * 200_000 + "</answer>" * 200_000,
        junk,
        "<answer>" + junk[:900] + "</answer>",
        "<answer>" + "9" * 12 + "*" + "9" * 12 + "</answer>",
    ]
    for text in hostile:
        for answer_format in ("chain", "expression"):
            assert verify([1, 2, 2, 2, 2, 2], 1, text, answer_format) is False


_ANSWER_ALPHABET = "0123456789+-*/x×÷=,() \n<>answer"


@pytest.mark.parametrize("answer_format", ["chain", "expression"])
@settings(max_examples=500, deadline=None, database=None)
@given(
    text=st.one_of(
        st.text(),
        st.text(alphabet=_ANSWER_ALPHABET, max_size=60).map(lambda body: f"<answer>{body}</answer>"),
    ),
    nums=st.lists(st.integers(min_value=0, max_value=100), min_size=1, max_size=5),
    target=st.integers(min_value=-5, max_value=1000),
)
def test_verify_never_raises(answer_format: str, text: str, nums: list[int], target: int) -> None:
    result = verify(nums, target, text, answer_format)
    assert result is (result is True)  # a bool, not a truthy stand-in
    if "<answer>" not in text:
        assert result is False  # no answer tag: nothing to accept
    # only the last answer counts: a later answer that cannot be right (an empty one) overrides this one
    assert verify(nums, target, text + "<answer></answer>", answer_format) is False


def random_solution(rng: random.Random, nums: list[int]) -> tuple[str, int]:
    """A correct chain over all of ``nums`` (random pairs and operations, exact non-negative steps) and its value."""
    pool, steps = list(nums), []
    while len(pool) > 1:
        a, b = (pool.pop(rng.randrange(len(pool))) for _ in range(2))
        ops = ["+", "*"] + (["-"] if a >= b else []) + (["/"] if b and a % b == 0 else [])
        op = rng.choice(ops)
        c = {"+": a + b, "*": a * b, "-": a - b, "/": a // b if b else 0}[op]
        steps.append(f"{a}{op}{b}={c}")
        pool.append(c)
    return ",".join(steps), pool[0]


@settings(max_examples=300, deadline=None, database=None)
@given(nums=st.lists(st.integers(min_value=0, max_value=100), min_size=2, max_size=5), rng=st.randoms(use_true_random=False))
def test_verify_accepts_every_correct_solution_and_rejects_it_for_another_target(nums: list[int], rng: random.Random) -> None:
    chain, value = random_solution(rng, nums)
    expression = chain_to_expression(chain)
    assert verify(nums, value, answer(chain)) is True
    assert verify(nums, value, answer(expression), answer_format="expression") is True
    assert verify(nums, value, answer(f"{expression} = {value}"), answer_format="expression") is True
    for wrong in (value + 1, value - 1):
        assert verify(nums, wrong, answer(chain)) is False
        assert verify(nums, wrong, answer(expression), answer_format="expression") is False
    assert verify(nums + [1], value, answer(chain)) is False  # an operand left unused
    assert verify(nums, value, answer("1+1=3") + answer(chain)) is True  # the last answer counts
    assert verify(nums, value, answer(chain) + answer("1+1=3")) is False
