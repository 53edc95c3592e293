# Sourced by the study scripts (experiments/tiny/study.sh, experiments/smollm2/style_study.sh, style_alone_study.sh,
# experiments/reasoning/study.sh) after they set root: it refuses a dirty tree (below), sets one CPU thread per process unless
# OMP_NUM_THREADS says otherwise, and defines `step NAME COMMAND...`, which
# runs COMMAND and appends {"step", "seconds", "command"} to $root/wall_times.jsonl (kdlab report sums it per
# step; a rerun adds its time). A failed step sets status=1 and the script goes on to the next.
# A study records the commit its runs come from (run_info.json); from a dirty tree that commit is not the code that ran.
# Refuse to start from one unless KDLAB_ALLOW_DIRTY=1 says so (kdlab report then names the dirty runs).
if [ "${KDLAB_ALLOW_DIRTY:-0}" != 1 ] && [ -n "$(git status --porcelain 2>/dev/null)" ]; then
  echo "$0: the working tree has uncommitted changes (git status --porcelain); commit them, or set KDLAB_ALLOW_DIRTY=1 to run anyway" >&2
  exit 2
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
mkdir -p "$root"
status=0
step() {
  local name=$1; shift
  local start=$SECONDS
  "$@" || status=1
  printf '{"step": "%s", "seconds": %d, "command": "%s"}\n' "$name" $((SECONDS - start)) "$*" >> "$root/wall_times.jsonl"
}
