"""Countdown: reach a target number from a few operands with +, -, * and exact division.

The task is generated, not loaded, and every answer is checked by :func:`verify`
(:mod:`kdlab.tasks.countdown_answers`, whose names this module also exports), a small
parser-and-simulator written for hostile text: completions are model output, so nothing ever
evaluates them as code (no ``eval``, no ``ast``, no computer algebra), and every loop is bounded by
a length, depth or magnitude cap before it starts.

Arithmetic rules, shared by the generator and the verifier so that every generated target is one
the verifier can accept:

* Each step combines two numbers of the current pool into one; a chain uses every operand once.
* Every value is an integer of at most 12 digits (``|v| < 10**12``); division must be exact and
  never by zero.
* In ``chain`` answers every intermediate is non-negative, because a step is written with unsigned
  literals (``5-5=0`` is a legal step, ``2-5=-3`` cannot be written). Zero is allowed. The
  generator's search uses the same rule.
* ``expression`` answers are ordinary arithmetic, so an intermediate may be negative
  (``3-5+4`` is 2); the value must still equal the target and every division must be exact
  where it happens (``7/2*2`` is wrong, not 7). Generated targets always have a non-negative
  chain; an expression answer may simply take another route to them.

Why the generator draws a target uniformly from the *reachable set* rather than drawing a number and
searching for a solution: every example is solvable by construction, and each example stores one
solution chain, which :meth:`Countdown.reference_completion` turns into a correct response.
Targets equal to one of the operands are excluded in every variant (they are often reachable by
discarding the other operands, e.g. ``(3-2)*5`` for 5). Each split is drawn from its own stream (the
seed and the split name). By default the splits are drawn without regard to each other, so a val or
test problem may also be a train problem (78 of the first 200 Countdown-3 val problems are, at the
default seed and 5,000 train problems); ``disjoint=True`` keeps drawing from a held-out split's own
stream past every problem (sorted operands, target) of train (and, for test, of val), so held-out
problems are never training problems while train stays as it was. Within a split problems may repeat
either way (Countdown-3 has only 816 operand multisets).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

from kdlab.tasks.base import Example, Task
from kdlab.tasks.countdown_answers import (  # noqa: F401 - the verifier's names, also kdlab 0.1 names of this module
    ANSWER_FORMATS,
    MAX_ANSWER_CHARS,
    MAX_DEPTH,
    MAX_DIGITS,
    MAX_OPERANDS,
    MAX_VALUE,
    apply_step,
    is_int,
    verify,
)

POOL: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 15, 20, 25, 50, 75)
"""Operands of Countdown-3 and Countdown-4, drawn with replacement."""

SMALL_POOL: tuple[int, ...] = tuple(range(1, 11))
"""Operands of Countdown-4E, drawn with replacement."""

VARIANTS: dict[str, tuple[tuple[int, ...], int, int | None]] = {
    # name: (operand pool, operands per problem, largest target or None for no cap)
    "countdown3": (POOL, 3, None),
    "countdown4": (POOL, 4, 10_000),
    "countdown4e": (SMALL_POOL, 4, 100),
    "countdown3s": (POOL, 3, 20),
}

MAX_SKIPPED_DRAWS = 100_000
"""Draws in a row a ``disjoint`` held-out split may skip (each a train or val problem) before it is refused."""

_INSTRUCTION = (
    "Solve the Countdown arithmetic problem. Using the provided numbers, create an equation that "
    "equals the target. You may use the operations +, -, x, and /, and each number must be used "
    "exactly once; every division must have an integer result. Show your work in <think>...</think> "
    "tags and "
)
_FORMAT_SENTENCES = {
    "chain": "return the solution as compact, comma-separated equations in <answer>...</answer> tags. "
    "For example, <answer>2+3=5,5*4=20</answer>.",
    "expression": "return the solution as a single arithmetic expression in <answer>...</answer> tags. "
    "For example, <answer>(2+3)*4</answer>.",
}


# ---- the generator's search ------------------------------------------------------------------------
def _steps(lo: int, hi: int) -> Iterator[tuple[str, int]]:
    """Every legal non-negative step on the pair ``lo <= hi``, as ``("hi+lo=r", r)``, results distinct.

    ``lo/hi`` is never needed: it is exact only when ``lo`` is 0 (giving ``hi*lo``) or equals ``hi``.
    """
    seen: set[int] = set()
    for a, op, b in ((hi, "+", lo), (hi, "-", lo), (hi, "*", lo), (hi, "/", lo)):
        value = apply_step(a, op, b)
        if value is not None and value not in seen:
            seen.add(value)
            yield f"{a}{op}{b}={value}", value


class _Search:
    """Memoised search over operand multisets, keyed by sorted tuple.

    ``reach(key)`` maps every value reachable from ``key`` (using each number exactly once) to the
    first step that leads there and the multiset after that step, so a chain is rebuilt by following
    the links. One instance lives for one split's generation (or one :func:`solve` call), so the memo
    never outgrows the problems at hand.
    """

    def __init__(self) -> None:
        self._memo: dict[tuple[int, ...], dict[int, tuple[str, tuple[int, ...]] | None]] = {}

    def reach(self, key: tuple[int, ...]) -> dict[int, tuple[str, tuple[int, ...]] | None]:
        found = self._memo.get(key)
        if found is not None:
            return found
        if len(key) == 1:
            found = {key[0]: None}
        else:
            found = {}
            pairs: set[tuple[int, int]] = set()
            for i in range(len(key)):
                for j in range(i + 1, len(key)):
                    if (key[i], key[j]) in pairs:  # equal pairs lead to the same children
                        continue
                    pairs.add((key[i], key[j]))
                    rest = key[:i] + key[i + 1 : j] + key[j + 1 :]
                    for step, value in _steps(key[i], key[j]):
                        child = tuple(sorted(rest + (value,)))
                        for reached in self.reach(child):
                            if reached not in found:
                                found[reached] = (step, child)
        self._memo[key] = found
        return found

    def chain(self, key: tuple[int, ...], target: int) -> list[str] | None:
        """The steps from ``key`` to ``target``, or ``None`` when ``target`` is unreachable."""
        if target not in self.reach(key):
            return None
        steps: list[str] = []
        while len(key) > 1:
            link = self.reach(key)[target]
            assert link is not None  # only singletons map to None
            steps.append(link[0])
            key = link[1]
        return steps


def solve(nums: Sequence[int], target: int) -> str | None:
    """A solution chain such as ``"3+2=5,5*4=20"`` for ``nums`` and ``target``, or ``None`` if none exists.

    Uses every number exactly once, with non-negative integer intermediates and exact division, the
    same rules :func:`verify` applies to chains. ``nums`` must hold 2 to 5 non-negative integers
    (the search grows quickly with more operands).
    """
    if not 2 <= len(nums) <= 5 or not all(is_int(n) and 0 <= n < MAX_VALUE for n in nums):
        raise ValueError(f"solve.nums must be 2 to 5 non-negative integers below 10**12, got {nums!r}")
    if not is_int(target):
        raise ValueError(f"solve.target must be an int, got {target!r}")
    steps = _Search().chain(tuple(sorted(nums)), target)
    return None if steps is None else ",".join(steps)


def chain_to_expression(chain: str) -> str:
    """Rewrite a correct chain such as ``"3+2=5,5*4=20"`` as one expression, ``"(3+2)*4"``.

    Composite operands are parenthesised, so the expression evaluates the same steps in the same
    order (and therefore with the same exact divisions).
    """
    pool: list[tuple[int, str]] = []  # (value, expression) per pool entry created so far
    for step in chain.split(","):
        left, result = step.split("=")
        op = next(char for char in left[1:] if char in "+-*/")  # operands are unsigned: skip index 0
        a, b = (int(part) for part in left.split(op, 1))
        parts = []
        for operand in (a, b):
            index = next((k for k, (value, _) in enumerate(pool) if value == operand), None)
            if index is None:  # an original operand
                parts.append(str(operand))
            else:
                parts.append(f"({pool.pop(index)[1]})")
        pool.append((int(result), f"{parts[0]}{op}{parts[1]}"))
    return pool[-1][1]


# ---- the task ----------------------------------------------------------------------------------------
class Countdown(Task):
    """Countdown: combine the operands with ``+ - * /`` (exact division) to reach the target.

    Variants (operands drawn with replacement; the target uniformly from the values reachable with
    every operand used once, excluding the operands themselves and values below 1):

    * ``countdown3``: three operands from :data:`POOL` (1-10, 12, 15, 20, 25, 50, 75); no upper cap on
      the target (at most 75**3 = 421,875).
    * ``countdown4``: four operands from :data:`POOL`; target in 1..10,000 (the RLVR stage).
    * ``countdown4e``: four operands from 1-10; target in 1..100. The source does not say how these
      targets are drawn; this rule is kdlab's choice.
    * ``countdown3s``: three operands from :data:`POOL`; target in 1..20. Not the paper's: the tiny world's
      harder held-out set (its teacher and student solve no Countdown-4E problem; small targets are their
      hardest Countdown-3 problems: ``scripts/harder_split_probe.py``).

    Operands whose candidate set is empty are redrawn. Example fields: ``id``
    (``"countdown3-train-17"``), ``nums`` (in drawn order), ``target`` and ``solution`` (one correct
    chain, e.g. ``"3+2=5,5*4=20"``).

    Args:
        variant: ``countdown3``, ``countdown4``, ``countdown4e`` or ``countdown3s``.
        num_train / num_val / num_test: examples per split.
        seed: split ``s`` is generated by ``random.Random(f"{seed}-{variant}-{s}")``, so splits never
            share a stream and each is reproducible on its own.
        disjoint: held-out problems are never training problems: val skips every draw whose (sorted
            operands, target) is a train problem, test every train or val problem, and each keeps drawing
            from its own stream until it is full. Train is the same either way. ``False`` (default): the
            splits are drawn without regard to each other, as the committed tiny-world studies were. A
            split that skips :data:`MAX_SKIPPED_DRAWS` draws in a row is refused (``ValueError``).
        exclude_train_of: other Countdown tasks whose train problems val and test leave out as well (drawing on
            from their own streams, as ``disjoint`` does), e.g. the Countdown-4 task an RLVR run trains on, for the
            Countdown-4E pass@k it tracks. Train is the same either way.
        answer_format: ``chain`` (comma-separated steps, the source's format) or ``expression``
            (one expression such as ``(2+3)*4``); sets the prompt, the reference and the verifier.
        instruction: start the user prompt with the paper's instruction; ``False`` sends only the
            ``Numbers: [...]`` / ``Target: ...`` lines (the tiny world, whose models learned the format).
        **prompting: the prompting settings of :class:`~kdlab.tasks.base.Task` (system prompt, chat
            template, teacher-only prompts).
    """

    default_system_prompt = "You are a careful arithmetic solver."

    def __init__(
        self,
        variant: str = "countdown3",
        num_train: int = 5000,
        num_val: int = 500,
        num_test: int = 500,
        seed: int = 42,
        answer_format: str = "chain",
        instruction: bool = True,
        disjoint: bool = False,
        exclude_train_of: Sequence[Countdown] | None = None,
        **prompting: Any,
    ) -> None:
        super().__init__(**prompting)
        if variant not in VARIANTS:
            raise ValueError(f"Countdown.variant must be one of {tuple(VARIANTS)}, got {variant!r}")
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(f"Countdown.answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
        for key, value in (("num_train", num_train), ("num_val", num_val), ("num_test", num_test)):
            if value < 0:
                raise ValueError(f"Countdown.{key} must be >= 0, got {value}")
        self.variant = variant
        self.answer_format = answer_format
        self.instruction = instruction
        self.sizes = {"train": num_train, "val": num_val, "test": num_test}
        self.seed = seed
        self.disjoint = disjoint
        self.exclude_train_of = list(exclude_train_of or ())
        for index, other in enumerate(self.exclude_train_of):
            if not isinstance(other, Countdown):
                raise TypeError(f"Countdown.exclude_train_of[{index}] must be a Countdown task, got {type(other).__name__}")

    def _draws(self, split: str, search: _Search) -> Iterator[tuple[list[int], tuple[int, ...], int]]:
        """``(nums, sorted nums, target)`` problems of ``split``'s stream, in order, without end."""
        pool, count, top = VARIANTS[self.variant]
        rng = random.Random(f"{self.seed}-{self.variant}-{split}")
        candidates: dict[tuple[int, ...], list[int]] = {}
        while True:
            nums = [rng.choice(pool) for _ in range(count)]
            key = tuple(sorted(nums))
            if key not in candidates:
                candidates[key] = sorted(
                    value for value in search.reach(key) if value >= 1 and (top is None or value <= top) and value not in key
                )
            if candidates[key]:  # else the operands are redrawn
                yield nums, key, rng.choice(candidates[key])

    def excluded_problems(self, split: str) -> set[tuple[tuple[int, ...], int]]:
        """The (sorted operands, target) problems ``split`` may not hold: with ``disjoint``, train's for
        val and train's and val's for test; for val and test, every ``exclude_train_of`` task's train problems too."""
        if split == "train":
            return set()
        sources = [(other, "train") for other in self.exclude_train_of]
        if self.disjoint:
            sources += [(self, name) for name in (("train",) if split == "val" else ("train", "val"))]
        return {(tuple(sorted(row["nums"])), row["target"]) for task, name in sources for row in task.examples(name)}

    def load_split(self, split: str) -> list[Example]:
        search = _Search()
        excluded = self.excluded_problems(split)
        rows: list[Example] = []
        skipped = 0
        draws = self._draws(split, search)
        while len(rows) < self.sizes[split]:
            nums, key, target = next(draws)
            if (key, target) in excluded:
                skipped += 1
                if skipped > MAX_SKIPPED_DRAWS:
                    raise ValueError(
                        f"Countdown.disjoint/exclude_train_of: {MAX_SKIPPED_DRAWS} {self.variant} draws in a row for the "
                        f"{split} split were excluded train or val problems ({len(rows)} of num_{split}={self.sizes[split]} "
                        "found); lower num_train or exclude fewer problems"
                    )
                continue
            skipped = 0
            steps = search.chain(key, target)
            assert steps is not None  # target came from the reachable set
            rows.append(
                {"id": f"{self.variant}-{split}-{len(rows)}", "nums": nums, "target": target, "solution": ",".join(steps)}
            )
        return rows

    def user_prompt(self, example: Example) -> str:
        problem = f"Numbers: {list(example['nums'])}\nTarget: {example['target']}"
        if not self.instruction:
            return problem
        return _INSTRUCTION + _FORMAT_SENTENCES[self.answer_format] + "\n" + problem

    def score(self, example: Example, completion: str) -> float:
        return float(verify(example.get("nums"), example.get("target"), completion, self.answer_format))

    def reference_completion(self, example: Example) -> str:
        """Short deterministic reasoning (each step and the pool it leaves), then the answer."""
        pool = sorted(example["nums"])
        lines = [f"Numbers {pool}, target {example['target']}."]
        for step in example["solution"].split(","):
            left, result = step.split("=")
            op = next(char for char in left[1:] if char in "+-*/")
            for operand in left.split(op, 1):
                pool.remove(int(operand))
            pool = sorted(pool + [int(result)])
            lines.append(f"{step} leaves {pool}.")
        lines.append(f"{pool[0]} is the target.")
        answer = example["solution"] if self.answer_format == "chain" else chain_to_expression(example["solution"])
        return "<think>" + "\n".join(lines) + f"</think>\n<answer>{answer}</answer>"
