"""The tiny-world study's verdicts: one row per headline finding of the paper, with the effect that
decides it, its 95% interval, and the runs and command behind it.

``kdlab report <root>`` writes them (``verdicts.md``, ``verdicts.csv``) when ``<root>`` holds the study's
layout, which ``experiments/tiny/study.sh`` writes::

    <root>/distill/                  main grid: rollout x KL x LR x seeds (experiments/tiny/grid.yaml)
    <root>/rlvr/<distilled run>/...  GRPO from each low-LR grid run (experiments/tiny/rlvr_pipeline.yaml)
    <root>/bf16/                     bf16-weight runs for update sparsity (experiments/tiny/bf16_grid.yaml)
    <root>/spectrum/                 lambda spectrum at the low LR (experiments/tiny/spectrum_sweep.yaml)
    <root>/spectrum_high/            reverse-KL spectrum at the high LR (experiments/tiny/spectrum_high.yaml)
    <root>/style/                    Spanish-style grid (experiments/tiny/style_grid.yaml)
    <root>/hard/                     pass@k on Countdown-4E (experiments/tiny/hard_passk.yaml)

An effect is a weighted sum of configuration means (for example OnPD minus OffPD). Its interval:

* held-out accuracy and pass@k: :func:`kdlab.study.stats.bootstrap_contrast`, a paired bootstrap (the same
  resampled problems for every configuration and seed, samples resampled within each problem);
* per-run numbers (OOD change, update sparsity, Spanish share): a t interval over seeds, variance
  ``sum w^2 s^2 / n`` and the smallest seed count minus one degrees of freedom.

Words: an effect is *beyond its interval* when the interval excludes 0. "reproduced" needs the paper's
effect beyond its interval in the paper's direction; "not reproduced" an effect beyond its interval the
other way; "not distinguishable" is everything else. A claim of *no* difference (no on-policy edge) is
"reproduced" when no difference is beyond its interval, which is weaker evidence than a found effect;
the row says so.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kdlab.study.groups import Group, group_runs, lr_levels
from kdlab.study.runs import TEACHER_ROLLOUTS, RunResult, read_run, read_samples
from kdlab.study.stats import bootstrap_contrast
from kdlab.study.tables import markdown_table, write_csv

PART_COMMANDS = {  # each part's folder and the command of experiments/tiny/study.sh that fills it
    "distill": "kdlab sweep --config experiments/tiny/grid.yaml",
    "rlvr": "kdlab pipeline --config experiments/tiny/rlvr_pipeline.yaml",
    "bf16": "kdlab sweep --config experiments/tiny/bf16_grid.yaml",
    "spectrum": "kdlab sweep --config experiments/tiny/spectrum_sweep.yaml",
    "spectrum_high": "kdlab sweep --config experiments/tiny/spectrum_high.yaml",
    "style": "kdlab sweep --config experiments/tiny/style_grid.yaml",
    "hard": "kdlab sweep --config experiments/tiny/hard_passk.yaml",
}
PARTS = tuple(PART_COMMANDS)
REPRODUCED, NOT_REPRODUCED, NOT_DISTINGUISHABLE = "reproduced", "not reproduced", "not distinguishable"
NOT_RUN = "not run"
# two-sided 97.5% quantiles of Student's t by degrees of freedom
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


@dataclass(frozen=True)
class Effect:
    """An estimate with its 95% interval, in the logged units (fractions; OOD change in points)."""

    value: float
    low: float
    high: float
    how: str

    @property
    def sign(self) -> int:
        """+1 / -1 when the interval lies above / below 0, else 0."""
        return 1 if self.low > 0 else -1 if self.high < 0 else 0

    def text(self, scale: float = 100.0) -> str:
        return f"{scale * self.value:+.1f} [{scale * self.low:+.1f}, {scale * self.high:+.1f}]"


def t_quantile(df: int) -> float:
    return _T975.get(df, 1.96 + 2.4 / df) if df >= 1 else math.inf


def accuracy_effect(terms: list[tuple[float, Group]], k: int | None = None, draws: int = 2000) -> Effect | None:
    """``sum w * mean`` of ``val/accuracy`` (``k`` None) or ``val/pass@k`` with a paired bootstrap interval
    from each seed's last evaluation samples; None when a run has no samples file."""
    tables = []
    for weight, group in terms:
        seeds = [read_samples(runs[-1].path) for runs in group.by_seed().values()]
        if not seeds or any(table is None for table in seeds):
            return None
        tables.append((weight, seeds))
    value, low, high = bootstrap_contrast(tables, k=k, draws=draws)
    return Effect(value, low, high, "paired bootstrap")


