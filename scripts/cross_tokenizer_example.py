"""The generated parts of docs/cross_tokenizer.md: the worked example (one sentence, both tokenizations, the
aligned groups and the events of each model at every group, computed from the packaged tiny models) and the
results table (read from the committed ``kdlab report`` folders of the cross-tokenizer runs).

    python scripts/cross_tokenizer_example.py [--check]

Writes the blocks between ``<!-- example: start -->`` / ``<!-- example: end -->`` and ``<!-- results: start -->`` /
``<!-- results: end -->`` of docs/cross_tokenizer.md (``--check``: exit 1 if the page differs). The example's tokenizers: the packaged student's and the random tiny
pair's (``kdlab://tiny-random/teacher``), two byte-level BPEs trained on different corpora.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "cross_tokenizer.md"
REPORTS = {"tiny": ROOT / "experiments" / "tiny" / "cross_tokenizer_report", "smollm2": ROOT / "experiments" / "smollm2" / "cross_tokenizer" / "report"}
STUDENT, TEACHER = "kdlab://tiny/student", "kdlab://tiny-random/teacher"
SENTENCE = "Numbers [6, 15, 50], target 285. 50*6=300 leaves [15, 300]."


def show(piece: bytes) -> str:
    text = piece.decode("utf-8", errors="backslashreplace")
    return "`" + text.replace("`", "\\`").replace("\n", "\\n").replace("|", "\\|") + "`" if text else "(end)"


def example() -> str:
    """The sentence in both tokenizers' tokens and the finest groups that spell the same bytes."""
    from kdlab.alignment import align_tokenizations
    from kdlab.models.loading import ModelSpec, load_tokenizer
    from kdlab.objectives.groups import pair_specials

    student, teacher = load_tokenizer(ModelSpec(STUDENT)), load_tokenizer(ModelSpec(TEACHER))
    s_ids = student(SENTENCE, add_special_tokens=False)["input_ids"]
    t_ids = teacher(SENTENCE, add_special_tokens=False)["input_ids"]
    alignment = align_tokenizations(SENTENCE, teacher, t_ids, student, s_ids)
    groups = pair_specials(alignment.groups)
    data = SENTENCE.encode("utf-8")
    piece = lambda spans, k: data[spans[k][0]:spans[k][1]]  # noqa: E731
    lines = [f"The sentence `{SENTENCE}` in each tokenizer's tokens:\n",
             f"- student (`{STUDENT}`, {len(student)} tokens): " + " ".join(show(piece(alignment.spans_b, k)) for k in range(len(s_ids))),
             f"- teacher (`{TEACHER}`, {len(teacher)} tokens): " + " ".join(show(piece(alignment.spans_a, k)) for k in range(len(t_ids))),
             "",
             f"The finest groups that spell the same bytes: {len(groups)} groups, {100 * alignment.one_to_one_share:.1f}% of the bytes in "
             "one-to-one groups. At the start of every group both models have read the same text; in a one-to-one group the "
             "two tokens are the same string (one pair of the vocabulary map), in the others each model's chain-rule "
             "probability of the group's text is compared:\n",
             "| group | bytes | student tokens | teacher tokens | kind |", "| ---: | --- | --- | --- | --- |"]
    for number, (t_range, s_range) in enumerate(groups, start=1):
        text = b"".join(piece(alignment.spans_b, k) for k in s_range)
        kind = "one to one" if len(s_range) == len(t_range) == 1 else f"{len(s_range)} student : {len(t_range)} teacher"
        lines.append(f"| {number} | {show(text)} | {' '.join(show(piece(alignment.spans_b, k)) for k in s_range)} "
                     f"| {' '.join(show(piece(alignment.spans_a, k)) for k in t_range)} | {kind} |")
    return "\n".join(lines) + "\n"


def results() -> str:
    """One row per committed cross-tokenizer run: held-out accuracy before and after (Coverage, with a 95%
    Wilson interval over its prompts), held-out forward KL before and after (HeldOutKL, over aligned groups)
    and the one-to-one share of the last step, from the report's runs.csv."""
    import csv

    from kdlab.study.stats import wilson_interval

    lines = ["| run | report | held-out accuracy before | after | held-out KL(T ‖ S) before | after | gap closed | one-to-one share | fit |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, folder in REPORTS.items():
        path = folder / "runs.csv"
        if not path.exists():
            lines.append(f"| {name} | not run yet | | | | | | | |")
            continue
        for row in csv.DictReader(path.open(encoding="utf-8")):
            keys = [key for key in row if key.startswith("coverage/") and key.endswith("/pass@1")]
            examples = int(row.get("coverage_examples") or 0) or (200 if name == "tiny" else 50)
            cell = lambda key: (f"{100 * float(row[key]):.1f}% [{100 * wilson_interval(float(row[key]), examples)[0]:.1f}, "  # noqa: E731
                                f"{100 * wilson_interval(float(row[key]), examples)[1]:.1f}]") if row.get(key) else "n/a"
            after = keys[0] if keys else ""
            number = lambda key: f"{float(row[key]):.3f}" if row.get(key) else "n/a"  # noqa: E731
            closed = f"{100 * float(row['heldout_kl/forward_closed']):.1f}%" if row.get("heldout_kl/forward_closed") else "n/a"
            fit = f"{float(row['fit_seconds']):.0f} s" if row.get("fit_seconds") else "n/a"
            lines.append(f"| {name} | `{folder.relative_to(ROOT)}/report.md` | {cell(after + '_before')} | {cell(after)} "
                         f"| {number('heldout_kl/forward_before')} | {number('heldout_kl/forward')} | {closed} "
                         f"| {number('train/one_to_one_share')} | {fit} |")
    return "\n".join(lines) + "\n"


def replace_block(page: str, name: str, body: str) -> str:
    start, end = f"<!-- {name}: start -->", f"<!-- {name}: end -->"
    head, rest = page.split(start, 1)
    _, tail = rest.split(end, 1)
    return head + start + "\n" + body + end + tail


def update_page(page: Path, blocks: dict[str, str], check: bool, script: str) -> None:
    """Write each ``name -> body`` of ``blocks`` between ``<!-- name: start -->`` and ``<!-- name: end -->`` of ``page``;
    with ``check``, write nothing and exit 1 if the page differs (``script`` is named in the message)."""
    text = page.read_text(encoding="utf-8")
    new = text
    for name, body in blocks.items():
        new = replace_block(new, name, body)
    if check:
        if new != text:
            print(f"{page.relative_to(ROOT)}'s generated blocks differ from what {script} computes")
            sys.exit(1)
        return
    page.write_text(new, encoding="utf-8")
    print(f"wrote {', '.join(blocks)} into {page.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/cross_tokenizer.md's generated blocks differ")
    args = parser.parse_args()
    torch.set_num_threads(1)
    update_page(PAGE, {"example": example(), "results": results()}, args.check, "scripts/cross_tokenizer_example.py")


if __name__ == "__main__":
    main()
