"""Maths with real data: MATH (Numina-MATH training rows, MATH-500 evaluation) and GSM8K.

Answers are model output, so nothing here evaluates them as code: answers are cut out of the text by
linear scans with explicit caps (:data:`MAX_ANSWER_CHARS`, :data:`MAX_NUMBER_DIGITS`), compared as
normalised strings or exact :class:`fractions.Fraction` values, and only then, for MATH, handed to
``math_verify`` (a LaTeX-to-SymPy checker) when it is installed.

``math_verify`` bounds each parse and comparison with ``signal.alarm``, which works only in the main
thread of a POSIX process; elsewhere (a DataLoader worker thread, Windows) and when it is not
installed, MATH answers are compared by :func:`normalise_answer` and :func:`as_fraction` alone. The
fallback is deliberately conservative: it accepts only rewritings of form (spacing,
``\\left``/``\\right``, ``\\dfrac``, degrees, ``x=``, a trailing unit in ``\\text{}``, which it ignores
whatever the unit) and equal plain numbers (``0.5`` and ``\\frac{1}{2}``), and rejects everything
else, so it undercounts correct answers written in other forms (``\\sqrt{18}`` for ``3\\sqrt{2}``).
"""

from __future__ import annotations

import os
import re
import threading
from fractions import Fraction
from typing import Any

from kdlab.tasks.answer_cost import MAX_BRACE_DEPTH, MAX_EXPONENT_DIGITS, too_costly  # noqa: F401 - MAX_BRACE_DEPTH: a kdlab 0.1 name
from kdlab.tasks.base import Example, Task, last_tagged
from kdlab.tasks.sources import UnresolvedAnswer, hashed_order, load_rows, require_fields

MATH_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
GSM8K_SYSTEM_PROMPT = "You are a careful solver of math word problems."
GSM8K_INSTRUCTION = (
    "Solve the math word problem. Reason step by step in <think>...</think> tags and place only the final "
    "number in <answer>...</answer> tags."
)

MAX_ANSWER_CHARS = 1_000
"""Longer extracted answers score 0 without being normalised or parsed."""
MAX_NUMBER_DIGITS = 40
"""Longest digit string read as a number (keeps Fraction arithmetic cheap)."""
VERIFY_TIMEOUT_S = 1
"""math_verify's per-parse and per-comparison alarm, in whole seconds."""

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_BRACE_TOKENS = re.compile(r"[\\{}]")  # a backslash (escaping the next character: \{, \}) or a brace


