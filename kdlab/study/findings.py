"""The paper's eight headline findings as claims on a study's runs (:class:`~kdlab.study.design.Study`), one function per
finding (:func:`on_policy_advantage` ... :func:`style_transfer`), each building its :class:`~kdlab.study.labels.Claim`
from :mod:`kdlab.study.effects`. :mod:`kdlab.study.verdicts` writes them as a page."""

from __future__ import annotations

import math
from pathlib import Path

from kdlab.study.design import Study, Verdict
from kdlab.study.groups import Group
from kdlab.study.labels import (
    ACCURACY_MARGIN,
    COLLAPSED,
    MAGNITUDE,
    NO_DIFFERENCE,
    NOT_SUPERIOR,
    OOD_MARGIN,
    REPRODUCED,
    UNTESTABLE,
    Claim,
    Effect,
    collapse_reason,
    row_word,
)
from kdlab.study.effects import accuracy_effect, difference, samples, scalar_effect, share_effect, table_effect
from kdlab.study.runs import TEACHER_ROLLOUTS, read_run

PAPER_HIGH_LR_DROP = (-14.0, -11.2)  # the paper's OOD change at 5e-5 (points)
PAPER_K = 10  # the paper's pass@k (k = 1, 10); the harder-set row's primary claim is at the logged k nearest it


def lr_departure(study: Study, part: str = "distill") -> str:
    """The part's LR ratio where it is not the paper's 5x (1e-5 vs 5e-5), else ""."""
    levels = {g.level: g.lr for g in study.groups(part) if g.level}
    if "low" not in levels or "high" not in levels:
        return ""
    ratio = levels["high"] / levels["low"]
    return "" if math.isclose(ratio, 5.0) else f"LR {levels['low']:g} vs {levels['high']:g}, {ratio:g}x where the paper's is 5x"


def _points(group: Group | None, metric: str) -> str:
    """The group's mean of a metric logged in points (e.g. ``ood/mean``), or n/a."""
    stats = group.stats(metric) if group else None
    return "n/a" if stats is None else f"{stats[0]:.1f}"


def _pct(group: Group | None, metric: str = "val/accuracy") -> str:
    stats = group.stats(metric) if group else None
    return "n/a" if stats is None else f"{100 * stats[0]:.1f}"


# ---- the eight findings --------------------------------------------------------------------------
def on_policy_advantage(study: Study, part: str = "distill") -> Verdict:
    claims, shown = [], []
    for direction in ("forward", "reverse"):
        for level in ("low", "high"):
            on, off = study.cell(part, "OnPD", direction, level), study.cell(part, "OffPD", direction, level)
            if on and off:
                effect = accuracy_effect([(1.0, on), (-1.0, off)])
                claims.append(Claim(f"OnPD - OffPD ({direction} KL, {level} LR)", effect, NOT_SUPERIOR, ACCURACY_MARGIN))
                if effect:
                    shown.append(f"{direction} KL, {level} LR: {effect.text()}")
    return Verdict(
        "No consistent on-policy advantage", "best mean accuracy OnPD 72% vs OffPD 73%",
        "OnPD - OffPD held-out accuracy (points): " + "; ".join(shown), row_word(claims), study.evidence(part),
        study.command(part), _rule(claims), lr_departure(study, part), claims, claims)