def difference(plus: list[Group], minus: list[Group]) -> list[tuple[float, Group]]:
    """Terms of ``mean(plus) - mean(minus)``, each configuration weighted equally within its side."""
    return [(1.0 / len(plus), g) for g in plus] + [(-1.0 / len(minus), g) for g in minus]


def scalar_effect(terms: list[tuple[float, Group]], metric: str) -> Effect | None:
    """``sum w * mean`` of a per-run metric over seeds, with a t interval (None without two seeds each)."""
    value, variance, seeds = 0.0, 0.0, []
    for weight, group in terms:
        values = [statistics.fmean(r.last[metric] for r in runs if metric in r.last) for runs in group.by_seed().values()
                  if any(metric in r.last for r in runs)]
        if len(values) < 2:
            return None
        value += weight * statistics.fmean(values)
        variance += weight * weight * statistics.variance(values) / len(values)
        seeds.append(len(values))
    half = t_quantile(min(seeds) - 1) * math.sqrt(variance)
    return Effect(value, value - half, value + half, f"t over seeds (n={min(seeds)})")


def verdict_word(effect: Effect | None, paper_sign: int) -> str:
    if effect is None:
        return NOT_DISTINGUISHABLE
    if effect.sign == 0:
        return NOT_DISTINGUISHABLE
    return REPRODUCED if effect.sign == paper_sign else NOT_REPRODUCED


@dataclass
class Verdict:
    finding: str
    paper: str
    tiny: str
    verdict: str
    evidence: str
    command: str


class Study:
    """The study's runs by part, and its configurations by (rollout kind, KL direction, LR level)."""

    def __init__(self, root: Path, runs: list[RunResult]) -> None:
        self.root = root
        self._groups: dict[str, list[Group]] = {}
        self.parts: dict[str, list[RunResult]] = {part: [] for part in PARTS}
        for run in runs:
            relative = Path(run.path).resolve().relative_to(root.resolve()) if _inside(run.path, root) else None
            if relative is not None and relative.parts and relative.parts[0] in self.parts:
                self.parts[relative.parts[0]].append(run)

    def groups(self, part: str) -> list[Group]:
        """The part's configurations (grouped once: each group keeps its computed intervals)."""
        if part not in self._groups:
            runs = self.parts[part]
            self._groups[part] = group_runs(runs, lr_levels({r.lr for r in runs}))
        return self._groups[part]

    def cell(self, part: str, kind: str, direction: str | None = None, level: str | None = None) -> Group | None:
        """The part's pure-policy configuration of rollout ``kind`` (OffPD/OnPD), KL ``direction`` and LR ``level``."""
        for group in self.groups(part):
            if group.lam is None and group.kind == kind and direction in (None, group.direction) and level in (None, group.level):
                return group
        return None

    def command(self, part: str) -> str:
        return PART_COMMANDS[part]

    def evidence(self, part: str) -> str:
        runs = self.parts[part]
        return f"{len(runs)} runs in {self.root.name}/{part}/" if runs else f"no runs in {self.root.name}/{part}/"


def _inside(path: Path, root: Path) -> bool:
    try:
        Path(path).resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def _pct(group: Group | None, metric: str = "val/accuracy") -> str:
    stats = group.stats(metric) if group else None
    return "n/a" if stats is None else f"{100 * stats[0]:.1f}"


