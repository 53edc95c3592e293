"""Multiple-choice tasks on real data: Science (SciKnowEval) and MedReason.

Both ask for reasoning in ``<think>...</think>`` and only the option letter in
``<answer>...</answer>``, and share one verifier, :func:`read_letter`: the *last* ``<answer>`` must
hold exactly one option letter, with surrounding whitespace, one pair of parentheses and a trailing
period tolerated (``B``, ``(B)``, ``B)``, ``B.``); anything else, including a lowercase letter, a
letter beyond the example's options, two letters or an option's text, scores 0, and so does a completion
whose final ``<answer>`` is never closed (cut off: no answer, whatever an earlier ``<answer>`` held).

Why splits are drawn by hashing rather than taken from the source: SciKnowEval publishes a single
split (named ``test``) and MedReason a single ``train`` split, and the paper's own Science split
(2,674 train / 507 test) is unpublished. Unless an ``eval_split`` is named, the rows that survive
filtering are ordered by :func:`kdlab.tasks.sources.hashed_order` (SHA-256 of ``seed``, the question
and the options) and the first ``round(eval_fraction * n)`` become the held-out ``test`` split, the
rest ``train``. The order depends only on each row's content, so upstream reordering does not move
rows between splits and exact duplicates land in the same split. ``val`` is the first ``num_val``
examples of ``test``: the paper tracks "held-out accuracy" on the first 200 held-out examples, and
DistillModule evaluates ``val`` and ``test`` on their first ``val_examples`` anyway.

MedReason stores the answer as text, not a letter; :func:`recover_letter` maps it to the one option
it names (rules in its docstring) and refuses when it names none or several.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from kdlab.tasks.base import Example, Task, last_tagged
from kdlab.tasks.sources import UnresolvedAnswer, load_rows, require_fields, split_by_fraction

SCIENCE_SYSTEM_PROMPT = "You are a careful solver of multiple-choice science questions."
SCIENCE_INSTRUCTION = (
    "Given a question and four options, select the correct answer. Reason step by step in <think>...</think> "
    "tags and place only the corresponding option letter (A, B, C, or D) in <answer>...</answer> tags."
)
MEDREASON_SYSTEM_PROMPT = "You are a careful medical reasoning assistant."
MEDREASON_INSTRUCTION = (
    "Given a medical multiple-choice question and its answer choices, select the correct answer. Reason step "
    "by step in <think>...</think> tags and place only the letter corresponding to the correct option in "
    "<answer>...</answer> tags; do not repeat the answer text."
)

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
MAX_ANSWER_CHARS = 64
"""Longer ``<answer>`` contents are rejected before any matching."""
UNMATCHED = ("error", "skip")

_BARE_LETTER = re.compile(r"(?:\(([A-Z])\)|([A-Z])\)?)\.?")  # B, B., B), B)., (B), (B).
_LABELLED_LINE = re.compile(r"\s*\(?([A-Z])\s*[.):]\s*(.*)")
_NOT_WORD = re.compile(r"[\W_]+")
_EXPLANATION = re.compile(r"\s*\bexplanation\s*:", re.IGNORECASE)
_LEAD_IN = re.compile(r"(?:the\s+)?(?:final\s+)?(?:answer|decision)(?:\s+is)?\s*:\s*", re.IGNORECASE)


# ---- verifier ------------------------------------------------------------------------------------------
def read_letter(completion: Any, letters: Sequence[str] | str = "ABCD") -> str | None:
    """The option letter in the last ``<answer>...</answer>`` of ``completion``, or ``None``.

    Accepted contents: one uppercase letter from ``letters``, bare or as ``(B)`` or ``B)``, then an
    optional ``.``, with any surrounding whitespace. A final ``<answer>`` that is never closed gives
    ``None`` (:func:`~kdlab.tasks.base.last_tagged`). Never raises; non-``str`` completions give ``None``.
    """
    content = last_tagged(completion)
    if content is None or len(content) > MAX_ANSWER_CHARS:
        return None
    match = _BARE_LETTER.fullmatch(content.strip())
    letter = match and (match.group(1) or match.group(2))
    return letter if letter and letter in letters else None


# ---- reading options and answers -------------------------------------------------------------------------
def normalise(text: str) -> str:
    """Lowercase, every run of non-word characters (punctuation, whitespace) -> one space, stripped.

    ``"Colle's  fascia."`` and ``"colle s fascia"`` compare equal; digits are kept, so ``"2.5 mg"``
    (``"2 5 mg"``) still differs from ``"25 mg"``.
    """
    return _NOT_WORD.sub(" ", text.lower()).strip()


def parse_options(value: Any) -> dict[str, str]:
    """Options as ``{"A": text, "B": text, ...}`` from a dict, a list, or MedReason's option text.

    MedReason stores options as one string, ``"Answer Choices:\\nA. ...\\nB. ..."``. Lines before
    the first ``A`` label are a header and ignored; a line opens a new option only when its label
    (``A.``, ``A)``, ``(A)``, ``A:``) is the next letter in sequence, otherwise it continues the
    previous option. A JSON object or list in the string is read as such. Returns ``{}`` for an empty
    value (an open-ended question). Raises :class:`UnresolvedAnswer` when options are present but
    do not form a run of at least two choices labelled from ``A``.
    """
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return {}
        if text[0] in "[{":
            try:
                value = json.loads(text)
            except ValueError:
                raise UnresolvedAnswer(f"options are neither lettered lines nor valid JSON: {text[:80]!r}") from None
        else:
            return _parse_option_lines(text)
    if isinstance(value, Mapping):
        options = {str(key).strip().upper(): str(text).strip() for key, text in value.items() if text is not None}
    elif isinstance(value, (list, tuple)):
        if len(value) > len(LETTERS):
            raise UnresolvedAnswer(f"{len(value)} options is more than the {len(LETTERS)} letters")
        options = {LETTERS[i]: str(text).strip() for i, text in enumerate(value)}
    else:
        raise UnresolvedAnswer(f"options must be text, a mapping or a list, got {type(value).__name__}")
    if not options:
        return {}
    if list(options) != list(LETTERS[: len(options)]) or len(options) < 2:
        raise UnresolvedAnswer(f"options must be labelled A, B, ... in order, got {list(options)}")
    return options


def _parse_option_lines(text: str) -> dict[str, str]:
    options: dict[str, list[str]] = {}
    for line in text.splitlines():
        expected = LETTERS[len(options)] if len(options) < len(LETTERS) else None
        match = _LABELLED_LINE.fullmatch(line)
        if match is not None and match.group(1) == expected:
            options[expected] = [match.group(2).strip()]
        elif options and line.strip():
            options[LETTERS[len(options) - 1]].append(line.strip())
    if len(options) < 2:
        raise UnresolvedAnswer(f"options hold fewer than two lettered choices: {text[:80]!r}")
    return {letter: " ".join(parts) for letter, parts in options.items()}


def recover_letter(answer: Any, options: Mapping[str, str]) -> str:
    """The letter of the one option that ``answer`` names.

    Rules, in order (texts compared after :func:`normalise`):

    1. ``answer`` is itself one of the option letters (``C``, ``C.``, ``(C)``): that letter. A letter
       that is not an option (``F`` of A-D) is an error unless rule 2 matches it as an option's text.
    2. ``answer`` equals exactly one option's text, tried for the whole answer, for the part before
       ``Explanation:`` (MedMCQA-derived rows read ``"<option>. Explanation: ..."``) and for that part
       without a lead-in such as ``The final decision is:`` (PubMedQA-derived rows).
    3. ``answer`` is ``"<letter>. <that option's text>"``.
    4. Exactly one option's text is a whole-word prefix of one of the forms in rule 2
       (``"Yes, because ..."`` names ``Yes``).

    Raises :class:`UnresolvedAnswer` when no option matches or several match at the deciding rule.
    """
    if not isinstance(answer, str):
        answer = str(answer)
    stripped = answer.strip()
    bare = _BARE_LETTER.fullmatch(stripped)
    bare_letter = bare and (bare.group(1) or bare.group(2))
    if bare_letter and bare_letter in options:
        return bare_letter
    head = _EXPLANATION.split(stripped, maxsplit=1)[0]
    forms = [normalise(form) for form in (stripped, head, _LEAD_IN.sub("", head, count=1))]
    forms = [form for form in dict.fromkeys(forms) if form]
    texts = {letter: normalise(text) for letter, text in options.items()}

    def decide(found: list[str], how: str) -> str | None:
        if len(found) > 1:
            raise UnresolvedAnswer(f"answer {stripped[:80]!r} {how} several options {found}")
        return found[0] if found else None

    for form in forms:
        letter = decide([key for key, text in texts.items() if text and text == form], "equals")
        if letter is not None:
            return letter
    labelled = _LABELLED_LINE.fullmatch(stripped)
    if (
        labelled is not None
        and labelled.group(1) in options
        and normalise(labelled.group(2)) == texts[labelled.group(1)]
    ):
        return labelled.group(1)
    for form in forms:
        found = [key for key, text in texts.items() if text and form.startswith(text + " ")]
        letter = decide(found, "begins with")
        if letter is not None:
            return letter
    if bare_letter:
        raise UnresolvedAnswer(f"answer letter {bare_letter!r} is not one of the options {list(options)}")
    raise UnresolvedAnswer(f"answer {stripped[:80]!r} matches none of the options {list(options)}")


def format_choices(options: Mapping[str, str]) -> str:
    """``"A. text\\nB. text..."``, the choice block of the user prompt."""
    return "\n".join(f"{letter}. {text}" for letter, text in options.items())


# ---- shared task ------------------------------------------------------------------------------------------
class MultipleChoiceTask(Task):
    """Shared loading, splitting, prompting and scoring of the real multiple-choice tasks.

    Subclasses set ``instruction`` and ``id_prefix`` and implement :meth:`select` and :meth:`build`,
    which turn source rows into examples with fields ``id``, ``question``, ``options`` (``{"A": text, ...}``), ``answer`` (the
    correct letter), ``row`` (index in the source split) and optionally ``reasoning``.

    Args:
        source: Hub dataset id, or a local file / directory in the same column layout.
        config: Hub configuration name (ignored for local files).
        revision: Hub revision to pin (ignored for local sources).
        train_split: the source split training rows come from (when ``eval_split`` is ``None``, also
            the pool the held-out split is drawn from).
        eval_split: a source split to use as ``test`` as is; ``None`` draws ``test`` from
            ``train_split`` by hashing (see the module docstring).
        eval_fraction: share of the pool that becomes ``test`` when ``eval_split`` is ``None``.
        seed: seed of the hashed split.
        num_val: ``val`` is the first ``num_val`` examples of ``test``.
        unmatched: ``"error"`` raises on a row whose correct letter cannot be established (unknown
            letter, answer text naming no option or several, unreadable options); ``"skip"`` drops it.
        **prompting: the prompting settings of :class:`~kdlab.tasks.base.Task`.
    """

    instruction: str = ""
    id_prefix: str = "mc"

    def __init__(
        self,
        source: str,
        config: str | None = None,
        revision: str | None = None,
        train_split: str = "train",
        eval_split: str | None = None,
        eval_fraction: float = 0.16,
        seed: int = 42,
        num_val: int = 200,
        unmatched: str = "error",
        **prompting: Any,
    ) -> None:
        super().__init__(**prompting)
        name = type(self).__name__
        if not source:
            raise ValueError(f"{name}.source must be a Hub dataset id or a local path, got {source!r}")
        if eval_split is None and not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"{name}.eval_fraction must be in (0, 1), got {eval_fraction}")
        if num_val < 0:
            raise ValueError(f"{name}.num_val must be >= 0, got {num_val}")
        if unmatched not in UNMATCHED:
            raise ValueError(f"{name}.unmatched must be one of {UNMATCHED}, got {unmatched!r}")
        self.source, self.config, self.revision = source, config, revision
        self.train_split, self.eval_split = train_split, eval_split
        self.eval_fraction, self.seed, self.num_val, self.unmatched = eval_fraction, seed, num_val, unmatched
        self._held: dict[str, list[Example]] | None = None

    # ---- subclasses ------------------------------------------------------------------------------
    def select(self, rows: list[dict]) -> list[tuple[int, dict]]:
        """``(index, row)`` of the source rows this task keeps, after checking their required fields."""
        raise NotImplementedError

    def build(self, index: int, row: dict, split: str) -> Example | None:
        """The example of one selected row (``None`` drops it); raises :class:`UnresolvedAnswer` when
        the correct letter cannot be established."""
        raise NotImplementedError

    # ---- shared ---------------------------------------------------------------------------------
    def _resolve(self, index: int, row: dict, split: str) -> Example | None:
        """:meth:`build`, where an :class:`UnresolvedAnswer` becomes an error naming source and row, or
        (``unmatched="skip"``) ``None``."""
        try:
            return self.build(index, row, split)
        except UnresolvedAnswer as error:
            if self.unmatched == "skip":
                return None
            raise UnresolvedAnswer(f"{self.source} row {index}: {error}") from None

    def _load(self, split: str) -> list[Example]:
        rows = load_rows(self.source, split, config=self.config, revision=self.revision)
        examples = (self._resolve(index, row, split) for index, row in self.select(rows))
        return [example for example in examples if example is not None]

    def _row_id(self, index: int, split: str) -> str:
        """``<prefix>-<row>`` when both splits come from one source split, else ``<prefix>-<split>-<row>``."""
        return f"{self.id_prefix}-{index}" if self.eval_split is None else f"{self.id_prefix}-{split}-{index}"

    def _partition(self) -> dict[str, list[Example]]:
        if self._held is None:
            pool = self._load(self.train_split)
            if self.eval_split is None:
                keys = [f"{ex['question']}\x1f{json.dumps(ex['options'], sort_keys=True)}" for ex in pool]
                train, test = split_by_fraction(keys, self.eval_fraction, self.seed)
                self._held = {"train": [pool[i] for i in train], "test": [pool[i] for i in test]}
            else:
                self._held = {"train": pool, "test": self._load(self.eval_split)}
        return self._held

    def load_split(self, split: str) -> list[Example]:
        held = self._partition()
        return held["test"][: self.num_val] if split == "val" else held[split]

    def user_prompt(self, example: Example) -> str:
        return f"{self.instruction}\n\n{example['question']}\n\n{format_choices(example['options'])}"

    def score(self, example: Example, completion: str) -> float:
        options = example.get("options")
        letters = "".join(options) if isinstance(options, Mapping) else "ABCD"
        letter = read_letter(completion, letters)
        return float(letter is not None and letter == example.get("answer"))

    def reference_completion(self, example: Example) -> str:
        """The row's reasoning (if any) in ``<think>``, then the correct letter in ``<answer>``."""
        letter = example["answer"]
        reasoning = (example.get("reasoning") or "").strip()
        if not reasoning:
            reasoning = f"Option {letter} ({example['options'][letter]}) is correct."
        return f"<think>{reasoning}</think>\n<answer>{letter}</answer>"


