"""Countdown answers read out of model output and checked: :func:`verify`, a small parser-and-simulator written
for hostile text. Completions are model output, so nothing here ever evaluates them as code (no ``eval``, no
``ast``, no computer algebra), and every loop is bounded by a length, depth or magnitude cap before it starts.
:func:`apply_step` is the arithmetic rule the generator's search (:mod:`kdlab.tasks.countdown`) shares, so every
generated target is one the verifier can accept; the rules are listed in that module's docstring.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from kdlab.tasks.base import last_tagged

ANSWER_FORMATS = ("chain", "expression")

MAX_DIGITS = 12
"""Longest number literal the verifier reads; every value, literal or computed, stays below 10**12."""
MAX_VALUE = 10**MAX_DIGITS
MAX_ANSWER_CHARS = 1_000
"""Longer ``<answer>`` contents are rejected before tokenising."""
MAX_DEPTH = 100
"""Deepest parenthesis nesting accepted in ``expression`` answers (keeps recursion bounded)."""
MAX_OPERANDS = 64
"""Longest ``nums`` the verifier accepts; :func:`~kdlab.tasks.countdown.solve` searches at most 5 operands."""

# Operator aliases: `x` and `×` mean multiplication, `÷` division (the prompt names "x"), `−` (U+2212) minus.
_SYMBOLS = {"x": "*", "×": "*", "÷": "/", "\u2212": "-"} | {char: char for char in "+-*/=,()"}
_DIGITS = frozenset("0123456789")


class _Reject(Exception):
    """Raised inside the verifier's parser for any malformed answer; :func:`verify` turns it into False."""


# ---- arithmetic shared by the generator's search and the verifier -------------------------------
def apply_step(a: int, op: str, b: int) -> int | None:
    """``a op b`` under Countdown rules, or ``None`` when the step is illegal.

    Division must be exact with a non-zero divisor; a result with 13 or more digits is illegal.
    Negative results are returned (``expression`` answers may pass through them); the chain format
    rejects them because its result literal is unsigned.
    """
    if op == "+":
        value = a + b
    elif op == "-":
        value = a - b
    elif op == "*":
        value = a * b
    else:
        if b == 0 or a % b:
            return None
        value = a // b
    return value if abs(value) < MAX_VALUE else None