def kl_direction_sensitivity(study: Study, part: str = "distill") -> Verdict:
    """Forward KL's high - low LR accuracy change is within the margin in each rollout policy's cells (one TOST per
    policy, joined as an intersection-union test: a mean of the two could hide opposite changes); reverse KL's,
    averaged over the two policies, is below 0 beyond the margin."""
    def lr_change(direction: str, kinds: tuple[str, ...] = ("OffPD", "OnPD")) -> list[tuple[float, Group]] | None:
        terms = []
        for kind in kinds:
            high, low = study.cell(part, kind, direction, "high"), study.cell(part, kind, direction, "low")
            if not (high and low):
                return None
            terms += [(1.0 / len(kinds), high), (-1.0 / len(kinds), low)]
        return terms

    forward, reverse = lr_change("forward"), lr_change("reverse")
    by_kind = {kind: lr_change("forward", (kind,)) for kind in ("OffPD", "OnPD")}
    each = {kind: accuracy_effect(terms) if terms else None for kind, terms in by_kind.items()}
    r = accuracy_effect(reverse) if reverse else None
    extra = accuracy_effect(reverse + [(-w, g) for w, g in forward]) if forward and reverse else None
    claims = [Claim(f"forward KL high - low LR ({kind})", effect, NO_DIFFERENCE, ACCURACY_MARGIN) for kind, effect in each.items()]
    claims.append(Claim("reverse KL high - low LR", r, -1, ACCURACY_MARGIN))
    tiny = ("accuracy change high - low LR (points): forward " + ", ".join(f"{kind} " + (e.text() if e else "n/a") for kind, e in each.items())
            + "; reverse (mean of OffPD and OnPD) " + (r.text() if r else "n/a") + "; reverse - forward (means) " + (extra.text() if extra else "n/a"))
    return Verdict("Forward KL stable across rollout policy and LR; reverse KL LR-sensitive",
                   "forward 71-73% everywhere; reverse 35-72%", tiny, row_word(claims), study.evidence(part),
                   study.command(part), _rule(claims), lr_departure(study, part), claims, claims)


def forgetting(study: Study, part: str = "distill") -> Verdict:
    def level_terms(level: str) -> list[tuple[float, Group]]:
        cells = [study.cell(part, kind, d, level) for kind in ("OffPD", "OnPD") for d in ("forward", "reverse")]
        cells = [c for c in cells if c]
        return [(1.0 / len(cells), c) for c in cells] if cells else []

    low, high = level_terms("low"), level_terms("high")
    lo = scalar_effect(low, "ood/mean_delta") if low else None
    hi = scalar_effect(high, "ood/mean_delta") if high else None
    gap = scalar_effect(high + [(-w, g) for w, g in low], "ood/mean_delta") if low and high else None
    claims = [Claim("OOD change at the low LR", lo, NO_DIFFERENCE, OOD_MARGIN, 1.0), Claim("OOD change at the high LR", hi, -1, OOD_MARGIN, 1.0)]
    magnitude = Claim("OOD change at the high LR", hi, MAGNITUDE, scale=1.0, expected=PAPER_HIGH_LR_DROP)
    tiny = ("mean OOD change (points; 4 earlier skills): low LR " + (lo.text(1.0) if lo else "n/a") + ", high LR " +
            (hi.text(1.0) if hi else "n/a") + ", high - low " + (gap.text(1.0) if gap else "n/a"))
    return Verdict("Forgetting is negligible at the low LR and visible at the high LR",
                   "|change| <= 1.3 points at 1e-5; drops of 11.2-14.0 at 5e-5", tiny,
                   row_word(claims) + f"; high-LR drop {magnitude.label} (paper: {-PAPER_HIGH_LR_DROP[1]:g}-{-PAPER_HIGH_LR_DROP[0]:g} points)",
                   study.evidence(part), study.command(part), _rule(claims + [magnitude]), lr_departure(study, part), claims + [magnitude], claims)


