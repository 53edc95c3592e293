"""How the study's verdicts are labelled: an :class:`Effect` (an estimate with its 95% intervals), a :class:`Claim`
(what the paper says of it: a difference of a sign, or none within a margin) and the one rule, :func:`label`, that
turns a claim's seed-level interval into a word; :func:`row_word` joins a row's words. A claim about a style
student that collapsed (:func:`collapse_reason`) is labelled "collapsed", whatever its interval."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kdlab.study import stats

REPRODUCED, OPPOSITE, NOT_DISTINGUISHABLE = "reproduced", "opposite", "not distinguishable"
EQUIVALENT, DIFFERENT = "equivalent", "different"
NOT_REPRODUCED = OPPOSITE  # the former name of "opposite"
NOT_RUN = "not run"
NO_DIFFERENCE = 0  # the claim of no difference, beside the signs +1 / -1 of a claimed difference
ACCURACY_MARGIN = 0.02  # equivalence margin of accuracy and pass@k differences (fractions: 2 points)
OOD_MARGIN = 2.0  # equivalence margin of the OOD change (logged in points)
COLLAPSED = "collapsed"
COLLAPSE_ACCURACY = 0.05  # a style student below 5% held-out accuracy has not learned the task ...
COLLAPSE_OOD = 50.0  # ... and one below 50 points of mean accuracy on its earlier skills has lost them


@dataclass(frozen=True)
class Effect:
    """An estimate with its 95% intervals, in the logged units (fractions; OOD change in points): ``low``/
    ``high`` over seeds (and problems and samples), which labels come from, None with a configuration of one
    seed; ``problems`` (accuracy and pass@k) over problems and samples, the trained models held fixed."""

    value: float
    low: float | None
    high: float | None
    how: str
    problems: tuple[float, float] | None = None

    @property
    def sign(self) -> int:
        """+1 / -1 when the seed-level interval lies above / below 0, else 0 (also without one)."""
        if self.low is None or self.high is None:
            return 0
        return 1 if self.low > 0 else -1 if self.high < 0 else 0

    def text(self, scale: float = 100.0) -> str:
        """``value [problems] / seeds [seed-level]`` in points (no problems interval: ``value seeds [...]``)."""
        pair = "[{:+.1f}, {:+.1f}]".format
        shown = f"{scale * self.value:+.1f}" + (f" {pair(scale * self.problems[0], scale * self.problems[1])} /" if self.problems else "")
        return shown + " seeds " + (pair(scale * self.low, scale * self.high) if self.low is not None and self.high is not None else "n/a")


def t_quantile(df: float) -> float:
    """Student's t 97.5% quantile with ``df`` degrees of freedom (any real; infinite below 1)."""
    return stats.t_quantile(0.975, df) if df >= 1 else math.inf


def label(effect: Effect | None, claim: int, margin: float | None = None, scale: float = 100.0) -> str:
    """One claim's label from ``effect``'s seed-level interval. A claimed difference of sign ``claim``
    (+1 / -1): "reproduced" (the interval excludes 0 on that side), "opposite" (on the other), else "not
    distinguishable". No difference (:data:`NO_DIFFERENCE`): "equivalent" (inside +-``margin``, ends
    included), else "different" (excludes 0), else "not distinguishable", each with the margin in points
    (``scale`` per logged unit). No effect or no seed-level interval: "not distinguishable"."""
    if claim == NO_DIFFERENCE:
        if margin is None or margin <= 0:
            raise ValueError("a claim of no difference needs a positive equivalence margin")
        stated = f" (margin +-{scale * margin:g} points)"
        if effect is None or effect.low is None or effect.high is None:
            return NOT_DISTINGUISHABLE + stated
        if -margin <= effect.low and effect.high <= margin:
            return EQUIVALENT + stated
        return (DIFFERENT if effect.sign else NOT_DISTINGUISHABLE) + stated
    if claim not in (1, -1):
        raise ValueError(f"a claim is +1, -1 or NO_DIFFERENCE (0), got {claim}")
    if effect is None or effect.sign == 0:
        return NOT_DISTINGUISHABLE
    return REPRODUCED if effect.sign == claim else OPPOSITE


@dataclass(frozen=True)
class Claim:
    """One claim a row tests: ``name`` (the contrast), its ``effect``, the paper's ``sign`` (+1 / -1, or
    :data:`NO_DIFFERENCE` with ``margin``) and the points per logged unit (``scale``)."""

    name: str
    effect: Effect | None
    sign: int
    margin: float | None = None
    scale: float = 100.0
    collapsed: bool = False  # a configuration it compares collapsed (:func:`collapse_reason`): labelled "collapsed"

    @property
    def label(self) -> str:
        return COLLAPSED if self.collapsed else label(self.effect, self.sign, self.margin, self.scale)

    @property
    def rule(self) -> str:
        if self.sign == NO_DIFFERENCE:
            return f"{self.name} = 0 (+-{self.scale * self.margin:g} points)"
        return f"{self.name} {'>' if self.sign > 0 else '<'} 0"


def verdict_word(effect: Effect | None, paper_sign: int) -> str:
    """:func:`label` of a claimed difference of sign ``paper_sign`` (kdlab 0.1's name for it)."""
    return label(effect, paper_sign)


def row_word(claims: list[Claim]) -> str:
    """A row's label from its claims' labels: the label when they all agree (or the only one), else each
    label followed by its claims, ``label: claim, claim; label: claim``. No claims: not distinguishable."""
    by_label: dict[str, list[str]] = {}
    for claim in claims:
        by_label.setdefault(claim.label, []).append(claim.name)
    if len(by_label) <= 1:
        return next(iter(by_label), NOT_DISTINGUISHABLE)
    return "; ".join(f"{word}: {', '.join(names)}" for word, names in by_label.items())


def collapse_reason(accuracy: float | None, ood_mean: float | None) -> str | None:
    """Why a (style) student counts as collapsed, or None: its held-out accuracy (a fraction) below
    :data:`COLLAPSE_ACCURACY`, or its earlier skills' mean accuracy (``ood/mean``, points) below :data:`COLLAPSE_OOD`.
    Its output then says nothing about style transfer: a broken model's Spanish share is not a transferred style."""
    reasons = []
    if accuracy is not None and accuracy < COLLAPSE_ACCURACY:
        reasons.append(f"accuracy {100 * accuracy:.1f}% < {100 * COLLAPSE_ACCURACY:g}%")
    if ood_mean is not None and ood_mean < COLLAPSE_OOD:
        reasons.append(f"earlier skills {ood_mean:.1f} < {COLLAPSE_OOD:g} points")
    return ", ".join(reasons) or None
