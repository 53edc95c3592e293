"""Real-data tasks (Science, MedReason, MATH, GSM8K) on small fixtures in each dataset's own column
layout: the paper's prompt texts, letter recovery, answer extraction and comparison, split rules,
errors that name file, row and field, and scorers that never raise on hostile completions."""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kdlab.tasks.math_answers as math_tasks
from kdlab.tasks.math import (
    GSM8K,
    MATH,
    answers_match,
    as_fraction,
    final_number,
    gsm8k_reference,
    last_boxed,
    normalise_answer,
)
from kdlab.tasks.multiple_choice import (
    MedReason,
    Science,
    UnresolvedAnswer,
    parse_options,
    read_letter,
    recover_letter,
)
from kdlab.tasks.sources import hashed_order, load_rows, require_fields, split_by_fraction

FIXTURES = Path(__file__).parent / "fixtures"
SCIKNOWEVAL = str(FIXTURES / "sciknoweval.jsonl")
MEDREASON = str(FIXTURES / "medreason.jsonl")
NUMINA = str(FIXTURES / "numina.jsonl")
MATH500 = str(FIXTURES / "math500.jsonl")
GSM8K_FILE = str(FIXTURES / "gsm8k.jsonl")

# The paper's Table 1 texts, typed out here rather than imported, so a drifted constant fails.
SCIENCE_SYSTEM = "You are a careful solver of multiple-choice science questions."
SCIENCE_USER = (
    "Given a question and four options, select the correct answer. Reason step by step in <think>...</think> tags "
    "and place only the corresponding option letter (A, B, C, or D) in <answer>...</answer> tags."
)
MEDREASON_SYSTEM = "You are a careful medical reasoning assistant."
MEDREASON_USER = (
    "Given a medical multiple-choice question and its answer choices, select the correct answer. Reason step by "
    "step in <think>...</think> tags and place only the letter corresponding to the correct option in "
    "<answer>...</answer> tags; do not repeat the answer text."
)
MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."


