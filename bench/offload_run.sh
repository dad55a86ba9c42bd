#!/usr/bin/env bash
# The trainer's actor_offload stage per step (issue 35), 1.5B char model (bench/gpu_1_5b_char_prepare.py first),
# gradients + optimizer state offloaded around the rollout: the worker's default pinned-memory setting
# (cudaHostRegister on 8 threads, runtime/host_memory.py) against torch's default pinning, same call.
set -u
sed -e 's/name: gpu-digit-sum-1-5b-full/name: offload-run/' -e 's/totalTrainingSteps: 200/totalTrainingSteps: 6/' \
    -e 's/saveFreq: 200/saveFreq: 0/' \
    -e 's/megatron: {useDistributedOptimizer: false}/megatron: {useDistributedOptimizer: false, gradOffload: true, optimizerOffload: true}/' \
    bench/gpu_digit_sum_1_5b_full.yaml > /tmp/offload_run.yaml
grep -q optimizerOffload /tmp/offload_run.yaml || { echo "offload_run.sh: the yaml edit did not apply"; exit 1; }
for v in registered torchdefault; do
  if [ $v = torchdefault ]; then export PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:False; fi
  python3 -m rljob_cli.main run /tmp/offload_run.yaml --workdir /tmp/offload-$v --fresh | grep -E 'step [0-9]+/|rror|Traceback'
  unset PYTORCH_CUDA_ALLOC_CONF
done
python3 - <<'PY'
import json, statistics
import results
rows = {}
for v in ("registered", "torchdefault"):
    steps = [json.loads(l) for l in open(f"/tmp/offload-{v}/work/metrics.jsonl")]
    off = [s.get("timing/actor_offload_s", 0.0) for s in steps]
    rows[v] = off
    print(v, "actor_offload_s per step", [round(x, 2) for x in off], "step_s", [round(s["timing/step_s"], 2) for s in steps])
shape = ("Qwen2.5-1.5B shape over the char vocabulary, GRPO digit-sum 16 x 8, 1 GPU, gradOffload + optimizerOffload "
         "(17.3 GiB of fp32 Adam state + main params), 6 steps")
r, t = rows["registered"], rows["torchdefault"]
results.record("actor_offload stage, steps 1-2 (pinning)", shape, "actor_offload_s", sum(r[:2]), "s",
               baseline="torch default pinning (cudaHostAlloc), same job", baseline_value=sum(t[:2]), same_run=True)
results.record("actor_offload stage, median of steps 3-6", shape, "actor_offload_s", statistics.median(r[2:]), "s",
               baseline="torch default pinning (cudaHostAlloc), same job", baseline_value=statistics.median(t[2:]),
               same_run=True)
PY
