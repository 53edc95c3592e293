"""The style row judged on the style-alone design (issue #44; experiments/smollm2/style_alone*.yaml): a task the
student already solves, so correctness and language separate; a teacher shown a correct Spanish worked answer, and
a control teacher shown the same answer in English; style measured per prompt by the log-odds of a Spanish over an
English correct answer (:class:`~kdlab.callbacks.StyleLogOdds`, ``style/log_odds``: no sampling, no correctness),
py3langid's Spanish share of greedy answers beside it; collapse judged against the student's own accuracy before
training (:func:`~kdlab.study.labels.collapse_by_drop`), not an absolute floor.

Parts of the study root: ``style_alone/`` (rollout x KL, Spanish teacher) and ``style_alone_control/`` (the English
teacher on two of its cells). The pre-stated primary claim: OffPD forward minus OnPD reverse on the log-odds > 0,
paired by seed (the paper: OnPD + reverse KL keeps the student's English, the other settings transfer Spanish)."""

from __future__ import annotations

from kdlab.study.effects import scalar_effect
from kdlab.study.design import Study, Verdict
from kdlab.study.findings import _rule
from kdlab.study.groups import Group
from kdlab.study.labels import COLLAPSED, Claim, collapse_by_drop, row_word

LOG_ODDS = "style/log_odds"
SHARE = "style/spanish_share"
ACCURACY = "coverage/task/pass@1"  # greedy accuracy on the task's held-out prompts, after training ...
ACCURACY_BEFORE = "coverage/task/pass@1_before"  # ... and before (the Coverage callback named "task")
OTHERS = (("OffPD", "forward"), ("OffPD", "reverse"), ("OnPD", "forward"))
CONTROL_CELLS = (("OffPD", "forward"), ("OnPD", "reverse"))


def _mean(group: Group | None, metric: str) -> float | None:
    stats = group.stats(metric) if group else None
    return None if stats is None else stats[0]


def collapse(group: Group | None) -> str | None:
    """:func:`~kdlab.study.labels.collapse_by_drop` of the configuration's mean accuracy after and before training."""
    return collapse_by_drop(_mean(group, ACCURACY), _mean(group, ACCURACY_BEFORE))


def shown(group: Group) -> str:
    """One configuration's numbers: log-odds, Spanish share, accuracy before -> after, and why it collapsed."""
    def number(metric: str, scale: float = 100.0, digits: int = 1) -> str:
        value = _mean(group, metric)
        return "n/a" if value is None else f"{scale * value:.{digits}f}"

    reason = collapse(group)
    return (f"{group.kind} {group.direction} log-odds {number(LOG_ODDS, 1.0, 2)} (Spanish {number(SHARE)}%, "
            f"accuracy {number(ACCURACY_BEFORE)}% -> {number(ACCURACY)}%)" + (f" ({COLLAPSED}: {reason})" if reason else ""))


def style_alone(study: Study) -> Verdict:
    """OnPD reverse KL against each other setting on ``style/log_odds`` (paired t over seeds), at the study's LR
    levels, each contrast's value and intervals in the row; the English-teacher control's difference shown beside the
    cells it covers."""
    rows, claims, primary = [], [], []
    for level in ("low", "high"):
        keep = study.cell("style_alone", "OnPD", "reverse", level)
        others = [g for g in (study.cell("style_alone", k, d, level) for k, d in OTHERS) if g]
        if not keep or not others:
            continue
        new = [Claim(f"{g.kind} {g.direction} - OnPD reverse, {level} LR (log-odds)", scalar_effect([(1.0, g), (-1.0, keep)], LOG_ODDS), +1,
                     scale=1.0, collapsed=bool(collapse(g) or collapse(keep))) for g in others]
        claims += new
        for group, claim in zip(others, new):  # the pre-stated primary claim: OffPD forward - OnPD reverse, at the low LR
            if (group.kind, group.direction) == ("OffPD", "forward") and (level == "low" or not primary):
                primary = [claim]
        controls = []
        for kind, direction in CONTROL_CELLS:
            spanish, english = study.cell("style_alone", kind, direction, level), study.cell("style_alone_control", kind, direction, level)
            if spanish and english:
                effect = scalar_effect([(1.0, spanish), (-1.0, english)], LOG_ODDS)
                controls.append(f"Spanish - English teacher, {kind} {direction}: " + (effect.text(1.0) if effect else "n/a")
                                + f" (English teacher: {shown(english)})")
        contrasts = ", ".join(f"{g.kind} {g.direction} - OnPD reverse {c.effect.text(1.0) if c.effect else 'n/a'}" for g, c in zip(others, new))
        rows.append(f"{level} LR: {shown(keep)} vs {', '.join(shown(g) for g in others)}; paired by seed (log-odds): {contrasts}"
                    + (f"; control: {'; '.join(controls)}" if controls else ""))
    return Verdict("OnPD + reverse KL keeps the student's English; the other settings transfer Spanish",
                   "other settings transfer Spanish almost fully", "; ".join(rows) or "n/a", row_word(claims),
                   "; ".join(study.evidence(part) for part in ("style_alone", "style_alone_control")),
                   "; ".join(study.command(part) for part in ("style_alone", "style_alone_control")), _rule(claims),
                   "style measured by the log-odds of a Spanish over an English correct answer (StyleLogOdds), on a task the "
                   "student already solves, the teacher shown a correct Spanish worked answer (docs/real_model.md, \"Style alone\")",
                   claims, primary)
