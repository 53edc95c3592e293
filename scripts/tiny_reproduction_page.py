"""The generated blocks of docs/tiny_reproduction.md, copied from the study's report:

    python scripts/tiny_reproduction_page.py [--check]

Every block comes from ``docs/tiny_reproduction/verdicts.md``, which ``bash experiments/tiny/study.sh`` ends by
writing (``kdlab report runs/tiny-study-5x --output docs/tiny_reproduction --low_lr 1e-4 --high_lr 5e-4``):
``verdicts`` (the verdict table and the Monte Carlo error of its bootstrap intervals), ``provenance`` (the parts
whose runs come from several commits or a dirty tree), ``departures`` (the departures from the paper's design),
``wall_time`` (the study's wall time by step and the runs' fit times) and ``parts`` (each part's report, its links
made relative to docs/). ``--check``: exit 1 if the page differs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cross_tokenizer_example import update_page

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "tiny_reproduction.md"
VERDICTS = ROOT / "docs" / "tiny_reproduction" / "verdicts.md"


def sections(text: str) -> dict[str, str]:
    """``verdicts.md`` by its ``## `` headings (the part before the first one under ``""``), each body stripped;
    a heading's parenthesis (``## Wall time (2-core CPU, ...)``) is kept as the body's first line."""
    found: dict[str, str] = {}
    name, lines = "", []
    for line in text.splitlines():
        if line.startswith("## "):
            found[name] = "\n".join(lines).strip()
            title, _, aside = line[3:].partition(" (")
            name, lines = title, ([f"({aside}"] if aside else [])
        else:
            lines.append(line)
    found[name] = "\n".join(lines).strip()
    return found


def blocks(text: str) -> dict[str, str]:
    found = sections(text)
    table = "\n".join(line for line in found[""].splitlines() if line.startswith("|"))
    monte_carlo = [line for line in found[""].splitlines() if line.startswith("Monte Carlo error:")]
    wall = found.get("Wall time", "No wall time recorded: `runs/tiny-study-5x/wall_times.jsonl` is written by `experiments/tiny/study.sh`.")
    parts = found["Each part's tables"].replace("](", "](tiny_reproduction/")
    provenance = found.get("Provenance", "Every part's runs come from one commit and a clean tree (each run's run_info.json).")
    return {"verdicts": "\n\n".join([table, *monte_carlo]) + "\n", "provenance": provenance + "\n", "departures": found["Departures from the paper's design"] + "\n", "wall_time": wall + "\n", "parts": parts + "\n"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page's generated blocks differ")
    args = parser.parse_args()
    update_page(PAGE, blocks(VERDICTS.read_text(encoding="utf-8")), args.check, "scripts/tiny_reproduction_page.py")


if __name__ == "__main__":
    main()
