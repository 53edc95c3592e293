"""The results table of docs/several_teachers.md, from the committed ``kdlab report`` of the multi-teacher run.

    python scripts/several_teachers_results.py [--check]

Writes the block between ``<!-- results: start -->`` and ``<!-- results: end -->`` (``--check``: exit 1 if the
page differs): per task, held-out accuracy before and after (the Coverage callbacks' ``pass@1_before`` and
``pass@1``, with 95% Wilson intervals over their prompts) and the change with a paired interval: the same prompts are
measured twice, and the runs keep only the two fractions, so the interval is the widest of Newcombe's paired method 10
over every 2 x 2 table those fractions allow (:func:`kdlab.study.stats.paired_difference_bounds`; exact where before is
0%).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from cross_tokenizer_example import update_page

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "several_teachers.md"
REPORT = ROOT / "experiments" / "tiny" / "multi_teacher_report"
EXAMPLES = 200  # the Coverage callbacks' prompts in experiments/tiny/multi_teacher.yaml (one sample each)


def results() -> str:
    from kdlab.study.stats import paired_difference_bounds, wilson_interval

    path = REPORT / "runs.csv"
    if not path.exists():
        return "Not run yet: no `experiments/tiny/multi_teacher_report/runs.csv`.\n"
    lines = ["| run | task (its teacher) | held-out accuracy before | after | change (points) |", "| --- | --- | ---: | ---: | ---: |"]
    teachers = {"countdown3": "countdown", "addition": "skills", "sorting": "skills"}
    cell = lambda value: f"{100 * value:.1f}% [{100 * wilson_interval(value, EXAMPLES)[0]:.1f}, {100 * wilson_interval(value, EXAMPLES)[1]:.1f}]"  # noqa: E731
    for row in csv.DictReader(path.open(encoding="utf-8")):
        for task, teacher in teachers.items():
            before, after = float(row[f"coverage/{task}/pass@1_before"]), float(row[f"coverage/{task}/pass@1"])
            _, low, high = paired_difference_bounds(after, before, EXAMPLES)
            lines.append(f"| `{REPORT.relative_to(ROOT)}/report.md` | {task} ({teacher}) | {cell(before)} | {cell(after)} "
                         f"| {100 * (after - before):+.1f} [{100 * low:+.1f}, {100 * high:+.1f}] |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page's results block differs")
    args = parser.parse_args()
    update_page(PAGE, {"results": results()}, args.check, "scripts/several_teachers_results.py")


if __name__ == "__main__":
    main()
