"""``kdlab report``'s figures and their drawing pieces: error bars in report units, the caption that names them
once, wrapped labels, and matplotlib figures on the Agg canvas (no pyplot state), with a clear error without
matplotlib.

Every figure is laid out in the study's factors with short labels (:mod:`kdlab.study.figure_labels`): a panel per
task, a row per rollout x KL (x the settings that tell configurations apart), a colour per learning rate; its
legend sits outside the axes (below them), never over data; the caption above names the interval once; and no
figure is more than twice as tall as it is wide (a figure that would be grows wider)."""

from __future__ import annotations

import math
import textwrap
from typing import Any

from kdlab.study.figure_labels import lr_label, short_labels, variant_labels, without_seed
from kdlab.study.groups import Group, is_percent


def error_bars(groups: list[Group], metric: str) -> tuple[list[float], list[list[float]]]:
    """Means and (below, above) error-bar lengths in report units: the 95% interval where there is one,
    else ± the std over seeds, else none."""
    scale = 100.0 if is_percent(metric) else 1.0
    means, below, above = [], [], []
    for g in groups:
        mean, std, _ = g.stats(metric)
        interval = g.interval(metric)
        low, high = interval[:2] if interval else (mean - (std or 0.0), mean + (std or 0.0))
        means.append(scale * mean)
        below.append(scale * max(0.0, mean - low))
        above.append(scale * max(0.0, high - mean))
    return means, [below, above]


def equal_note(values: list[float], what: str) -> str:
    """A caption's note when two or more plotted values are all the same (a flat chart is otherwise unreadable),
    else ``""``."""
    if len(values) > 1 and max(values) - min(values) < 1e-9:
        return f"all {len(values)} values of {what} are {values[0]:.4g}"
    return ""


def note_if_equal(ax: Any, values: list[float], what: str) -> None:
    """kdlab 0.1's note on an axes when every plotted value is the same; the report's figures now say it in
    their caption (:func:`equal_note`)."""
    if values and max(values) - min(values) < 1e-9:
        ax.text(0.5, 0.5, f"all {len(values)} values of {what} are {values[0]:.4g}", transform=ax.transAxes,
                ha="center", va="center", fontsize=9, bbox={"facecolor": "white", "alpha": 0.8})


def interval_caption(groups: list[Group], metric: str) -> str:
    """What the error bars of ``metric`` are, said once: the 95% interval (bootstrap over problems, or Wilson)
    where there is one, else ± the std over seeds, else none (one seed, no interval)."""
    kinds = []
    for g in groups:
        stats = g.stats(metric)
        interval = g.interval(metric) if stats else None
        kinds.append(interval[2] if interval else "std" if stats and stats[1] is not None else "none")
    parts = []
    if "bootstrap" in kinds:
        parts.append("95% interval, bootstrap over problems" + (" and samples" if metric == "val/accuracy" else ""))
    if "Wilson" in kinds:
        parts.append("95% Wilson interval")
    if "std" in kinds:
        parts.append("± std over seeds" + (" where there is no interval" if parts else ""))
    if not parts:
        return "no error bars: one seed and no interval"
    return "error bars: " + "; ".join(parts) + ("; none for one seed without an interval" if "none" in kinds else "")


def intervals_caption(lines: list[tuple[list[Group], str]]) -> str:
    """:func:`interval_caption` of every metric the ``(configurations, metric)`` lines plot: said once when they
    agree, else each with its metrics (``val/pass@1, val/pass@4: 95% interval, bootstrap over problems;
    coverage/x/pass@1: 95% Wilson interval``)."""
    by_text: dict[str, list[str]] = {}
    for metric in dict.fromkeys(metric for _, metric in lines):
        groups = [g for members, plotted in lines if plotted == metric for g in members]
        by_text.setdefault(interval_caption(groups, metric), []).append(metric)
    if len(by_text) == 1:
        return next(iter(by_text))
    return "error bars: " + "; ".join(f"{', '.join(metrics)}: {text.removeprefix('error bars: ')}" for text, metrics in by_text.items())


def wrap(text: str, width: int) -> str:
    """``text`` on lines of at most ``width`` characters (a long label or title fits its figure)."""
    return textwrap.fill(text, width, break_long_words=True, break_on_hyphens=False)


LABEL_WIDTH = 40  # characters per line of a tick label or legend entry
TITLE_WIDTH = 70  # characters per line of a title (8-9 points) over a figure's axes


