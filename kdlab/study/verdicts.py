"""A study's verdicts: one row per headline finding of the paper, with the effect that decides it, its 95%
interval, and the runs and command behind it. ``kdlab report <root>`` writes them (``verdicts.md``,
``verdicts.csv``) when ``<root>`` holds the study's layout, which ``experiments/tiny/study.sh`` writes (the
real-model study, ``experiments/smollm2/style_study.sh``, only its ``style/``; the tiny world's departures
from the paper's design are said only for tiny-world runs)::

    <root>/distill/                  main grid: rollout x KL x LR (1e-4, 5e-4) x seeds (experiments/tiny/grid_5x.yaml)
    <root>/hard/                     harder set: distilled on Countdown-3, pass@k on countdown3s
    <root>/rlvr/<distilled run>/...  GRPO on the harder set from the hard runs (both: experiments/tiny/rlvr_harder_pipeline.yaml)
    <root>/bf16/                     the main grid's cells in bf16 (experiments/tiny/bf16_grid_5x.yaml)
    <root>/spectrum/                 lambda spectrum at the low LR (experiments/tiny/spectrum_sweep_5x.yaml)
    <root>/spectrum_high/            reverse-KL spectrum at the high LR (experiments/tiny/spectrum_high_5x.yaml)
    <root>/style/                    Spanish-style grid (experiments/tiny/style_grid_5x.yaml)

The findings themselves (:class:`Study`, :class:`Verdict`, one function per finding) live in
:mod:`kdlab.study.findings`, their effects in :mod:`kdlab.study.effects` (seed-level intervals paired where the
configurations share their seeds: :func:`~kdlab.study.stats.seed_contrast`), their labels in :mod:`kdlab.study.labels`.
This module writes the page: each row's labels, its pre-stated primary claim with Holm's correction over the
findings, and the runs' provenance (several commits or a
dirty tree in one part, :func:`~kdlab.provenance.commit_mix`). :data:`METHOD` says how, for the reader of ``verdicts.md``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from kdlab.provenance import commit_mix
from kdlab.study.effects import accuracy_effect, difference, scalar_effect, table_effect  # noqa: F401  (kdlab 0.1 imported them from here)
from kdlab.study.design import NOT_IN_DESIGN, PARALLEL_RUNS, PART_COMMANDS, PARTS, Study, StudyDesign, Verdict  # noqa: F401  (importable from here as before)
from kdlab.study.findings import (  # noqa: F401  (the findings, importable from here as before)
    forgetting,
    harder_pass_at_k,
    kl_direction_sensitivity,
    lr_departure,
    on_policy_advantage,
    rlvr_edge,
    sparsity,
    spectrum,
    style_transfer,
)
from kdlab.study.coverage_findings import harder_from_coverage, measures_harder, rlvr_from_coverage
from kdlab.study.style_findings import style_alone
from kdlab.study.labels import ACCURACY_MARGIN, ALPHA, COLLAPSE_ACCURACY, COLLAPSE_OOD, NOT_HERE, NOT_RUN, OOD_MARGIN, holm
from kdlab.study.labels import REPRODUCED as _REPRODUCED  # kdlab.verdicts.REPRODUCED is the legacy name of labels'
from kdlab.study.labels import Effect  # noqa: F401  (kdlab 0.1 imported it from here)
from kdlab.study.runs import RunResult
from kdlab.study.tables import markdown_table, write_csv


def primary_text(verdict: Verdict) -> str:
    """The primary claim's cell: its rule, its p-value (intersection-union: the largest of its parts') and Holm's."""
    if verdict.holm_p is None:
        return verdict.primary_rule or "n/a"
    word = _REPRODUCED if verdict.holm_p < ALPHA else "not shown"
    return f"{verdict.primary_rule}: **{word}** (p {verdict.primary_p:.3g}, Holm {verdict.holm_p:.3g})"


def provenance_text(study: Study) -> str:
    """One line per part whose runs come from more than one commit or from a dirty tree (:func:`~kdlab.provenance.commit_mix`)."""
    lines = []
    for part in PARTS:
        mix = commit_mix([run.path for run in study.parts[part]])
        if mix:
            lines.append(f"- {part}: {mix}")
    return "\n".join(lines)


