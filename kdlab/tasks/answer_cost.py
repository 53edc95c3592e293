"""What a model's answer would cost a LaTeX-to-SymPy checker (``math_verify``) before it is handed there:
:func:`too_costly` stops the answers that run into its alarm (about a second each: power towers, huge
exponents and factorials, deep nesting), so a model that learns to write them cannot slow every evaluation
a thousandfold. Used by :func:`kdlab.tasks.math.answers_match`; it scans, nothing is evaluated.
"""

from __future__ import annotations

import re

MAX_BRACE_DEPTH = 8
"""Answers nested deeper than this (braces, parentheses and brackets together) are not handed to math_verify:
SymPy's parse of ten nested braces alone runs into the alarm (about 1 s); MATH answers nest three or four deep."""
MAX_EXPONENT_DIGITS = 4
"""Longest digit string in an exponent, a factorial's operand (3 there) or a binomial that is handed to
math_verify: ``2^{99999999}`` costs SymPy a second, ``2^{9999}`` tens of milliseconds."""


def _brace_depth(text: str) -> int:
    """The deepest nesting of braces, parentheses and brackets together (``\\left(`` counts as ``(``)."""
    depth = deepest = 0
    for char in text:
        if char in "{([":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "})]":
            depth -= 1
    return deepest


_DIGITS = re.compile(r"\d+")
_REDUNDANT = re.compile(r"[{(\[](?:\s*[{(\[]){2}")
_CLOSING = {")": "(", "}": "{", "]": "["}


def _group_before(text: str, end: int) -> str:
    """The bracketed group (or digit run, or single character) that ends just before ``text[end]``."""
    if end <= 0:
        return ""
    if text[end - 1] in _CLOSING:
        depth = 0
        for start in range(end - 1, -1, -1):
            depth += text[start] in _CLOSING
            depth -= text[start] in _CLOSING.values()
            if depth == 0:
                return text[start:end]
        return text[:end]
    start = end
    while start > 0 and text[start - 1].isdigit():
        start -= 1
    return text[start:end] if start < end else text[end - 1]


def _group_after(text: str, start: int) -> str:
    """The braced group (or digit run, or single character) that starts at ``text[start]``."""
    if start >= len(text):
        return ""
    if text[start] == "{":
        depth = 0
        for end in range(start, len(text)):
            depth += text[end] == "{"
            depth -= text[end] == "}"
            if depth == 0:
                return text[start : end + 1]
        return text[start:]
    match = _DIGITS.match(text, start)
    return match.group() if match else text[start]


def _longest_digits(text: str) -> int:
    return max((len(run) for run in _DIGITS.findall(text)), default=0)


def too_costly(answer: str) -> str | None:
    """Why handing ``answer`` to math_verify could cost SymPy up to its alarm (about a second), or ``None``:
    nesting deeper than :data:`MAX_BRACE_DEPTH` or three brackets opened in a row; a power tower (an exponent holding ``^``, ``!`` or a
    binomial) or an exponent with more than :data:`MAX_EXPONENT_DIGITS` digits (``9^{9^{9}}``,
    ``10^{10^{10}}``, ``2^{99999999}``); a repeated factorial or one of more than a 3-digit number or of a
    group holding ``^`` (``(10^{100000})!``, ``99999!``); a binomial of large numbers. Linear time: one
    scan per ``^`` and ``!`` over what they apply to, within :data:`MAX_ANSWER_CHARS`. No correct MATH
    answer is refused by these (its answers are below a thousand characters, with small exponents)."""
    if _brace_depth(answer) > MAX_BRACE_DEPTH:
        return f"nested more than {MAX_BRACE_DEPTH} deep"
    if _REDUNDANT.search(answer):
        return "three brackets opened in a row"
    for at in (i for i, char in enumerate(answer) if char == "^"):
        exponent = _group_after(answer, at + 1)
        if "^" in exponent or "!" in exponent or "binom" in exponent or "choose" in exponent:
            return "a power tower"
        if _longest_digits(exponent) > MAX_EXPONENT_DIGITS:
            return f"an exponent of more than {MAX_EXPONENT_DIGITS} digits"
    if "!!" in answer.replace(" ", ""):
        return "a repeated factorial"
    for at in (i for i, char in enumerate(answer) if char == "!"):
        operand = _group_before(answer.rstrip(), len(answer[:at].rstrip()))
        if "^" in operand or _longest_digits(operand) > MAX_EXPONENT_DIGITS - 1:
            return "a factorial of a large number"
    if ("binom" in answer or "choose" in answer) and ("^" in answer or _longest_digits(answer) > MAX_EXPONENT_DIGITS):
        return "a binomial of large numbers"
    return None
