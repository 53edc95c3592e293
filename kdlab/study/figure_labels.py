"""Short labels of configurations in the report's figures, in the study's own factors: the rollout (``OffPD``,
``OnPD``, a mixture's ``λ=0.5``), the KL direction (``FKL``, ``RKL``), the learning rate (``1e-4``) and, where
configurations agree on those and still differ, the fewest settings that tell them apart (``precision=bf16-true``,
``StyleTransfer`` for a callback that is on), each value cut to what differs between the configurations
(``checkpoint=OnPD-FKL-seed=42`` for ``runs/study/hard/rollout=StudentRollouts-objective=ForwardKL-seed=42/
checkpoints/final.ckpt``). The tables keep the full names (:func:`kdlab.study.groups.group_label`)."""

from __future__ import annotations

import math
import re

from kdlab.study.groups import Group, shorten
from kdlab.study.runs import TEACHER_ROLLOUTS

ABBREVIATIONS = {
    **dict.fromkeys(TEACHER_ROLLOUTS, "OffPD"),
    "StudentRollouts": "OnPD",
    "ForwardKL": "FKL",
    "ReverseKL": "RKL",
}
"""The paper's short names of the rollouts and KL directions, used in every figure label."""
VALUE_WIDTH = 18  # the most characters of one setting's value in a label
SEPARATORS = "/=-_,:; "


def abbreviate(text: str) -> str:
    """``text`` with the paper's short names (``StudentRollouts`` -> ``OnPD``, ``ForwardKL`` -> ``FKL``) and
    without the ``rollout=`` / ``objective=`` key names a run folder's name carries."""
    for long in sorted(ABBREVIATIONS, key=len, reverse=True):
        text = text.replace(long, ABBREVIATIONS[long])
    return re.sub(r"\b(rollout|objective)=", "", text)


def lr_label(lr: float) -> str:
    """A learning rate as the paper writes it: ``1e-4``, ``5e-5``, ``2.5e-4``; 0 as ``0``."""
    if lr == 0 or not math.isfinite(lr):
        return f"{lr:g}"
    exponent = math.floor(math.log10(abs(lr)))
    mantissa = round(lr / 10**exponent, 3)
    if mantissa >= 10:
        mantissa, exponent = mantissa / 10, exponent + 1
    return f"{mantissa:g}e{exponent}"


def rollout_label(group: Group) -> str:
    """``λ=<lam>`` for a mixture; ``OffPD`` / ``OnPD`` for teacher / student rollouts; otherwise the class name
    without ``Rollouts`` or ``Module`` (``GRPOModule`` -> ``GRPO``)."""
    if group.lam is not None:
        return f"λ={group.lam:g}"
    return ABBREVIATIONS.get(group.rollout) or re.sub(r"(Rollouts|Module)$", "", group.rollout) or group.rollout


def objective_label(group: Group) -> str:
    """``FKL`` / ``RKL``; nothing for a stage that names itself in both columns (a GRPO run); otherwise the
    class name."""
    if group.objective == group.rollout:
        return ""
    return ABBREVIATIONS.get(group.objective, group.objective)


def _trim(values: list[str]) -> list[str]:
    """Each value without the start and end that all ``values`` share, cut at a separator (``/``, ``=``, ``-``,
    ...): ``runs/a/seed=42/final.ckpt`` and ``runs/a/seed=43/final.ckpt`` -> ``seed=42``, ``seed=43``; then, where
    every value has the same number of ``-``-separated parts, without the parts they all share in the same place
    (``OnPD-FKL-lr=0.0001-seed=42`` and ``OffPD-RKL-lr=0.0001-seed=43`` -> ``OnPD-FKL-seed=42``, ``OffPD-RKL-seed=43``)."""
    trimmed = _trim_ends(values)
    parts = [value.split("-") for value in trimmed]
    if len(set(trimmed)) < 2 or len({len(p) for p in parts}) != 1:
        return trimmed
    keep = [i for i in range(len(parts[0])) if len({p[i] for p in parts}) > 1]
    return ["-".join(p[i] for i in keep) for p in parts]


def _trim_ends(values: list[str]) -> list[str]:
    """:func:`_trim`'s first part: the shared start and end cut at a separator."""
    distinct = sorted(set(values))
    if len(distinct) < 2:
        return values
    head = len(_common_start(distinct))
    tail = len(_common_start([v[::-1] for v in distinct]))
    if head + tail >= min(len(v) for v in distinct):
        return values
    trimmed = []
    for value in values:
        start, end = head, len(value) - tail
        while start > 0 and value[start - 1] not in SEPARATORS:  # back to the last separator
            start -= 1
        while end < len(value) and value[end] not in SEPARATORS:
            end += 1
        trimmed.append(value[start:end].strip(SEPARATORS) or value)
    return trimmed