def sparsity(study: Study) -> Verdict:
    metric = "sparsity/1e-06"
    cells = {(kind, level): study.cell("bf16", kind, "forward", level) for kind in ("OffPD", "OnPD") for level in ("low", "high")}
    have = all(cells.values())
    by_lr = scalar_effect([(0.5, cells["OffPD", "low"]), (0.5, cells["OnPD", "low"]), (-0.5, cells["OffPD", "high"]),
                           (-0.5, cells["OnPD", "high"])], metric) if have else None
    by_rollout = scalar_effect([(0.5, cells["OffPD", "low"]), (0.5, cells["OffPD", "high"]), (-0.5, cells["OnPD", "low"]),
                                (-0.5, cells["OnPD", "high"])], metric) if have else None
    # "OffPD at least as sparse" is tested as OffPD sparser: "not distinguishable" there is no evidence against it
    claims = [Claim("sparsity low - high LR", by_lr, +1), Claim("sparsity OffPD - OnPD", by_rollout, +1)]
    means = ", ".join(f"{k} {lv} {_pct(g, metric)}%" for (k, lv), g in cells.items() if g)
    fp32 = {(k, lv): study.cell("distill", k, "forward", lv) for k in ("OffPD", "OnPD") for lv in ("low", "high")}
    tiny = (f"bf16 weights, forward KL, sparsity tau 1e-6: {means}; low - high LR " + (by_lr.text() if by_lr else "n/a") +
            " points, OffPD - OnPD " + (by_rollout.text() if by_rollout else "n/a") +
            " points. fp32 grid (forward KL): " + ", ".join(f"{k} {lv} {_pct(g, metric)}%" for (k, lv), g in fp32.items() if g))
    return Verdict("Updates are sparse at the low LR, far less at the high LR; OffPD at least as sparse as OnPD",
                   "85.3-89.6% at 1e-5 vs 51.9-60.0% at 5e-5", tiny, row_word(claims),
                   study.evidence("bf16") + "; " + study.evidence("distill"), study.command("bf16"), _rule(claims), "", claims, claims[:1])


def spectrum(study: Study) -> Verdict:
    """Along the rollout spectrum (``MixtureRollouts``, lambda < 0 the teacher's side, > 0 the student's): reverse
    KL's accuracy on the student's side minus the teacher's (> 0) at the low LR and, with the high-LR runs, at
    the high LR; forward KL's (= 0 within :data:`ACCURACY_MARGIN`: "stays high across lambda"), its range of
    means shown beside it (descriptive: its ends are chosen after the fact)."""
    def side_contrast(part: str, direction: str) -> tuple[Effect | None, list[Group]]:
        groups = [g for g in study.groups(part) if g.lam is not None and g.direction == direction]
        above = [g for g in groups if g.lam > 0 and not math.isclose(g.lam, 0.0)]
        below = [g for g in groups if g.lam < 0 and not math.isclose(g.lam, 0.0)]
        if not (above and below):
            return None, groups
        return accuracy_effect(difference(above, below)), groups

    low_r, _ = side_contrast("spectrum", "reverse")
    high_r, high_groups = side_contrast("spectrum_high", "reverse")
    low_f, forward = side_contrast("spectrum", "forward")
    means = sorted((g.stats("val/accuracy")[0], g.lam) for g in forward if g.stats("val/accuracy"))
    if means:  # the range is descriptive: its ends are chosen after the fact, so no interval is given for it
        (worst, worst_lam), (best, best_lam) = means[0], means[-1]
        spread_text = (f"forward KL means from {100 * worst:.1f}% (lam {worst_lam:g}) to {100 * best:.1f}% (lam {best_lam:g}), "
                       f"lam > 0 minus lam < 0 {low_f.text() if low_f else 'n/a'}")
    else:
        spread_text = "forward KL: n/a"
    claims = [Claim("forward KL lam > 0 - lam < 0, low LR", low_f, NO_DIFFERENCE, ACCURACY_MARGIN),
              Claim("reverse KL lam > 0 - lam < 0, low LR", low_r, +1)] + (
        [Claim("reverse KL lam > 0 - lam < 0, high LR", high_r, +1)] if high_r else [])
    seeds_spread = ""
    if high_groups:
        stds = [g.stats("val/accuracy")[1] for g in high_groups if g.stats("val/accuracy") and g.stats("val/accuracy")[1] is not None]
        if stds:
            seeds_spread = f"; high-LR reverse KL seed std {100 * min(stds):.1f}-{100 * max(stds):.1f} points across lam"
    tiny = (f"{spread_text}; reverse KL, mean over lam > 0 minus lam < 0 (points): low LR " + (low_r.text() if low_r else "n/a") +
            (", high LR " + high_r.text() if high_r else "") + seeds_spread)
    return Verdict("Spectrum: forward KL stays high across lambda; reverse KL favours lambda > 0",
                   "forward KL > 80% across lambda (5.2-point spread); reverse KL favours lambda > 0, unstable at the high LR",
                   tiny, row_word(claims), study.evidence("spectrum") + "; " + study.evidence("spectrum_high"),
                   "; ".join(dict.fromkeys([study.command("spectrum"), study.command("spectrum_high")])), _rule(claims), "", claims, claims[:2])


