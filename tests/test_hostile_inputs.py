"""Every verifier scores any string without raising and without evaluating it as code.

The default run throws 300 generated strings at each verifier; ``-m slow`` throws 10,000 at each.
Strings mix arbitrary text with fragments that look like answers, so the parsers' deep paths are hit.
Some fragments call a sentinel installed as a Python builtin: a verifier that evaluated its input
(``eval``, ``exec``, ``sympify``) would call it, and every check asserts it was never touched.
"""

import builtins
import contextlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kdlab.tasks.countdown import verify
from kdlab.tasks.math import MAX_ANSWER_CHARS, answers_match, final_number, last_boxed, math_verify_usable, too_costly
from kdlab.tasks.multiple_choice import read_letter

SENTINEL_CODE = ["kdlab_sentinel()", "__import__('builtins').kdlab_sentinel()", "(lambda: kdlab_sentinel())()", "kdlab_sentinel.touch"]
FRAGMENTS = ["<answer>", "</answer>", "\\boxed{", "}", "{", "(", ")", "=", ",", "+", "-", "*", "/", "**", "2", "75", "9" * 30,
             "####", "$", "\\frac{1}{2}", "A", "(B)", "C.", "__import__('os').system('true')", "\x00", "é", "\n", *SENTINEL_CODE]
hostile_text = st.one_of(st.text(), st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=3), max_size=60).map("".join))

VERIFIERS = {
    "countdown_chain": lambda text: verify([2, 3, 4, 75], 20, text),
    "countdown_expression": lambda text: verify([2, 3, 4, 75], 20, text, answer_format="expression"),
    "multiple_choice": lambda text: read_letter(text),
    "boxed": lambda text: (last_boxed(text), answers_match("\\frac{1}{2}", text, use_math_verify=False)),
    "boxed_math_verify": lambda text: answers_match("\\frac{1}{2}", last_boxed(text) or text[:MAX_ANSWER_CHARS], use_math_verify=True),
    "gsm8k_number": lambda text: final_number(text),
}


class Sentinel:
    """Records every call and attribute read made while it is armed (inside ``recording()``): visible proof
    that the code under test evaluated a verifier's input. Reads outside that window (pytest's or hypothesis'
    own probing of builtins, e.g. ``_mock_name``) are not the verifier's and are not recorded."""

    def __init__(self) -> None:
        self.touched: list[str] = []
        self.armed = False

    @contextlib.contextmanager
    def recording(self):
        """Arm the sentinel for the block and yield the list of what it saw there; it is disarmed and
        emptied afterwards whatever the block's outcome, so one test's record never reaches the next."""
        self.touched, self.armed = [], True
        seen = self.touched
        try:
            yield seen
        finally:
            self.touched, self.armed = [], False

    def __call__(self, *args, **kwargs):
        if self.armed:
            self.touched.append("call")
        return 0

    def __getattr__(self, name):
        if name.startswith("__"):  # Python's own probing (e.g. __test__), never an evaluation
            raise AttributeError(name)
        if self.armed:
            self.touched.append(name)
        return self


SENTINEL = Sentinel()


@pytest.fixture(autouse=True, scope="module")
def sentinel_builtin():
    builtins.kdlab_sentinel = SENTINEL  # reachable by name from any eval/exec with default builtins
    yield SENTINEL
    del builtins.kdlab_sentinel


def check(name, text):
    with SENTINEL.recording() as touched:
        VERIFIERS[name](text)  # must return, whatever the text
        seen = list(touched)
    assert seen == [], f"{name} evaluated {text!r}"


def test_the_sentinel_shows_an_evaluation():
    with SENTINEL.recording() as touched:
        for code in SENTINEL_CODE:
            eval(code)  # what a verifier that evaluated its input would do
        seen = list(touched)
    assert seen == ["call", "call", "call", "touch"]


