"""The drawing pieces of ``kdlab report``'s figures: error bars in report units, a note on a flat chart, wrapped
labels, and matplotlib figures on the Agg canvas (no pyplot state), with a clear error without matplotlib."""

from __future__ import annotations

import textwrap
from typing import Any

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


def note_if_equal(ax: Any, values: list[float], what: str) -> None:
    """Say on the figure when every plotted value is the same (a flat chart is otherwise unreadable)."""
    if values and max(values) - min(values) < 1e-9:
        ax.text(0.5, 0.5, f"all {len(values)} values of {what} are {values[0]:.4g}", transform=ax.transAxes,
                ha="center", va="center", fontsize=9, bbox={"facecolor": "white", "alpha": 0.8})


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