def _figure_factory():
    """Makes matplotlib Figures on the Agg canvas (no pyplot state), with constrained layout (labels, titles
    and legends are fitted inside the figure when it is drawn); a clear error when matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("kdlab report draws its figures with matplotlib: pip install 'kdlab[report]'") from error

    def figure(**kwargs: Any) -> Figure:
        fig = Figure(layout="constrained", **kwargs)
        FigureCanvasAgg(fig)
        return fig

    return figure


CAPTION_WIDTH = 90  # characters per caption line at the report's 7-inch figures


def _fit_aspect(width: float, height: float) -> tuple[float, float]:
    """A figure size no taller than twice its width: a taller one grows wider."""
    return max(width, height / 2), height


def _caption(fig: Any, *lines: str) -> None:
    fig.suptitle("\n".join(wrap(line, CAPTION_WIDTH) for line in lines if line), fontsize=8)


def _legend_below(fig: Any, handles: list, labels: list[str], title: str | None = None) -> None:
    """The legend under the axes, outside them (constrained layout makes room), a few entries a row."""
    if handles:
        columns = min(len(labels), 4 if max(map(len, labels)) <= 22 else 2)
        fig.legend(handles, [wrap(label, LABEL_WIDTH) for label in labels], loc="outside lower center", ncols=columns,
                   fontsize=7, title=title, title_fontsize=7, frameon=False)


def lr_colour(lr: float, lrs: list[float]) -> str:
    """The colour of learning rate ``lr`` in every figure of one report: its place among the report's learning
    rates ``lrs`` (ascending), so a rate has one colour in the accuracy bars and in the curves."""
    return f"C{sorted(lrs).index(lr) % 10}"


def accuracy_figure(new_figure: Any, groups: list[Group], metric: str = "val/accuracy", report_lrs: list[float] | None = None) -> Any:
    """Horizontal bars of ``metric`` (percent): a panel per task, a row per rollout x KL (x the settings that
    tell configurations apart, :func:`~kdlab.study.figure_labels.short_labels`), a bar per learning rate in each
    row (a colour each, :func:`lr_colour` over ``report_lrs``, default these groups' rates; the legend below), each
    row as tall as its bars need; the caption names the error bars (:func:`interval_caption`)."""
    lrs = sorted({g.lr for g in groups})
    palette = sorted(set(report_lrs or lrs) | set(lrs))
    tasks = list(dict.fromkeys(g.task for g in groups))
    labels, shared = short_labels(groups, lr=False)
    rows = {task: list(dict.fromkeys(label for g, label in zip(groups, labels) if g.task == task)) for task in tasks}
    row_height = 0.12 + 0.12 * len(lrs)  # inches: one learning rate 0.24, five 0.72
    height = 0.8 + row_height * sum(map(len, rows.values())) + 0.45 * len(tasks) + (0.35 if len(lrs) > 1 else 0.0)
    fig = new_figure(figsize=_fit_aspect(7.0, height))
    axes = fig.subplots(len(tasks), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": [len(rows[t]) + 1.2 for t in tasks]})[:, 0]
    means_all, handles = [], {}
    for ax, task in zip(axes, tasks):
        here = rows[task]
        for g, label in zip(groups, labels):
            if g.task != task:
                continue
            slot, width = lrs.index(g.lr), 0.8 / len(lrs)
            y = here.index(label) + (slot - (len(lrs) - 1) / 2) * width
            means, errors = error_bars([g], metric)
            bar = ax.barh([y], means, height=width * 0.95, xerr=errors, capsize=2, color=lr_colour(g.lr, palette), alpha=0.85, error_kw={"lw": 1})
            ax.plot(means, [y], "k|", markersize=6)  # a zero-length bar still shows its value
            handles.setdefault(g.lr, bar)
            means_all += means
        ax.set_yticks(range(len(here)), [wrap(label, LABEL_WIDTH) for label in here], fontsize=8)
        ax.set_ylim(len(here) - 0.5, -0.5)
        ax.set_xlim(0, 100)
        ax.set_title(task, fontsize=8, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel(f"{metric} (%)")
    lr_text = f"lr {lr_label(lrs[0])}" if len(lrs) == 1 else ""
    _caption(fig, f"{metric} (%) at the last evaluation, mean over seeds" + "".join(f"; {t}" for t in (shared, lr_text) if t),
             interval_caption(groups, metric), equal_note(means_all, f"{metric} (%)"))
    if len(lrs) > 1:
        _legend_below(fig, [handles[lr] for lr in lrs], [lr_label(lr) for lr in lrs], title="learning rate")
    return fig


def lam_lines(groups: list[Group], metrics: list[str]) -> list[tuple[list[Group], str]]:
    """The lines of a :func:`lam_figure`: for each metric, the mixtures of each KL, learning rate and
    :func:`~kdlab.study.figure_labels.variant_labels` (settings that only come with one ``lam`` make no line of
    their own), sorted by ``lam``; a line without the metric is left out."""
    variants = variant_labels(groups)
    curves: dict[tuple, list[Group]] = {}
    for g, variant in zip(groups, variants):
        curves.setdefault((g.objective, g.lr, variant), []).append(g)
    lines = []
    for metric in metrics:
        for key in sorted(curves):
            members = sorted((g for g in curves[key] if g.stats(metric)), key=lambda g: g.lam)
            if members:
                lines.append((members, metric))
    return lines


def lam_figure(new_figure: Any, lines: list[tuple[list[Group], str]], ylabel: str, title: str) -> Any:
    """Percent metrics against a mixture's ``lam``: one line per ``(configurations of one curve, metric)``,
    labelled by :func:`~kdlab.study.figure_labels.short_labels` of the curves (and the metric when there are
    several), error bars from :func:`error_bars` (the caption names each metric's kind, :func:`intervals_caption`), the legend
    below the axes."""
    fig = new_figure(figsize=(7.0, 4.6))
    ax = fig.add_subplot()
    firsts = [members[0] for members, _ in lines]
    labels, shared = short_labels(firsts, rollout=False)
    metrics = list(dict.fromkeys(metric for _, metric in lines))
    plotted, handles, names = [], [], []
    for (members, metric), label in zip(lines, labels):
        means, errors = error_bars(members, metric)
        handles.append(ax.errorbar([g.lam for g in members], means, yerr=errors, marker="o", capsize=3, markersize=4))
        names.append(" ".join([metric.rsplit("/", 1)[-1] if metric.startswith("val/") else metric] * (len(metrics) > 1) + [label]))
        plotted += means
    ax.set(xlabel="lam (-1 teacher, 1 student)", ylabel=ylabel, ylim=(0, 100))
    ax.grid(alpha=0.3)
    _caption(fig, title + (f"; {shared}" if shared and len(lines) > 1 else ""), intervals_caption(lines), equal_note(plotted, ylabel))
    _legend_below(fig, handles, names)
    return fig


CURVE_COLOURS = 10  # the most colours a curves figure gives its configurations; more and it is not drawn


def curve_keys(groups: list[Group]) -> tuple[list[str], str]:
    """The colour of each configuration in a curves figure: its short label without a ``seed=N`` part (chains
    that differ only in their seed share one), and what every configuration shares."""
    labels, shared = short_labels(groups)
    return [without_seed(label) for label in labels], shared


def curves_figure(new_figure: Any, groups: list[Group], metric: str, title: str, report_lrs: list[float] | None = None) -> Any | None:
    """``metric`` against the step, every run a line, a colour per :func:`curve_keys` (the legend below), a
    panel per task; None when the runs need more than :data:`CURVE_COLOURS` colours or logged no ``metric``. When
    every key has one learning rate and no two keys share one (an LR sweep, with or without a GRPO run at its own
    rate), a key's colour is its rate's
    (:func:`lr_colour` over ``report_lrs``, default these groups' rates), as in the accuracy bars."""
    shown = [g for g in groups if any(metric in run.series for run in g.runs)]
    keys, shared = curve_keys(shown)
    rate_of = dict(zip(keys, (g.lr for g in shown)))
    by_rate = len(set(rate_of.values())) == len(rate_of) and all(rate_of[key] == g.lr for key, g in zip(keys, shown))
    palette = sorted(set(report_lrs or []) | {g.lr for g in shown})
    colours = sorted(dict.fromkeys(keys), key=rate_of.get) if by_rate else list(dict.fromkeys(keys))

    def colour(key: str) -> str:
        return lr_colour(rate_of[key], palette) if by_rate else f"C{colours.index(key) % 10}"

    if not shown or len(colours) > CURVE_COLOURS:
        return None
    tasks = list(dict.fromkeys(g.task for g in shown))
    fig = new_figure(figsize=(7.0, 1.2 + 2.6 * len(tasks) + 0.2 * math.ceil(len(colours) / 2)))
    axes = fig.subplots(len(tasks), 1, sharex=True, squeeze=False)[:, 0]
    handles: dict[str, Any] = {}
    for ax, task in zip(axes, tasks):
        for g, key in zip(shown, keys):
            if g.task != task:
                continue
            for run in g.runs:
                if metric in run.series:
                    steps, values = zip(*run.series[metric])
                    (line,) = ax.plot(steps, values, color=colour(key), alpha=0.8, lw=1)
                    handles.setdefault(key, line)
        ax.set_ylabel(metric, fontsize=8)
        ax.set_title(task, fontsize=8, loc="left")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    _caption(fig, title + (f"; {shared}" if shared else "") + "; every run a line")
    if len(colours) > 1 or not shared:
        _legend_below(fig, [handles[key] for key in colours], colours)
    return fig
