"""The generated blocks of docs/real_model.md's "Teacher style on the real model" section, from committed files:

    python scripts/real_model_style_results.py [--check]

``style_check``: ``experiments/smollm2/style_check.json`` (does the told teacher answer in Spanish, and which task
does the model already solve), each share with its 95% Wilson interval; ``bf16``: the rounding prediction of
update sparsity from SmolLM2's weights and the measured bf16 runs (``experiments/smollm2/bf16_sparsity.json``);
``style``: the style table of the grid's report (``experiments/smollm2/style_report/report.md``, written by
``kdlab report runs/smollm2-study --output experiments/smollm2/style_report --low_lr 1e-5 --high_lr 5e-5``) and
its verdict row; ``style_samples``: what the low-LR students answer (:func:`style_samples`); ``style_alone_gate``: the
style-alone study's gate (``experiments/smollm2/style_alone_gate.json``, written by
``experiments/smollm2/style_alone_gate.py``); ``style_alone``: the style-alone study's style table and verdict row
(``experiments/smollm2/style_alone_report``, written by ``bash experiments/smollm2/style_alone_study.sh``'s last
step); ``style_alone_rerun``: archived style-alone runs rerun at a later commit
(``experiments/smollm2/style_alone_provenance.json``, :func:`tiny_reproduction_page.rerun_block`). ``--check``: exit 1 if the page differs.
"""

from __future__ import annotations

import argparse
import json
import tarfile
from pathlib import Path

from cross_tokenizer_example import update_page
from tiny_reproduction_page import rerun_block

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "real_model.md"
CHECK = ROOT / "experiments" / "smollm2" / "style_check.json"
BF16 = ROOT / "experiments" / "smollm2" / "bf16_sparsity.json"
REPORT = ROOT / "experiments" / "smollm2" / "style_report"
RUNS = ROOT / "experiments" / "smollm2" / "study_runs"
GATE = ROOT / "experiments" / "smollm2" / "style_alone_gate.json"
ALONE = ROOT / "experiments" / "smollm2" / "style_alone_report"
ALONE_RERUN = ROOT / "experiments" / "smollm2" / "style_alone_provenance.json"


def pct(value: float, interval: list[float] | None = None) -> str:
    return f"{100 * value:.1f}%" + (f" [{100 * interval[0]:.1f}, {100 * interval[1]:.1f}]" if interval else "")