def fixture_rows(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def answer(body: str) -> str:
    return f"<think>...</think>\n<answer>{body}</answer>"


@pytest.fixture(scope="module")
def science() -> Science:
    return Science(source=SCIKNOWEVAL, eval_fraction=0.5, num_val=2)


@pytest.fixture(scope="module")
def medreason() -> MedReason:
    return MedReason(source=MEDREASON, eval_fraction=0.3)


@pytest.fixture(scope="module")
def math_task() -> MATH:
    return MATH(train_source=NUMINA, eval_source=MATH500, num_val=4, use_math_verify=False)


@pytest.fixture(scope="module")
def gsm8k() -> GSM8K:
    return GSM8K(source=GSM8K_FILE, num_val=3)


# ---- sources ------------------------------------------------------------------------------------------------
def test_load_rows_reads_every_local_format_alike(tmp_path: Path) -> None:
    import pandas as pd

    rows = load_rows(GSM8K_FILE, "train")
    assert rows == fixture_rows(GSM8K_FILE)
    frame = pd.DataFrame(rows)
    frame.to_parquet(tmp_path / "gsm8k.parquet")
    frame.to_csv(tmp_path / "gsm8k.csv", index=False)
    (tmp_path / "gsm8k.json").write_text(json.dumps(rows))
    for suffix in ("parquet", "csv", "json"):
        assert load_rows(str(tmp_path / f"gsm8k.{suffix}"), "test") == rows, suffix


def test_load_rows_directory_picks_the_named_split(tmp_path: Path) -> None:
    rows = fixture_rows(GSM8K_FILE)
    write_rows(tmp_path / "train.jsonl", rows[:4])
    write_rows(tmp_path / "test.jsonl", rows[4:])
    assert load_rows(str(tmp_path), "train") == rows[:4]
    assert load_rows(str(tmp_path), "test") == rows[4:]


def test_missing_local_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "rows.jsonl"
    with pytest.raises(FileNotFoundError, match="nowhere/rows.jsonl"):
        load_rows(str(missing), "train")
    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        Science(source="./no_such_dir").examples("train")


def test_hub_ids_go_to_load_dataset_with_config_split_and_revision(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    calls = []

    class Table:
        def to_list(self) -> list[dict]:
            return [{"question": "q", "answer": "#### 1"}]

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return Table()

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_rows("openai/gsm8k", "test", config="main", revision="abc123") == [
        {"question": "q", "answer": "#### 1"}
    ]
    assert calls == [(("openai/gsm8k", "main"), {"split": "test", "revision": "abc123"})]
    assert GSM8K().examples("test")[0]["answer"] == "1"  # the default source is the Hub id


def test_require_fields_names_source_row_and_field() -> None:
    require_fields("f.jsonl", [(0, {"a": 1})], ("a",))
    with pytest.raises(ValueError, match=r"^f\.jsonl row 3: missing field 'b'$"):
        require_fields("f.jsonl", [(0, {"a": 1, "b": 2}), (3, {"a": 1, "b": None})], ("a", "b"))


def test_hashed_order_depends_on_content_not_position() -> None:
    keys = [f"question {i}" for i in range(50)]
    order = [keys[i] for i in hashed_order(keys, seed=1)]
    shuffled = random.Random(0).sample(keys, len(keys))
    assert [shuffled[i] for i in hashed_order(shuffled, seed=1)] == order
    assert [keys[i] for i in hashed_order(keys, seed=2)] != order
    train, test = split_by_fraction(keys, 0.2, seed=1)
    assert len(test) == 10 and sorted(train + test) == list(range(50))


# ---- multiple choice: scoring ---------------------------------------------------------------------------------
@pytest.mark.parametrize("body", ["B", " B ", "B.", "B)", "(B)", "\nB.\n", "(B)."])
def test_read_letter_tolerates_whitespace_period_and_parentheses(body: str) -> None:
    assert read_letter(answer(body)) == "B"


@pytest.mark.parametrize("body", ["b", "BB", "B C", "Answer: B", "E", "", "(B", "B..", "Ceftriaxone", "B" + " " * 80])
def test_read_letter_rejects_anything_else(body: str) -> None:
    assert read_letter(answer(body)) is None


def test_read_letter_uses_the_last_answer_and_the_options_range() -> None:
    assert read_letter("<answer>A</answer> on reflection <answer>C</answer>") == "C"
    assert read_letter("<answer>C</answer> on reflection <answer>maybe</answer>") is None
    assert read_letter(answer("E"), "ABCDE") == "E"
    assert read_letter(answer("E"), "ABCD") is None
    assert read_letter("B") is None  # no tags


# ---- every tag-reading task: an unclosed final answer ------------------------------------------------------------
def test_an_unclosed_final_answer_is_no_answer_for_every_task_that_reads_the_answer_tag() -> None:
    """last_tagged's rule (a ``<answer>`` after the last ``</answer>`` means no answer, whatever an earlier
    ``<answer>...</answer>`` held), as every task sharing it reads it: Countdown's verifier, read_letter,
    final_number (which does not fall through to a box or the whole text for it), Addition, the skills and
    the format reward (``Task.well_formed``); complete answers read as before."""
    from kdlab.tasks import Addition, Counting, last_tagged
    from kdlab.tasks.countdown import verify

    draft = "<think><answer>{}</answer></think><answer>{}"  # a draft inside <think>, then a final answer cut off
    assert last_tagged(draft.format("a", "b")) is None and last_tagged("<answer>a</answer><answer>") is None
    assert last_tagged("<answer>a</answer> and <answer>b</answer>") == "b" and last_tagged("<answer>x<answer>y</answer>") == "y"
    assert verify([3, 5, 4], 32, draft.format("3+5=8,8*4=32", "3*5=15")) is False
    assert verify([3, 5, 4], 32, "<answer>3+5=8,8*4=32</answer><answer>") is False
    assert verify([3, 5, 4], 32, "<think><answer>3*5=15</answer></think><answer>3+5=8,8*4=32</answer>") is True
    assert read_letter(draft.format("B", "C")) is None and read_letter(draft.format("B", "")) is None
    assert final_number(draft.format("72", "73")) is None and final_number("\\boxed{72} <answer>72") is None
    assert final_number("\\boxed{72}") == 72 and final_number(draft.format("1", "") + "72</answer>") == 72
    gsm8k_example = {"id": "g", "answer": "72"}
    assert GSM8K(source=GSM8K_FILE).score(gsm8k_example, draft.format("72", "72")) == 0.0
    addition, counting = Addition(), Counting()
    assert addition.score({"id": "x", "a": 1, "b": 1}, draft.format("2", "2")) == 0.0
    assert counting.score({"id": "c", "word": "aab", "letter": "a"}, draft.format("2", "2")) == 0.0
    assert not addition.well_formed(draft.format("2", "2")) and addition.well_formed("<answer>2</answer>")


# ---- multiple choice: option and letter recovery ------------------------------------------------------------------
OPTIONS = {"A": "Vitamin A", "B": "Vitamin B12", "C": "Vitamin C", "D": "Vitamin D"}


@pytest.mark.parametrize(
    "text, letter",
    [
        ("Vitamin C", "C"),
        ("  vitamin   c. ", "C"),
        ("Vitamin C. Explanation: needed for collagen.", "C"),
        ("C", "C"),
        ("(C)", "C"),
        ("C.", "C"),
        ("C. Vitamin C", "C"),
        ("The answer is: Vitamin B12", "B"),
    ],
)
def test_recover_letter_by_text_or_letter(text: str, letter: str) -> None:
    assert recover_letter(text, OPTIONS) == letter


def test_recover_letter_prefix_and_ambiguity() -> None:
    assert recover_letter("The final decision is: yes. Trained adults...", {"A": "Yes", "B": "No"}) == "A"
    with pytest.raises(UnresolvedAnswer, match="several options"):
        recover_letter("Lead", {"A": "Lead", "B": "lead.", "C": "Mercury"})
    with pytest.raises(UnresolvedAnswer, match="several options"):
        recover_letter("Lead acetate poisoning", {"A": "Lead", "B": "Lead acetate", "C": "Mercury"})
    with pytest.raises(UnresolvedAnswer, match="none of the options"):
        recover_letter("Vitamin K", OPTIONS)
    with pytest.raises(UnresolvedAnswer, match="answer letter 'F'"):
        recover_letter("F", OPTIONS)


def test_parse_options_reads_medreason_text_dicts_and_lists() -> None:
    text = "Answer Choices:\nA. Red cell casts in the\nurine\nB) Heavy proteinuria\n(C) Oedema\nD: I. and II. only"
    assert parse_options(text) == {
        "A": "Red cell casts in the urine",
        "B": "Heavy proteinuria",
        "C": "Oedema",
        "D": "I. and II. only",
    }
    assert parse_options('{"A": "x", "B": "y"}') == {"A": "x", "B": "y"}
    assert parse_options(["x", "y", "z"]) == {"A": "x", "B": "y", "C": "z"}
    assert parse_options("") == {}
    for bad in ("just prose", "A. only one", {"B": "x", "C": "y"}, "{not json"):
        with pytest.raises(UnresolvedAnswer):
            parse_options(bad)


# ---- Science ---------------------------------------------------------------------------------------------------
def test_science_prompt_is_the_papers_text_then_question_and_choices(science: Science) -> None:
    example = next(ex for ex in science.examples("train") + science.examples("test") if ex["row"] == 0)
    messages = science.student_messages(example)
    assert messages[0] == {"role": "system", "content": SCIENCE_SYSTEM}
    assert messages[1]["content"] == (
        SCIENCE_USER
        + "\n\nWhich reagent converts a primary alcohol to an aldehyde without over-oxidation to the carboxylic acid?"
        + "\n\nA. Potassium permanganate\nB. Pyridinium chlorochromate\nC. Chromic acid\nD. Sodium borohydride"
    )
    assert example["answer"] == "B"


def test_science_keeps_chemistry_level3_four_option_rows_and_splits_them(science: Science) -> None:
    train, test, val = (science.examples(split) for split in ("train", "test", "val"))
    # rows 4 (L1), 5 (true/false) and 6 (Biology) are filtered out
    assert sorted(ex["row"] for ex in train + test) == [0, 1, 2, 3, 7, 8, 9]
    assert len(test) == round(0.5 * 7) and not {ex["id"] for ex in train} & {ex["id"] for ex in test}
    assert val == test[:2]
    again = Science(source=SCIKNOWEVAL, eval_fraction=0.5)
    assert again.examples("test") == test
    assert [ex["id"] for ex in Science(source=SCIKNOWEVAL, eval_fraction=0.5, seed=7).examples("test")] != [
        ex["id"] for ex in test
    ]
    everything = Science(source=SCIKNOWEVAL, domain=None, level=None, question_type=None, eval_fraction=0.2)
    assert len(everything.examples("train")) + len(everything.examples("test")) == 10


def test_science_scores_the_right_letter_only(science: Science) -> None:
    for example in science.examples("train") + science.examples("test"):
        assert science.score(example, science.reference_completion(example)) == 1.0
        for letter in "ABCD":
            expected = float(letter == example["answer"])
            assert science.score(example, answer(letter)) == expected
            assert science.score(example, answer(f"({letter})")) == expected


def test_science_row_missing_a_field_names_file_row_and_field(tmp_path: Path) -> None:
    rows = fixture_rows(SCIKNOWEVAL)
    del rows[2]["question"]
    path = write_rows(tmp_path / "broken.jsonl", rows)
    with pytest.raises(ValueError, match=r"broken\.jsonl row 2: missing field 'question'"):
        Science(source=path).examples("train")


def test_science_unknown_answer_letter_names_file_and_row(tmp_path: Path) -> None:
    rows = fixture_rows(SCIKNOWEVAL)
    rows[3]["answerKey"] = "E"
    path = write_rows(tmp_path / "bad_key.jsonl", rows)
    with pytest.raises(ValueError, match=r"bad_key\.jsonl row 3: answerKey 'E' is not one of"):
        Science(source=path).examples("train")
    skipping = Science(source=path, unmatched="skip", eval_fraction=0.5)
    assert 3 not in {ex["row"] for ex in skipping.examples("train") + skipping.examples("test")}


def test_construction_validates_settings() -> None:
    with pytest.raises(ValueError, match="Science.eval_fraction"):
        Science(eval_fraction=1.0)
    with pytest.raises(ValueError, match="MedReason.unmatched"):
        MedReason(unmatched="ignore")
    with pytest.raises(ValueError, match="MATH.num_train"):
        MATH(num_train=-1)
    with pytest.raises(ValueError, match="GSM8K.num_val"):
        GSM8K(num_val=-1)


# ---- MedReason ----------------------------------------------------------------------------------------------
def test_medreason_recovers_letters_and_drops_open_ended_rows(medreason: MedReason) -> None:
    examples = medreason.examples("train") + medreason.examples("test")
    letters = {ex["row"]: ex["answer"] for ex in examples}
    # row 3 (huatuo) has no options; the others name C, C (medqa, 5 options), A (pubmedqa), B, B, C, A
    assert letters == {0: "C", 1: "C", 2: "A", 4: "B", 5: "B", 6: "C", 7: "A"}
    assert next(ex for ex in examples if ex["row"] == 1)["options"]["E"] == "Sitagliptin"


def test_medreason_prompt_reference_and_scores(medreason: MedReason) -> None:
    example = next(ex for ex in medreason.examples("train") + medreason.examples("test") if ex["row"] == 0)
    messages = medreason.student_messages(example)
    assert messages[0] == {"role": "system", "content": MEDREASON_SYSTEM}
    assert messages[1]["content"] == (
        MEDREASON_USER
        + "\n\nDeficiency of which vitamin causes scurvy?\n\nA. Vitamin A\nB. Vitamin B12\nC. Vitamin C\nD. Vitamin D"
    )
    reference = medreason.reference_completion(example)
    assert reference.startswith("<think>Finding reasoning paths:") and reference.endswith("<answer>C</answer>")
    for ex in medreason.examples("train") + medreason.examples("test"):
        assert medreason.score(ex, medreason.reference_completion(ex)) == 1.0
        wrong = next(letter for letter in ex["options"] if letter != ex["answer"])
        assert medreason.score(ex, answer(wrong)) == 0.0
        assert medreason.score(ex, answer(ex["options"][ex["answer"]])) == 0.0  # the text, not the letter


def test_medreason_five_option_rows_accept_e() -> None:
    task = MedReason(source=MEDREASON)
    example = {"id": "x", "question": "q", "options": dict(zip("ABCDE", "vwxyz")), "answer": "E"}
    assert task.score(example, answer("E")) == 1.0
    assert task.score({**example, "options": dict(zip("ABCD", "wxyz")), "answer": "D"}, answer("E")) == 0.0


@pytest.mark.parametrize(
    "change, message",
    [
        ({"answer": "Vitamin K"}, r"med\.jsonl row 0: answer 'Vitamin K' matches none of the options"),
        ({"answer": "F"}, r"med\.jsonl row 0: answer letter 'F' is not one of the options"),
        ({"options": "Answer Choices:\nA. Lead\nB. Lead.\nC. Tin", "answer": "lead"}, r"med\.jsonl row 0: .*several"),
    ],
)
def test_medreason_unresolvable_rows_name_file_and_row(tmp_path: Path, change: dict, message: str) -> None:
    rows = fixture_rows(MEDREASON)
    rows[0].update(change)
    path = write_rows(tmp_path / "med.jsonl", rows)
    with pytest.raises(ValueError, match=message):
        MedReason(source=path).examples("train")
    skipping = MedReason(source=path, unmatched="skip", eval_fraction=0.3)
    assert 0 not in {ex["row"] for ex in skipping.examples("train") + skipping.examples("test")}


def test_medreason_row_missing_a_field_names_file_row_and_field(tmp_path: Path) -> None:
    rows = fixture_rows(MEDREASON)
    rows[5]["answer"] = None
    path = write_rows(tmp_path / "med_missing.jsonl", rows)
    with pytest.raises(ValueError, match=r"med_missing\.jsonl row 5: missing field 'answer'"):
        MedReason(source=path).examples("train")


# ---- MATH: extraction and comparison --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [
        ("so $\\boxed{\\frac{1}{\\sqrt{2}}}$.", "\\frac{1}{\\sqrt{2}}"),
        ("\\boxed{1} then \\boxed{ {2}+{3} }", " {2}+{3} "),
        ("\\fbox{7}", "7"),
        ("\\boxed{3} and finally \\fbox{4}", "4"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed 5$ done", "5"),
        ("\\boxed{\\boxed{8}}", "8"),
        ("\\boxed{1} but \\boxed{2", None),
        ("\\boxed{a\\}", None),
        ("no box here", None),
        ("\\boxed", None),
        ("\\boxed{" + "{" * 10_000 + "x" + "}" * 10_000 + "}", "{" * 10_000 + "x" + "}" * 10_000),
    ],
)
def test_last_boxed_balances_braces(text: str, expected: str | None) -> None:
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    "reference, guess",
    [
        ("\\frac{1}{2}", "0.5"),
        ("\\frac{1}{2}", "\\dfrac{1}{2}"),
        ("\\frac{1}{2}", "\\frac12"),
        ("0.5", ".5"),
        ("-\\frac{3}{4}", "\\frac{-3}{4}"),
        ("3/4", "0.75"),
        ("10", "10.0"),
        ("1000", "1,000"),
        ("5", "5\\text{ cm}"),
        ("90^\\circ", "90"),
        ("\\text{(A)}", "(A)"),
        ("3\\sqrt{2}", "3 \\sqrt2"),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
        ("12", "x = 12"),
        ("7", "$7$."),
        ("10\\%", "10"),
        ("2\\!\\cdot\\!3", "2 \\cdot 3"),
    ],
)
def test_fallback_normaliser_equalities(reference: str, guess: str) -> None:
    assert answers_match(reference, guess, use_math_verify=False)


