#!/usr/bin/env bash
# The reasoning-world study (docs/tiny_reasoning.md, issue #44), every run:
#   bash experiments/reasoning/study.sh
# Run from the repository root of a clean checkout: every run records its commit (run_info.json). Each sweep
# runs two processes at a time with one CPU thread each; a finished run (DONE) is skipped on a rerun, an
# interrupted one resumes. The wall time of each step goes to runs/reasoning-study/wall_times.jsonl.
# Parts: the fp32 main grid and RLVR from its low-LR runs (rlvr_pipeline.yaml, which runs grid.yaml's runs
# first), then the grid in bf16 (bf16_grid.yaml).
set -u
root=runs/reasoning-study
source experiments/steps.sh  # refuses a tree with uncommitted changes unless KDLAB_ALLOW_DIRTY=1
step grid_rlvr kdlab pipeline --config experiments/reasoning/rlvr_pipeline.yaml
step bf16 kdlab sweep --config experiments/reasoning/bf16_grid.yaml
exit $status