def harder_pass_at_k(study: Study) -> Verdict:
    """OnPD - OffPD pass@k on the harder held-out set, the claim (> 0: the paper's on-policy edge is "consistent")
    tested at every k the runs log. The paper distils on Countdown-3 and measures Countdown-4E; the runs' task
    says what they did instead. (A study whose main-grid runs measure the harder set themselves:
    :func:`kdlab.study.coverage_findings.harder_from_coverage`; :func:`kdlab.study.verdicts.harder_set` picks.)"""
    groups = study.groups("hard")
    ks = sorted({int(m.rsplit("@", 1)[1]) for g in groups for m in g.runs[0].last if m.startswith("val/pass@")})
    on = [g for g in groups if g.kind == "OnPD" and g.lam is None]
    off = [g for g in groups if g.kind == "OffPD" and g.lam is None]
    effects = {j: accuracy_effect(difference(on, off), k=j) for j in ks} if on and off else {}
    means = "; ".join(f"{g.kind} {g.direction}: " + ", ".join(f"pass@{j} {_pct(g, f'val/pass@{j}')}%" for j in ks) for g in off + on)
    task = groups[0].task if groups else "n/a"
    tiny = (f"task {task}: {means}; OnPD - OffPD (points) " +
            (", ".join(f"pass@{j} " + (effects[j].text() if effects.get(j) else "n/a") for j in ks) or "n/a"))
    claims = [Claim(f"OnPD - OffPD pass@{j}", effects.get(j), +1) for j in ks] or [Claim("OnPD - OffPD pass@k", None, +1)]
    if not groups or "held out: countdown4e" in task:
        departure = ""
    elif "held out" in task:
        departure = f"harder set {task.split('held out: ', 1)[1].rstrip(')')} in place of Countdown-4E"
    else:
        departure = f"distilled on the harder task itself ({task}), not on Countdown-3"
    primary = min(ks, key=lambda j: (abs(j - PAPER_K), -j)) if ks else None  # pre-stated: the k nearest the paper's 10
    return Verdict("On-policy rollouts give higher pass@k on a harder set", "10-15% higher pass@k on Countdown-4E",
                   tiny, row_word(claims), study.evidence("hard"), study.command("hard"), _rule(claims), departure, claims,
                   [c for c in claims if c.name == f"OnPD - OffPD pass@{primary}"][:1] or claims[:1])


def rlvr_chains(study: Study, source_part: str) -> tuple[dict[tuple[str, str], dict], set[float]]:
    """The RLVR runs as chains: ``{(rollout kind, objective): {source seed: RLVR run}}``, each RLVR run under the
    configuration and seed of the ``source_part`` run it started from (its folder's name), and the set of RLVR LR /
    distillation LR ratios."""
    chains: dict[tuple[str, str], dict] = {}
    ratios = set()
    for run in study.parts["rlvr"]:
        source = study.root / source_part / Path(run.path).resolve().parent.name
        if (source / "config.yaml").is_file():
            source_run = read_run(source)
            ratios.add(round(run.lr / source_run.lr, 6))
            kind = "OffPD" if source_run.rollout in TEACHER_ROLLOUTS else {"StudentRollouts": "OnPD"}.get(source_run.rollout)
            if kind:
                chains.setdefault((kind, str(source_run.objective)), {})[source_run.seed] = run
    return chains, ratios


