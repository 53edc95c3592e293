#!/usr/bin/env bash
# The tiny-world reproduction study (docs/tiny_reproduction.md), every run and then the report:
#   bash experiments/tiny/study.sh
# Run from the repository root. Each sweep runs two processes at a time with one CPU thread each; a
# finished run (DONE) is skipped on a rerun, an interrupted one resumes. The wall time of each step
# and of the whole study goes to runs/tiny-study/wall_times.jsonl; the report sums it per step (a rerun adds its time).
set -u
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
mkdir -p runs/tiny-study
status=0
step() {
  local name=$1; shift
  local start=$SECONDS
  "$@" || status=1
  printf '{"step": "%s", "seconds": %d, "command": "%s"}\n' "$name" $((SECONDS - start)) "$*" >> runs/tiny-study/wall_times.jsonl
}
step grid kdlab sweep --config experiments/tiny/grid.yaml
step rlvr kdlab pipeline --config experiments/tiny/rlvr_pipeline.yaml
step style kdlab sweep --config experiments/tiny/style_grid.yaml
step bf16 kdlab sweep --config experiments/tiny/bf16_grid.yaml
step hard kdlab sweep --config experiments/tiny/hard_passk.yaml
step spectrum_high kdlab sweep --config experiments/tiny/spectrum_high.yaml
step lr kdlab sweep --config experiments/tiny/lr_sweep.yaml
step rlvr_student kdlab sweep --config experiments/tiny/rlvr_student.yaml
step spectrum kdlab sweep --config experiments/tiny/spectrum_sweep.yaml
step report kdlab report runs/tiny-study --output docs/tiny_reproduction --low_lr 1e-4 --high_lr 2e-3
step report_world kdlab report runs/tiny-world --output docs/tiny_world_runs --low_lr 1e-4 --high_lr 2e-3
exit $status
