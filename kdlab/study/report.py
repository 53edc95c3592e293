"""``kdlab report RUN_DIR... [--output DIR]``: tables and figures of finished runs, beside the paper's numbers.

Each run directory needs the ``config.yaml`` the fit wrote (what was run: task, rollout policy and its
``lam``, objective, learning rate, seed); directories without one are listed and skipped. A sweep's
output directory (it holds ``sweep.json``) stands for all its runs, and any other folder for the run
directories inside it (``runs/<name>`` for its ``version_N``). Metrics come from ``metrics.jsonl``
(:class:`kdlab.runlog.MetricsFile` writes every number a run logs there); a metric's value is the one at
its last step (at the same step, the later line). Missing metrics are left out.

Unfinished runs are refused (listed as skipped, never averaged): a run is finished when it has a done
marker (``DONE`` from ``kdlab sweep``, ``checkpoints/final.ckpt`` from every ``kdlab fit``) or, without
one, when its last logged step reaches ``trainer.max_steps - 1``; a run with neither marker nor
``max_steps`` is reported and flagged.

Runs whose configs differ only in the seed are one configuration: mean +- sample standard deviation
(n - 1) over its seeds, n seeds shown; reruns of one seed are averaged into that seed first. Each
value also gets a 95% interval in brackets where one can be made: a bootstrap over problems (and,
for the accuracy, the samples within each) of each seed's last evaluation (``samples/val-*.jsonl``) for ``val/accuracy`` and
``val/pass@k``, a Wilson interval over the callback's examples x samples for
``coverage/<task>/pass@1``. Settings other than task, rollout, ``lam``, objective and learning rate
that vary between configurations are shown in an ``other`` column, so no two settings are ever averaged:
only the settings (down to one argument of one callback) that differ, each by a short dotted name, classes
without their module (``callbacks.HeldOutKL.every_n_steps=50``, ``callbacks.Coverage=off``), a cell cut
to 120 characters (:func:`kdlab.study.groups.other_labels`).

Written to ``--output``; by default to ``<RUN_DIR>/report`` for one folder (``kdlab report runs/sweep-smoke``
writes ``runs/sweep-smoke/report``) and, for several, to ``report/`` in the folder holding them all when that
folder lies below the working directory (``runs/a runs/b`` -> ``runs/report``); otherwise ``--output`` is
required (:func:`default_output`):

- ``report.md``: results by configuration (``val/accuracy``, ``ood/mean_delta``, ``sparsity/1e-06``)
  with the paper's headline numbers beside the matching rows; the rollout spectrum (MixtureRollouts,
  x = lam, y = val/accuracy, per objective); pass@k (``val/pass@k``, ``coverage/<name>/pass@k``);
  ``style/spanish_share``; final ``rlvr/reward*``. Fractions are shown in percent, ``ood/*`` in points.
- CSV files in the units the runs logged: ``runs.csv`` (every run, every metric's last value, and the
  fit's wall time from ``kdlab sweep``'s ``DONE`` summary),
  ``summary.csv``, ``spectrum.csv``, ``pass_at_k.csv``, ``style.csv``, ``rlvr_curves.csv`` (whole curves).
- PNG figures in the study's factors (:mod:`kdlab.study.figures`: a panel per task, short labels such as
  ``OffPD FKL`` and ``1e-4``, the legend below the axes, a caption naming the metric and, once, what its error
  bars are, and saying when every plotted value is equal): ``accuracy``, ``train-loss`` (every run's curve,
  when its configurations need at most 10 colours), ``spectrum-<task>``, ``pass_at_k-<task>`` and the RLVR
  rewards; also embedded with the Markdown in TensorBoard under ``<output>/tensorboard``.

The paper's numbers sit beside a row when the setting matches: the paper's task (its headline numbers are
Countdown-3, Science and MedReason; a row of another task, e.g. SmolLM2 on Counting, gets none, and a report
with no run on a task of the paper carries neither the numbers' table nor the paper's notes), rollout OffPD (TeacherRollouts,
TeacherDatasetRollouts, CachedTeacherRollouts, or MixtureRollouts at lam = -1) or OnPD (StudentRollouts,
or lam = 1), full-vocabulary ForwardKL or ReverseKL, and, for numbers the paper gives per learning rate, the "low" (paper: 1e-5) or "high"
(5e-5) rate. The tiny world uses other rates, so ``--low_lr`` / ``--high_lr`` map them; by default, of
exactly two learning rates the smaller is low, otherwise only 1e-5 and 5e-5 themselves are mapped.
Figures need matplotlib: ``pip install 'kdlab[report]'``; without it the tables are written and the report
names the figures it skipped.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from kdlab.provenance import commit_mix
from kdlab.study.groups import (
    Group,
    cell,
    group_label,
    group_runs,
    lr_levels,
    metric_unit,
    pass_at_k_order,
)
from kdlab.study.paper import PAPER, PAPER_NOTE_TASKS, PAPER_NOTES, PAPER_RESULTS, is_paper_task
from kdlab.study.runs import MAIN_METRICS, PASS_AT_K, STYLE_METRICS, RunResult, collect

STYLE_GUARDS = ("val/accuracy", "ood/mean_delta", "heldout_kl/forward", "heldout_kl/student_prefixes/forward")
"""Shown beside the Spanish share, on the configurations that logged it."""
from kdlab.study.figures import CURVE_COLOURS, LABEL_WIDTH, TITLE_WIDTH, _figure_factory, accuracy_figure, curves_figure, error_bars, lam_figure, lam_lines, note_if_equal, wrap  # noqa: F401 - old names here too
from kdlab.study.tables import counted, markdown_table, write_csv


# ---- the report ----------------------------------------------------------------------------------
class _Report:
    """Collects the Markdown lines, CSV files and figures of one report, section by section."""

    def __init__(self, runs: list[RunResult], output: Path, levels: dict[float, str]) -> None:
        try:
            self.new_figure = _figure_factory()
        except ImportError:  # no matplotlib: the tables only, the figures named as skipped (skipped_figures)
            self.new_figure = None
        self.skipped_figures: list[str] = []
        self.runs, self.output, self.levels = runs, output, levels
        self.groups = group_runs(runs, levels)
        self.with_other = any(group.other for group in self.groups)
        self.present = {name for run in runs for name in run.last}
        self.md: list[str] = []
        self.figures: dict[str, Any] = {}

    def describe(self, group: Group) -> list[str]:
        lr = f"{group.lr:g}"
        return [group.task, group.rollout_label, group.objective, lr, group.level or ""] + ([group.other] if self.with_other else [])

    @property
    def describe_header(self) -> list[str]:
        return ["task", "rollout", "objective", "lr", "lr level"] + (["other"] if self.with_other else [])

    def csv(self, name: str, groups: list[Group], metrics: list[str]) -> None:
        """One row per configuration: its columns, then mean, std and n of each metric (logged units)."""
        header = ["task", "rollout", "lam", "objective", "lr", "lr_level", "other", "n", "runs"]
        header += [f"{metric} {part}" for metric in metrics for part in ("mean", "std", "n", "ci_low", "ci_high", "ci")]
        rows = []
        for g in groups:
            row = [g.task, g.rollout, "" if g.lam is None else g.lam, g.objective, g.lr, g.level or "", g.other, g.seeds, len(g.runs)]
            for metric in metrics:
                stats = g.stats(metric)
                interval = g.interval(metric) if stats else None
                row += [stats[0], "" if stats[1] is None else stats[1], stats[2]] if stats else ["", "", 0]
                row += list(interval) if interval else ["", "", ""]
            rows.append(row)
        write_csv(self.output / name, header, rows)

    def paper_note(self, key: str, groups: list[Group]) -> list[str]:
        """The paper's note ``key`` as a Markdown quote when a row of ``groups`` is on one of its tasks
        (:data:`~kdlab.study.paper.PAPER_NOTE_TASKS`), else nothing."""
        if any(is_paper_task(g.task, PAPER_NOTE_TASKS[key]) for g in groups):
            return [f"> Paper: {PAPER_NOTES[key]}"]
        return []

    def metric_section(self, title: str, metrics: list[str], csv_name: str, note: str | None = None, beside: list[str] = ()) -> list[Group]:
        """A table (and CSV) of ``metrics`` for the configurations that logged any of them, with the ``beside``
        metrics after them; ``note`` names the paper's note shown under it (:meth:`paper_note`)."""
        shown = [g for g in self.groups if any(g.stats(m) for m in metrics)]
        metrics = [*metrics, *beside]
        rows = [self.describe(g) + [str(g.seeds)] + [cell(g, m) for m in metrics] for g in shown]
        self.md += ["", f"## {title}", "", markdown_table(self.describe_header + ["n", *map(metric_unit, metrics)], rows)]
        quote = self.paper_note(note, shown) if note else []
        if quote:
            self.md += ["", *quote]
        self.csv(csv_name, shown, metrics)
        return shown

    def drawing(self, name: str) -> bool:
        """Whether figure ``name`` can be drawn (matplotlib is installed); else it is noted as skipped."""
        if self.new_figure is None:
            self.skipped_figures.append(name)
        return self.new_figure is not None

    def lam_figure(self, name: str, lines: list[tuple[list[Group], str]], ylabel: str, title: str) -> None:
        """:func:`kdlab.study.figures.lam_figure` as figure ``name`` (when matplotlib is there)."""
        if self.drawing(name):
            self.figures[name] = lam_figure(self.new_figure, lines, ylabel, title)

    def curves(self, name: str, groups: list[Group], metric: str, title: str) -> None:
        """:func:`kdlab.study.figures.curves_figure` as figure ``name``, when it can be drawn."""
        if not any(metric in run.series for g in groups for run in g.runs) or not self.drawing(name):
            return
        fig = curves_figure(self.new_figure, groups, metric, title, sorted({g.lr for g in self.groups}))
        if fig is not None:
            self.figures[name] = fig
        else:
            self.md += ["", f"Figure {name} not drawn: its configurations need more than {CURVE_COLOURS} colours ({metric} is in runs.csv)."]

    # -- sections
    def results(self) -> None:
        """val/accuracy, ood/mean_delta, sparsity by configuration, the paper's numbers beside them."""
        metrics = [m for m in MAIN_METRICS if m in self.present]
        with_paper = [m for m in metrics if any(g.paper(m) for g in self.groups)]
        header = self.describe_header + ["n"]
        for metric in metrics:
            header += [metric_unit(metric)] + (["paper"] if metric in with_paper else [])
        rows = []
        for group in self.groups:
            row = self.describe(group) + [str(group.seeds)]
            for metric in metrics:
                row.append(cell(group, metric))
                if metric in with_paper:
                    row.append("; ".join(f"{p.value} [{p.key}]" for p in group.paper(metric)))
            rows.append(row)
        self.md += ["", "## Results by configuration", "", markdown_table(header, rows)]
        self.csv("summary.csv", self.groups, metrics)
        if any(is_paper_task(g.task) for g in self.groups):  # the paper's numbers only in a report on its tasks
            self.md += [
                "",
                "### The paper's headline numbers",
                "",
                (
                    "From Qwen2.5-7B -> 1.5B and Llama-3.1-8B -> 3.2-1B on Countdown-3, Science and MedReason at LR 1e-5 "
                    "(low) and 5e-5 (high): where a reproduction should land, not what the tiny world should give. "
                    "OffPD = teacher rollouts, OnPD = student rollouts."
                ),
                "",
                markdown_table(
                    ["key", "metric", "rollout", "KL", "lr", "paper", "what", f"source ({PAPER})"],
                    [[p.key, p.metric, p.rollout or "any", p.direction or "any", p.lr or "any", p.value, p.claim, p.source] for p in PAPER_RESULTS],
                ),
            ]
        shown = [g for g in self.groups if g.stats("val/accuracy")]
        if shown and self.drawing("accuracy"):
            self.figures["accuracy"] = accuracy_figure(self.new_figure, shown, report_lrs=sorted({g.lr for g in self.groups}))
        self.curves("train-loss", self.groups, "train/loss", "train/loss (the training objective) against the step")

    def spectrum(self) -> None:
        """MixtureRollouts: val/accuracy against lam, one curve per objective (and learning rate)."""
        mixture = [g for g in self.groups if g.lam is not None and g.stats("val/accuracy")]
        if not mixture:
            return
        self.md += ["", "## Rollout spectrum (MixtureRollouts: lam = -1 teacher, 1 student)", ""]
        csv_rows = []
        for task in sorted({g.task for g in mixture}):
            here = [g for g in mixture if g.task == task]
            curves: dict[str, list[Group]] = {}
            for g in sorted(here, key=lambda g: (g.objective, g.lr, g.other, g.lam)):
                curves.setdefault(f"{g.objective}, lr={g.lr:g}" + (f", {g.other}" if g.other else ""), []).append(g)
            table = []
            for lam in sorted({g.lam for g in here}):
                row = [f"{lam:g}"]
                for members in curves.values():
                    match = [g for g in members if g.lam == lam]
                    row.append(f"{cell(match[0], 'val/accuracy')} (n={match[0].seeds})" if match else "")
                table.append(row)
            self.md += [f"{task}: val/accuracy (%) by lam", "", markdown_table(["lam", *curves], table), ""]
            lines = lam_lines(here, ["val/accuracy"])
            self.lam_figure(f"spectrum-{task}", lines, "val/accuracy (%)", f"Rollout spectrum, {task}: val/accuracy (%) at the last evaluation, mean over seeds")
            for g in here:
                mean, std, n = g.stats("val/accuracy")
                interval = g.interval("val/accuracy")
                csv_rows.append([task, g.objective, g.lr, g.other, g.lam, n, mean, "" if std is None else std, *(interval[:2] if interval else ("", ""))])
        self.md += self.paper_note("spectrum", mixture)
        header = ["task", "objective", "lr", "other", "lam", "n", "val/accuracy mean", "val/accuracy std", "val/accuracy ci_low", "val/accuracy ci_high"]
        write_csv(self.output / "spectrum.csv", header, csv_rows)

    def pass_at_k(self) -> None:
        metrics = sorted((m for m in self.present if PASS_AT_K.match(m)), key=pass_at_k_order)
        if not metrics:
            return
        shown = self.metric_section("pass@k", metrics, "pass_at_k.csv", "pass@k")
        for task in sorted({g.task for g in shown if g.lam is not None}):
            here = [g for g in shown if g.task == task and g.lam is not None]
            lines = lam_lines(here, metrics)
            self.lam_figure(f"pass_at_k-{task}", lines, "pass@k (%)", f"pass@k against lam, {task}, mean over seeds")

    def style(self) -> None:
        """The Spanish share with what tells a transferred style from a broken student beside it: held-out
        accuracy, the change on earlier skills, and the held-out KLs on teacher and on student samples."""
        metrics = [m for m in STYLE_METRICS if m in self.present]
        if metrics:
            guards = [m for m in STYLE_GUARDS if m in self.present]
            title = "Style transfer (share of primarily Spanish student responses; accuracy, forgetting and held-out KL beside it)"
            self.metric_section(title, metrics, "style.csv", "style", beside=guards)

    def rlvr(self) -> None:
        """Final rewards in a table; whole curves (every run, a colour per configuration) in figures and CSV."""
        metrics = sorted(m for m in self.present if m.startswith("rlvr/reward"))
        if not metrics:
            return
        shown = self.metric_section("RLVR reward (last value; whole curves in rlvr_curves.csv and the figures)", metrics, "rlvr.csv")
        rows = []
        for metric in metrics:
            self.curves(metric.replace("/", "-"), shown, metric, f"{metric} against the step")
            for g in shown:
                for run in (r for r in g.runs if metric in r.series):
                    lam = "" if g.lam is None else g.lam
                    rows += [[str(run.path), g.task, g.rollout, lam, g.objective, g.lr, run.seed, metric, s, v] for s, v in run.series[metric]]
        header = ["run", "task", "rollout", "lam", "objective", "lr", "seed", "metric", "step", "value"]
        write_csv(self.output / "rlvr_curves.csv", header, rows)

    def every_run(self) -> None:
        names = sorted(self.present)
        rows = [
            [str(r.path), r.task, r.rollout, "" if r.lam is None else r.lam, r.objective, r.lr, self.levels.get(r.lr, ""), r.seed,
             "" if r.seconds is None else r.seconds]
            + [r.last.get(name, "") for name in names]
            for r in self.runs
        ]
        header = ["run", "task", "rollout", "lam", "objective", "lr", "lr_level", "seed", "fit_seconds", *names]
        write_csv(self.output / "runs.csv", header, rows)