def rlvr_edge(study: Study) -> Verdict:
    """OnPD - OffPD before RLVR (the distilled runs the RLVR runs started from: the harder-set part ``hard`` when
    the RLVR runs start from it, else the main grid's low LR) and after it, their difference in differences,
    and RLVR's own effect on held-out accuracy (after - before, every configuration). Each RLVR run is one chain:
    the seed of the distilled run it started from (the RLVR runs' own seed is the same for all of them, so they are
    grouped by their source, not by their seed). "Before" takes every seed of the source configurations; the
    difference in differences and RLVR's effect take the chains that have both stages, each chain's after and
    before paired by its seed. The paper's claim needs an edge to lose: without an OnPD - OffPD edge before RLVR
    (its claim not "reproduced") the row is "untestable". (RLVR runs that measure the harder set themselves, before
    and after: :func:`kdlab.study.coverage_findings.rlvr_from_coverage`; :func:`kdlab.study.verdicts.rlvr_row` picks.)"""
    source_part = "hard" if any((study.root / "hard" / Path(run.path).resolve().parent.name).is_dir() for run in study.parts["rlvr"]) else "distill"
    level = None if source_part == "hard" else "low"
    sources = [g for g in study.groups(source_part) if g.lam is None and level in (None, g.level)]
    after, ratios = rlvr_chains(study, source_part)
    before_tables, after_tables, chain_before = {}, {}, {}  # (kind, objective) -> {seed: table}
    for group in sources:
        key = (group.kind, str(group.runs[0].objective))
        before_tables[key] = {seed: samples(runs[-1].path) for seed, runs in group.by_seed().items()}
        chains = after.get(key, {})
        after_tables[key] = {seed: samples(run.path) for seed, run in chains.items()}
        chain_before[key] = {seed: table for seed, table in before_tables[key].items() if seed in chains}
    ks = sorted({int(m.rsplit("@", 1)[1]) for chains in after.values() for run in chains.values() for m in run.last if m.startswith("val/pass@")})
    k = max(ks) if ks else None
    metric = f"pass@{k}" if k else "accuracy"

    def effect(sides: list[tuple[float, dict]], kinds: dict[str, float], metric_k: int | None) -> Effect | None:
        terms = []
        for sign, tables in sides:
            for kind, weight in kinds.items():
                configurations = [by_seed for (of, _), by_seed in sorted(tables.items()) if of == kind]
                if not configurations or any(not by_seed or any(t is None for t in by_seed.values()) for by_seed in configurations):
                    return None
                terms += [(sign * weight / len(configurations), by_seed) for by_seed in configurations]
        return table_effect(terms, metric_k)

    edge = {"OnPD": 1.0, "OffPD": -1.0}
    every = {"OnPD": 0.5, "OffPD": 0.5}
    before_edge = effect([(1.0, before_tables)], edge, k)
    after_edge = effect([(1.0, after_tables)], edge, k)
    did = effect([(1.0, after_tables), (-1.0, chain_before)], edge, k)
    moved = effect([(1.0, after_tables), (-1.0, chain_before)], every, None)
    shown = lambda e: e.text() if e else "n/a"  # noqa: E731
    chains = sorted({len(c) for c in after.values()})
    tiny = (f"RLVR from the {source_part} part's runs ({'/'.join(map(str, chains)) or 0} chains per configuration); held-out accuracy "
            f"after - before RLVR {shown(moved)}; OnPD - OffPD {metric}: before RLVR {shown(before_edge)}, after {shown(after_edge)}, "
            f"after - before (difference in differences, chains paired) {shown(did)} (points)")
    departure = ("" if not study.parts["rlvr"] else "RLVR on countdown3s (the harder set) in place of Countdown-4" if source_part == "hard"
                 else "RLVR on Countdown-3 (the distillation task) in place of Countdown-4, from the main grid's low-LR runs")
    return rlvr_verdict(study, Claim("held-out accuracy after - before RLVR", moved, +1), metric, (before_edge, after_edge, did), tiny,
                        departure, ratios, study.chain_evidence(after, source_part))