def _common_start(values: list[str]) -> str:
    first, last = min(values), max(values)
    size = 0
    while size < min(len(first), len(last)) and first[size] == last[size]:
        size += 1
    return first[:size]


def _setting_text(name: str, value: str | None) -> str:
    """One setting in a label: a class in a list by its name when on and not at all when off, else
    ``name=value`` with the last part of the dotted name."""
    if value is None or value == "off":
        return ""
    last = name.rsplit(".", 1)[-1]
    if value == "on":
        return last
    return f"{last}={shorten(abbreviate(value), VALUE_WIDTH)}"


def variant_labels(groups: list[Group]) -> list[str]:
    """For each configuration, the fewest of its other settings (:attr:`Group.other_parts`) that tell it from
    the configurations with the same rollout, KL and learning rate, shortest first, joined by ``, ``; ``""``
    where none is needed. A setting another configuration lacks reads as absent."""
    settings = [dict(g.other_parts) for g in groups]
    names = sorted({name for s in settings for name in s})
    shown_values = {}
    for name in names:
        present = [i for i, s in enumerate(settings) if name in s]
        trimmed = _trim([settings[i][name] for i in present])
        shown_values[name] = dict(zip(present, trimmed))
    cells: dict[tuple, list[int]] = {}
    for index, g in enumerate(groups):
        cells.setdefault((g.rollout, g.lam, g.objective, g.lr, g.task), []).append(index)

    def texts(index: int, chosen: list[str]) -> str:
        return ", ".join(t for t in (_setting_text(n, shown_values[n].get(index)) for n in chosen) if t)

    def apart(chosen: list[str]) -> int:  # pairs of one cell the chosen settings tell apart
        return sum(texts(i, chosen) != texts(j, chosen) for members in cells.values() for i in members for j in members if i < j)

    def needed(name: str) -> bool:  # the setting differs within one cell
        return any(len({settings[i].get(name) for i in members}) > 1 for members in cells.values())

    def length(name: str) -> int:
        return max(len(_setting_text(name, value)) for value in shown_values[name].values())

    candidates = [n for n in names if needed(n)]
    chosen: list[str] = []
    goal = apart(candidates)
    while apart(chosen) < goal:  # greedy: the setting that tells most pairs apart, the shorter on a tie
        chosen.append(max((n for n in candidates if n not in chosen), key=lambda n: (apart([*chosen, n]), -length(n))))
    for name in reversed(list(chosen)):  # then drop any the others make unnecessary
        if apart([n for n in chosen if n != name]) == goal:
            chosen.remove(name)
    chosen = [n for n in names if n in chosen]  # in the settings' order
    return [texts(i, chosen) for i in range(len(groups))]


def short_labels(groups: list[Group], *, lr: bool = True, rollout: bool = True) -> tuple[list[str], str]:
    """Each configuration's label, and what every one of them shares (for the caption): rollout, KL and (``lr``)
    learning rate (each left out when a figure shows it otherwise: a colour, the x axis), then its
    :func:`variant_labels` after a ``·``, each factor left out of the labels when all
    ``groups`` share it (it goes to the shared text instead): ``OffPD FKL``, ``OnPD RKL · precision=bf16-true``
    and ``1e-4``. One configuration keeps every factor in its label."""
    variants = variant_labels(groups)
    columns = [[rollout_label(g) for g in groups]] if rollout else []
    columns.append([objective_label(g) for g in groups])
    if lr:
        columns.append([lr_label(g.lr) for g in groups])
    shared = [c[0] for c in columns if len(groups) > 1 and len(set(c)) == 1 and c[0]]
    kept = [c for c in columns if len(groups) == 1 or len(set(c)) > 1]
    labels = []
    for index, extra in enumerate(variants):
        text = " ".join(c[index] for c in kept if c[index])
        labels.append(" · ".join(t for t in (text, extra) if t) or " ".join(shared))
    return labels, " ".join(shared)


def without_seed(label: str) -> str:
    """``label`` without a ``seed=N`` part (one colour for the chains that differ only in their seed)."""
    return re.sub(r"[-_ ,]*\bseed=\d+", "", label).strip(" ,-·") or label