METHOD = (
    "Written by `kdlab report` from the study's runs (kdlab/study/verdicts.py). Each effect is a difference of configuration "
    "means in points. Held-out accuracy and pass@k get two 95% intervals, written `value [problems] / seeds [seeds]`: "
    "[problems] is a paired bootstrap over the problems (for accuracy also over the samples within each) of each seed's last "
    "evaluation, the trained models held fixed (shown, never labelled); seeds [...] covers the training seed and the problems "
    "drawn, as crossed random effects: each (seed, problem) cell enters with its own samples' mean, never resampled (the samples' "
    "noise, already in the spread between cells, is counted once), the variance of the contrast comes from two-way mean squares, "
    "(MS seed + max(MS problem - MS residual, 0)) / (seeds x problems), the seeds' mean square always whole, "
    "and the interval is a t interval with Satterthwaite's degrees of freedom, the same method at any number of seeds (two seeds, "
    "one degree of freedom, may run slightly above the nominal 5%). Where the "
    "configurations share their seeds (the seed fixes the data order and the evaluation's sampling streams, so same-seed runs share "
    "random numbers), the contrast is taken cell by cell (paired) on the seeds and problems every configuration has; otherwise "
    "each configuration's seeds count on their own (unpaired). Per-run numbers (OOD change, sparsity) get a t interval over seeds, "
    "paired when the seeds are shared; the Spanish share, which sits near 0 and 100%, is tested on the logit scale (each run's "
    "share moved to its Wilson interval's centre, then t over seeds) and shown in points beside its log-odds. "
    "Labels (column verdict) come from the seed-level intervals of each claim the row tests (column rule), every one-sided "
    f"test at {100 * ALPHA:g}% and each claim on its own (not corrected for the many claims a page shows: the column is "
    "exploratory): a claimed difference (`> 0`, `< 0`, or beyond a margin) is \"reproduced\" when the 90% interval "
    "lies beyond 0 (or the margin) on the paper's side, \"opposite\" when it lies beyond 0 on the other side, \"not "
    "distinguishable\" otherwise; a claim of no difference (`= 0`, TOST) is \"equivalent\" when the 90% interval lies inside "
    f"the margin ({100 * ACCURACY_MARGIN:g} points of accuracy, {OOD_MARGIN:g} points of OOD change), \"different\" when the 95% "
    "interval excludes 0; a claim of no superiority (`< +margin`) is \"reproduced\" when the 90% interval's upper end lies "
    "below the margin, \"opposite\" when the 95% interval lies above 0; the paper's magnitude is compared with the 95% "
    "interval. Each finding has one primary claim, stated before the runs (column primary claim): rows 1-3 on the fp32 grid "
    "(row 2's forward KL in each rollout policy's cells), the spectrum's forward and reverse KL at the low LR, the harder set at "
    "the k nearest the paper's 10, RLVR's edge before it and its loss, the style claims at the paper's (low) LR; a claim of "
    "several parts is an intersection-union test (its p-value the largest of its parts'), and Holm's procedure over the findings "
    "holds the family-wise error of the primary claims at 5%. Row 7 is "
    "\"untestable\" when there is no OnPD edge before RLVR to lose. A style claim comparing a student below "
    f"{100 * COLLAPSE_ACCURACY:g}% held-out accuracy or {COLLAPSE_OOD:g} points on its earlier skills is \"collapsed\", whatever "
    "its interval (a broken model's Spanish share is no transferred style). A row whose claims get different labels lists each "
    "label with its claims. \"not run\": the finding's own runs are missing; \"not tested here\": the study's design "
    "(`kdlab report --design`) leaves the finding to another study, named in its evidence. Changed from kdlab 0.1 (issue #40): same-seed "
    "contrasts were unpaired and redrew the samples in every seed slot (noise counted twice), 2000 draws let labels move with the "
    "bootstrap's random numbers, equivalence needed the 95% interval (2.5% per side), directional claims were read from the 95% "
    "interval, row 1 was tested as equivalence, row 2 as reverse minus forward KL, and no correction covered the findings. "
    "Changed after a statistics review: the seed-level interval was a t over the seeds' means below 5 seeds (the problems held fixed) and a "
    "percentile bootstrap over seeds and problems from 5 (too narrow at 5 seeds); row 2's forward KL was tested on the mean of "
    "the two policies' changes; a run missing a problem or a seed ended the pairing (or the report)."
)