@pytest.mark.parametrize(
    "reference, guess",
    [
        ("\\frac{1}{2}", "0.51"),
        ("\\frac{1}{2}", "\\frac{2}{1}"),
        ("10", "100"),
        ("1,2", "12"),
        ("x^2", "x^3"),
        ("\\sqrt{2}", "2"),
        ("3\\sqrt{2}", "\\sqrt{18}"),  # equal value, unequal form: only math_verify may accept it
        ("5", ""),
        ("5", "\\frac{5}{0}"),
        ("(A)", "(B)"),
        ("X", "x"),
    ],
)
def test_fallback_normaliser_inequalities(reference: str, guess: str) -> None:
    assert not answers_match(reference, guess, use_math_verify=False)


def test_normalise_and_as_fraction_directly() -> None:
    assert normalise_answer("\\left[ 0, \\dfrac{1}{2} \\right)") == "[0,\\frac{1}{2})"
    assert normalise_answer("4\\text{ m}\\text{/s}") == "4"
    assert as_fraction("-\\frac{-6}{4}") == Fraction(3, 2)
    assert as_fraction("2.50") == Fraction(5, 2)
    assert as_fraction("1/0") is None and as_fraction("\\pi") is None and as_fraction("9" * 41) is None


def test_math_verify_path_accepts_equivalent_forms() -> None:
    pytest.importorskip("math_verify")
    assert math_tasks.math_verify_usable()
    assert answers_match("3\\sqrt{2}", "\\sqrt{18}")
    assert answers_match("(x+1)^2", "x^2+2x+1")
    assert not answers_match("3\\sqrt{2}", "\\sqrt{19}")
    assert not answers_match("\\frac{1}{2}", "0.51")


