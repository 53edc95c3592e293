"""Maths with real data: MATH (Numina-MATH training rows, MATH-500 evaluation) and GSM8K.

Answers are model output: they are read and compared by :mod:`kdlab.tasks.math_answers` (linear scans with
caps, exact fractions, ``math_verify`` only where it is installed and usable), whose names this module also
exports (kdlab 0.1 imported them from here).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from kdlab.tasks.answer_cost import MAX_BRACE_DEPTH, MAX_EXPONENT_DIGITS, too_costly  # noqa: F401 - kdlab 0.1 names
from kdlab.tasks.base import Example, Task, last_tagged
from kdlab.tasks.math_answers import (  # noqa: F401 - the answer functions, also kdlab 0.1 names of this module
    _PLAIN_NUMBER,
    MAX_ANSWER_CHARS,
    MAX_NUMBER_DIGITS,
    VERIFY_TIMEOUT_S,
    answers_match,
    as_fraction,
    last_boxed,
    last_number,
    math_verify_usable,
    normalise_answer,
)
from kdlab.tasks.sources import UnresolvedAnswer, hashed_order, load_rows, require_fields

MATH_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
GSM8K_SYSTEM_PROMPT = "You are a careful solver of math word problems."
GSM8K_INSTRUCTION = (
    "Solve the math word problem. Reason step by step in <think>...</think> tags and place only the final "
    "number in <answer>...</answer> tags."
)


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
    (:func:`last_number`). An ``<answer>`` without a number gives ``None`` (no fall-through), and so
    does a final ``<answer>`` that is never closed (cut off: no answer, see :func:`last_tagged`)."""
    if not isinstance(completion, str):
        return None
    part = last_tagged(completion)
    if part is None and "<answer>" in completion:  # the last <answer> is unclosed
        return None
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
