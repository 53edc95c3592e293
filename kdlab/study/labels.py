"""How the study's verdicts are labelled: an :class:`Effect` (an estimate with its seed-level intervals), a
:class:`Claim` (what the paper says of it: a difference of a sign, beyond a margin or not; none within a margin, a
TOST; no superiority; the paper's magnitude) and the one rule, :func:`label`, that turns a claim's seed-level
intervals into a word, every one-sided test at :data:`ALPHA` (the 90% interval); :func:`p_value` is the same test's
p-value and :func:`holm` corrects a family of them; :func:`row_word` joins a row's words. A claim about a style
student that collapsed (:func:`collapse_reason`) is labelled "collapsed", whatever its interval."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kdlab.study import stats

REPRODUCED, OPPOSITE, NOT_DISTINGUISHABLE = "reproduced", "opposite", "not distinguishable"
EQUIVALENT, DIFFERENT = "equivalent", "different"
NOT_REPRODUCED = OPPOSITE  # the former name of "opposite"
NOT_RUN = "not run"
NOT_HERE = "not tested here"  # the study's design (StudyDesign.elsewhere) leaves the finding's part to another study
NO_DIFFERENCE = 0  # the claim of no difference (a TOST), beside the signs +1 / -1 of a claimed difference
NOT_SUPERIOR = 2  # the one-sided claim "not better by more than the margin" (non-superiority)
MAGNITUDE = 3  # the paper's magnitude: does the interval meet the paper's range (descriptive, no test)
ALPHA = 0.05  # every one-sided test (each side of a TOST, non-superiority, a claimed sign), and Holm's family-wise level
UNTESTABLE = "untestable"
WITHIN_MARGIN = "within the margin"  # a difference claimed beyond a margin, whose 90% interval lies inside +-margin
AS_PAPER, SMALLER, LARGER = "as large as the paper's", "smaller than the paper's", "larger than the paper's"
ACCURACY_MARGIN = 0.02  # equivalence margin of accuracy and pass@k differences (fractions: 2 points)
OOD_MARGIN = 2.0  # equivalence margin of the OOD change (logged in points)
COLLAPSED = "collapsed"
COLLAPSE_ACCURACY = 0.05  # a style student below 5% held-out accuracy has not learned the task ...
COLLAPSE_OOD = 50.0  # ... and one below 50 points of mean accuracy on its earlier skills has lost them
COLLAPSE_DROP = 0.10  # where the student's own accuracy before training is known: a drop of more than 10 points


@dataclass(frozen=True)
class Effect:
    """An estimate with its 95% intervals, in the logged units (fractions; OOD change in points): ``low``/
    ``high`` over seeds (and problems), which labels come from, None with a configuration of one seed; ``problems``
    (accuracy and pass@k) over problems and samples, the trained models held fixed; ``seeds`` the seed-level
    interval's whole record (its 90% ends, p-values; None for a made-up effect, whose 95% interval
    then stands in for the 90% one and which has no p-value)."""

    value: float
    low: float | None
    high: float | None
    how: str
    problems: tuple[float, float] | None = None
    seeds: stats.SeedInterval | None = field(default=None, compare=False, repr=False)

    @property
    def sign(self) -> int:
        """+1 / -1 when the seed-level 95% interval lies above / below 0, else 0 (also without one)."""
        if self.low is None or self.high is None:
            return 0
        return 1 if self.low > 0 else -1 if self.high < 0 else 0

    @property
    def interval90(self) -> tuple[float, float] | None:
        """The seed-level 90% interval (one-sided tests at 5% read its ends); the 95% one for a made-up effect."""
        if self.seeds is not None:
            return self.seeds.low90, self.seeds.high90
        return None if self.low is None or self.high is None else (self.low, self.high)

    def p_greater(self, null: float) -> float:
        """One-sided p-value of "the effect > ``null``" (1 without a seed-level interval)."""
        return 1.0 if self.seeds is None else self.seeds.p_greater(null)

    def p_less(self, null: float) -> float:
        """One-sided p-value of "the effect < ``null``" (1 without a seed-level interval)."""
        return 1.0 if self.seeds is None else self.seeds.p_less(null)

    def text(self, scale: float = 100.0) -> str:
        """``value [problems] / seeds [seed-level] (90% [seed-level])`` in points, the 95% intervals and the 90% one the
        one-sided tests read (no problems interval: ``value seeds [...]``; a made-up effect: no 90% one)."""
        pair = "[{:+.1f}, {:+.1f}]".format
        shown = f"{scale * self.value:+.1f}" + (f" {pair(scale * self.problems[0], scale * self.problems[1])} /" if self.problems else "")
        if self.low is None or self.high is None:
            return shown + " seeds n/a"
        ninety = f" (90% {pair(scale * self.seeds.low90, scale * self.seeds.high90)})" if self.seeds is not None else ""
        return shown + " seeds " + pair(scale * self.low, scale * self.high) + ninety


def t_quantile(df: float) -> float:
    """Student's t 97.5% quantile with ``df`` degrees of freedom (any real; infinite below 1)."""
    return stats.t_quantile(0.975, df) if df >= 1 else math.inf