def test_without_math_verify_the_fallback_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(math_tasks, "_math_verify_functions", None)  # as if it were not installed
    assert not math_tasks.math_verify_usable()
    assert answers_match("\\frac{1}{2}", "0.5") and not answers_match("3\\sqrt{2}", "\\sqrt{18}")


# ---- MATH task --------------------------------------------------------------------------------------------------
def test_math_task_rows_prompts_and_scores(math_task: MATH) -> None:
    train, test = math_task.examples("train"), math_task.examples("test")
    # olympiads (no box) and gsm8k rows are not in the default sources; row 3's last box is 1/2
    assert sorted(ex["row"] for ex in train) == [0, 1, 3, 5, 6, 7]
    assert {ex["row"]: ex["answer"] for ex in train}[3] == "\\frac{1}{2}"
    assert [ex["answer"] for ex in test][:2] == ["\\frac{1}{2}", "10"]
    assert math_task.examples("val") == test[:4]
    messages = math_task.student_messages(test[1])
    assert messages == [{"role": "system", "content": MATH_SYSTEM}, {"role": "user", "content": "Compute $4+6$."}]
    for example in train + test:
        assert math_task.score(example, math_task.reference_completion(example)) == 1.0
        assert math_task.score(example, "I think it is \\boxed{12345}.") == 0.0
        assert math_task.score(example, f"{example['answer']} with no box") == 0.0
    half = test[0]
    assert math_task.score(half, "It is \\boxed{0.5}") == 1.0
    assert math_task.score(half, "\\boxed{0.5} no wait \\boxed{0.25}") == 0.0
    assert len(MATH(train_source=NUMINA, eval_source=MATH500, num_train=2).examples("train")) == 2
    assert len(MATH(train_source=NUMINA, eval_source=MATH500, sources=None, unmatched="skip").examples("train")) == 7