# ---- the eight findings --------------------------------------------------------------------------
def on_policy_advantage(study: Study) -> Verdict:
    effects = {}
    for direction in ("forward", "reverse"):
        for level in ("low", "high"):
            on, off = study.cell("distill", "OnPD", direction, level), study.cell("distill", "OffPD", direction, level)
            if on and off:
                effects[(direction, level)] = accuracy_effect([(1.0, on), (-1.0, off)])
    shown = [f"{d} KL, {lv} LR: {e.text()}" for (d, lv), e in effects.items() if e]
    found = [e for e in effects.values() if e]
    if not found:
        word = NOT_DISTINGUISHABLE
    elif all(e.sign > 0 for e in found):
        word = NOT_REPRODUCED  # a consistent on-policy edge
    else:
        word = REPRODUCED
    if found and word == REPRODUCED:
        word += " (no consistent edge: " + ("no cell's difference is beyond its interval" if all(e.sign == 0 for e in found) else "the cells disagree") + ")"
    return Verdict(
        "No consistent on-policy advantage", "best mean accuracy OnPD 72% vs OffPD 73%",
        "OnPD - OffPD held-out accuracy (points): " + "; ".join(shown), word, study.evidence("distill"), study.command("distill"))


def kl_direction_sensitivity(study: Study) -> Verdict:
    def lr_change(direction: str) -> list[tuple[float, Group]] | None:
        terms = []
        for kind in ("OffPD", "OnPD"):
            high, low = study.cell("distill", kind, direction, "high"), study.cell("distill", kind, direction, "low")
            if not (high and low):
                return None
            terms += [(0.5, high), (-0.5, low)]
        return terms

    forward, reverse = lr_change("forward"), lr_change("reverse")
    f = accuracy_effect(forward) if forward else None
    r = accuracy_effect(reverse) if reverse else None
    extra = accuracy_effect(reverse + [(-w, g) for w, g in forward]) if forward and reverse else None
    stable = f is not None and f.sign == 0
    sensitive = extra is not None and extra.sign < 0
    if stable and sensitive:
        word = REPRODUCED
    elif not stable and (extra is None or extra.sign == 0):
        word = NOT_REPRODUCED + " (both directions change with the LR, by amounts not distinguishable)" if f is not None and f.sign != 0 else NOT_DISTINGUISHABLE
    else:
        word = "partly: " + ("forward KL stable" if stable else "forward KL not stable") + ", " + (
            "reverse KL more LR-sensitive" if sensitive else "reverse KL not more LR-sensitive")
    tiny = "accuracy change high - low LR (points, mean of OffPD and OnPD): forward " + (f.text() if f else "n/a") + \
        ", reverse " + (r.text() if r else "n/a") + "; reverse - forward " + (extra.text() if extra else "n/a")
    return Verdict("Forward KL stable across rollout policy and LR; reverse KL LR-sensitive",
                   "forward 71-73% everywhere; reverse 35-72%", tiny, word, study.evidence("distill"), study.command("distill"))


def forgetting(study: Study) -> Verdict:
    def level_terms(level: str) -> list[tuple[float, Group]]:
        cells = [study.cell("distill", kind, d, level) for kind in ("OffPD", "OnPD") for d in ("forward", "reverse")]
        cells = [c for c in cells if c]
        return [(1.0 / len(cells), c) for c in cells] if cells else []

    low, high = level_terms("low"), level_terms("high")
    lo = scalar_effect(low, "ood/mean_delta") if low else None
    hi = scalar_effect(high, "ood/mean_delta") if high else None
    gap = scalar_effect(high + [(-w, g) for w, g in low], "ood/mean_delta") if low and high else None
    word = verdict_word(gap, -1) if hi is not None and hi.sign < 0 else verdict_word(hi, -1)
    tiny = ("mean OOD change (points; 4 earlier skills): low LR " + (lo.text(1.0) if lo else "n/a") + ", high LR " +
            (hi.text(1.0) if hi else "n/a") + ", high - low " + (gap.text(1.0) if gap else "n/a"))
    return Verdict("Forgetting is negligible at the low LR and visible at the high LR",
                   "|change| <= 1.3 points at 1e-5; drops of 11.2-14.0 at 5e-5", tiny, word, study.evidence("distill"), study.command("distill"))


