"""The generated blocks of a study's page, copied from the study's report:

    python scripts/tiny_reproduction_page.py [--check]
    python scripts/tiny_reproduction_page.py --page docs/tiny_reasoning.md --report docs/tiny_reasoning [--check]

Every block comes from ``<report>/verdicts.md`` (default ``docs/tiny_reproduction/verdicts.md``, which ``bash
experiments/tiny/study.sh`` ends by writing: ``kdlab report runs/tiny-study-5x --output docs/tiny_reproduction
--low_lr 1e-4 --high_lr 5e-4``; the reasoning world's, ``docs/tiny_reasoning/verdicts.md``, is written by the command
in ``experiments/reasoning/design.yaml``): ``verdicts`` (the verdict
table), ``provenance`` (the parts whose runs come from several commits or a dirty tree), ``departures`` (the
departures from the paper's design), ``wall_time`` (the study's wall time by step and the runs' fit times) and
``parts`` (each part's report, its links made relative to the page). With ``--rerun FILE`` (the JSON
``scripts/provenance_rerun.py`` writes), also ``rerun``: how many archived runs the code at a later commit reproduces
byte for byte, and which differ. A page takes the blocks it has markers for. ``--check``: exit 1 if the page differs.
"""

from __future__ import annotations

import argparse
import json
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


def blocks(text: str, folder: str = "tiny_reproduction") -> dict[str, str]:
    """The page's blocks from ``verdicts.md``'s ``text``; ``folder``: the report's folder relative to the page."""
    found = sections(text)
    table = "\n".join(line for line in found[""].splitlines() if line.startswith("|"))
    wall = found.get("Wall time", "No wall time recorded: the study's script writes `wall_times.jsonl` beside its runs.")
    parts = found["Each part's tables"].replace("](", f"]({folder}/")
    provenance = found.get("Provenance", "Every part's runs come from one commit and a clean tree (each run's run_info.json).")
    return {"verdicts": table + "\n", "provenance": provenance + "\n", "departures": found["Departures from the paper's design"] + "\n", "wall_time": wall + "\n", "parts": parts + "\n"}


def rerun_block(record: dict) -> str:
    """The ``rerun`` block from ``scripts/provenance_rerun.py``'s JSON: the commits, the count of runs whose sample
    files are byte-identical, each run's cell, and the runs that differ or failed."""
    runs = record["runs"]
    archived = sorted({r.get("archived_commit") or "?" for r in runs})
    same = [r for r in runs if r["status"] == "identical"]
    folders: dict[str, int] = {}
    for run in runs:
        if run.get("rerun"):
            folder = Path(run["rerun"]).parent.as_posix()
            folders[folder] = folders.get(folder, 0) + 1
    lines = [f"`{record['command']}`: {len(same)} of {len(runs)} archived runs (from commit "
             f"{', '.join(f'`{c[:7]}`' for c in archived)}) rerun at commit `{record['commit'][:7]}` (clean tree, "
             f"{record['threads']} thread) write sample files byte-identical to the archived ones (the reruns: "
             + ", ".join(f"{count} in `{folder}`" for folder, count in folders.items()) + ").", "", "| run | samples |", "| --- | --- |"]
    for run in runs:
        status = run["status"] if run["status"] != "differs" else "differs: " + ", ".join(run["differing_files"])
        lines.append(f"| {run['run']} | {status} |")
    environments = [json.dumps(run.get("environment", {}), sort_keys=True) for run in runs]
    if len(set(environments)) == 1 and runs[0].get("environment"):
        lines += ["", "Every rerun's environment differs from its archived run's in: " + "; ".join(
            f"{key} {old} -> {new}" for key, (old, new) in sorted(runs[0]["environment"].items())) + " (`run_info.json`)."]
    elif len(set(environments)) > 1:
        lines += ["", "The environments differ run by run: see each run's `environment` in the JSON."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page's generated blocks differ")
    parser.add_argument("--page", default=str(PAGE.relative_to(ROOT)), help="the page (default: docs/tiny_reproduction.md)")
    parser.add_argument("--report", default=str(VERDICTS.parent.relative_to(ROOT)), help="the study's report folder, beside the page")
    parser.add_argument("--rerun", help="scripts/provenance_rerun.py's JSON, for the page's rerun block")
    args = parser.parse_args()
    page, report = ROOT / args.page, ROOT / args.report
    found = blocks((report / "verdicts.md").read_text(encoding="utf-8"), report.relative_to(page.parent).as_posix())
    if args.rerun:
        found["rerun"] = rerun_block(json.loads((ROOT / args.rerun).read_text(encoding="utf-8")))
    text = page.read_text(encoding="utf-8")
    update_page(page, {name: body for name, body in found.items() if f"<!-- {name}: start -->" in text}, args.check, "scripts/tiny_reproduction_page.py")


if __name__ == "__main__":
    main()