def write_report(
    runs: list[RunResult],
    skipped: list[tuple[str, str]],
    output: str | Path,
    low_lr: list[float] | None = None,
    high_lr: list[float] | None = None,
) -> Path:
    """Write ``report.md``, the CSV files, the PNG figures and ``tensorboard/`` to ``output``; returns
    the Markdown file's path."""
    output = Path(output)
    levels = lr_levels({run.lr for run in runs}, low_lr, high_lr)
    report = _Report(runs, output, levels)
    output.mkdir(parents=True, exist_ok=True)
    report.md += [
        "# kdlab report",
        "",
        (
            f"{counted(len(runs), 'run')} in {counted(len(report.groups), 'configuration')}: mean ± sample standard deviation over the "
            "seeds of a configuration (n seeds; reruns of one seed are averaged into that seed), then, in brackets, "
            "a 95% interval of that mean: for val/accuracy and val/pass@k a bootstrap over the problems (for val/accuracy also the samples within each) "
            "of each seed's last evaluation (samples/val-*.jsonl), for coverage/<task>/pass@1 a Wilson interval over "
            "the callback's examples x samples. Accuracy, pass@k, sparsity and Spanish share in percent; "
            "ood/mean_delta in points (after - before). The CSV files keep the units the runs logged. "
            "val/accuracy is the mean score of eval_samples completions per held-out prompt at the last validation; "
            "coverage/<task>/pass@k is the Coverage callback's own draw on its task, a different number."
        ),
    ]
    reruns = [(g, g.seeds) for g in report.groups if len(g.runs) > g.seeds]
    if reruns:
        report.md += ["", "Reruns of a seed (averaged as one seed, not counted as more seeds):"]
        report.md += [f"- {group_label(g)}: {counted(len(g.runs), 'run')}, {counted(seeds, 'seed')}" for g, seeds in reruns]
    flagged = [run for run in runs if run.flag]
    if flagged:
        report.md += ["", "Flagged:", *(f"- `{run.path}`: {run.flag}" for run in flagged)]
    mix = commit_mix([run.path for run in runs])  # issue #40: one table's runs from several commits or a dirty tree
    if mix:
        report.md += ["", f"Provenance (each run's run_info.json): {mix}; these tables may mix code versions."]
    if levels:
        how = "as given" if (low_lr or high_lr) else "default: the smaller of two learning rates is low; set with --low_lr / --high_lr"
        mapping = ", ".join(f"{lr:g} = {level}" for lr, level in sorted(levels.items()))
        report.md += ["", f"Learning-rate levels for the paper's numbers: {mapping} ({how})."]
    if skipped:
        report.md += ["", "Skipped:", *(f"- `{path}`: {reason}" for path, reason in skipped)]
    report.results()
    report.spectrum()
    report.pass_at_k()
    report.style()
    report.rlvr()
    report.every_run()
    if report.figures:
        report.md += ["", "## Figures", "", *(f"![{name}]({name}.png)" for name in report.figures)]
    if report.skipped_figures:
        skipped_figures = f"figures not drawn, matplotlib is not installed (pip install 'kdlab[report]'): {', '.join(report.skipped_figures)}"
        report.md += ["", skipped_figures[0].upper() + skipped_figures[1:] + "."]
        print(f"[report] {skipped_figures}", file=sys.stderr)
    text = "\n".join(report.md) + "\n"
    path = output / "report.md"
    path.write_text(text, encoding="utf-8")
    for name, fig in report.figures.items():
        fig.savefig(output / f"{name}.png", dpi=120)
    _write_tensorboard(output / "tensorboard", report.figures, text)
    return path


