"""The SmolLM2 grid's table for docs/real_model.md, from files committed commands wrote:

    python experiments/smollm2/summarize.py      # after grid.yaml, kdlab report and baselines.py (docs/real_model.md)

Reads ``experiments/smollm2/report/runs.csv`` and ``summary.csv`` (``kdlab report runs/smollm2-grid
--output experiments/smollm2/report``) and ``experiments/smollm2/baselines_grid_eval.csv`` (the teacher
and the fresh student on the grid's own evaluation: counting ``val``, 50 problems, greedy, 32 new tokens,
scored by the last integer). Writes ``experiments/smollm2/baselines.md`` (``baselines.csv`` as a table) and
``experiments/smollm2/grid_summary.md`` and ``.csv``, one row per cell:

- held-out KL to the teacher on its own samples of the 50 held-out prompts (``HeldOutKL``), before and
  after, forward and reverse, and the share of the forward-KL gap closed (the teacher's KL to itself is 0);
- held-out counting accuracy after distillation (``val/accuracy``, greedy, one sample per problem) with
  its 95% bootstrap interval over the 50 problems, and the change from the fresh student's accuracy on the
  same evaluation (``baselines_grid_eval.csv``; ``Coverage`` measures it again at step 0 of every cell);
  the teacher's accuracy on that evaluation heads the table;
- forgetting: addition (scored by the last integer) before and after (``ood/addition``);
- update sparsity: the share of parameters that moved by less than 1e-6 (``sparsity/1e-06``);
- the fit's wall time (``kdlab sweep``'s ``DONE`` summary).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

HERE = Path(__file__).parent
KIND = {"TeacherRollouts": "OffPD", "StudentRollouts": "OnPD"}
DIRECTION = {"ForwardKL": "forward", "ReverseKL": "reverse"}


def read(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run the commands in this script's docstring first")
    with path.open(encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def number(row: dict[str, str], key: str) -> float:
    if row.get(key, "") == "":
        raise SystemExit(f"{key} is missing from a row of {row.get('run', 'the file')}")
    return float(row[key])


def cell(row: dict[str, str], prefix: str = "") -> str:
    """``0.22 [0.12, 0.34]`` (an accuracy and its 95% interval), and a student's paired gap to the teacher."""
    text = f"{number(row, prefix + 'accuracy'):.2f} [{number(row, prefix + 'ci_low'):.2f}, {number(row, prefix + 'ci_high'):.2f}]"
    gap = "teacher_minus_student" if not prefix else prefix + "teacher_minus_student"
    low, high = ("gap_ci_low", "gap_ci_high") if not prefix else (prefix + "gap_ci_low", prefix + "gap_ci_high")
    if row.get(gap, "") != "":
        text += f" (gap {number(row, gap):+.2f} [{number(row, low):+.2f}, {number(row, high):+.2f}])"
    return text