WORLD_DEPARTURES = (
    "Every row: {world}'s packaged teacher and student ({page}) in place of 1.5-8B models; "
    "Countdown-3 the one reasoning task distilled (the paper also distils Science and MedReason); {world}'s "
    "earlier skills (the OODForgetting callback's tasks) in place of seven lm-eval-harness tasks. "
    "Each row's own departures (its verdict says \"design differs\"):"
)
"""The departures every row of a tiny-world study shares, for the study's ``world`` and its ``page``."""

def harder_set(study: Study) -> Verdict:
    """The harder-set row: measured by the main grid's own runs (a ``Coverage`` named ``harder``, no ``hard`` part:
    :func:`~kdlab.study.coverage_findings.harder_from_coverage`) or by the ``hard`` part (:func:`harder_pass_at_k`)."""
    if not study.parts["hard"] and measures_harder(study.parts["distill"]):
        return harder_from_coverage(study)
    return harder_pass_at_k(study)


def rlvr_row(study: Study) -> Verdict:
    """The RLVR row: chains that measure the harder set before and after themselves
    (:func:`~kdlab.study.coverage_findings.rlvr_from_coverage`), else :func:`rlvr_edge`."""
    if not study.parts["hard"] and measures_harder(study.parts["rlvr"]):
        return rlvr_from_coverage(study)
    return rlvr_edge(study)


def style_row(study: Study) -> Verdict:
    """The style row: the style-alone design when the study has its part (:func:`~kdlab.study.style_findings.style_alone`),
    else :func:`style_transfer`."""
    return style_alone(study) if study.parts["style_alone"] else style_transfer(study)


FINDINGS: tuple[Callable[[Study], Verdict], ...] = (
    on_policy_advantage, kl_direction_sensitivity, forgetting, sparsity, spectrum, harder_set, rlvr_row, style_row,
)


PRECISION_FINDINGS = (on_policy_advantage, kl_direction_sensitivity, forgetting)
"""The main grid's rows, tested on the fp32 grid (``distill``) and, where the study has it, on the same cells in bf16."""


def with_bf16(finding: Callable[..., Verdict], study: Study) -> Verdict:
    """``finding`` on the main grid and, when the ``bf16`` part holds both KL directions, on it too: the row
    then says which precision each label and effect is from."""
    fp32 = finding(study)
    if {g.direction for g in study.groups("bf16")} != {"forward", "reverse"}:
        return fp32
    bf16 = finding(study, "bf16")
    departures = "; ".join(dict.fromkeys(d for d in (fp32.departure, bf16.departure) if d))
    return Verdict(fp32.finding, fp32.paper, f"fp32: {fp32.tiny}. bf16: {bf16.tiny}", f"fp32: {fp32.verdict}. bf16: {bf16.verdict}",
                   f"{fp32.evidence}; {bf16.evidence}", f"{fp32.command}; {bf16.command}", f"{fp32.rule} (each precision)", departures,
                   fp32.claims + bf16.claims, fp32.primary)  # the primary claim is the fp32 grid's: bf16 repeats it


def is_study(root: Path) -> bool:
    """Whether ``root`` has the study's layout: a part's folder (:data:`PARTS`) holding a sweep, or subfolders
    that do (e.g. ``style/low``, ``style/high``), so the real-model study with its style part alone is one."""
    return any((root / part / "sweep.json").is_file() or any((root / part).glob("*/sweep.json")) for part in PARTS)