def _write_tensorboard(directory: Path, figures: dict[str, Any], text: str) -> None:
    from torch.utils.tensorboard import SummaryWriter

    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("events.out.tfevents.*"):  # a rewritten report replaces the last one
        old.unlink()
    writer = SummaryWriter(str(directory))
    try:
        for name, fig in figures.items():
            writer.add_figure(f"report/{name}", fig, global_step=0)
        writer.add_text("report", text, global_step=0)
    finally:
        writer.close()


def default_output(paths: list[str | Path]) -> Path:
    """Where a report goes without ``--output`` (the README's rule): for one folder, ``<folder>/report``
    (``kdlab report runs/sweep-smoke`` writes ``runs/sweep-smoke/report``); for several, ``report/`` in the
    folder holding them all when that folder lies below the working directory (``runs/a runs/b`` ->
    ``runs/report``). Otherwise (their common folder is the working directory, above it or elsewhere, e.g.
    ``/``) ``ValueError``: the caller asks for ``--output`` rather than write where nobody looks."""
    if len(paths) == 1:
        return Path(paths[0]) / "report"
    common = Path(os.path.commonpath([Path(path).resolve() for path in paths]))
    cwd = Path.cwd().resolve()
    if cwd not in common.parents:
        where = "the working directory" if common == cwd else str(common)
        raise ValueError(
            f"the given folders share no folder below the working directory (their common folder is {where}): "
            "say where the report goes with --output DIR"
        )
    return common.relative_to(cwd) / "report"