def baselines_table(rows: list[dict[str, str]]) -> list[str]:
    """Teacher and fresh students on every offline task (``baselines.csv``): the tag verifier and, for the
    numeric tasks, the last-integer one; and how often completions ended within the token budget."""
    models = list(dict.fromkeys((r["model"], r["layers"], r["parameters"]) for r in rows))
    names = [f"{m} `{layers}` ({int(parameters) / 1e6:.1f} M)" for m, layers, parameters in models]
    lines = ["| task, check | " + " | ".join(names) + " |", "|" + " --- |" * (len(names) + 1)]
    by = {(r["task"], r["model"], r["layers"]): r for r in rows}
    for task in dict.fromkeys(r["task"] for r in rows):
        for prefix, check in (("", "tag"), ("last_number_", "last number")):
            cells = [by.get((task, m, layers)) for m, layers, _ in models]
            if any(c is None or c.get(prefix + "accuracy", "") == "" for c in cells):
                continue
            lines.append(f"| {task}, {check} | " + " | ".join(cell(c, prefix) for c in cells) + " |")
        cells = [by.get((task, m, layers)) for m, layers, _ in models]
        lines.append(f"| {task}, ended within the budget | " + " | ".join(f"{number(c, 'ended'):.2f}" for c in cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", default=str(HERE / "report"))
    parser.add_argument("--baselines", default=str(HERE / "baselines_grid_eval.csv"))
    parser.add_argument("--all-tasks", default=str(HERE / "baselines.csv"))
    parser.add_argument("--out", default=str(HERE / "grid_summary"))
    args = parser.parse_args()
    runs = read(Path(args.report) / "runs.csv")
    summary = {(r["rollout"], r["objective"]): r for r in read(Path(args.report) / "summary.csv")}
    teacher = next(r for r in read(Path(args.baselines)) if r["model"] == "teacher" and r["task"] == "counting")
    fresh = next(r for r in read(Path(args.baselines)) if r["model"] == "student" and r["task"] == "counting")
    teacher_accuracy, start = number(teacher, "last_number_accuracy"), number(fresh, "last_number_accuracy")
    header = ["cell", "forward KL before -> after (nats/token)", "forward-KL gap closed", "reverse KL before -> after",
              "counting accuracy after [95% interval]", "change from the fresh student",
              "addition before -> after", "moved < 1e-6", "fit (min)"]
    rows, csv_rows = [], []
    for run in sorted(runs, key=lambda r: (r["rollout"] != "TeacherRollouts", r["objective"])):
        cell = f"{KIND.get(run['rollout'], run['rollout'])} x {DIRECTION.get(run['objective'], run['objective'])} KL"
        before, after = number(run, "heldout_kl/forward_before"), number(run, "heldout_kl/forward")
        closed = number(run, "heldout_kl/forward_closed")
        reverse_before, reverse_after = number(run, "heldout_kl/reverse_before"), number(run, "heldout_kl/reverse")
        accuracy = number(run, "val/accuracy")
        group = summary[run["rollout"], run["objective"]]
        low, high = number(group, "val/accuracy ci_low"), number(group, "val/accuracy ci_high")
        change = accuracy - start
        ood_before, ood_after = number(run, "ood/addition_before"), number(run, "ood/addition")
        rows.append([cell, f"{before:.2f} -> {after:.2f}", f"{100 * closed:.0f}%", f"{reverse_before:.2f} -> {reverse_after:.2f}",
                     f"{100 * accuracy:.0f}% [{100 * low:.0f}, {100 * high:.0f}]", f"{100 * change:+.0f} points",
                     f"{ood_before:.0f}% -> {ood_after:.0f}%", f"{100 * number(run, 'sparsity/1e-06'):.1f}%",
                     f"{number(run, 'fit_seconds') / 60:.1f}"])
        csv_rows.append([cell, before, after, closed, reverse_before, reverse_after, accuracy, low, high, change, start,
                         teacher_accuracy, ood_before, ood_after, number(run, "sparsity/1e-06"), number(run, "fit_seconds")])
    lines = [f"On the same evaluation the teacher scores {100 * teacher_accuracy:.0f}% "
             f"[{100 * number(teacher, 'last_number_ci_low'):.0f}, {100 * number(teacher, 'last_number_ci_high'):.0f}] and the fresh "
             f"student {100 * start:.0f}% [{100 * number(fresh, 'last_number_ci_low'):.0f}, {100 * number(fresh, 'last_number_ci_high'):.0f}] "
             f"({Path(args.baselines).name}).", "",
             "| " + " | ".join(header) + " |", "|" + " --- |" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with Path(args.out + ".csv").open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["cell", "heldout_kl_forward_before", "heldout_kl_forward_after", "forward_gap_closed", "heldout_kl_reverse_before",
                         "heldout_kl_reverse_after", "accuracy_after", "accuracy_ci_low", "accuracy_ci_high", "accuracy_change",
                         "accuracy_before", "teacher_accuracy", "ood_addition_before", "ood_addition_after", "sparsity_1e-06", "fit_seconds"])
        writer.writerows(csv_rows)
    print("\n".join(lines))
    table = baselines_table(read(Path(args.all_tasks)))
    Path(args.out).with_name("baselines.md").write_text("\n".join(table) + "\n", encoding="utf-8")
    print("\n".join(table))


if __name__ == "__main__":
    main()
