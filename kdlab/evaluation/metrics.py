"""Pure measurement functions: pass@k, update sparsity, and the language of a response.

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
    outcomes (bools), or a ``(problems, n)`` bool tensor. ``compute()`` returns ``{k: pass@k}``."""

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
        self.sums = self.sums + torch.tensor(rows, dtype=torch.float64, device=self.sums.device).sum(dim=0)
        self.problems = self.problems + outcomes.shape[0]

    def compute(self) -> dict[int, torch.Tensor]:
        means = self.sums / self.problems.clamp(min=1)
        return {k: means[i] for i, k in enumerate(self.ks)}


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
_NEUTRAL = [
    re.compile(r"<answer>.*?</answer>", re.S),  # answer labels and equations
    re.compile(r"```.*?```", re.S),  # code blocks
    re.compile(r"\\boxed\{[^{}]*\}|\$[^$]*\$"),  # maths
    re.compile(r"</?[a-zA-Z_]+>|<\|[^|]*\|>"),  # tags and special tokens
    re.compile(r"[0-9+\-*/×÷=().,;:\[\]{}^%<>|_\\]+"),  # numbers, operators, punctuation
]


def strip_language_neutral(text: str) -> str:
    """Remove what counts as language-neutral (tags, answers, equations, numbers, maths, code),
    leaving the words whose language is judged."""
    for pattern in _NEUTRAL:
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


def detect_language(text: str, languages: Sequence[str] = ("en", "es")) -> str | None:
    """The language (ISO 639-1 code among ``languages``) of ``text``'s words, judged by py3langid
    after :func:`strip_language_neutral`; ``None`` when no word is left."""
    words = strip_language_neutral(text)
    if not re.search(r"[^\W\d_]", words):
        return None
    return _identifier(tuple(languages)).classify(words)[0]


def spanish_share(texts: Iterable[str]) -> float:
    """Share of ``texts`` that are primarily Spanish (English vs Spanish); texts with no words count as not Spanish."""
    texts = list(texts)
    if not texts:
        raise ValueError("spanish_share needs at least one text")
    return sum(detect_language(text) == "es" for text in texts) / len(texts)
