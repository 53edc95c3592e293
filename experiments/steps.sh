# Sourced by the study scripts (experiments/tiny/study.sh, experiments/smollm2/style_study.sh) after they set
# root: one CPU thread per process unless OMP_NUM_THREADS says otherwise, and `step NAME COMMAND...`, which
# runs COMMAND and appends {"step", "seconds", "command"} to $root/wall_times.jsonl (kdlab report sums it per
# step; a rerun adds its time). A failed step sets status=1 and the script goes on to the next.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
mkdir -p "$root"
status=0
step() {
  local name=$1; shift
  local start=$SECONDS
  "$@" || status=1
  printf '{"step": "%s", "seconds": %d, "command": "%s"}\n' "$name" $((SECONDS - start)) "$*" >> "$root/wall_times.jsonl"
}