# ---- Science ------------------------------------------------------------------------------------------------
class Science(MultipleChoiceTask):
    """SciKnowEval chemistry, level L3 (reasoning), four-option multiple choice.

    Source columns (``hicai-zju/SciKnowEval``, one Hub config per domain, a single ``test`` split):
    ``question`` (str), ``choices`` (``{"text": [...], "label": ["A", "B", "C", "D"]}``), ``answerKey``
    (a label), ``type`` (``"mcq-4-choices"``, ``"mcq-2-choices"``, ``"true_or_false"``, ...),
    ``domain`` (``"Chemistry"``, ...), ``details`` (``{"level": "L3", "task": ..., "subtask": ...}``);
    other columns (``prompt``, ``answer``) are ignored. Rows are kept when ``domain``,
    ``details.level`` and ``type`` equal the filters (a ``None`` filter keeps everything), then
    ``question``, ``choices`` and ``answerKey`` are required.

    Example fields: ``id`` (``"science-<row>"``), ``question``, ``options``, ``answer`` (the letter),
    ``row``. The prompt is the paper's instruction, a blank line, the question, a blank line, and one
    ``"A. text"`` line per choice.

    Args:
        domain / level / question_type: row filters (see above); defaults select the paper's data.
        eval_fraction: 0.16 by default, close to the paper's unpublished 507 / (2,674 + 507).
        train_split: defaults to ``"test"``, the only split SciKnowEval publishes; the other
            arguments are :class:`MultipleChoiceTask`'s.
    """

    default_system_prompt = SCIENCE_SYSTEM_PROMPT
    instruction = SCIENCE_INSTRUCTION
    id_prefix = "science"

    def __init__(
        self,
        source: str = "hicai-zju/SciKnowEval",
        config: str | None = "Chemistry",
        revision: str | None = None,
        train_split: str = "test",
        eval_split: str | None = None,
        eval_fraction: float = 0.16,
        seed: int = 42,
        num_val: int = 200,
        unmatched: str = "error",
        domain: str | None = "Chemistry",
        level: str | None = "L3",
        question_type: str | None = "mcq-4-choices",
        **prompting: Any,
    ) -> None:
        super().__init__(
            source, config, revision, train_split, eval_split, eval_fraction, seed, num_val, unmatched, **prompting
        )
        self.domain, self.level, self.question_type = domain, level, question_type

    def _keep(self, index: int, row: dict) -> bool:
        filters = (("domain", self.domain), ("details", self.level), ("type", self.question_type))
        require_fields(self.source, [(index, row)], [key for key, wanted in filters if wanted is not None])
        if self.level is not None:
            details = row["details"]
            if not isinstance(details, Mapping):
                raise ValueError(f"{self.source} row {index}: field 'details' must be a mapping, got {details!r}")
            if details.get("level") != self.level:
                return False
        return (self.domain is None or row["domain"] == self.domain) and (
            self.question_type is None or row["type"] == self.question_type
        )

    def select(self, rows: list[dict]) -> list[tuple[int, dict]]:
        kept = [(index, row) for index, row in enumerate(rows) if self._keep(index, row)]
        require_fields(self.source, kept, ("question", "choices", "answerKey"))
        return kept

    def build(self, index: int, row: dict, split: str) -> Example:
        choices = row["choices"]
        if not isinstance(choices, Mapping) or choices.get("text") is None or choices.get("label") is None:
            raise ValueError(f"{self.source} row {index}: field 'choices' must hold 'text' and 'label' lists")
        texts, labels = list(choices["text"]), [str(label).strip() for label in choices["label"]]
        if len(texts) != len(labels):
            raise UnresolvedAnswer(f"choices have {len(texts)} texts but {len(labels)} labels")
        options = parse_options(dict(zip(labels, texts)))
        key = str(row["answerKey"]).strip()
        if key not in options:
            raise UnresolvedAnswer(f"answerKey {key!r} is not one of the choice labels {list(options)}")
        return {
            "id": self._row_id(index, split),
            "question": str(row["question"]).strip(),
            "options": options,
            "answer": key,
            "row": index,
        }


