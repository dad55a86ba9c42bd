#!/usr/bin/env bash
# The trainer's actor_offload stage per step (issue 35), 1.5B char model (bench/gpu_1_5b_char_prepare.py first),
# gradients + optimizer state offloaded around the rollout, same call for every variant:
#   OFFLOADRUN_VARIANTS="registered torchdefault": the worker's pinned-memory default (cudaHostRegister on 8
#     threads, runtime/host_memory.py) against torch's pinning, both with RLJOB_OFFLOAD=always;
#   "auto always" (the default): the trainer's own choice (offload stops after step 1 when the first rollout's
#     peak plus the moved state fit the GPU) against offloading every step.
set -u
VARIANTS=${OFFLOADRUN_VARIANTS:-auto always}
sed -e 's/name: gpu-digit-sum-1-5b-full/name: offload-run/' -e 's/totalTrainingSteps: 200/totalTrainingSteps: 6/' \
    -e 's/saveFreq: 200/saveFreq: 0/' \
    -e 's/megatron: {useDistributedOptimizer: false}/megatron: {useDistributedOptimizer: false, gradOffload: true, optimizerOffload: true}/' \
    bench/gpu_digit_sum_1_5b_full.yaml > /tmp/offload_run.yaml
grep -q optimizerOffload /tmp/offload_run.yaml || { echo "offload_run.sh: the yaml edit did not apply"; exit 1; }
for v in $VARIANTS; do
  case $v in
    torchdefault) env PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:False RLJOB_OFFLOAD=always \
        python3 -m rljob_cli.main run /tmp/offload_run.yaml --workdir /tmp/offload-$v --fresh ;;
    registered|always) env RLJOB_OFFLOAD=always python3 -m rljob_cli.main run /tmp/offload_run.yaml --workdir /tmp/offload-$v --fresh ;;
    auto) python3 -m rljob_cli.main run /tmp/offload_run.yaml --workdir /tmp/offload-$v --fresh ;;
  esac 2>&1 | grep -E 'step [0-9]+/|offload off|rror|Traceback'
done
VARIANTS="$VARIANTS" python3 - <<'PY'
import json, os, statistics
import results
rows, step_s = {}, {}
for v in os.environ["VARIANTS"].split():
    steps = [json.loads(l) for l in open(f"/tmp/offload-{v}/work/metrics.jsonl")]
    off = [s.get("timing/actor_offload_s", 0.0) for s in steps]
    rows[v] = off
    step_s[v] = [s["timing/step_s"] for s in steps]
    print(v, "actor_offload_s per step", [round(x, 2) for x in off], "step_s", [round(s["timing/step_s"], 2) for s in steps])
shape = ("Qwen2.5-1.5B shape over the char vocabulary, GRPO digit-sum 16 x 8, 1 GPU, gradOffload + optimizerOffload "
         "(17.3 GiB of fp32 Adam state + main params), 6 steps")
if "registered" in rows and "torchdefault" in rows:
    r, t = rows["registered"], rows["torchdefault"]
    results.record("actor_offload stage, steps 1-2 (pinning)", shape, "actor_offload_s", sum(r[:2]), "s",
                   baseline="torch default pinning (cudaHostAlloc), same job", baseline_value=sum(t[:2]),
                   same_run=True)
    results.record("actor_offload stage, median of steps 3-6", shape, "actor_offload_s", statistics.median(r[2:]),
                   "s", baseline="torch default pinning (cudaHostAlloc), same job",
                   baseline_value=statistics.median(t[2:]), same_run=True)
if "auto" in rows and "always" in rows:
    results.record("GRPO step, offload stopped after step 1 (the rollout fits beside the state)", shape,
                   "step_s", statistics.median(step_s["auto"][2:]), "s",
                   baseline="offload every step (RLJOB_OFFLOAD=always), same job",
                   baseline_value=statistics.median(step_s["always"][2:]), same_run=True)
PY