def test_math_solution_without_box_names_file_and_row(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"numina\.jsonl row 2: field 'solution' has no \\boxed"):
        MATH(train_source=NUMINA, eval_source=MATH500, sources=None).examples("train")
    rows = fixture_rows(MATH500)
    del rows[4]["answer"]
    path = write_rows(tmp_path / "m500.jsonl", rows)
    with pytest.raises(ValueError, match=r"m500\.jsonl row 4: missing field 'answer'"):
        MATH(train_source=NUMINA, eval_source=path).examples("test")


# ---- GSM8K -----------------------------------------------------------------------------------------------------
def test_gsm8k_reference_numbers() -> None:
    assert gsm8k_reference("48+24 = <<48+24=72>>72\n#### 72") == "72"
    assert gsm8k_reference("#### 1,200") == "1200"
    assert gsm8k_reference("#### $-2.5.") == "-2.5"
    assert gsm8k_reference("no marker 72") is None
    assert gsm8k_reference("#### seventy") is None


@pytest.mark.parametrize(
    "completion, value",
    [
        ("<answer>72</answer>", 72),
        ("<answer> $1,234. </answer>", 1234),
        ("<answer>72.0</answer>", 72),
        ("first <answer>1</answer> then <answer>The total is 5 + 3 = 8</answer>", 8),
        ("So the answer is \\boxed{72.50}. Check: 3", Fraction(145, 2)),
        ("The balance is -2.5 dollars.", Fraction(-5, 2)),
        ("She has 3 apples, then 4, so 7.", 7),
        ("<answer>seventy-two</answer> 72", None),
        ("no digits at all", None),
        ("<answer>" + "9" * 41 + "</answer>", None),
        # last_number's sign and comma rules: U+2212 is a minus; a comma only separates groups of exactly three
        ("<answer>\u221272</answer>", -72),
        ("<answer>\u2212$3.50</answer>", Fraction(-7, 2)),
        ("so 5\u22123 is 2, and 3\u22125", -5),  # as 3-5 reads: the sign touching the digits
        ("<answer>1,2</answer>", None),
        ("<answer>1234,567</answer>", None),
        ("<answer>1,234,56</answer>", None),
        ("<answer>12,345,678.5</answer>", Fraction(24691357, 2)),
        ("<answer>1,000.</answer>", 1000),
        ("the points (1,2) and 3, then 7,", 7),
    ],
)
def test_final_number(completion: str, value: Fraction | int | None) -> None:
    assert final_number(completion) == value


