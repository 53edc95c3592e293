#!/usr/bin/env bash
# The tiny-world reproduction study at the paper's 5x LR ratio (docs/tiny_reproduction.md), every run and
# then the report:
#   bash experiments/tiny/study.sh
# Run from the repository root. Each sweep runs two processes at a time with one CPU thread each; a
# finished run (DONE) is skipped on a rerun, an interrupted one resumes. The wall time of each step goes to
# runs/tiny-study-5x/wall_times.jsonl (experiments/steps.sh); the report sums it per step. The last step copies
# the report's verdicts, departures, wall time and part links into docs/tiny_reproduction.md.
set -u
root=runs/tiny-study-5x
source experiments/steps.sh  # refuses a tree with uncommitted changes unless KDLAB_ALLOW_DIRTY=1
step grid kdlab sweep --config experiments/tiny/grid_5x.yaml
step hard_rlvr kdlab pipeline --config experiments/tiny/rlvr_harder_pipeline.yaml
step bf16 kdlab sweep --config experiments/tiny/bf16_grid_5x.yaml
step style kdlab sweep --config experiments/tiny/style_grid_5x.yaml
step spectrum_high kdlab sweep --config experiments/tiny/spectrum_high_5x.yaml
step spectrum kdlab sweep --config experiments/tiny/spectrum_sweep_5x.yaml
rm -rf docs/tiny_reproduction  # the report is written afresh: no file of an earlier design is left behind
step report kdlab report $root --output docs/tiny_reproduction --low_lr 1e-4 --high_lr 5e-4
step page python scripts/tiny_reproduction_page.py
exit $status