def rlvr_verdict(study: Study, moved: Claim, metric: str, edges: tuple[Effect | None, Effect | None, Effect | None], tiny: str,
                 departure: str, ratios: set[float], evidence: str) -> Verdict:
    """The RLVR row from its effects, however they were measured: ``moved`` (RLVR's own effect) and the OnPD - OffPD
    ``metric`` edges ``(before RLVR, after RLVR, after - before)``. Primary claims: an edge before RLVR (> 0) and its
    loss (after - before < 0); without an edge to lose the row is "untestable". ``ratios``: the RLVR / distillation
    LR ratios of the chains, named in the departure when not the paper's 0.2."""
    before_edge, after_edge, did = edges
    claims = [moved,
              Claim(f"OnPD - OffPD {metric} before RLVR", before_edge, +1),
              Claim(f"OnPD - OffPD {metric} after RLVR", after_edge, NO_DIFFERENCE, ACCURACY_MARGIN),
              Claim(f"OnPD - OffPD {metric} after - before RLVR", did, -1)]
    word = row_word(claims)
    if study.parts["rlvr"] and claims[1].label != REPRODUCED:
        word = f"{UNTESTABLE}: no OnPD - OffPD edge before RLVR to lose ({claims[1].label}); {word}"
    if departure and ratios and ratios != {0.2}:
        departure += f"; RLVR LR {'/'.join(f'{r:g}' for r in sorted(ratios))}x the distillation's (the paper's 0.2x)"
    return Verdict("The on-policy edge does not survive RLVR", "after GRPO on Countdown-4 the OnPD/OffPD difference is gone",
                   tiny, word, evidence, study.command("rlvr"), _rule(claims), departure, claims, [claims[1], claims[3]])


def style_transfer(study: Study) -> Verdict:
    """OnPD reverse KL against each other setting's Spanish share, at each LR; a claim that compares a collapsed
    configuration (:func:`~kdlab.study.labels.collapse_reason` of its mean accuracy and earlier skills) is
    labelled "collapsed", not transferred. (A study with the style-alone design: :func:`kdlab.study.style_findings.style_alone`;
    :func:`kdlab.study.verdicts.style_row` picks.)"""
    metric = "style/spanish_share"
    rows, claims, primary = [], [], []

    def reason(group: Group) -> str | None:
        accuracy, ood = group.stats("val/accuracy"), group.stats("ood/mean")
        return collapse_reason(accuracy[0] if accuracy else None, ood[0] if ood else None)

    for level in ("low", "high"):
        keep = study.cell("style", "OnPD", "reverse", level)
        others = [study.cell("style", k, d, level) for k, d in (("OffPD", "forward"), ("OffPD", "reverse"), ("OnPD", "forward"))]
        others = [g for g in others if g]
        if not keep or not others:
            continue
        gaps = [scalar_effect([(1.0, g), (-1.0, keep)], metric) for g in others]  # shown in points
        tests = [share_effect([(1.0, g), (-1.0, keep)], metric, "style") for g in others]  # tested in log-odds
        new = [Claim(f"{g.kind} {g.direction} - OnPD reverse, {level} LR", e, +1, collapsed=bool(reason(g) or reason(keep)))
               for g, e in zip(others, tests)]
        claims += new
        primary += new if level == "low" else []
        shown = lambda g: (f"{g.kind} {g.direction} {_pct(g, metric)}% Spanish (accuracy {_pct(g)}%, earlier skills {_points(g, 'ood/mean')})"  # noqa: E731
                           + (f" ({COLLAPSED}: {reason(g)})" if reason(g) else ""))
        found = [(e, t) for e, t in zip(gaps, tests) if e]
        smallest = min(found, key=lambda pair: pair[0].value) if found else None
        rows.append(f"{level} LR: {shown(keep)} vs {', '.join(shown(g) for g in others)}; smallest gap " +
                    (f"{100 * smallest[0].value:+.1f} points" + (f" (log-odds {smallest[1].text(1.0)})" if smallest[1] else "")
                     if smallest else "n/a points"))
    return Verdict("OnPD + reverse KL keeps the student's English; the other settings transfer Spanish",
                   "other settings transfer Spanish almost fully", "; ".join(rows) or "n/a", row_word(claims), study.evidence("style"),
                   study.command("style"), _rule(claims),
                   "the tiny world's Spanish is its teacher's swap of eight English words and phrases (kdlab/tiny/world.py), judged by py3langid; "
                   "the real-model style study (docs/real_model.md) judges real Spanish" if study.parts["style"] and study.tiny else "",
                   claims, primary or claims[:3])


def _rule(claims: list[Claim]) -> str:
    return "; ".join(claim.rule for claim in claims)