def test_gsm8k_task_rows_prompts_and_scores(gsm8k: GSM8K) -> None:
    test = gsm8k.examples("test")
    assert [ex["answer"] for ex in test] == ["72", "360", "1200", "-2.5", "7", "60"]
    assert gsm8k.examples("val") == test[:3]
    assert len({ex["id"] for ex in gsm8k.examples("train")}) == 6
    user = gsm8k.student_messages(test[0])[-1]["content"]
    assert user.endswith(
        "\n\nA baker makes 48 rolls in the morning and half as many in the afternoon. How many rolls does he make in all?"
    )
    assert "<answer>...</answer>" in user
    first = test[0]
    assert "<<" not in gsm8k.reference_completion(first)
    for example in test:
        assert gsm8k.score(example, gsm8k.reference_completion(example)) == 1.0
    assert gsm8k.score(first, answer("72.0")) == 1.0
    assert gsm8k.score(first, answer("$72")) == 1.0
    assert gsm8k.score(first, answer("73")) == 0.0
    assert gsm8k.score(test[2], answer("1,200")) == 1.0
    assert gsm8k.score(test[3], "so she owes money: -2.50") == 1.0
    assert gsm8k.score(test[3], "so she owes money: 2.5") == 0.0
    assert gsm8k.score(test[3], answer("\u22122.5")) == 1.0  # U+2212 minus
    assert gsm8k.score(test[2], answer("1,2,00")) == 0.0  # not groups of three: no number, not 1200


