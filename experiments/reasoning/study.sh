#!/usr/bin/env bash
# The reasoning-world study (docs/tiny_reasoning.md, issue #44), every run:
#   bash experiments/reasoning/study.sh
# Run from the repository root of a clean checkout: every run records its commit (run_info.json). Each sweep
# runs two processes at a time with one CPU thread each; a finished run (DONE) is skipped on a rerun, an
# interrupted one resumes. The wall time of each step goes to runs/reasoning-study/wall_times.jsonl.
# Parts: the fp32 main grid and RLVR from its low-LR runs (rlvr_pipeline.yaml, which runs grid.yaml's runs
# first), then the grid in bf16 (bf16_grid.yaml).
set -u
if [ "${KDLAB_ALLOW_DIRTY:-0}" != 1 ] && [ -n "$(git status --porcelain 2>/dev/null)" ]; then
  echo "$0: the working tree has uncommitted changes (git status --porcelain); commit them, or set KDLAB_ALLOW_DIRTY=1 to run anyway" >&2
  exit 2
fi
root=runs/reasoning-study
source experiments/steps.sh
step grid_rlvr kdlab pipeline --config experiments/reasoning/rlvr_pipeline.yaml
step bf16 kdlab sweep --config experiments/reasoning/bf16_grid.yaml
exit $status