def test_the_sentinel_ignores_reads_outside_a_check_and_resets_after_a_failure():
    SENTINEL._mock_name  # what a test framework's probing of builtins looks like: not recorded
    assert SENTINEL.touched == []
    with pytest.raises(AssertionError):
        with SENTINEL.recording():
            SENTINEL()
            raise AssertionError("a failing check")
    assert SENTINEL.touched == [] and not SENTINEL.armed
    check("countdown_chain", "kdlab_sentinel")  # the next check starts clean


@pytest.mark.parametrize("name", VERIFIERS)
@pytest.mark.parametrize("code", SENTINEL_CODE)
def test_answers_that_are_code_are_never_evaluated(name, code):
    for text in (code, f"<answer>{code}</answer>", f"\\boxed{{{code}}}", f"#### {code}", f"The answer is {code}"):
        check(name, text)


@pytest.mark.parametrize("name", VERIFIERS)
@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=hostile_text)
def test_verifiers_never_raise(name, text):
    check(name, text)


@pytest.mark.slow
@pytest.mark.parametrize("name", VERIFIERS)
@settings(max_examples=10_000, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=hostile_text)
def test_verifiers_never_raise_10k(name, text):
    check(name, text)


@pytest.mark.parametrize("name", VERIFIERS)
@pytest.mark.parametrize(
    "text",
    ["2**2**2**2**2", "<answer>2**2**2**2**2</answer>", "(" * 10_000 + "1" + ")" * 10_000, "x" * 1_000_000,
     "\\boxed{" * 10_000, "<answer>" + "9" * 100_000 + "</answer>", "#### " + "9" * 100_000],
    ids=["power-tower", "power-tower-tagged", "deep-nesting", "1MB", "unclosed-boxes", "huge-number", "huge-gsm8k"],
)
def test_known_hostile_strings(name, text):
    check(name, text)


COSTLY_ANSWERS = {  # issue #41: about a second each of math_verify's alarm on kdlab before the pre-check
    "power-tower": "9^{9^{9}}", "power-tower-10": "10^{10^{10}}", "factorial-of-a-power": "(10^{100000})!",
    "million-digits": "9" * 1_000_000, "nested-braces": "{" * 10_000 + "1" + "}" * 10_000, "redundant-braces": "{{{{{1}}}}}",
    "huge-factorial": "99999999999!", "factorials": "9!!!!!", "huge-exponent": "2^{99999999}", "binomial": "\\binom{10^{9}}{10^{5}}",
    "exp-tower": "e^{10^{10}}", "nested-roots": "\\sqrt{" * 30 + "2" + "}" * 30,
}


@pytest.mark.parametrize("answer", list(COSTLY_ANSWERS.values()), ids=list(COSTLY_ANSWERS))
def test_answers_that_would_cost_math_verify_its_alarm_score_in_under_50_ms_with_it_on(answer):
    """Each is scored 0 in under 50 ms with math_verify on (the pre-check too_costly stops it), where
    math_verify spent about a second on it; a plain answer still reaches math_verify and matches."""
    import time

    assert math_verify_usable()
    assert answers_match("\\frac{1}{2}", "\\frac{2}{4}+0", use_math_verify=True)  # math_verify decides (and is warm)
    started = time.perf_counter()
    scored = answers_match("\\frac{1}{2}", last_boxed(f"\\boxed{{{answer}}}", MAX_ANSWER_CHARS) or "", use_math_verify=True)  # as MATH.score
    elapsed = time.perf_counter() - started
    assert scored is False and elapsed < 0.05, elapsed
    assert len(answer) > MAX_ANSWER_CHARS or too_costly(answer) is not None
    assert last_boxed(f"\\boxed{{{answer}}}") == answer  # without the limit, the whole box is still read


def test_the_pre_check_lets_every_fixture_answer_through():
    """No reference answer of the MATH-500 and Numina fixtures is stopped by too_costly."""
    import json
    from pathlib import Path

    root = Path(__file__).parent / "fixtures"
    answers = [json.loads(line).get("answer") or last_boxed(json.loads(line)["solution"])
               for name in ("math500.jsonl", "numina.jsonl") for line in (root / name).read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(answers) >= 10 and [answer for answer in answers if answer and too_costly(answer)] == []
