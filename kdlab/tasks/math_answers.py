"""Answers of maths tasks read out of model output, and compared: nothing here evaluates them as code. Answers are
cut out of the text by linear scans with explicit caps (:data:`MAX_ANSWER_CHARS`, :data:`MAX_NUMBER_DIGITS`),
compared as normalised strings or exact :class:`fractions.Fraction` values, and only then handed to
``math_verify`` (a LaTeX-to-SymPy checker) when it is installed (:func:`answers_match`).

``math_verify`` bounds each parse and comparison with ``signal.alarm``, which works only in the main
thread of a POSIX process; elsewhere (a DataLoader worker thread, Windows) and when it is not
installed, answers are compared by :func:`normalise_answer` and :func:`as_fraction` alone. The
fallback is deliberately conservative: it accepts only rewritings of form (spacing,
``\\left``/``\\right``, ``\\dfrac``, degrees, ``x=``, a trailing unit in ``\\text{}``, which it ignores
whatever the unit) and equal plain numbers (``0.5`` and ``\\frac{1}{2}``), and rejects everything
else, so it undercounts correct answers written in other forms (``\\sqrt{18}`` for ``3\\sqrt{2}``).
The tasks that use them: :mod:`kdlab.tasks.math` (MATH, GSM8K).
"""

from __future__ import annotations

import os
import re
import threading
from fractions import Fraction
from typing import Any

from kdlab.tasks.answer_cost import too_costly

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


_NUMBER = re.compile(r"([-\u2212]?)\$?(\d+(?:,\d+)*(?:\.\d+)?|\.\d+)")
_GROUPED = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def last_number(text: Any) -> Fraction | None:
    """The last number written in ``text`` as an exact Fraction, or ``None``.

    A number is an optional minus sign (``-`` or ``−``, U+2212), an optional ``$``, then digits with
    optional commas and an optional decimal part; a trailing period or comma is punctuation. A comma is
    a thousands separator only between groups of exactly three digits after a first group of one to
    three (``1,234`` and ``12,345,678.5`` are read without it); when the last number's commas are
    anything else (``1,2``, ``1234,567``) there is no number (``None``), not the digits run together.
    Numbers with more than :data:`MAX_NUMBER_DIGITS` digits give ``None``. Linear time (one regex
    scan; each repeated comma group starts with a comma, so no two ways to match overlap).
    """
    if not isinstance(text, str):
        return None
    match = None
    for match in _NUMBER.finditer(text):
        pass
    if match is None:
        return None
    digits = match.group(2)
    if "," in digits:
        if _GROUPED.fullmatch(digits) is None:
            return None
        digits = digits.replace(",", "")
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