def style_check() -> str:
    record = json.loads(CHECK.read_text(encoding="utf-8"))
    lines = [f"`{record['command']}` ({record['examples']} held-out prompts per task, T = {record['temperature']}, "
             f"{record['max_new_tokens']} new tokens; system prompt \"{record['system_prompt']}\", instruction \"{record['instruction']}\"):", "",
             "| task | greedy accuracy (last number) | Spanish: plain prompt | system prompt | instruction | both |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for task, result in record["tasks"].items():
        shares = result["spanish_share"]
        lines.append(f"| {task} | {pct(result['greedy_accuracy'], result['greedy_accuracy_ci95'])} | " +
                     " | ".join(pct(shares[t]["share"], shares[t]["ci95"]) for t in ("plain", "system", "instruction", "system+instruction")) + " |")
    return "\n".join(lines) + "\n"


def style_alone_gate() -> str:
    """The gate's table: the plain student, then each teacher at each temperature, accuracy and language shares with
    their 95% Wilson intervals, and the log-odds of the Spanish over the English answer under each context."""
    if not GATE.exists():
        return "Not run yet: no `experiments/smollm2/style_alone_gate.json`.\n"
    record = json.loads(GATE.read_text(encoding="utf-8"))
    gate = record["gate"]
    lines = [f"`{record['command']}` ({record['task']['num_val']} held-out one-digit additions, {record['max_new_tokens']} new tokens, "
             f"seed {record['seed']}; log-odds: mean over prompts of the per-token log-prob of \"{record['templates']['spanish']}\" minus "
             f"that of \"{record['templates']['english']}\", nats):", "",
             "| who | temperature | accuracy | Spanish | English | log-odds (share > 0) |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    student = record["student"]
    odds = lambda o: f"{o['mean']:+.2f} ({pct(o['positive']['share'])})"  # noqa: E731
    for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        row = student[name]
        lines.append(f"| plain student | {temperature:g} | {pct(row['accuracy']['share'], row['accuracy']['ci95'])} | "
                     f"{pct(row['spanish']['share'], row['spanish']['ci95'])} | {pct(row['english']['share'], row['english']['ci95'])} | "
                     + (odds(student["log_odds"]) if name == "greedy" else "") + " |")
    for teacher in ("spanish", "english"):
        result = record[f"{teacher}_teacher"]
        for index, (temperature, row) in enumerate(result["by_temperature"].items()):
            lines.append(f"| {teacher} teacher | {float(temperature):g} | {pct(row['accuracy']['share'], row['accuracy']['ci95'])} | "
                         f"{pct(row['spanish']['share'], row['spanish']['ci95'])} | {pct(row['english']['share'], row['english']['ci95'])} | "
                         + (odds(result["log_odds"]) if index == 0 else "") + " |")
    passing = [t for t, g in gate["by_temperature"].items() if g["passed"]]
    lines += ["", f"Gate (the Spanish teacher at least {100 * gate['spanish_share_at_least']:g}% Spanish and "
              f"{100 * gate['accuracy_at_least']:g}% correct): " + (f"passed at T = {', '.join(f'{float(t):g}' for t in passing)}; "
              f"the study's teacher temperature is {gate['study_temperature']:g}." if gate["passed"] else "failed at every temperature: no grid run.")]
    return "\n".join(lines) + "\n"


def bf16() -> str:
    if not BF16.exists():
        return "Not run yet: no `experiments/smollm2/bf16_sparsity.json`.\n"
    record = json.loads(BF16.read_text(encoding="utf-8"))
    measured = {round(row["lr"], 12): row for row in record["measured"]}
    lines = [f"`{record['command']}` (tau = {record['tau']:g}):", "",
             "| LR | predicted S_tau (weights a +-LR step cannot move in bf16) | measured S_tau, bf16 run |", "| ---: | ---: | ---: |"]
    for lr, prediction in record["prediction"].items():
        run = measured.get(round(float(lr), 12))
        lines.append(f"| {lr} | {pct(prediction['predicted'])} | " + (pct(run["sparsity/1e-06"]) if run and run["sparsity/1e-06"] is not None else "not run") + " |")
    return "\n".join(lines) + "\n"


def style(report: Path = REPORT) -> str:
    """The style table of a study's report (``report/report.md``, written by ``kdlab report``) and its verdict row
    (``report/verdicts.md``) under the verdicts' header."""
    name = report.relative_to(ROOT).as_posix()
    if not (report / "report.md").exists():
        return f"Not run yet: no `{name}/report.md`.\n"
    text = (report / "report.md").read_text(encoding="utf-8")
    start = text.index("## Style transfer")
    table = [line for line in text[start:].splitlines()[1:] if line.startswith("|")]
    verdicts = report / "verdicts.md"
    lines = verdicts.read_text(encoding="utf-8").splitlines() if verdicts.exists() else []
    rows = [line for line in lines if line.startswith("| OnPD + reverse KL")][:1]  # the style row, under the table's header
    header = [index for index, line in enumerate(lines) if line.startswith("| finding (paper)")][:1]
    return "\n".join(table + (["", *lines[header[0]:header[0] + 2], rows[0]] if rows and header else [])) + "\n"


def style_samples() -> str:
    """The first two held-out counting prompts and each low-LR cell's greedy answer to them (seed 42, the runs kept
    in ``experiments/smollm2/study_runs/style_low.tar.gz``), with the score ``val/accuracy`` gave it."""
    archive = RUNS / "style_low.tar.gz"
    if not archive.exists():
        return "Not run yet: no `experiments/smollm2/study_runs/style_low.tar.gz`.\n"
    lines = ["| cell (LR 1e-5, seed 42) | prompt | greedy answer | score |", "| --- | --- | --- | ---: |"]
    with tarfile.open(archive) as tar:
        for name in sorted(n for n in tar.getnames() if "seed=42/samples/val-" in n):
            cell = name.split("/")[-3].split("-lr=")[0].replace("rollout=", "").replace("-objective=", ", ")
            for line in tar.extractfile(name).read().decode("utf-8").splitlines()[:2]:
                row = json.loads(line)
                cells = [cell, row["prompt"], row["completion"], f"{float(row['score']):g}"]
                lines.append("| " + " | ".join(" ".join(c.split()).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def style_alone_rerun() -> str:
    """How many archived style-alone runs the code at a later commit reproduces byte for byte
    (``experiments/smollm2/style_alone_provenance.json``, written by ``scripts/provenance_rerun.py``)."""
    if not ALONE_RERUN.exists():
        return "Not run yet: no `experiments/smollm2/style_alone_provenance.json`.\n"
    return rerun_block(json.loads(ALONE_RERUN.read_text(encoding="utf-8")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page's generated blocks differ")
    args = parser.parse_args()
    update_page(PAGE, {"style_check": style_check(), "bf16": bf16(), "style": style(), "style_samples": style_samples(),
                       "style_alone_gate": style_alone_gate(), "style_alone": style(ALONE),
                       "style_alone_rerun": style_alone_rerun()}, args.check, "scripts/real_model_style_results.py")


if __name__ == "__main__":
    main()
