"""The served teacher's figures in docs/teachers.md, from committed files only.

    python scripts/served_teacher_results.py [--check]

Writes three blocks of the page (``--check``: exit 1 if any differs):

* ``served-cost``, from ``benchmarks/results/served_teacher_step-tiny.json`` (``python
  benchmarks/served_teacher_step.py``): each variant's wall time per step and its ratio to the cached step;
* ``served-quickstart-cost``, from ``benchmarks/results/served_quickstart_step-tiny.json`` (``python
  benchmarks/served_quickstart_step.py``): the quickstart's step in-process and with the served-teacher overlay,
  and their ratio; until that file is committed, a line saying how to make it;
* ``served-accuracy``, from ``experiments/tiny/served_teacher_report/`` (``kdlab report`` of the in-process
  quickstart and the same run with the teacher served): each run's held-out accuracy (the Coverage callback's
  ``pass@1``, one sample on each of its 200 prompts, 95% Wilson intervals) and the difference served minus
  in-process on those same prompts with a paired interval (the runs keep only the two fractions: the widest of
  Newcombe's paired method 10 over every 2 x 2 table they allow, :func:`kdlab.study.stats.paired_difference_bounds`);
  and the difference of ``val/accuracy`` on the same 200 validation prompts (``samples/*.jsonl``, copied from the
  runs) with a paired bootstrap over those prompts.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from cross_tokenizer_example import update_page

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "teachers.md"
BENCHMARK = ROOT / "benchmarks" / "results" / "served_teacher_step-tiny.json"
QUICKSTART_BENCHMARK = ROOT / "benchmarks" / "results" / "served_quickstart_step-tiny.json"
REPORT = ROOT / "experiments" / "tiny" / "served_teacher_report"
EXAMPLES = 200  # the Coverage callback's prompts in experiments/tiny/quickstart.yaml (one sample each)
TARGET = 0.02  # issue #28: the served run within 2 points of the in-process one


def cost() -> str:
    record = json.loads(BENCHMARK.read_text(encoding="utf-8"))
    cached = record["results"]["cached"]["step_s"]
    lines = ["| variant | prefetch | wall time per step | / cached |", "| --- | --- | ---: | ---: |"]
    for variant, row in record["results"].items():
        prefetch = {True: "on", False: "off", None: "n/a"}[row.get("prefetch")]
        lines.append(f"| {variant} | {prefetch} | {1000 * row['step_s']:.0f} ms | {row['step_s'] / cached:.2f}x |")
    verdict = "met" if record["ratio"] <= record["target"] else "missed"
    shapes = record["shapes"]
    lines.append(f"\nB = {shapes['batch']}, top-{shapes['top_k']}, {record['threads']} thread for the trainer and one for the server, "
                 f"{record['machine']['cores']} cores, replies decoded by {record['json_decoder']}; {record['repeats']} fits of "
                 f"{record['steps']} steps per variant (`{BENCHMARK.relative_to(ROOT)}`). The target, at most {record['target']}x "
                 f"the cached step, is {verdict} with prefetch ({record['ratio']:.2f}x; without it {record['ratio_no_prefetch']:.2f}x).")
    return "\n".join(lines) + "\n"


def quickstart_cost() -> str:
    """The quickstart's step, in-process and served, from its benchmark's JSON (or how to make it)."""
    if not QUICKSTART_BENCHMARK.exists():
        return (f"Not measured yet: `python benchmarks/served_quickstart_step.py` writes `{QUICKSTART_BENCHMARK.relative_to(ROOT)}`, "
                "then `python scripts/served_teacher_results.py` copies it here.\n")
    record = json.loads(QUICKSTART_BENCHMARK.read_text(encoding="utf-8"))
    if record.get("smoke") or record.get("problems"):
        raise SystemExit(f"{QUICKSTART_BENCHMARK.relative_to(ROOT)} is a --smoke record or lists problems: not a result to quote")
    results = record["results"]
    lines = ["| variant | teacher | wall time per step | / in-process |", "| --- | --- | ---: | ---: |"]
    for variant, row in results.items():
        lines.append(f"| {variant} | {row['teacher']} | {1000 * row['step_s']:.0f} ms | {row['step_s'] / results['in_process']['step_s']:.2f}x |")
    verdict = "met" if record["ratio"] <= record["target"] else "missed"
    lines.append(f"\nB = {results['served']['batch']}, {record['threads']} thread for the trainer and one for the server, "
                 f"{record['machine']['cores']} cores; {record['repeats']} fits of {record['steps']} steps per variant "
                 f"(`{QUICKSTART_BENCHMARK.relative_to(ROOT)}`). The target, at most {record['target']}x the in-process step, "
                 f"is {verdict} ({record['ratio']:.2f}x).")
    return "\n".join(lines) + "\n"


def val_scores(path: Path) -> dict[str, list[float]]:
    table: dict[str, list[float]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        table.setdefault(str(row["id"]), []).append(float(row["score"]))
    return table


def accuracy() -> str:
    from kdlab.study.stats import bootstrap_contrast, paired_difference_bounds, wilson_interval

    path = REPORT / "runs.csv"
    if not path.exists():
        return "Not run yet: no `experiments/tiny/served_teacher_report/runs.csv`.\n"
    rows = {("served" if "served" in row["run"] else "in-process"): row for row in csv.DictReader(path.open(encoding="utf-8"))}
    cell = lambda value: f"{100 * value:.1f}% [{100 * wilson_interval(value, EXAMPLES)[0]:.1f}, {100 * wilson_interval(value, EXAMPLES)[1]:.1f}]"  # noqa: E731
    lines = ["| run | teacher | held-out accuracy before | after | val/accuracy |", "| --- | --- | ---: | ---: | ---: |"]
    for name, teacher in (("in-process", "`kdlab://tiny/teacher` in the training process"), ("served", "the same, behind the loopback server, top-20")):
        row = rows[name]
        lines.append(f"| {name} (`{row['run']}`) | {teacher} | {cell(float(row['coverage/countdown3/pass@1_before']))} "
                     f"| {cell(float(row['coverage/countdown3/pass@1']))} | {100 * float(row['val/accuracy']):.1f}% |")
    served, local = float(rows["served"]["coverage/countdown3/pass@1"]), float(rows["in-process"]["coverage/countdown3/pass@1"])
    _, low, high = paired_difference_bounds(served, local, EXAMPLES)
    tables = {name: val_scores(REPORT / "samples" / f"{name}.jsonl") for name in ("served", "in-process")}
    paired, paired_low, paired_high = bootstrap_contrast([(1.0, [tables["served"]]), (-1.0, [tables["in-process"]])])
    within = abs(served - local) <= TARGET
    covered = low >= -TARGET and high <= TARGET
    lines.append(
        f"\nServed minus in-process, held-out accuracy: {100 * (served - local):+.1f} points [{100 * low:+.1f}, {100 * high:+.1f}] "
        f"(paired, 95%, the widest over the prompts' unknown pairing); val/accuracy on the same {len(tables['served'])} validation prompts: {100 * paired:+.1f} points "
        f"[{100 * paired_low:+.1f}, {100 * paired_high:+.1f}] (paired bootstrap over the prompts). "
        + ("The measured difference is within 2 points" if within else "The measured difference is more than 2 points")
        + (", and so is the whole interval." if covered else
           "; the intervals are wider than 2 points either way, so these runs cannot show the two within 2 points, only "
           + ("that they are not distinguishable (both intervals hold 0)." if low <= 0 <= high and paired_low <= 0 <= paired_high
              else "that they differ."))
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if one of the page's blocks differs")
    args = parser.parse_args()
    blocks = {"served-cost": cost(), "served-quickstart-cost": quickstart_cost(), "served-accuracy": accuracy()}
    update_page(PAGE, blocks, args.check, "scripts/served_teacher_results.py")


if __name__ == "__main__":
    main()
