"""What the tiny world is: its tasks, the teacher's two reasoning styles, and the SFT data of each model.

* Target task: Countdown-3 with the paper's answer format (a chain of equations in ``<answer>``,
  reasoning in ``<think>``); prompts carry only the ``Numbers``/``Target`` lines (``instruction=False``)
  to keep sequences short. Countdown-4E and Countdown-4 use the same task class and verifier.
* Earlier skills (forgetting suite): addition, sorting, reversal, counting.
* Style switch: told :data:`SPANISH_INSTRUCTION`, the teacher writes its ``<think>`` in Spanish
  words; otherwise in English. Numbers, equations and tags are language-neutral.

The student learns the earlier skills and a little Countdown-3 in English; the teacher learns
Countdown-3 well, in both styles.
"""

from __future__ import annotations

from typing import Any

from kdlab.tasks import Addition, Countdown
from kdlab.tasks.base import Task
from kdlab.tasks.countdown import chain_to_expression
from kdlab.tasks.skills import Counting, Reversal, Sorting

SPANISH_INSTRUCTION = "Razona solo en español."

_VERBS = {
    "english": {"+": "add", "-": "subtract", "*": "multiply", "/": "divide"},
    "spanish": {"+": "sumo", "-": "resto", "*": "multiplico", "/": "divido"},
}
_WORDS = {
    "english": ("first", "then", "and", "to get"),
    "spanish": ("primero", "luego", "y", "para obtener"),
}


def countdown(variant: str = "countdown3", **kwargs: Any) -> Countdown:
    """The tiny world's Countdown: no system prompt, no instruction text, chat template on; the teacher's
    prompt carries :data:`SPANISH_INSTRUCTION` (used when the Spanish style is asked for)."""
    kwargs.setdefault("system_prompt", "")
    kwargs.setdefault("teacher_instruction", SPANISH_INSTRUCTION)
    return Countdown(variant=variant, instruction=False, **kwargs)


def skills(num_train: int = 1000, num_val: int = 200, seed: int = 0) -> list[Task]:
    """The four earlier skills, with no system prompt."""
    common = dict(num_train=num_train, num_val=num_val, num_test=num_val, seed=seed, system_prompt="")
    return [Addition(max_digits=2, **common), Sorting(**common), Reversal(**common), Counting(**common)]


def trace(solution: str, language: str, answer_format: str = "chain") -> str:
    """A response for a Countdown chain: the steps in words inside ``<think>``, then the answer as the
    chain (the teacher's and the task's format) or as one expression (the student's own habit).

    ``trace("6+1=7,7*3=21", "english")`` ->
    ``<think>first add 6 and 1 to get 7, then multiply 7 and 3 to get 21</think><answer>6+1=7,7*3=21</answer>``;
    with ``answer_format="expression"`` the answer is ``<answer>(6+1)*3</answer>``.
    """
    first, then, conjunction, result = _WORDS[language]
    parts = []
    for index, step in enumerate(solution.split(",")):
        left, value = step.split("=")
        op = next(char for char in left[1:] if char in "+-*/")
        a, b = left.split(op, 1)
        lead = first if index == 0 else then
        parts.append(f"{lead} {_VERBS[language][op]} {a} {conjunction} {b} {result} {value}")
    answer = solution if answer_format == "chain" else chain_to_expression(solution)
    return f"<think>{', '.join(parts)}</think><answer>{answer}</answer>"


def countdown_rows(task: Countdown, split: str, language: str, expression_share: float = 0.0, seed: int = 0) -> list[dict[str, Any]]:
    """SFT rows for ``task``'s ``split``: English responses to the plain prompt, Spanish ones to the
    teacher's prompt (which carries ``task.teacher_instruction``); a seeded ``expression_share`` of
    them answer with one expression instead of the chain."""
    import random

    draw = random.Random(seed)
    rows = []
    for example in task.examples(split):
        messages = task.teacher_messages(example) if language == "spanish" else task.student_messages(example)
        answer_format = "expression" if draw.random() < expression_share else "chain"
        rows.append({"id": example["id"], "messages": messages, "completion": trace(example["solution"], language, answer_format)})
    return rows


def skill_rows(tasks: list[Task], split: str = "train") -> list[dict[str, Any]]:
    rows = []
    for task in tasks:
        for example in task.examples(split):
            rows.append({"id": example["id"], "messages": task.student_messages(example), "completion": task.reference_completion(example)})
    return rows


def corpus(size: int = 3000) -> list[str]:
    """Text the tiny tokenizer is trained on: every kind of prompt and response of the world."""
    task = countdown(num_train=size, num_val=0, num_test=0, seed=7)
    texts = []
    for language in ("english", "spanish"):
        texts += [row["messages"][-1]["content"] + " " + row["completion"] for row in countdown_rows(task, "train", language)]
    for row in skill_rows(skills(num_train=size // 4, num_val=0, seed=7)):
        texts.append(row["messages"][-1]["content"] + " " + row["completion"])
    return texts