def write_verdicts(root: Path, runs: list[RunResult], output: Path, design: StudyDesign | None = None,
                   low_lr: list[float] | None = None, high_lr: list[float] | None = None) -> list[Verdict]:
    """``verdicts.md`` and ``verdicts.csv`` in ``output``: one row per finding, and the study's wall time
    (``<root>/wall_times.jsonl``, written by ``experiments/tiny/study.sh``). Each part's own report, which
    ``verdicts.md`` links to (``<output>/<part>/report.md``), is ``kdlab report``'s to write. ``design``: the parts
    the study runs and those it leaves to another study (:class:`~kdlab.study.design.StudyDesign`). Writes nothing
    and returns ``[]`` when no finding has its runs in ``root`` (a folder of runs laid out like a study, such as the
    tiny world's ``runs/tiny-world`` with its RLVR sweep). ``low_lr``/``high_lr``: every part's LR levels (:class:`Study`)."""
    study = Study(root, runs, design, low_lr, high_lr)
    verdicts = [with_bf16(finding, study) if finding in PRECISION_FINDINGS else finding(study) for finding in FINDINGS]
    for verdict in verdicts:  # a finding whose own runs (its first evidence) are missing was not tested
        first = verdict.evidence.split("; ")[0]
        if first.startswith(NOT_IN_DESIGN):
            verdict.verdict = NOT_HERE
        elif first.startswith("no runs"):
            verdict.verdict = NOT_RUN
    if all(v.verdict in (NOT_RUN, NOT_HERE) for v in verdicts):  # a folder laid out as a study without a finding's runs
        return []
    tested = [v for v in verdicts if v.verdict not in (NOT_RUN, NOT_HERE) and v.primary]
    for verdict, adjusted in zip(tested, holm([v.primary_p for v in tested])):
        verdict.holm_p = adjusted
    header = ["finding (paper)", "paper", f"{study.world.removeprefix('the ')}: effect [95% interval, problems] / seeds [95% interval, seeds]", "verdict",
              "rule (claims the verdict tests)", f"primary claim (Holm over {len(tested)} findings)", "evidence", "command"]
    rows = [[v.finding, v.paper, v.tiny, f"**{v.verdict}**" + (f" (design differs: {v.departure})" if v.departure else ""),
             v.rule, primary_text(v), v.evidence, f"`{v.command}`"] for v in verdicts]
    lines = [f"# Verdicts: the paper's headline findings on {study.world}", "", METHOD, "", markdown_table(header, rows)]
    provenance = provenance_text(study)
    if provenance:
        lines += ["", "## Provenance", "", provenance]
    departures = [[v.finding, v.departure] for v in verdicts if v.departure]  # the page of a real-model study states its own
    lines += ["", "## Departures from the paper's design", "", WORLD_DEPARTURES.format(world=study.world, page=study.world_page), "", markdown_table(["finding", "design here"], departures)
              if departures else "No row departs further from the paper's design."] if study.tiny else []
    times = root / "wall_times.jsonl"
    run_seconds = sum(r.seconds or 0.0 for r in runs)
    by_part = "By part: " + ", ".join(f"{part} {sum(r.seconds or 0.0 for r in study.parts[part]) / 60:.1f} min ({len(study.parts[part])} runs)"
                                      for part in PARTS if study.parts[part]) + "."
    if times.is_file():
        lines += ["", "## Wall time (2-core CPU, two runs at a time, one thread each)", ""]
        steps = [json.loads(line) for line in times.read_text().splitlines() if line.strip()]
        by_step: dict[str, dict] = {}
        for step in steps:  # a step run again (resumed, or finding its runs done) adds its time
            seen = by_step.setdefault(step["step"], dict(step, seconds=0))
            seen["seconds"] += step["seconds"]
        total = sum(step["seconds"] for step in by_step.values())
        lines += [markdown_table(["step", "wall time (min)", "command"], [[s["step"], f"{s['seconds'] / 60:.1f}", f"`{s['command']}`"] for s in by_step.values()]),
                  "", f"Whole study: {total / 60:.1f} min of wall time logged; {run_seconds / 60:.1f} min summed over the runs' own fit "
                  f"times, about {run_seconds / 60 / PARALLEL_RUNS:.1f} min of wall time at two runs at a time (an estimate that also counts "
                  "runs finished in an earlier call of a step, and time other jobs took from the runs). " + by_part]
    else:
        lines += ["", "## Wall time", "", f"No log of the steps' wall time (`{times.name}`, which a study's script writes beside its "
                  f"runs) in this folder. The runs' own fit times sum to {run_seconds / 60:.1f} min. " + by_part]
    output.mkdir(parents=True, exist_ok=True)
    lines += ["", "## Each part's tables", "", *(f"- [{part}]({part}/report.md): `{study.command(part)}`" for part in PARTS if study.parts[part])]
    (output / "verdicts.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    write_csv(output / "verdicts.csv", ["finding", "paper", "tiny", "verdict", "rule", "evidence", "command", "departure", "primary", "primary_p", "holm_p"],
              [[v.finding, v.paper, v.tiny, v.verdict, v.rule, v.evidence, v.command, v.departure, v.primary_rule,
                v.primary_p if v.holm_p is not None else None, v.holm_p] for v in verdicts])
    return verdicts
