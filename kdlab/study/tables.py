"""Writing a table: Markdown for the reports, CSV (through pandas) for everything a reader may reload, and counts
with their nouns for the reports' sentences.

The Markdown writer is kdlab's own on purpose: pandas' ``to_markdown`` (tabulate) pads every cell to
its column's width and right-aligns numbers, so each committed report and the tables the docs copy
would change byte for byte without a reader gaining anything."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def counted(count: int, noun: str) -> str:
    """``"1 run"``, ``"2 runs"``: a count and its noun (a regular plural) for the reports' sentences and the sweep's and
    pipeline's lines."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(header), "|" + " --- |" * len(header), *map(line, rows)])


def write_csv(path: Path, header: list[str], rows: list[list[Any]]) -> None:
    """``rows`` under ``header`` as CSV: values as Python writes them (``repr`` of a float, so the file
    reloads to the same numbers), ``None`` as an empty cell, a NaN as ``nan``; CRLF line ends, as the
    ``csv`` module writes."""
    import pandas as pd  # here: the sweep and pipeline runners use counted, and need not load pandas

    frame = pd.DataFrame(rows, columns=header, dtype=object)
    frame = frame.map(lambda value: "" if value is None else value)
    frame.to_csv(path, index=False, lineterminator="\r\n", na_rep="nan")
