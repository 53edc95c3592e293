"""The harder-set and RLVR rows when the harder set is measured inside the runs by a ``Coverage`` callback named
``harder`` (``coverage/harder/pass@k`` and ``..._before``), as the reasoning world's study does
(experiments/reasoning/: the main grid's runs measure it after distillation, and each RLVR chain measures it before
RLVR, on its distilled start, and after). Every number is a per-run pass@k, so each contrast is a t interval over
seeds, paired where the configurations share their seeds (:func:`~kdlab.study.effects.seed_values_effect`); an RLVR
chain pairs its own before and after."""

from __future__ import annotations

from typing import Any

from kdlab.study.effects import seed_values_effect
from kdlab.study.design import Study, Verdict
from kdlab.study.findings import PAPER_K, _rule, rlvr_chains, rlvr_verdict
from kdlab.study.groups import Group
from kdlab.study.labels import Claim, Effect, row_word

NAME = "harder"
PREFIX = f"coverage/{NAME}/pass@"


def logged_ks(runs: list[Any]) -> list[int]:
    """The k of every ``coverage/harder/pass@k`` the runs logged."""
    return sorted({int(m[len(PREFIX):]) for run in runs for m in run.last if m.startswith(PREFIX) and m[len(PREFIX):].isdigit()})


def measures_harder(runs: list[Any]) -> bool:
    """Whether runs measure the harder set with a Coverage callback named ``harder``."""
    return bool(logged_ks(runs))


def _by_seed(group: Group, metric: str) -> dict[Any, float]:
    return {seed: sum(r.last[metric] for r in runs) / len(runs) for seed, runs in group.by_seed().items() if all(metric in r.last for r in runs)}


def _contrast(plus: list[dict[Any, float]], minus: list[dict[Any, float]]) -> Effect | None:
    """mean(plus) - mean(minus) of per-seed values, each configuration weighted equally within its side."""
    if not plus or not minus:
        return None
    return seed_values_effect([(1.0 / len(plus), v) for v in plus] + [(-1.0 / len(minus), v) for v in minus], " of per-run pass@k")


def _pct(values: list[dict[Any, float]]) -> str:
    seen = [v for by_seed in values for v in by_seed.values()]
    return f"{100 * sum(seen) / len(seen):.1f}%" if seen else "n/a"


def harder_from_coverage(study: Study) -> Verdict:
    """OnPD - OffPD ``coverage/harder/pass@k`` of the main grid's low-LR runs at every logged k (paired t over
    seeds); the primary claim at the k nearest the paper's 10."""
    groups = [g for g in study.groups("distill") if g.lam is None and g.level == "low"]
    ks = logged_ks([r for g in groups for r in g.runs])
    on, off = [g for g in groups if g.kind == "OnPD"], [g for g in groups if g.kind == "OffPD"]
    effects = {k: _contrast([_by_seed(g, f"{PREFIX}{k}") for g in on], [_by_seed(g, f"{PREFIX}{k}") for g in off]) for k in ks}
    means = "; ".join(f"{g.kind} {g.direction}: " + ", ".join(f"pass@{k} {_pct([_by_seed(g, f'{PREFIX}{k}')])}" for k in ks) for g in off + on)
    tiny = (f"harder set after distillation (low LR): {means or 'n/a'}; OnPD - OffPD (points) "
            + (", ".join(f"pass@{k} " + (effects[k].text() if effects.get(k) else "n/a") for k in ks) or "n/a"))
    claims = [Claim(f"OnPD - OffPD pass@{k}", effects.get(k), +1) for k in ks] or [Claim("OnPD - OffPD pass@k", None, +1)]
    primary = min(ks, key=lambda k: (abs(k - PAPER_K), -k)) if ks else None
    return Verdict("On-policy rollouts give higher pass@k on a harder set", "10-15% higher pass@k on Countdown-4E",
                   tiny, row_word(claims), study.evidence("distill"), study.command("distill"), _rule(claims),
                   "harder set: Countdown-3 with targets 1-20 (countdown3s) deduplicated against every training split "
                   "(kdlab.tiny.reasoning.UnseenCountdown), 32 samples at T = 1.0, in place of Countdown-4E",
                   claims, [c for c in claims if c.name == f"OnPD - OffPD pass@{primary}"][:1] or claims[:1])


def rlvr_from_coverage(study: Study) -> Verdict:
    """Each RLVR chain (grouped by the configuration of the distilled run it started from, keyed by that run's
    seed) logs the harder set's pass@k before RLVR (its distilled start) and after: OnPD - OffPD before and after,
    the difference in differences (each chain's after - before, then OnPD - OffPD, paired by seed), and RLVR's own
    effect (after - before over every chain), all at the largest logged k (the paper reads pass@k at its largest)."""
    chains, ratios = rlvr_chains(study, "distill")  # (kind, objective) -> {source seed: RLVR run}
    ks = logged_ks([run for by_seed in chains.values() for run in by_seed.values()])
    k = max(ks) if ks else None

    def values(kind: str, suffix: str) -> list[dict[Any, float]]:
        metric = f"{PREFIX}{k}{suffix}"
        return [{seed: run.last[metric] for seed, run in by_seed.items() if metric in run.last}
                for (of, _), by_seed in sorted(chains.items()) if of == kind]

    def change(kind: str) -> list[dict[Any, float]]:
        return [{seed: a[seed] - b[seed] for seed in a if seed in b} for a, b in zip(values(kind, ""), values(kind, "_before"))]

    before_edge = _contrast(values("OnPD", "_before"), values("OffPD", "_before")) if k else None
    after_edge = _contrast(values("OnPD", ""), values("OffPD", "")) if k else None
    did = _contrast(change("OnPD"), change("OffPD")) if k else None
    every = change("OnPD") + change("OffPD") if k else []
    moved = seed_values_effect([(1.0 / len(every), v) for v in every], " of per-run pass@k") if every else None
    shown = lambda e: e.text() if e else "n/a"  # noqa: E731
    counts = sorted({len(c) for c in chains.values()})
    metric = f"pass@{k}" if k else "pass@k"
    tiny = (f"RLVR from the main grid's low-LR runs ({'/'.join(map(str, counts)) or 0} chains per configuration); harder set {metric} "
            f"before RLVR {_pct(values('OffPD', '_before') + values('OnPD', '_before')) if k else 'n/a'}, after "
            f"{_pct(values('OffPD', '') + values('OnPD', '')) if k else 'n/a'}; after - before {shown(moved)}; OnPD - OffPD {metric}: "
            f"before RLVR {shown(before_edge)}, after {shown(after_edge)}, after - before (difference in differences, chains paired) "
            f"{shown(did)} (points)")
    return rlvr_verdict(study, Claim(f"harder {metric} after - before RLVR", moved, +1), metric, (before_edge, after_edge, did), tiny,
                        "RLVR on countdown3s (the harder task's training split) in place of Countdown-4, measured on the harder set",
                        ratios, study.chain_evidence(chains, "distill"))
