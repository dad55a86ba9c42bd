#!/usr/bin/env bash
# One 7B-shape GRPO run through `rljob run` (issue 23), driven by bench/gpu_all.sh sections q7b*.
#   bash bench/q7b_run.sh tp2dp2|tp2pp2 every-rank|rank0
# Env: Q7B_STEPS (default 3; step 1 is the warm-up the report leaves out), Q7B_PROMPTS (default 32 per step).
# Output: /tmp/q7b-<layout>-<ranks>/work/metrics.jsonl, the step lines, and the run's RESULT line.
set -u
layout=$1 ranks=$2
steps=${Q7B_STEPS:-3} prompts=${Q7B_PROMPTS:-32}
name="gpu-7b-$layout-$ranks"
work="/tmp/q7b-$layout-$ranks"
yaml="/tmp/$name.yaml"
sed -e "s/^  name: .*/  name: $name/" -e "s/ranks: every-rank/ranks: $ranks/" \
    -e "s/trainBatchSizePerNode: .*/trainBatchSizePerNode: $prompts/" \
    -e "s/ppoMiniBatchSizePerNode: .*/ppoMiniBatchSizePerNode: $prompts/" "bench/gpu_7b_$layout.yaml" > "$yaml"
grep -E "ranks:|BatchSizePerNode" "$yaml"
python3 -m rljob_cli.main run "$yaml" --workdir "$work" --fresh --steps "$steps" \
  | grep --line-buffered -E "step [0-9]+/|rror|Traceback|done:|nothing"
rc=${PIPESTATUS[0]}
if [ "$rc" != 0 ]; then
  echo "run failed (rc $rc); last lines of the pod logs:"
  tail -n 40 "$work"/pod-*.log 2>/dev/null | grep -v -i warn | tail -n 40
fi
python3 bench/grpo_scale_report.py --gpus 4 "$layout-$ranks=$work/work/metrics.jsonl" \
  --command "bash bench/gpu_all.sh q7bprep q7b$([ "$layout" = tp2pp2 ] && echo pp2 || ([ "$ranks" = rank0 ] && echo rank0 || echo every))"
exit "$rc"
