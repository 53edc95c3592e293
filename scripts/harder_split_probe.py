"""Which held-out Countdown set can stand in for the paper's Countdown-4E in the tiny world: pass@k of the
packaged tiny teacher and the undistilled tiny student on each candidate (held-out problems, samples at
T = 1.0, the unbiased estimator), and how many of a candidate's problems also appear in Countdown-3's
training split. Writes ``experiments/tiny/harder_split_probe.json``::

    python scripts/harder_split_probe.py            # about 15 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kdlab.evaluation.metrics import pass_at_k
from kdlab.models.loading import ModelSpec, load_causal_lm, load_tokenizer
from kdlab.rollouts.decoding import sample_completions
from kdlab.tasks import Countdown

OUTPUT = Path("experiments/tiny/harder_split_probe.json")
MODELS = {"teacher": "kdlab://tiny/teacher", "student": "kdlab://tiny/student"}
CANDIDATES = {"countdown3": 64, "countdown3s": 64, "countdown4e": 96}  # variant -> completion budget (tokens)
KS = (1, 4, 16, 32)


def task(variant: str, problems: int) -> Countdown:
    """The tiny world's prompting (quickstart.yaml's task), ``problems`` held-out problems."""
    return Countdown(variant=variant, instruction=False, system_prompt="", num_train=0, num_val=problems, num_test=0)


def overlap(variant: str, problems: int) -> float:
    """Share of ``variant``'s first ``problems`` held-out problems whose (operands, target) are a problem of
    Countdown-3's training split (quickstart.yaml's 5,000)."""
    train = {(tuple(sorted(row["nums"])), row["target"]) for row in Countdown(num_train=5000, num_val=0, num_test=0).examples("train")}
    rows = task(variant, problems).examples("val")
    return sum((tuple(sorted(row["nums"])), row["target"]) in train for row in rows) / len(rows)


def measure(problems: int, samples: int, seed: int) -> dict:
    results: dict = {}
    for role, path in MODELS.items():
        spec = ModelSpec(path=path)
        tokenizer, model = load_tokenizer(spec), load_causal_lm(spec)
        for variant, budget in CANDIDATES.items():
            candidate = task(variant, problems)
            rows = candidate.examples("val")
            generator = torch.Generator().manual_seed(seed)
            texts = sample_completions(model, tokenizer, candidate, [row for row in rows for _ in range(samples)],
                                       temperature=1.0, max_new_tokens=budget, max_prompt_tokens=64,
                                       batch_size=256, generator=generator)
            assert len(texts) == len(rows) * samples, (len(texts), len(rows), samples)
            correct = [sum(candidate.score(row, texts[i * samples + j][0]) >= 1.0 for j in range(samples)) for i, row in enumerate(rows)]
            results.setdefault(variant, {})[role] = {f"pass@{k}": sum(pass_at_k(samples, c, k) for c in correct) / len(correct) for k in KS}
            results[variant][role]["problems_solved_at_least_once"] = sum(c > 0 for c in correct)
    for variant in CANDIDATES:
        results[variant]["share_in_countdown3_train"] = overlap(variant, problems)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", type=int, default=100)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.time()
    results = measure(args.problems, args.samples, args.seed)
    record = {"command": "python scripts/harder_split_probe.py", "problems": args.problems, "samples": args.samples,
              "temperature": 1.0, "ks": list(KS), "seed": args.seed, "threads": torch.get_num_threads(),
              "models": MODELS, "seconds": round(time.time() - start, 1), "candidates": results}
    args.output.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(record["candidates"], indent=1))


if __name__ == "__main__":
    main()