def label(effect: Effect | None, claim: int, margin: float | None = None, scale: float = 100.0,
          expected: tuple[float, float] | None = None) -> str:
    """One claim's label from ``effect``'s seed-level intervals; every one-sided test is at :data:`ALPHA` (5%), so it
    reads the 90% interval. A claimed difference of sign ``claim`` (+1 / -1), beyond ``margin`` when one is given
    (``sign * effect > margin``): "reproduced" (the 90% interval lies beyond it on that side), "opposite" (the 90%
    interval lies beyond 0 on the other side), "within the margin" (a margin is given and the 90% interval lies inside
    +-margin: a difference smaller than the claimed one), else "not distinguishable". No difference (:data:`NO_DIFFERENCE`,
    a TOST): "equivalent" (the 90% interval inside +-``margin``, ends included), else "different" (the 95% interval
    excludes 0), else "not distinguishable". Not superior (:data:`NOT_SUPERIOR`, ``effect < +margin``): "reproduced"
    (the 90% interval's upper end below the margin), else "opposite" (the 95% interval above 0), else "not
    distinguishable". The paper's magnitude (:data:`MAGNITUDE`, ``expected`` its range): "as large as the paper's"
    (the 95% interval meets the range), else "smaller than the paper's" (it lies on 0's side of the range) or "larger
    than the paper's". A margin is stated in points (``scale`` per logged unit). No effect or no seed-level interval:
    "not distinguishable"."""
    stated = "" if margin is None else f" (margin +-{scale * margin:g} points)"
    if claim == MAGNITUDE:
        if expected is None:
            raise ValueError("a claim of the paper's magnitude needs its expected range")
        if effect is None or effect.low is None or effect.high is None:
            return NOT_DISTINGUISHABLE
        bottom, top = sorted(expected)
        if effect.high < bottom or effect.low > top:  # the interval misses the range: on 0's side of it, or beyond it
            return SMALLER if (effect.low > top if top <= 0 else effect.high < bottom) else LARGER
        return AS_PAPER
    if claim in (NO_DIFFERENCE, NOT_SUPERIOR) and (margin is None or margin <= 0):
        raise ValueError("a claim of no difference or of no superiority needs a positive margin")
    if claim not in (1, -1, NO_DIFFERENCE, NOT_SUPERIOR):
        raise ValueError(f"a claim is +1, -1, NO_DIFFERENCE (0), NOT_SUPERIOR or MAGNITUDE, got {claim}")
    ninety = effect.interval90 if effect is not None else None
    if ninety is None:
        return NOT_DISTINGUISHABLE + stated
    low, high = ninety
    if claim == NO_DIFFERENCE:
        if -margin <= low and high <= margin:
            return EQUIVALENT + stated
        return (DIFFERENT if effect.sign else NOT_DISTINGUISHABLE) + stated
    if claim == NOT_SUPERIOR:
        if high < margin:
            return REPRODUCED + stated
        return (OPPOSITE if effect.sign > 0 else NOT_DISTINGUISHABLE) + stated
    beyond = margin or 0.0
    if (claim > 0 and low > beyond) or (claim < 0 and high < -beyond):
        return REPRODUCED + stated
    if (claim > 0 and high < 0) or (claim < 0 and low > 0):
        return OPPOSITE + stated
    if beyond and -beyond < low and high < beyond:
        return WITHIN_MARGIN + stated
    return NOT_DISTINGUISHABLE + stated