# ---- MedReason -----------------------------------------------------------------------------------------------
class MedReason(MultipleChoiceTask):
    """UCSC-VLAA/MedReason: medical multiple choice with knowledge-graph reasoning traces.

    Source columns (a single ``train`` split): ``dataset_name`` (the origin: ``medqa``, ``medmcqa``,
    ``pubmedqa``, ``huatuo``, ...), ``id_in_dataset``, ``question`` (the stem), ``options`` (one string,
    ``"Answer Choices:\\nA. ...\\nB. ..."``; empty for open-ended questions), ``answer`` (the correct
    option's *text*, sometimes followed by ``". Explanation: ..."``), ``reasoning`` (the trace).
    ``question``, ``options`` and ``answer`` are required; rows with empty ``options`` are
    open-ended and dropped; the letter is recovered by :func:`recover_letter`.

    Example fields: ``id`` (``"medreason-<row>"``), ``question``, ``options``, ``answer`` (the letter),
    ``reasoning`` (``""`` when absent), ``row``. The prompt is the paper's instruction, a blank line,
    the question, a blank line, and one ``"A. text"`` line per choice (some rows have five or more).

    Args:
        eval_fraction: 0.05 by default (the paper does not give its MedReason split).
        Others: see :class:`MultipleChoiceTask`.
    """

    default_system_prompt = MEDREASON_SYSTEM_PROMPT
    instruction = MEDREASON_INSTRUCTION
    id_prefix = "medreason"

    def __init__(
        self,
        source: str = "UCSC-VLAA/MedReason",
        config: str | None = None,
        revision: str | None = None,
        train_split: str = "train",
        eval_split: str | None = None,
        eval_fraction: float = 0.05,
        seed: int = 42,
        num_val: int = 200,
        unmatched: str = "error",
        **prompting: Any,
    ) -> None:
        super().__init__(
            source, config, revision, train_split, eval_split, eval_fraction, seed, num_val, unmatched, **prompting
        )

    def select(self, rows: list[dict]) -> list[tuple[int, dict]]:
        indexed = list(enumerate(rows))
        require_fields(self.source, indexed, ("question", "options", "answer"))
        return indexed

    def build(self, index: int, row: dict, split: str) -> Example | None:
        options = parse_options(row["options"])
        if not options:
            return None  # open-ended question: nothing to choose from
        reasoning = row.get("reasoning")
        return {
            "id": self._row_id(index, split),
            "question": str(row["question"]).strip(),
            "options": options,
            "answer": recover_letter(row["answer"], options),
            "reasoning": reasoning.strip() if isinstance(reasoning, str) else "",
            "row": index,
        }
