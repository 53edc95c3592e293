"""Small verifiable skills that a student has before distillation: the tiny world's forgetting suite.

Each task draws its examples from ``random.Random(f"{seed}-{name}-{split}")`` and expects the answer
inside ``<answer>...</answer>``. Together with :class:`~kdlab.tasks.addition.Addition` they are the
"earlier capabilities" whose change ``ood/mean_delta`` reports.
"""

from __future__ import annotations

import random
import string
from typing import Any

from kdlab.tasks.base import Example, Task, check_answer_source, last_integer, last_tagged


class _Skill(Task):
    """Shared split generation and exact-match scoring of the answer tag.

    ``lengths``: ``(low, high)``, the inclusive range of the drawn list or word's length (each skill's default
    is its class's ``default_lengths``; longer ranges make a harder probe).

    ``answer_from``: ``"tag"`` (the last ``<answer>...</answer>``) or, for a numeric skill (counting),
    ``"last_number"`` (the last integer anywhere in the response, for models that answer in their own words).
    """

    name = "skill"
    numeric = False
    default_lengths: tuple[int, int] = (3, 6)

    def __init__(self, num_train: int = 1000, num_val: int = 100, num_test: int = 100, seed: int = 0, answer_from: str = "tag",
                 lengths: tuple[int, int] | None = None, **prompting: Any) -> None:
        super().__init__(**prompting)
        low, high = self.lengths = tuple(lengths or self.default_lengths)
        if not 1 <= low <= high:
            raise ValueError(f"{type(self).__name__}.lengths must be (low, high) with 1 <= low <= high, got {list(lengths)}")
        self.answer_from = check_answer_source(type(self).__name__, answer_from)
        if answer_from == "last_number" and not self.numeric:
            raise ValueError(f"{type(self).__name__}.answer_from 'last_number' needs a numeric answer; {type(self).__name__} has none")
        for key, value in (("num_train", num_train), ("num_val", num_val), ("num_test", num_test)):
            if value < 0:
                raise ValueError(f"{type(self).__name__}.{key} must be >= 0, got {value}")
        self.sizes = {"train": num_train, "val": num_val, "test": num_test}
        self.seed = seed

    def draw(self, rng: random.Random) -> dict[str, Any]:
        raise NotImplementedError

    def answer(self, example: Example) -> str:
        raise NotImplementedError

    def load_split(self, split: str) -> list[Example]:
        rng = random.Random(f"{self.seed}-{self.name}-{split}")
        return [{"id": f"{self.name}-{split}-{i}", **self.draw(rng)} for i in range(self.sizes[split])]

    def score(self, example: Example, completion: str) -> float:
        if self.answer_from == "last_number":
            return float(last_integer(completion) == int(self.answer(example)))
        answer = last_tagged(completion)
        return float(answer is not None and answer.strip() == self.answer(example))

    def well_formed(self, completion: str) -> bool:
        return last_integer(completion) is not None if self.answer_from == "last_number" else super().well_formed(completion)

    def reference_completion(self, example: Example) -> str:
        return f"<answer>{self.answer(example)}</answer>"

    def gold_answer(self, example: Example) -> str:
        return self.answer(example)


class Sorting(_Skill):
    """Sort a list of 3-6 (``lengths``) single-digit numbers in ascending order: ``3 1 2`` -> ``1 2 3``."""

    name = "sorting"

    def draw(self, rng: random.Random) -> dict[str, Any]:
        return {"values": [rng.randint(0, 9) for _ in range(rng.randint(*self.lengths))]}

    def user_prompt(self, example: Example) -> str:
        return "Sort ascending: " + " ".join(map(str, example["values"]))

    def answer(self, example: Example) -> str:
        return " ".join(map(str, sorted(example["values"])))


class Reversal(_Skill):
    """Reverse a string of 3-7 (``lengths``) lowercase letters: ``abc`` -> ``cba``."""

    name = "reversal"
    default_lengths = (3, 7)

    def draw(self, rng: random.Random) -> dict[str, Any]:
        return {"word": "".join(rng.choice(string.ascii_lowercase[:8]) for _ in range(rng.randint(*self.lengths)))}

    def user_prompt(self, example: Example) -> str:
        return "Reverse: " + " ".join(example["word"])

    def answer(self, example: Example) -> str:
        return " ".join(reversed(example["word"]))


class Counting(_Skill):
    """Count how often a letter occurs in a string of 4-9 (``lengths``) letters from ``abcd``."""

    name = "counting"
    numeric = True
    default_lengths = (4, 9)

    def draw(self, rng: random.Random) -> dict[str, Any]:
        word = "".join(rng.choice("abcd") for _ in range(rng.randint(*self.lengths)))
        return {"word": word, "letter": rng.choice("abcd")}

    def user_prompt(self, example: Example) -> str:
        return f"Count {example['letter']} in: " + " ".join(example["word"])

    def answer(self, example: Example) -> str:
        return str(example["word"].count(example["letter"]))