def p_value(effect: Effect | None, claim: int, margin: float | None = None) -> float:
    """The one-sided p-value of the claim :func:`label` tests (1 without an effect or a seed-level interval; the
    magnitude is descriptive, 1 too): a claimed sign, ``sign * effect > margin``; no difference, the TOST's larger
    p-value ``max(p(effect > -margin), p(effect < margin))``; not superior, ``p(effect < margin)``."""
    if effect is None or effect.seeds is None or claim == MAGNITUDE:
        return 1.0
    if claim == NO_DIFFERENCE:
        return max(effect.p_greater(-margin), effect.p_less(margin))
    if claim == NOT_SUPERIOR:
        return effect.p_less(margin)
    beyond = margin or 0.0
    return effect.p_greater(beyond) if claim > 0 else effect.p_less(-beyond)


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the given order (``statsmodels.stats.multitest.multipletests``)."""
    if not p_values:
        return []
    multipletests = stats.statistics_library("statsmodels.stats.multitest").multipletests
    return [float(p) for p in multipletests(p_values, alpha=ALPHA, method="holm")[1]]


@dataclass(frozen=True)
class Claim:
    """One claim a row tests: ``name`` (the contrast), its ``effect``, the paper's ``sign`` (+1 / -1, beyond ``margin``
    when one is given; :data:`NO_DIFFERENCE` or :data:`NOT_SUPERIOR` with ``margin``; :data:`MAGNITUDE` with the
    paper's ``expected`` range) and the points per logged unit (``scale``)."""

    name: str
    effect: Effect | None
    sign: int
    margin: float | None = None
    scale: float = 100.0
    collapsed: bool = False  # a configuration it compares collapsed (:func:`collapse_reason`): labelled "collapsed"
    expected: tuple[float, float] | None = None

    @property
    def label(self) -> str:
        return COLLAPSED if self.collapsed else label(self.effect, self.sign, self.margin, self.scale, self.expected)

    @property
    def p_value(self) -> float:
        """:func:`p_value` of the claim; 1 for a collapsed one."""
        return 1.0 if self.collapsed else p_value(self.effect, self.sign, self.margin)

    @property
    def rule(self) -> str:
        points = f"{self.scale * self.margin:g}" if self.margin is not None else ""
        if self.sign == NO_DIFFERENCE:
            return f"{self.name} = 0 (+-{points} points, TOST)"
        if self.sign == NOT_SUPERIOR:
            return f"{self.name} < +{points} points (not superior)"
        if self.sign == MAGNITUDE:
            low, high = sorted(self.scale * e for e in self.expected)
            return f"{self.name} vs the paper's {low:g} to {high:g} points"
        if self.margin:
            return f"{self.name} {'> +' if self.sign > 0 else '< -'}{points} points"
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


def collapse_by_drop(accuracy: float | None, before: float | None) -> str | None:
    """Why a (style) student counts as collapsed when its accuracy before training is known, or None: its held-out
    accuracy (a fraction) fell by more than :data:`COLLAPSE_DROP` from ``before`` (the same student, the same prompts,
    before training). A task the student half-solves keeps its floor where the student started, not at 5%."""
    if accuracy is None or before is None or before - accuracy <= COLLAPSE_DROP:
        return None
    return f"accuracy {100 * before:.1f}% -> {100 * accuracy:.1f}%, a drop of more than {100 * COLLAPSE_DROP:g} points"


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