# ---- verifier --------------------------------------------------------------------------------------
def is_int(value: Any) -> bool:
    """Whether ``value`` is an ``int`` (``True`` and ``False`` are not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _tokens(text: str) -> list[int | str]:
    """Numbers (as ints) and canonical symbols; whitespace separates tokens and is otherwise ignored."""
    out: list[int | str] = []
    i, n = 0, len(text)
    while i < n:
        char = text[i]
        if char in _DIGITS:  # ASCII only: str.isdigit would also accept "²" and other scripts' digits
            start = i
            while i < n and text[i] in _DIGITS:
                i += 1
            if i - start > MAX_DIGITS:
                raise _Reject
            out.append(int(text[start:i]))
            continue
        if char in _SYMBOLS:
            out.append(_SYMBOLS[char])
        elif not char.isspace():
            raise _Reject
        i += 1
    return out


def _check_chain(nums: Sequence[int], target: int, tokens: list[int | str]) -> bool:
    """Simulate ``a op b = c`` steps on a multiset pool that starts as ``nums``."""
    pool = Counter(nums)
    steps: list[list[int | str]] = [[]]
    for token in tokens:
        if token == ",":
            steps.append([])
        else:
            steps[-1].append(token)
    for step in steps:
        if len(step) != 5 or step[3] != "=":
            raise _Reject
        a, op, b, _, c = step
        if not (is_int(a) and is_int(b) and is_int(c)) or op not in ("+", "-", "*", "/"):
            raise _Reject
        pool[a] -= 1
        pool[b] -= 1
        if pool[a] < 0 or pool[b] < 0 or apply_step(a, op, b) != c:  # c is unsigned, so no negatives
            return False
        pool[c] += 1
    return +pool == Counter([target])  # unary + drops the zero counts


class _Expression:
    """Recursive-descent parser and exact evaluator for ``expr := term (('+'|'-') term)*``,
    ``term := factor (('*'|'/') factor)*``, ``factor := NUMBER | '(' expr ')'``. No unary operators."""

    def __init__(self, tokens: list[int | str]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.literals: list[int] = []

    def _peek(self) -> int | str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def parse(self) -> int:
        value = self._expr(0)
        if self.pos != len(self.tokens):
            raise _Reject
        return value

    def _binary(self, left: int, op: str, right: int) -> int:
        value = apply_step(left, op, right)
        if value is None:
            raise _Reject
        return value

    def _expr(self, depth: int) -> int:
        value = self._term(depth)
        while self._peek() in ("+", "-"):
            op = self.tokens[self.pos]
            self.pos += 1
            value = self._binary(value, op, self._term(depth))
        return value

    def _term(self, depth: int) -> int:
        value = self._factor(depth)
        while self._peek() in ("*", "/"):
            op = self.tokens[self.pos]
            self.pos += 1
            value = self._binary(value, op, self._factor(depth))
        return value

    def _factor(self, depth: int) -> int:
        token = self._peek()
        self.pos += 1
        if is_int(token):
            self.literals.append(token)
            return token
        if token != "(" or depth >= MAX_DEPTH:
            raise _Reject
        value = self._expr(depth + 1)
        if self._peek() != ")":
            raise _Reject
        self.pos += 1
        return value


def _check_expression(nums: Sequence[int], target: int, tokens: list[int | str]) -> bool:
    if tokens.count("=") > 1:
        raise _Reject
    if "=" in tokens:  # an optional "= N" after the expression, accepted when N is the value
        split = tokens.index("=")
        tokens, claimed = tokens[:split], tokens[split + 1 :]
        if len(claimed) != 1 or claimed[0] != target:
            return False
    parser = _Expression(tokens)
    value = parser.parse()
    return value == target and Counter(parser.literals) == Counter(nums)


def verify(nums: Any, target: Any, text: Any, answer_format: str = "chain") -> bool:
    """Whether the last ``<answer>...</answer>`` in ``text`` solves the Countdown problem; a final
    ``<answer>`` that is never closed (cut off) is no answer, whatever an earlier one held.

    ``chain`` answers are comma-separated steps ``a op b = c``: ``a`` and ``b`` must be in the
    current pool (a multiset that starts as ``nums``; each entry used at most once), ``c`` must be
    exactly ``a op b``, then ``a`` and ``b`` leave the pool and ``c`` joins it; correct when the pool
    ends as the single number ``target``. ``expression`` answers are one expression over ``+ - * /``
    and parentheses, e.g. ``(2+3)*4``, optionally followed by ``= 20``; the literals must be
    ``nums`` as a multiset and the value must be ``target``.

    Both formats: ``x`` and ``×`` are read as ``*``, ``÷`` as ``/``, ``−`` (U+2212) as ``-``; one
    ``.`` ending the answer (``5*4=20.``) is punctuation and ignored, a second or any other is not;
    whitespace is ignored between tokens; numbers are unsigned ASCII digit runs of at most 12 digits
    (leading zeros are read as decimal, ``007`` is 7); division must be exact with
    a non-zero divisor; every value must stay below ``10**12`` in magnitude. Answers longer than
    1,000 characters, nested deeper than 100 parentheses, ``**``, unary signs, decimals, empty
    answers, wrong argument types (``nums`` must be a list or tuple of 1 to 64 non-negative ints,
    ``target`` an int, ``text`` a str) and unknown formats all give ``False``; nothing raises.
    """
    if not isinstance(nums, (list, tuple)) or not 1 <= len(nums) <= MAX_OPERANDS or not is_int(target):
        return False
    if not all(is_int(n) and 0 <= n < MAX_VALUE for n in nums):
        return False
    if answer_format not in ANSWER_FORMATS:
        return False
    answer = last_tagged(text)  # None for non-str text
    if answer is None or len(answer) > MAX_ANSWER_CHARS:
        return False
    answer = answer.strip()
    if answer.endswith("."):  # a sentence's full stop after the final equation
        answer = answer[:-1]
    try:
        tokens = _tokens(answer)
        if not tokens:
            return False
        if answer_format == "chain":
            return _check_chain(nums, target, tokens)
        return _check_expression(nums, target, tokens)
    except _Reject:
        return False