def sparsity(study: Study) -> Verdict:
    metric = "sparsity/1e-06"
    cells = {(kind, level): study.cell("bf16", kind, "forward", level) for kind in ("OffPD", "OnPD") for level in ("low", "high")}
    have = all(cells.values())
    by_lr = scalar_effect([(0.5, cells["OffPD", "low"]), (0.5, cells["OnPD", "low"]), (-0.5, cells["OffPD", "high"]),
                           (-0.5, cells["OnPD", "high"])], metric) if have else None
    by_rollout = scalar_effect([(0.5, cells["OffPD", "low"]), (0.5, cells["OffPD", "high"]), (-0.5, cells["OnPD", "low"]),
                                (-0.5, cells["OnPD", "high"])], metric) if have else None
    lr_word = verdict_word(by_lr, +1)
    at_least = by_rollout is not None and by_rollout.sign >= 0  # "OffPD at least as sparse": fails only below 0
    word = lr_word if lr_word != REPRODUCED else (REPRODUCED if at_least else "partly: low LR sparser, but OffPD less sparse than OnPD")
    means = ", ".join(f"{k} {lv} {_pct(g, metric)}%" for (k, lv), g in cells.items() if g)
    fp32 = {(k, lv): study.cell("distill", k, "forward", lv) for k in ("OffPD", "OnPD") for lv in ("low", "high")}
    tiny = (f"bf16 weights, forward KL, sparsity tau 1e-6: {means}; low - high LR " + (by_lr.text() if by_lr else "n/a") +
            " points, OffPD - OnPD " + (by_rollout.text() if by_rollout else "n/a") +
            " points. fp32 grid (forward KL): " + ", ".join(f"{k} {lv} {_pct(g, metric)}%" for (k, lv), g in fp32.items() if g))
    return Verdict("Updates are sparse at the low LR, far less at the high LR; OffPD at least as sparse as OnPD",
                   "85.3-89.6% at 1e-5 vs 51.9-60.0% at 5e-5", tiny, word,
                   study.evidence("bf16") + "; " + study.evidence("distill"), study.command("bf16"))


def spectrum(study: Study) -> Verdict:
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
    words = [f"low LR {verdict_word(low_r, +1)}"] + ([f"high LR {verdict_word(high_r, +1)}"] if high_r else [])
    word = REPRODUCED if REPRODUCED in (verdict_word(low_r, +1), verdict_word(high_r, +1)) else (
        NOT_REPRODUCED if NOT_REPRODUCED in (verdict_word(low_r, +1), verdict_word(high_r, +1)) else NOT_DISTINGUISHABLE)
    seeds_spread = ""
    if high_groups:
        stds = [g.stats("val/accuracy")[1] for g in high_groups if g.stats("val/accuracy") and g.stats("val/accuracy")[1] is not None]
        if stds:
            seeds_spread = f"; high-LR reverse KL seed std {100 * min(stds):.1f}-{100 * max(stds):.1f} points across lam"
    tiny = (f"{spread_text}; reverse KL, mean over lam > 0 minus lam < 0 (points): low LR " + (low_r.text() if low_r else "n/a") +
            (", high LR " + high_r.text() if high_r else "") + seeds_spread)
    return Verdict("Spectrum: forward KL stays high across lambda; reverse KL favours lambda > 0",
                   "forward KL > 80% across lambda (5.2-point spread); reverse KL favours lambda > 0, unstable at the high LR",
                   tiny, f"{word} ({', '.join(words)})", study.evidence("spectrum") + "; " + study.evidence("spectrum_high"),
                   study.command("spectrum") + "; " + study.command("spectrum_high"))


def harder_pass_at_k(study: Study) -> Verdict:
    groups = study.groups("hard")
    ks = sorted({int(m.rsplit("@", 1)[1]) for g in groups for m in g.runs[0].last if m.startswith("val/pass@")})
    k = max(ks) if ks else None
    on = [g for g in groups if g.kind == "OnPD" and g.lam is None]
    off = [g for g in groups if g.kind == "OffPD" and g.lam is None]
    effect = accuracy_effect(difference(on, off), k=k) if on and off and k else None
    one = accuracy_effect(difference(on, off), k=1) if on and off and k else None
    means = "; ".join(f"{g.kind} {g.direction}: pass@1 {_pct(g, 'val/pass@1')}%, pass@{k} {_pct(g, f'val/pass@{k}')}%" for g in off + on) if k else ""
    tiny = (f"Countdown-4E held-out, distilled from kdlab://tiny/teacher-4e: {means}; OnPD - OffPD pass@{k} " +
            (effect.text() if effect else "n/a") + ", pass@1 " + (one.text() if one else "n/a") + " points")
    return Verdict("On-policy rollouts give higher pass@k on a harder set", "10-15% higher pass@k on Countdown-4E",
                   tiny, verdict_word(effect, +1), study.evidence("hard"), study.command("hard"))


