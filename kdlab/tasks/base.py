"""The ``Task`` contract: prompts per split, how each model is prompted, and a verifier.

An example is a plain ``dict`` with a unique string ``"id"`` plus whatever fields the task needs
(operands, options, reference answer). The student and the teacher may be prompted differently
(for instance the teacher gets a style instruction); the KL is still taken on the same completion
tokens, each model conditioned on its own prompt.
"""

from __future__ import annotations

import re

from collections.abc import Sequence
from typing import Any

from kdlab.components import Component
from kdlab.tasks.math_answers import last_number

Example = dict[str, Any]
Messages = list[dict[str, str]]

SPLITS = ("train", "val", "test")


class Task(Component):
    """Base class of every task.

    Subclasses implement :meth:`load_split`, :meth:`user_prompt` and :meth:`score`, and may override
    :meth:`teacher_messages` and :meth:`reference_completion`.

    Args:
        system_prompt: system message of the chat; ``None`` uses the task's default
            (``default_system_prompt``), ``""`` sends none.
        chat_template: render prompts with each tokenizer's chat template; ``False`` renders
            ``system + "\\n\\n" + user + "\\n"`` as plain text (for base models).
        teacher_system_prompt: the teacher's system message when it differs from the student's
            (``None``: the same).
        teacher_instruction: text appended to the teacher's user message only, e.g. the paper's
            "reason only in Spanish" instruction (``None``: nothing).
        teacher_demonstration: show the teacher a correct worked response before the question, as the paper's
            style experiment did: ``True`` shows the task's :meth:`reference_completion`; a string is a template
            filled with the example's fields and ``{answer}`` (:meth:`gold_answer`), e.g. a worked answer in the
            language the teacher should write (``"Ejemplo de respuesta correcta: {a} + {b} = {answer}."``),
            shown as written.
    """

    default_system_prompt: str = ""

    def __init__(
        self,
        system_prompt: str | None = None,
        chat_template: bool = True,
        teacher_system_prompt: str | None = None,
        teacher_instruction: str | None = None,
        teacher_demonstration: bool | str = False,
    ) -> None:
        super().__init__()
        self.system_prompt = self.default_system_prompt if system_prompt is None else system_prompt
        self.chat_template = chat_template
        self.teacher_system_prompt = teacher_system_prompt
        self.teacher_instruction = teacher_instruction
        self.teacher_demonstration = teacher_demonstration
        self._splits: dict[str, list[Example]] = {}

    # ---- what subclasses provide -------------------------------------------------------------
    def load_split(self, split: str) -> Sequence[Example]:
        """Return the examples of ``split`` (one of ``train``, ``val``, ``test``), in a fixed order."""
        raise NotImplementedError

    def user_prompt(self, example: Example) -> str:
        """The user message the student sees for ``example``."""
        raise NotImplementedError

    def score(self, example: Example, completion: str) -> float:
        """Score a completion in [0, 1]; must never raise, whatever the completion holds."""
        raise NotImplementedError

    def well_formed(self, completion: str) -> bool:
        """Whether ``completion`` has the task's answer format (an ``<answer>...</answer>`` that is not
        followed by an unclosed ``<answer>``: :func:`last_tagged`), whatever the answer; RLVR's format
        reward. Must never raise."""
        return last_tagged(completion) is not None

    def reference_completion(self, example: Example) -> str | None:
        """A correct response for ``example`` if the task can write one (used to train tiny teachers)."""
        return None

    def gold_answer(self, example: Example) -> str | None:
        """The correct answer of ``example`` as text (the number a numeric task wants), if the task knows it: what
        a string ``teacher_demonstration`` and answer templates (:class:`~kdlab.callbacks.StyleLogOdds`) fill in."""
        return None

    # ---- shared behaviour --------------------------------------------------------------------
    def examples(self, split: str) -> list[Example]:
        """The examples of ``split``, loaded once and checked for unique ``id`` fields."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if split not in self._splits:
            rows = list(self.load_split(split))
            ids = [row.get("id") for row in rows]
            for index, row_id in enumerate(ids):
                if not isinstance(row_id, str) or not row_id:
                    raise ValueError(f"{type(self).__name__} {split} row {index}: missing string field 'id'")
            if len(set(ids)) != len(ids):
                raise ValueError(f"{type(self).__name__} {split}: example ids are not unique")
            self._splits[split] = rows
        return self._splits[split]

    def student_messages(self, example: Example) -> Messages:
        """Chat messages for the student: the system prompt (if any), then the user prompt."""
        messages: Messages = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": self.user_prompt(example)})
        return messages

    def teacher_messages(self, example: Example) -> Messages:
        """Chat messages for the teacher: the student's, changed by the ``teacher_*`` settings.

        The KL is still taken on the same completion tokens, each model conditioned on its own prompt.
        """
        system = self.system_prompt if self.teacher_system_prompt is None else self.teacher_system_prompt
        user = self.user_prompt(example)
        if isinstance(self.teacher_demonstration, str):
            user = f"{fill_answer_template(self, example, self.teacher_demonstration, 'teacher_demonstration')}\n\n{user}"
        elif self.teacher_demonstration:
            demonstration = self.reference_completion(example)
            if demonstration is None:
                raise ValueError(
                    f"{type(self).__name__}.teacher_demonstration is true but example {example['id']!r} has no reference completion"
                )
            user = f"A correct response to the question below:\n{demonstration}\n\n{user}"
        if self.teacher_instruction:
            user = f"{user}\n\n{self.teacher_instruction}"
        messages: Messages = [{"role": "system", "content": system}] if system else []
        return messages + [{"role": "user", "content": user}]

    def render(self, tokenizer: Any, messages: Messages) -> str:
        """Turn messages into the prompt text for one model, ending where the response begins."""
        if self.chat_template:
            if getattr(tokenizer, "chat_template", None) is None:
                raise ValueError(
                    f"{type(self).__name__}.chat_template is true but tokenizer "
                    f"{getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; "
                    "set chat_template: false for plain-text prompts"
                )
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return "\n\n".join(message["content"] for message in messages) + "\n"


def fill_answer_template(task: Task, example: Example, template: str, setting: str) -> str:
    """``template`` filled with ``example``'s fields and ``answer`` (``task.gold_answer(example)``); a ``ValueError``
    names ``setting`` when the task has no gold answer or the template names a field the example lacks."""
    answer = task.gold_answer(example)
    if answer is None:
        raise ValueError(f"{type(task).__name__}.gold_answer gives nothing for example {example.get('id')!r}: {setting} needs the answer")
    try:
        return template.format(**{**example, "answer": answer})
    except (KeyError, IndexError) as error:
        fields = ", ".join(sorted({*example, "answer"}))
        raise ValueError(f"{setting} {template!r} names {error} which {type(task).__name__} examples lack (fields: {fields})") from None


def last_tagged(text: str, tag: str = "answer") -> str | None:
    """The content of the last ``<tag>...</tag>`` in ``text``, or ``None`` when there is none.

    A ``<tag>`` after the last ``</tag>`` (a final answer cut off by the token limit, or opened and never
    closed) means the completion has no answer: ``None``, even when an earlier ``<tag>...</tag>`` (a
    draft inside ``<think>``, say) is complete, since nothing before a final answer is the answer.
    Linear time in ``len(text)`` (three ``rfind`` calls, no regular expression), so hostile
    completions of any size are cheap; anything that is not a ``str`` gives ``None``.
    """
    if not isinstance(text, str):
        return None
    open_tag = f"<{tag}>"
    close = text.rfind(f"</{tag}>")
    if close < 0 or text.rfind(open_tag) > close:
        return None
    start = text.rfind(open_tag, 0, close)
    if start < 0:
        return None
    return text[start + len(open_tag) : close]


ANSWER_SOURCES = ("tag", "last_number")
"""Where a numeric task reads the answer: the last ``<answer>`` tag (kdlab's format), or the last integer
written anywhere (``last_number``: for pretrained models that answer in their own words)."""


def last_integer(text: str) -> int | None:
    """The last number written in ``text`` when it is an integer, else ``None``: :func:`~kdlab.tasks.math_answers.last_number`'s
    reading (a ``-`` or U+2212 minus kept, thousands commas only in groups of three, a trailing period or comma
    as punctuation), so ``"2.5"`` is no integer rather than 5, ``"5.0"`` is 5 and ``"1,2"`` is no number rather
    than 12. ``None`` when ``text`` is not a ``str``. Linear time."""
    value = last_number(text)
    return int(value) if value is not None and value.denominator == 1 else None


def check_answer_source(owner: str, answer_from: str) -> str:
    if answer_from not in ANSWER_SOURCES:
        raise ValueError(f"{owner}.answer_from must be one of {ANSWER_SOURCES}, got {answer_from!r}")
    return answer_from
