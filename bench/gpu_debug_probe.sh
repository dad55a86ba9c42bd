#!/usr/bin/env bash
# A separate rollout pool on 2 GPUs, each probe under a time limit: a probe still running then gets SIGABRT, so
# faulthandler prints every thread's stack into $OUT/<probe>.log (how the weight-push deadlock was found).
export PYTHONFAULTHANDLER=1
export PYTHONPATH=/tmp/site:$PWD/operator:$PWD/worker:$PWD/bench PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 HF_HUB_OFFLINE=1
WHEELS=$(ls .whl/megatron_actor_gpu/*.whl 2>/dev/null)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $WHEELS 2>&1 | tail -1
probe() {  # name, seconds, process pattern, command...
  local name=$1 limit=$2 pattern=$3; shift 3
  "$@" > $OUT/$name.log 2>&1 &
  local pid=$! t=0
  while kill -0 $pid 2>/dev/null && [ $t -lt $limit ]; do sleep 2; t=$((t+2)); done
  if kill -0 $pid 2>/dev/null; then
    echo "$name: hung after ${limit}s; dumping stacks" >> $OUT/$name.log
    pkill -ABRT -f "$pattern"; sleep 5; pkill -9 -f "$pattern"; pkill -9 -f torch.distributed.run; sleep 2
  fi
  wait $pid; echo "=== $name rc $? after ${t}s"
  grep -v -i -E "warn|^\s*$" $OUT/$name.log | tail -60 | cut -c1-250
}
probe wptiny 60 weight_push.py python3 -m torch.distributed.run --nproc_per_node 2 bench/weight_push.py --model tiny
probe async1 120 rljob_worker python3 -m rljob_cli.main run bench/gpu_digit_sum_sep_async1.yaml --workdir /tmp/sep_a1 --fresh --steps 20