def rlvr_edge(study: Study) -> Verdict:
    """OnPD - OffPD before RLVR (the low-LR grid) and after it (each RLVR run grouped by the rollout of
    the run it started from)."""
    before_on = [g for g in study.groups("distill") if g.kind == "OnPD" and g.level == "low" and g.lam is None]
    before_off = [g for g in study.groups("distill") if g.kind == "OffPD" and g.level == "low" and g.lam is None]
    after: dict[str, list[RunResult]] = {"OnPD": [], "OffPD": []}
    for run in study.parts["rlvr"]:
        distilled = Path(run.path).resolve().parent
        source = study.root / "distill" / distilled.name
        if (source / "config.yaml").is_file():
            rollout = read_run(source).rollout
            kind = "OffPD" if rollout in TEACHER_ROLLOUTS else {"StudentRollouts": "OnPD"}.get(rollout)
            if kind:
                after[kind].append(run)

    def contrast(on: list[Group], off: list[Group], k: int | None) -> Effect | None:
        if not (on and off):
            return None
        return accuracy_effect(difference(on, off), k=k)

    # one configuration per distilled run (its seed is the distilled run's): group RLVR runs by source
    after_groups = {kind: [Group([run]) for run in runs] for kind, runs in after.items()}
    rows = []
    for label, k in (("accuracy", None), ("pass@4", 4)):
        b, a = contrast(before_on, before_off, k), contrast(after_groups["OnPD"], after_groups["OffPD"], k)
        rows.append((label, b, a))
    b, a = rows[0][1], rows[0][2]
    if b is None or a is None:
        word = NOT_DISTINGUISHABLE
    elif b.sign > 0:
        word = REPRODUCED if a.sign <= 0 else NOT_REPRODUCED
    else:
        word = NOT_DISTINGUISHABLE + " (no on-policy edge before RLVR to lose" + ("; after RLVR OnPD - OffPD is beyond its interval)" if a.sign else ")")
    tiny = "; ".join(f"OnPD - OffPD {label}: before RLVR {bb.text() if bb else 'n/a'}, after {aa.text() if aa else 'n/a'}" for label, bb, aa in rows)
    return Verdict("The on-policy edge does not survive RLVR", "after GRPO on Countdown-4 the OnPD/OffPD difference is gone",
                   tiny + " (points)", word, study.evidence("rlvr"), study.command("rlvr"))


def style_transfer(study: Study) -> Verdict:
    metric = "style/spanish_share"
    rows, words = [], []
    for level in ("low", "high"):
        keep = study.cell("style", "OnPD", "reverse", level)
        others = [study.cell("style", k, d, level) for k, d in (("OffPD", "forward"), ("OffPD", "reverse"), ("OnPD", "forward"))]
        others = [g for g in others if g]
        if not keep or not others:
            continue
        gaps = [scalar_effect([(1.0, g), (-1.0, keep)], metric) for g in others]
        signs = [e.sign if e else 0 for e in gaps]
        words.append(REPRODUCED if all(s > 0 for s in signs) else NOT_REPRODUCED if any(s < 0 for s in signs) else NOT_DISTINGUISHABLE)
        shares = ", ".join(f"{g.kind} {g.direction} {_pct(g, metric)}%" for g in others)
        rows.append(f"{level} LR: OnPD reverse {_pct(keep, metric)}% Spanish vs {shares}; smallest gap " +
                    min((e.text() for e in gaps if e), key=lambda t: float(t.split()[0]), default="n/a") + " points")
    if not words:
        word = NOT_DISTINGUISHABLE
    elif all(w == REPRODUCED for w in words):
        word = REPRODUCED
    elif REPRODUCED in words:
        word = "partly: " + ", ".join(f"{lv} LR {w}" for lv, w in zip(("low", "high"), words))
    else:
        word = words[0] if len(set(words)) == 1 else NOT_DISTINGUISHABLE
    return Verdict("OnPD + reverse KL keeps the student's English; the other settings transfer Spanish",
                   "other settings transfer Spanish almost fully", "; ".join(rows) or "n/a", word, study.evidence("style"), study.command("style"))


