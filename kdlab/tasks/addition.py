"""Multi-digit addition: a small verifiable task that needs no data files.

It is the smallest task that exercises the whole loop (prompts, rollouts, verifier), and one of the
earlier skills whose forgetting the tiny world measures.
"""

from __future__ import annotations

import random
from typing import Any

from kdlab.tasks.base import Example, Task, check_answer_source, last_integer, last_tagged


class Addition(Task):
    """Add two non-negative integers; the answer goes inside ``<answer>...</answer>``.

    With ``answer_from="tag"`` the answer is read as a run of ASCII digits (surrounding whitespace
    ignored, at most 64 digits); anything else, a sign, a period or another script's digits (``٢``,
    ``²``) included, scores 0.

    Args:
        max_digits: operands have 1..max_digits digits.
        num_train / num_val / num_test: examples per split.
        seed: split ``s`` is generated from ``seed`` and the split name, so splits never share a stream.
        answer_from: ``"tag"`` (the last ``<answer>...</answer>``) or ``"last_number"`` (the last integer
            anywhere in the response, for pretrained models that answer in their own words).
        **prompting: the prompting settings of :class:`~kdlab.tasks.base.Task`.
    """

    default_system_prompt = "You are a careful calculator."

    def __init__(
        self,
        max_digits: int = 3,
        num_train: int = 1000,
        num_val: int = 100,
        num_test: int = 100,
        seed: int = 0,
        answer_from: str = "tag",
        **prompting: Any,
    ) -> None:
        super().__init__(**prompting)
        self.answer_from = check_answer_source("Addition", answer_from)
        if max_digits < 1:
            raise ValueError(f"Addition.max_digits must be >= 1, got {max_digits}")
        for key, value in (("num_train", num_train), ("num_val", num_val), ("num_test", num_test)):
            if value < 0:
                raise ValueError(f"Addition.{key} must be >= 0, got {value}")
        self.max_digits = max_digits
        self.sizes = {"train": num_train, "val": num_val, "test": num_test}
        self.seed = seed

    def load_split(self, split: str) -> list[Example]:
        rng = random.Random(f"{self.seed}-{split}")
        top = 10**self.max_digits - 1
        return [
            {"id": f"add-{split}-{i}", "a": rng.randint(0, top), "b": rng.randint(0, top)}
            for i in range(self.sizes[split])
        ]

    def user_prompt(self, example: Example) -> str:
        return f"Add the numbers. Put the sum in <answer></answer>.\n{example['a']}+{example['b']}"

    def score(self, example: Example, completion: str) -> float:
        if self.answer_from == "last_number":
            return float(last_integer(completion) == example["a"] + example["b"])
        answer = last_tagged(completion)
        if answer is None:
            return 0.0
        answer = answer.strip()
        # ASCII digits only: str.isdigit also takes "²" (which int() refuses) and other scripts' digits
        if not (answer.isascii() and answer.isdigit()) or len(answer) > 64:
            return 0.0
        return float(int(answer) == example["a"] + example["b"])

    def well_formed(self, completion: str) -> bool:
        return last_integer(completion) is not None if self.answer_from == "last_number" else super().well_formed(completion)

    def reference_completion(self, example: Example) -> str:
        return f"<answer>{example['a'] + example['b']}</answer>"

    def gold_answer(self, example: Example) -> str:
        return str(example["a"] + example["b"])