def test_gsm8k_row_without_marker_names_file_and_row(tmp_path: Path) -> None:
    rows = fixture_rows(GSM8K_FILE)
    rows[1]["answer"] = "It is 360."
    path = write_rows(tmp_path / "g.jsonl", rows)
    with pytest.raises(ValueError, match=r"g\.jsonl row 1: field 'answer' has no '#### <number>' line"):
        GSM8K(source=path).examples("test")


# ---- hostile completions -------------------------------------------------------------------------------------------
HOSTILE = [
    "",
    "x" * 1_000_000,
    bytes(random.Random(0).randrange(256) for _ in range(20_000)).decode("latin-1"),
    "{" * 10_000 + "}" * 10_000,
    "\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}",
    "\\boxed{" * 10_000,
    "\\boxed{" + "x" * 100_000,
    "<answer>" * 10_000 + "A" + "</answer>" * 10_000,
    "<answer>" + "9" * 100_000 + "</answer>",
    "\\boxed{" + "\\frac{" * 200 + "1" + "}{2}" * 200 + "}",
    "1," * 100_000,
    "\\boxed{\\sqrt{\\sqrt{" + "(" * 500 + "}}}",
    "\x00\ud800<answer>\x00</answer>",
]


@pytest.fixture(scope="module")
def all_tasks(science, medreason, math_task, gsm8k):
    verified = MATH(train_source=NUMINA, eval_source=MATH500, use_math_verify=True)
    return [
        (science, science.examples("test")[0]),
        (medreason, medreason.examples("test")[0]),
        (math_task, math_task.examples("test")[0]),
        (verified, verified.examples("test")[2]),
        (gsm8k, gsm8k.examples("test")[0]),
    ]


def test_scores_never_raise_on_hostile_completions(all_tasks) -> None:
    for task, example in all_tasks:
        for completion in HOSTILE + [None, b"<answer>A</answer>", 5]:
            assert task.score(example, completion) == 0.0, (type(task).__name__, repr(completion)[:40])
        assert task.score({"id": "empty"}, "<answer>A</answer> \\boxed{1} 1") == 0.0


TOKENS = [
    "<answer>",
    "</answer>",
    "<think>",
    "\\boxed{",
    "\\fbox{",
    "{",
    "}",
    "\\",
    "\\frac",
    "\\sqrt",
    "\\text{",
    "$",
    "-",
    ".",
    ",",
    "=",
    "^",
    "A",
    "B",
    "(",
    ")",
    "0",
    "1",
    "2",
    "72",
    " ",
    "\n",
    "\\left(",
    "\\right)",
]
completions = st.one_of(st.text(max_size=200), st.lists(st.sampled_from(TOKENS), max_size=40).map("".join))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(completion=completions)
def test_property_scores_are_zero_or_one_and_never_raise(all_tasks, completion: str) -> None:
    for task, example in all_tasks:
        assert task.score(example, completion) in (0.0, 1.0)