def main(argv: list[str] | None = None) -> None:
    """``kdlab report RUN_DIR... [--output DIR] [--low_lr LR...] [--high_lr LR...] [--design FILE]``."""
    parser = argparse.ArgumentParser(
        prog="kdlab report", description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # --out DIR is an unknown option, not --output (issue #43)
    )
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR",
                        help="run directories, folders holding them (runs/<name> with its version_N) or a sweep's output directory")
    parser.add_argument("--output", help="where the report goes (default: RUN_DIR/report for one folder; for several, report/ in "
                        "the folder holding them all when it lies below the working directory, else --output is required)")
    parser.add_argument("--low_lr", type=float, nargs="+", help="learning rates compared with the paper's 1e-5")
    parser.add_argument("--high_lr", type=float, nargs="+", help="learning rates compared with the paper's 5e-5")
    parser.add_argument("--design", help="a study's design (YAML: 'commands', the command of each part it runs; 'elsewhere', each part it "
                        "leaves to another study and why): its verdicts say 'not tested here' for those (default: every part, the tiny study's)")
    options = parser.parse_args(argv)
    missing = [path for path in options.runs if not Path(path).exists()]
    if missing:  # said as such, not as "no finished run directory among" it
        parser.error(f"{missing[0]}: no such file or folder")
    from kdlab.study.verdicts import PARTS, Study, StudyDesign, is_study, write_verdicts

    try:
        design = StudyDesign.load(options.design) if options.design else None
    except ValueError as error:
        parser.error(str(error))
    if design is not None and not (len(options.runs) == 1 and is_study(Path(options.runs[0]))):
        parser.error("--design is for one study's folder (a part such as distill/ holding a sweep), not " + " ".join(options.runs))
    if options.output:
        output = Path(options.output)
    else:
        try:
            output = default_output(options.runs)
        except ValueError as error:
            parser.error(str(error))
    runs, skipped = collect(options.runs)
    skipped += [(str(run.path), run.unfinished) for run in runs if run.unfinished]  # never averaged with finished runs
    runs = [run for run in runs if not run.unfinished]
    for path, reason in skipped:
        print(f"[report] skipped {path}: {reason}", file=sys.stderr)
    for run in runs:
        if run.flag:
            print(f"[report] flagged {run.path}: {run.flag}", file=sys.stderr)
    if not runs:
        parser.error("no finished run directory with a config.yaml among " + " ".join(options.runs))
    path = write_report(runs, skipped, output, options.low_lr, options.high_lr)
    print(f"[report] {counted(len(runs), 'run')} -> {path} (CSV, PNG and tensorboard/ beside it)")
    if len(options.runs) == 1 and is_study(Path(options.runs[0])):
        if not write_verdicts(Path(options.runs[0]), runs, output, design, options.low_lr, options.high_lr):
            print(f"[report] {options.runs[0]} is laid out as a study but holds no finding's runs: no verdicts written", file=sys.stderr)
            return
        parts = Study(Path(options.runs[0]), runs).parts
        for part in PARTS:  # each part's own tables, without the other parts' settings in their columns
            if parts[part]:  # the given LR levels; else the part's own (lr_levels)
                write_report(parts[part], [], output / part, options.low_lr, options.high_lr)
        print(f"[report] the study's verdicts -> {output / 'verdicts.md'}")