METHOD = (
    "Written by `kdlab report` from the study's runs (kdlab/study/verdicts.py). Each effect is a difference of configuration "
    "means in points, with a 95% interval: for held-out accuracy and pass@k a paired bootstrap over the problems (for "
    "accuracy also over the samples within each) of each seed's last evaluation, for per-run numbers (OOD change, sparsity, Spanish share) a t interval "
    "over seeds. An effect is beyond its interval when the interval excludes 0. \"reproduced\": the paper's effect is "
    "beyond its interval in the paper's direction; \"not reproduced\": beyond its interval the other way; \"not "
    "distinguishable\": neither. For a claim of no difference, \"reproduced\" means no difference beyond its interval. "
    "\"not run\": the finding's own runs are missing."
)

FINDINGS: tuple[Callable[[Study], Verdict], ...] = (
    on_policy_advantage, kl_direction_sensitivity, forgetting, sparsity, spectrum, harder_pass_at_k, rlvr_edge, style_transfer,
)


def is_study(root: Path) -> bool:
    """Whether ``root`` has the study's layout (its main grid folder at least)."""
    return (root / "distill" / "sweep.json").is_file()


def write_verdicts(root: Path, runs: list[RunResult], output: Path) -> list[Verdict]:
    """``verdicts.md`` and ``verdicts.csv`` in ``output``: one row per finding, and the study's wall time
    (``<root>/wall_times.jsonl``, written by ``experiments/tiny/study.sh``). Each part's own report, which
    ``verdicts.md`` links to (``<output>/<part>/report.md``), is ``kdlab report``'s to write."""
    study = Study(root, runs)
    verdicts = [finding(study) for finding in FINDINGS]
    for verdict in verdicts:  # a finding whose own runs (its first evidence) are missing was not tested
        if verdict.evidence.split("; ")[0].startswith("no runs"):
            verdict.verdict = NOT_RUN
    header = ["finding (paper)", "paper", "tiny world: effect [95% interval]", "verdict", "evidence", "command"]
    rows = [[v.finding, v.paper, v.tiny, f"**{v.verdict}**", v.evidence, f"`{v.command}`"] for v in verdicts]
    lines = ["# Verdicts: the paper's headline findings on the tiny world", "", METHOD, "", markdown_table(header, rows)]
    times = root / "wall_times.jsonl"
    if times.is_file():
        steps = [json.loads(line) for line in times.read_text().splitlines() if line.strip()]
        by_step: dict[str, dict] = {}
        for step in steps:  # a step run again (resumed, or finding its runs done) adds its time
            seen = by_step.setdefault(step["step"], dict(step, seconds=0))
            seen["seconds"] += step["seconds"]
        total = sum(step["seconds"] for step in by_step.values())
        run_seconds = sum(r.seconds or 0.0 for r in runs)
        lines += ["", "## Wall time (2-core CPU, two runs at a time, one thread each)", "",
                  markdown_table(["step", "wall time (min)", "command"], [[s["step"], f"{s['seconds'] / 60:.1f}", f"`{s['command']}`"] for s in by_step.values()]),
                  "", f"Whole study: {total / 60:.1f} min of wall time; {run_seconds / 60:.1f} min summed over the runs' own fit times."]
    output.mkdir(parents=True, exist_ok=True)
    lines += ["", "## Each part's tables", "", *(f"- [{part}]({part}/report.md): `{PART_COMMANDS[part]}`" for part in PARTS if study.parts[part])]
    (output / "verdicts.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    write_csv(output / "verdicts.csv", ["finding", "paper", "tiny", "verdict", "evidence", "command"],
              [[v.finding, v.paper, v.tiny, v.verdict, v.evidence, v.command] for v in verdicts])
    return verdicts
