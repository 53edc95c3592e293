"""Pure measurement functions: pass@k, mean scores, update sparsity, and the language of a response.

Callbacks and reports build on these; each is small enough to check by hand.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping, Sequence

import torch
from torchmetrics import Metric


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: ``1 - C(n-c, k) / C(n, k)``.

    Computed as ``1 - prod_{i=n-c+1}^{n} (1 - k / i)`` to avoid huge binomials. Requires
    ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


class PassAtK(Metric):
    """torchmetrics pass@k averaged over problems; ``update(correct)`` takes one problem's ``n`` sample
    outcomes (bools), or a ``(problems, n)`` bool tensor (``problems`` may be 0: nothing added). ``compute()`` returns
    ``{k: pass@k}``; under several processes the sums and problem counts are summed over the ranks first."""

    full_state_update = False

    def __init__(self, ks: Sequence[int] = (1, 10), **kwargs) -> None:
        super().__init__(**kwargs)
        if not ks or any(k < 1 for k in ks):
            raise ValueError(f"PassAtK.ks must be positive integers, got {list(ks)}")
        self.ks = tuple(ks)
        self.add_state("sums", default=torch.zeros(len(self.ks), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("problems", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, correct: torch.Tensor | Sequence[bool]) -> None:
        outcomes = torch.as_tensor(correct, dtype=torch.bool)
        if outcomes.dim() == 1:
            outcomes = outcomes[None]
        n = outcomes.shape[1]
        if max(self.ks) > n:
            raise ValueError(f"PassAtK: k={max(self.ks)} needs at least that many samples per problem, got {n}")
        rows = [[pass_at_k(n, int(row), k) for k in self.ks] for row in outcomes.sum(dim=1).tolist()]
        # out of place: states made under a Trainer's inference mode (validate before fit) cannot be updated in place
        self.sums = self.sums + torch.tensor(rows, dtype=torch.float64, device=self.sums.device).reshape(-1, len(self.ks)).sum(dim=0)
        self.problems = self.problems + outcomes.shape[0]

    def compute(self) -> dict[int, torch.Tensor]:
        means = self.sums / self.problems.clamp(min=1)
        return {k: means[i] for i, k in enumerate(self.ks)}


class MeanScore(Metric):
    """torchmetrics mean of scores: ``update(scores)`` adds a 1-D float tensor (or sequence) of scores, possibly
    empty; ``compute()`` returns their mean over every update (float64; 0 when there were none). Under several
    processes the score sums and counts are summed over the ranks before dividing, so ranks that scored different
    numbers of rows weigh each row the same (Lightning's ``self.log(..., sync_dist=True)`` averages its integer
    row counts over the ranks with integer division: 5 rows on 2 ranks counted as 4)."""

    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("total", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, scores: torch.Tensor | Sequence[float]) -> None:
        values = torch.as_tensor(scores, dtype=torch.float64).reshape(-1)
        # out of place, as PassAtK: states made under a Trainer's inference mode cannot be updated in place
        self.total = self.total + values.sum().to(self.total.device)
        self.count = self.count + values.numel()

    def compute(self) -> torch.Tensor:
        return self.total / self.count.clamp(min=1)


def update_sparsity(before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor], threshold: float) -> float:
    """Fraction of parameters whose change ``|after - before|`` is strictly below ``threshold``.

    ``before`` and ``after`` map parameter names to tensors of equal shapes; the fraction is over
    all their entries together (counted in float64 on each tensor's device).
    """
    if not threshold > 0:
        raise ValueError(f"update_sparsity: threshold must be > 0, got {threshold}")
    if before.keys() != after.keys():
        raise ValueError(f"update_sparsity: parameter names differ: {sorted(set(before) ^ set(after))[:5]}")
    small, total = sparsity_counts(before, after, threshold)
    if total == 0:
        raise ValueError("update_sparsity: no parameters to compare")
    return small / total


def sparsity_counts(before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor], threshold: float) -> tuple[int, int]:
    """(entries that moved less than ``threshold``, all entries): the shard-local counts behind
    :func:`update_sparsity`, so sharded runs can sum them across ranks before dividing."""
    small = total = 0
    for name, old in before.items():
        new = after[name]
        if old.shape != new.shape:
            raise ValueError(f"update_sparsity: {name} has shape {tuple(old.shape)} before and {tuple(new.shape)} after")
        delta = (new.detach().to(old.device, torch.float64) - old.detach().to(torch.float64)).abs()
        small += int((delta < threshold).sum())
        total += delta.numel()
    return small, total


def bf16_frozen_counts(weights: Mapping[str, torch.Tensor], step: float) -> tuple[int, int]:
    """(entries a step of ``+-step`` cannot move in bf16, all entries): an entry is frozen when both
    ``w + step`` and ``w - step``, computed in fp32 and rounded to bf16 as a bf16 optimiser step is, give ``w``
    back, i.e. ``step`` is below half the bf16 spacing around ``w`` (8 significant bits: a weight of magnitude
    ``2**e`` cannot move by less than ``2**(e - 8)``).

    The rounding prediction of update sparsity: with bf16 weights and Adam (whose step is about ``lr`` for a
    steady gradient, ``|m / sqrt(v)| <= 1``), an entry frozen at ``step = lr`` never changes, so the share frozen
    is what the weights alone predict of ``S_tau`` at that LR. Weights are read through bf16 first."""
    if not step > 0:
        raise ValueError(f"bf16_frozen_counts: step must be > 0, got {step}")
    frozen = total = 0
    for tensor in weights.values():
        w = tensor.detach().to(torch.bfloat16)
        wide = w.float()
        same = ((wide + step).to(torch.bfloat16) == w) & ((wide - step).to(torch.bfloat16) == w)
        frozen += int(same.sum())
        total += w.numel()
    return frozen, total


# ---- language of a response ---------------------------------------------------------------------
MIN_WORDS = 2
"""Fewest words (runs of two or more letters) a response must keep once its language-neutral parts are removed for
its language to be judged: py3langid calls a lone English word ("Done.", "Total", "Correct", "Result") Spanish; two
words are judged ("Final answer" English, "¿Cómo cómo?" Spanish)."""

_NEUTRAL = [
    re.compile(r"<answer>.*?</answer>", re.S),  # answer labels and equations
    re.compile(r"```.*?```", re.S),  # code blocks
    re.compile(r"\\boxed\{[^{}]*\}"),  # boxed answers
    re.compile(r"\\\(.*?\\\)|\\\[.*?\\\]", re.S),  # LaTeX inline \(...\) and display \[...\] maths: never currency
    re.compile(r"\\begin\{(equation|align|gather|multline|eqnarray)(\*?)\}.*?\\end\{\1\2\}", re.S),  # maths environments
]
_AFTER_MATHS = [
    re.compile(r"</?[a-zA-Z_]+>|<\|[^|]*\|>"),  # tags and special tokens
    re.compile(r"[0-9+\-*/×÷=().,;:\[\]{}^%<>|_\\$]+"),  # numbers, operators, punctuation, currency signs
]
_LATEX_COMMAND = re.compile(r"\\[a-zA-Z]+\*?(?:\{[^{}$]*\})?")  # \frac, \cdot, \text{ mol}: a command and its first argument
_PROSE_WORD = re.compile(r"[^\W\d_]{3,}")  # three or more letters in a row: a word, not a variable (x, ab, pH)
_DISPLAY_MATHS = re.compile(r"\$\$(.*?)\$\$", re.S)


def looks_like_maths(inner: str) -> bool:
    """Whether the text between two dollar signs is maths: once LaTeX commands (with their first braced argument:
    ``\\frac{a}``, ``\\text{ mol}``) are removed, no word of three or more letters is left, only digits, operators and
    variables of one or two letters. ``"x^2 + 2ab"`` and ``"6.02 \\times 10^{23} \\text{ mol}^{-1}"`` are maths;
    the ``"5 for apples and then he also pays "`` between two dollar amounts is prose."""
    return _PROSE_WORD.search(_LATEX_COMMAND.sub(" ", inner)) is None


def _without_maths(text: str) -> str:
    """``text`` without its ``$$...$$`` and ``$...$`` spans whose content :func:`looks_like_maths`. A span that
    does not is prose between two currency amounts (``$5 ... $3``): it is kept, and its closing ``$`` may open the
    next span (``$5 and we solve $x+1=6$``)."""
    text = _DISPLAY_MATHS.sub(lambda match: " " if looks_like_maths(match.group(1)) else match.group(0), text)
    kept, start, opening = [], 0, text.find("$")
    while opening != -1:
        closing = text.find("$", opening + 1)
        if closing == -1:
            break
        if looks_like_maths(text[opening + 1:closing]):
            kept.append(text[start:opening] + " ")
            start, opening = closing + 1, text.find("$", closing + 1)
        else:
            opening = closing
    return "".join(kept) + text[start:]


def strip_language_neutral(text: str) -> str:
    """Remove what counts as language-neutral (answers, code, boxed answers, maths between dollar signs, between
    ``\\(`` and ``\\)`` or ``\\[`` and ``\\]`` and in equation-like environments, tags,
    numbers, operators and punctuation), leaving the words whose language is judged. Dollar signs around prose
    (``$5 for apples and then $3``) are currency, not maths: the prose stays (:func:`looks_like_maths`)."""
    for pattern in _NEUTRAL:
        text = pattern.sub(" ", text)
    text = _without_maths(text)
    for pattern in _AFTER_MATHS:
        text = pattern.sub(" ", text)
    return " ".join(text.split())


@functools.cache
def _identifier(languages: tuple[str, ...]):
    try:
        from py3langid import langid
    except ImportError as error:
        raise ImportError("language detection needs py3langid: pip install 'kdlab[eval]'") from error
    identifier = langid.LanguageIdentifier.from_model_file(langid.MODEL_FILE, norm_probs=True)
    identifier.set_languages(list(languages))
    return identifier


def require_language_detector() -> None:
    """Raise now, naming ``pip install 'kdlab[eval]'``, if py3langid is not installed: a callback that judges languages
    calls it when it is built, before any training."""
    _identifier(("en", "es"))


def detect_language(text: str, languages: Sequence[str] = ("en", "es")) -> str | None:
    """The language (ISO 639-1 code among ``languages``) of ``text``'s words, judged by py3langid
    after :func:`strip_language_neutral`; ``None`` when fewer than :data:`MIN_WORDS` words (runs of two or
    more letters) are left: too little language to judge."""
    words = strip_language_neutral(text)
    if len(re.findall(r"[^\W\d_]{2,}", words)) < MIN_WORDS:
        return None
    return _identifier(tuple(languages)).classify(words)[0]


def spanish_share(texts: Iterable[str]) -> float:
    """Share of ``texts`` that are primarily Spanish (English vs Spanish, :func:`detect_language`). A text with too
    little language to judge (fewer than :data:`MIN_WORDS` words once its maths, tags and answers are removed,
    ``"3+5=8, 8*4=32. Listo."`` as much as ``"... Done."``) counts as not Spanish: it is one of the responses, and
    it is not primarily Spanish."""
    texts = list(texts)
    if not texts:
        raise ValueError("spanish_share needs at least one text")
    return sum(detect_language(text) == "es" for text in texts) / len(texts)