# ---- extraction -----------------------------------------------------------------------------------------------
def last_boxed(text: Any, limit: int | None = None) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced.

    The last occurrence of the command decides: if its braces never close, the answer is ``None``
    (an earlier complete box does not count). ``\\{`` and ``\\}`` are literal braces and do not
    count towards the balance. ``\\boxed 5`` (a space, then one token) gives ``"5"``. Linear time:
    one ``rfind`` per command and one forward scan (a regular expression over the braces and escapes, so a
    million digits take milliseconds); non-``str`` input gives ``None``. ``limit``: a box whose content
    is longer than this many characters gives ``None`` too, found without reading past it.
    """
    if not isinstance(text, str):
        return None
    start, command = max((text.rfind(command), command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    n, i = len(text), start + len(command)
    j = i
    while j < n and text[j] == " ":
        j += 1
    if j < n and text[j] == "{":
        depth = escaped = 0
        for match in _BRACE_TOKENS.finditer(text, j, n if limit is None else min(n, j + limit + 2)):  # braces and backslashes only
            at, token = match.start(), match.group()
            if at < escaped:  # the character after a backslash (\{ or \}): literal
                continue
            if token == "\\":
                escaped = at + 2
            elif token == "{":
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    return text[j + 1 : at]
        return None
    if j > i:  # "\boxed 5": one whitespace-delimited token
        end = j
        while end < n and not text[end].isspace() and text[end] != "$":
            end += 1
        return text[j:end] or None
    return None


_NUMBER = re.compile(r"(-?)\$?(\d[\d,]*(?:\.\d+)?|\.\d+)")


def last_number(text: Any) -> Fraction | None:
    """The last number written in ``text`` as an exact Fraction, or ``None``.

    A number is an optional ``-``, an optional ``$``, then digits with optional commas (removed:
    ``1,234`` is 1234) and an optional decimal part; a trailing period is punctuation. Numbers
    with more than :data:`MAX_NUMBER_DIGITS` digits give ``None``. Linear time (one regex scan with
    no nested repetition).
    """
    if not isinstance(text, str):
        return None
    match = None
    for match in _NUMBER.finditer(text):
        pass
    if match is None:
        return None
    digits = match.group(2).replace(",", "")
    if sum(char.isdigit() for char in digits) > MAX_NUMBER_DIGITS:
        return None
    value = Fraction(digits)
    return -value if match.group(1) else value


# ---- comparison ---------------------------------------------------------------------------------------------
_SPACING = re.compile(r"\\[!,;:> ]|\\q?quad\b|~")
_LEFT_RIGHT = re.compile(r"\\(?:left|right|big|Big|bigg|Bigg)(?![a-zA-Z])")
_DEGREES = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|°")
_TEXT = re.compile(r"\\(?:text|textbf|textrm|mbox|mathrm)\s*\{([^{}]*)\}")
_FRAC_DIGITS = re.compile(r"\\frac(\d)(\d)")
_FRAC_DIGIT_DENOMINATOR = re.compile(r"\\frac(\{[^{}]*\})(\d)")
_SQRT_TOKEN = re.compile(r"\\sqrt([0-9a-zA-Z])")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_ASSIGNMENT = re.compile(r"[a-zA-Z]=(.+)")
_PLAIN_NUMBER = re.compile(r"(-?)(\d+(?:\.\d*)?|\.\d+)")
_SLASH_FRACTION = re.compile(r"(-?)(\d+)/(\d+)")
_LATEX_FRACTION = re.compile(r"(-?)\\frac\{(-?)(\d+(?:\.\d+)?)\}\{(-?)(\d+(?:\.\d+)?)\}")


def normalise_answer(text: str) -> str:
    """A canonical string for a MATH answer; equal strings mean equal answers. Steps, in order:

    drop ``$``, ``\\displaystyle``, spacing commands (``\\!``, ``\\,``, ``\\;``, ``\\:``, ``\\ ``,
    ``\\quad``, ``~``), ``\\left``/``\\right`` (and ``\\big`` sizes), degrees (``^\\circ``,
    ``^{\\circ}``, ``°``) and percent signs (``\\%``, ``%``); ``\\dfrac``/``\\tfrac`` -> ``\\frac``;
    a trailing ``\\text{...}`` (or ``\\mbox``, ``\\mathrm``, ``\\textbf``) after other content is a
    unit and is dropped (``5\\text{ cm}`` -> ``5``), any other such group is replaced by its content
    (``\\text{(A)}`` -> ``(A)``); all whitespace removed; a trailing period removed;
    ``\\frac12`` -> ``\\frac{1}{2}``, ``\\sqrt2`` -> ``\\sqrt{2}``; thousands separators removed
    (``1,000`` -> ``1000``, only for strict groups of three digits); a leading single-letter
    assignment dropped (``x=5`` -> ``5``). Case is kept (variables are case-sensitive).
    """
    s = text.replace("$", "").replace("\\displaystyle", "")
    s = _SPACING.sub(" ", s)
    s = _LEFT_RIGHT.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _DEGREES.sub("", s).replace("\\%", "").replace("%", "")
    s = s.strip()
    while True:  # peel trailing unit groups: "5\text{ m}\text{/s}" -> "5"
        units = list(_TEXT.finditer(s))
        if not units or units[-1].end() != len(s) or units[-1].start() == 0:
            break
        s = s[: units[-1].start()].rstrip()
    s = _TEXT.sub(lambda m: m.group(1), s)
    s = "".join(s.split())
    s = s.rstrip(".")
    s = _FRAC_DIGITS.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_DIGIT_DENOMINATOR.sub(r"\\frac\1{\2}", s)
    s = _SQRT_TOKEN.sub(r"\\sqrt{\1}", s)
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    assignment = _ASSIGNMENT.fullmatch(s)
    if assignment is not None:
        s = assignment.group(1)
    return s


def as_fraction(text: str) -> Fraction | None:
    """The exact value of a normalised plain number, or ``None`` when ``text`` is anything else.

    Plain numbers: ``3``, ``-0.25``, ``.5``, ``3/4``, ``\\frac{3}{4}``, ``-\\frac{3}{4}``,
    ``\\frac{-3}{4}`` (at most :data:`MAX_NUMBER_DIGITS` digits); a zero denominator gives ``None``.
    """
    if len(text) > 2 * MAX_NUMBER_DIGITS + 16 or sum(c.isdigit() for c in text) > MAX_NUMBER_DIGITS:
        return None
    plain = _PLAIN_NUMBER.fullmatch(text)
    if plain is not None:
        value = Fraction(plain.group(2))
        return -value if plain.group(1) else value
    slash = _SLASH_FRACTION.fullmatch(text)
    if slash is not None:
        sign, numerator, denominator = slash.group(1), Fraction(slash.group(2)), Fraction(slash.group(3))
    else:
        latex = _LATEX_FRACTION.fullmatch(text)
        if latex is None:
            return None
        numerator, denominator = Fraction(latex.group(3)), Fraction(latex.group(5))
        negatives = (latex.group(1), latex.group(2), latex.group(4)).count("-")
        sign = "-" if negatives % 2 else ""
    if denominator == 0:
        return None
    value = numerator / denominator
    return -value if sign else value


_math_verify_functions: tuple[Any, Any] | None | bool = False  # False: not looked up yet


def _math_verify() -> tuple[Any, Any] | None:
    """``(parse, verify)`` from math_verify, or ``None`` when it is not installed (looked up once)."""
    global _math_verify_functions
    if _math_verify_functions is False:
        try:
            from math_verify import parse, verify
        except Exception:  # noqa: BLE001 - ImportError, or a broken install of its SymPy/ANTLR dependencies
            _math_verify_functions = None
        else:
            _math_verify_functions = (parse, verify)
    return _math_verify_functions  # type: ignore[return-value]


def math_verify_usable() -> bool:
    """Whether math_verify is installed and its alarm-based timeouts work here (main thread, POSIX)."""
    return os.name == "posix" and threading.current_thread() is threading.main_thread() and _math_verify() is not None


def answers_match(reference: str, answer: str, use_math_verify: bool = True) -> bool:
    """Whether ``answer`` (e.g. the content of a model's last ``\\boxed{}``) equals ``reference``.

    Equal :func:`normalise_answer` strings match; two plain numbers (:func:`as_fraction`) match
    exactly when their values are equal, and never go further. Otherwise, when ``use_math_verify``
    is true and :func:`math_verify_usable`, ``math_verify.verify(parse(reference), parse(answer))``
    decides, each step under a :data:`VERIFY_TIMEOUT_S` alarm, for answers up to
    :data:`MAX_ANSWER_CHARS` characters that :func:`too_costly` lets through (an answer it stops, such as
    a power tower, scores 0 at once instead of costing math_verify its alarm). Never raises.
    """
    if not isinstance(reference, str) or not isinstance(answer, str) or len(answer) > MAX_ANSWER_CHARS:
        return False
    gold, guess = normalise_answer(reference), normalise_answer(answer)
    if not guess:
        return False
    if gold == guess:
        return True
    gold_value, guess_value = as_fraction(gold), as_fraction(guess)
    if gold_value is not None and guess_value is not None:
        return gold_value == guess_value
    if not use_math_verify or not math_verify_usable() or too_costly(answer) is not None:
        return False
    parse, verify = _math_verify()  # type: ignore[misc]
    try:
        gold_parsed = parse(f"\\boxed{{{reference}}}", parsing_timeout=VERIFY_TIMEOUT_S)
        guess_parsed = parse(f"\\boxed{{{answer}}}", parsing_timeout=VERIFY_TIMEOUT_S)
        if not gold_parsed or not guess_parsed:
            return False
        return bool(verify(gold_parsed, guess_parsed, timeout_seconds=VERIFY_TIMEOUT_S))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # noqa: BLE001 - anything SymPy throws; math_verify's TimeoutException is a BaseException
        return False


# ---- MATH ------------------------------------------------------------------------------------------------
class MATH(Task):
    """Competition maths with boxed answers: Numina-MATH to train, MATH-500 to evaluate.

    Training rows (``AI-MO/NuminaMath-CoT``, split ``train``): ``source`` (``"math"`` for MATH train,
    ``"synthetic_math"``, ``"olympiads"``, ...), ``problem``, ``solution`` (worked solution ending in
    ``\\boxed{...}``), ``messages`` (ignored). Rows whose ``source`` is in ``sources`` are kept, their
    reference answer is the last ``\\boxed{}`` of ``solution``, and ``num_train`` of them are drawn
    in :func:`~kdlab.tasks.sources.hashed_order` of ``problem`` (the paper's 20k mix of MATH train
    and ``synthetic_math`` is not published; this is kdlab's rule).

    Evaluation rows (``HuggingFaceH4/MATH-500``, split ``test``): ``problem``, ``answer`` (the reference),
    ``solution``, ``subject``, ``level``, ``unique_id`` (the last four optional here). ``val`` is the
    first ``num_val`` of them.

    Example fields: ``id`` (``"math-train-<row>"`` / ``"math-test-<row>"``), ``problem``, ``answer``,
    ``solution`` (``""`` when absent), ``row``. The user prompt is the problem alone; the system
    prompt is the paper's. A completion scores 1 when the content of its last ``\\boxed{}``
    :func:`answers_match` the reference.

    Args:
        train_source / train_config / train_split / train_revision: where training rows come from.
        sources: values of the ``source`` column to keep (``None``: keep all, ``source`` not needed).
        num_train: training rows drawn (``None``: all that are kept).
        eval_source / eval_config / eval_split / eval_revision: where evaluation rows come from.
        seed: seed of the hashed draw of training rows.
        num_val: ``val`` is the first ``num_val`` evaluation rows.
        unmatched: a training solution without ``\\boxed{}``: ``"error"`` raises, naming source and
            row; ``"skip"`` drops the row.
        use_math_verify: compare with math_verify when it is usable (see :func:`answers_match`);
            ``False`` keeps the deterministic fallback only.
        **prompting: the prompting settings of :class:`~kdlab.tasks.base.Task`.
    """

    default_system_prompt = MATH_SYSTEM_PROMPT

    def __init__(
        self,
        train_source: str = "AI-MO/NuminaMath-CoT",
        train_config: str | None = None,
        train_split: str = "train",
        train_revision: str | None = None,
        sources: tuple[str, ...] | None = ("math", "synthetic_math"),
        num_train: int | None = 20_000,
        eval_source: str = "HuggingFaceH4/MATH-500",
        eval_config: str | None = None,
        eval_split: str = "test",
        eval_revision: str | None = None,
        seed: int = 42,
        num_val: int = 200,
        unmatched: str = "error",
        use_math_verify: bool = True,
        **prompting: Any,
    ) -> None:
        super().__init__(**prompting)
        if num_train is not None and num_train < 0:
            raise ValueError(f"MATH.num_train must be >= 0 or None, got {num_train}")
        if num_val < 0:
            raise ValueError(f"MATH.num_val must be >= 0, got {num_val}")
        if unmatched not in ("error", "skip"):
            raise ValueError(f"MATH.unmatched must be one of ('error', 'skip'), got {unmatched!r}")
        self.train_from = (train_source, train_split, train_config, train_revision)
        self.eval_from = (eval_source, eval_split, eval_config, eval_revision)
        self.sources = None if sources is None else tuple(sources)
        self.num_train, self.seed, self.num_val = num_train, seed, num_val
        self.unmatched, self.use_math_verify = unmatched, use_math_verify

    def _train_rows(self) -> list[Example]:
        source, split, config, revision = self.train_from
        rows = list(enumerate(load_rows(source, split, config=config, revision=revision)))
        if self.sources is not None:
            require_fields(source, rows, ("source",))
            rows = [(index, row) for index, row in rows if row["source"] in self.sources]
        require_fields(source, rows, ("problem", "solution"))
        examples = []
        for index, row in rows:
            answer = last_boxed(row["solution"])
            if answer is None or not answer.strip():
                if self.unmatched == "skip":
                    continue
                raise UnresolvedAnswer(f"{source} row {index}: field 'solution' has no \\boxed{{}} answer")
            examples.append(
                {
                    "id": f"math-train-{index}",
                    "problem": row["problem"],
                    "answer": answer.strip(),
                    "solution": row["solution"],
                    "row": index,
                }
            )
        order = hashed_order([example["problem"] for example in examples], self.seed)
        if self.num_train is not None:
            order = order[: self.num_train]
        return [examples[i] for i in order]

    def _eval_rows(self) -> list[Example]:
        source, split, config, revision = self.eval_from
        rows = list(enumerate(load_rows(source, split, config=config, revision=revision)))
        require_fields(source, rows, ("problem", "answer"))
        return [
            {
                "id": f"math-test-{index}",
                "problem": row["problem"],
                "answer": str(row["answer"]).strip(),
                "solution": row.get("solution") or "",
                "row": index,
            }
            for index, row in rows
        ]

    def load_split(self, split: str) -> list[Example]:
        if split == "train":
            return self._train_rows()
        rows = self.examples("test") if split == "val" else self._eval_rows()
        return rows[: self.num_val] if split == "val" else rows

    def user_prompt(self, example: Example) -> str:
        return example["problem"]

    def well_formed(self, completion: str) -> bool:
        return last_boxed(completion) is not None

    def score(self, example: Example, completion: str) -> float:
        answer = last_boxed(completion, MAX_ANSWER_CHARS)
        reference = example.get("answer")
        if answer is None or not isinstance(reference, str):
            return 0.0
        return float(answers_match(reference, answer, self.use_math_verify))

    def reference_completion(self, example: Example) -> str:
        """The row's worked solution when it ends in a box, else a one-line boxed answer."""
        solution = example.get("solution") or ""
        if last_boxed(solution) is not None:
            return solution
        return f"The final answer is $\\boxed{{{example['answer']}}}$."


# ---- GSM8K ----------------------------------------------------------------------------------------------
_CALCULATOR = re.compile(r"<<[^<>]*>>")


def gsm8k_reference(answer: str) -> str | None:
    """The number after the last ``####`` of a GSM8K ``answer``, commas, ``$`` and a trailing period
    removed (``"#### 1,200"`` -> ``"1200"``), or ``None`` when there is no such plain number."""
    marker = answer.rfind("####")
    if marker < 0:
        return None
    text = answer[marker + 4 :].strip().replace(",", "").replace("$", "").rstrip(".")
    plain = _PLAIN_NUMBER.fullmatch(text) is not None
    return text if plain and as_fraction(text) is not None else None


def final_number(completion: Any) -> Fraction | None:
    """The model's final number: from the last ``<answer>`` if there is one, else from the last
    ``\\boxed{}``, else from the whole text; in each case the last number of that part
    (:func:`last_number`). An ``<answer>`` without a number gives ``None`` (no fall-through)."""
    if not isinstance(completion, str):
        return None
    part = last_tagged(completion)
    if part is None:
        part = last_boxed(completion)
    if part is None:
        part = completion
    return last_number(part)


class GSM8K(Task):
    """Grade-school maths word problems (``openai/gsm8k``, config ``main``).

    Source columns: ``question``, ``answer`` (a worked solution with ``<<48/2=24>>`` calculator notes,
    ending in ``#### 72``). The reference is the number after ``####`` with commas removed; a row
    without one raises a ValueError naming source and row. Splits: ``train`` and ``test`` are the
    source splits ``train_split`` / ``eval_split``; ``val`` is the first ``num_val`` of ``test``.

    The paper uses GSM8K test only in its style-transfer evaluation and gives no prompt for it; the
    prompt here (:data:`GSM8K_SYSTEM_PROMPT`, :data:`GSM8K_INSTRUCTION`, a blank line, the question)
    follows the other tasks' ``<think>``/``<answer>`` format. Scoring reads :func:`final_number` and
    compares exact values (``72.0`` equals ``72``; ``$1,234.`` reads as 1234).

    Example fields: ``id`` (``"gsm8k-<split>-<row>"``), ``question``, ``answer`` (the reference as
    text, e.g. ``"72"``), ``solution`` (the worked text without calculator notes), ``row``.
    """

    default_system_prompt = GSM8K_SYSTEM_PROMPT

    def __init__(
        self,
        source: str = "openai/gsm8k",
        config: str | None = "main",
        revision: str | None = None,
        train_split: str = "train",
        eval_split: str = "test",
        num_val: int = 200,
        **prompting: Any,
    ) -> None:
        super().__init__(**prompting)
        if num_val < 0:
            raise ValueError(f"GSM8K.num_val must be >= 0, got {num_val}")
        self.source, self.config, self.revision = source, config, revision
        self.train_split, self.eval_split, self.num_val = train_split, eval_split, num_val

    def _rows(self, split: str) -> list[Example]:
        source_split = self.train_split if split == "train" else self.eval_split
        rows = list(enumerate(load_rows(self.source, source_split, config=self.config, revision=self.revision)))
        require_fields(self.source, rows, ("question", "answer"))
        examples = []
        for index, row in rows:
            text = str(row["answer"])
            reference = gsm8k_reference(text)
            if reference is None:
                raise UnresolvedAnswer(f"{self.source} row {index}: field 'answer' has no '#### <number>' line")
            solution = _CALCULATOR.sub("", text[: text.rfind("####")]).strip()
            examples.append(
                {
                    "id": f"gsm8k-{split}-{index}",
                    "question": str(row["question"]).strip(),
                    "answer": reference,
                    "solution": solution,
                    "row": index,
                }
            )
        return examples

    def load_split(self, split: str) -> list[Example]:
        if split == "val":
            return self.examples("test")[: self.num_val]
        return self._rows(split)

    def user_prompt(self, example: Example) -> str:
        return f"{GSM8K_INSTRUCTION}\n\n{example['question']}"

    def score(self, example: Example, completion: str) -> float:
        reference = example.get("answer")
        guess = final_number(completion)
        if guess is None or not isinstance(reference, str):
            return 0.0
        value = as_fraction(reference)
        return float(value is not None and value == guess)

    def reference_completion(self, example: Example) -> str:
        return f"<think>{example['solution']}</think>\n<answer>{example['answer']}</answer>"
