#!/usr/bin/env bash
# The digit-sum GRPO job with vLLM at rollout TP2 on two GPUs (bench/gpu_digit_sum_vllm_tp2.yaml), its whole log
# under $OUT. If no step has finished after STALL_S seconds, every worker prints all its threads' stacks (SIGUSR1,
# registered by the worker) into the log before the job is stopped: where it waits.
# Before it, optionally, the engine alone (bench/vllm_tp2_probe.py, PROBES below), stacks dumped if one stalls.
set -u
OUT=${OUT:-/tmp/bench_out}; STALL_S=${STALL_S:-200}; PROBE_STALL_S=${PROBE_STALL_S:-120}
probe() {  # name, probe options...
  local name=$1; shift
  timeout -k 10 $((PROBE_STALL_S + 20)) python3 -m torch.distributed.run --nproc-per-node 2 bench/vllm_tp2_probe.py \
    --stall-s "$PROBE_STALL_S" --workdir "/tmp/vllm_tp2_probe_$name" "$@" >"$OUT/vllmtp2_probe_$name.log" 2>&1
  local rc=$?
  grep -E "^\[rank|probe rank|Error|error:" "$OUT/vllmtp2_probe_$name.log" | head -30; echo "probe $name: rc $rc"
  [ $rc != 0 ] && grep -A12 -E "^Thread 0x|^Current thread" "$OUT/vllmtp2_probe_$name.log" | head -60
  return $rc; }
# workers of the job (not torchrun's agent, rljob_worker.runtime.launch); the image has no pgrep
workers() { for d in /proc/[0-9]*; do local cmd; cmd=$(tr '\0' ' ' <"$d/cmdline" 2>/dev/null) || continue
  case "$cmd" in *"rljob_worker.runtime.launch"*) ;; *"rljob_worker --spec"*) echo "${d#/proc/}" ;; esac; done; }
# PROBES: which engine-alone probes run first (default: the tiny test model; builtin: tiny-qwen2 (head_dim 16) with the
# job's engine settings, which hangs in vLLM's warm-up at TP2; megatron: the same after megatron's groups are made, as
# in the trainer; model: tiny-qwen2 with the default probe's settings; settings: the test model with the job's settings)
for p in ${PROBES:-}; do
  case $p in
    default) probe default ;;
    builtin) probe builtin --builtin --max-model-len 10 --gpu-mem 0.05 --skip-shape-check ;;
    megatron) probe megatron --builtin --max-model-len 10 --gpu-mem 0.05 --megatron --skip-shape-check ;;
    model) probe model --builtin --skip-shape-check ;;
    settings) probe settings --max-model-len 10 --gpu-mem 0.05 ;;
  esac
done
LOG_FILE=$OUT/vllmtp2.log
python3 -m rljob_cli.main run bench/gpu_digit_sum_vllm_tp2.yaml --workdir /tmp/vllmtp2 --fresh >"$LOG_FILE" 2>&1 &
job=$!
waited=0
while kill -0 $job 2>/dev/null && ! grep -q -E "step [0-9]+/" "$LOG_FILE"; do
  sleep 5; waited=$((waited + 5))
  if [ $waited -ge "$STALL_S" ]; then
    echo "no step after ${STALL_S}s: dumping the workers' stacks"
    pids=$(workers); echo "workers: $pids"
    for pid in $pids; do kill -USR1 "$pid"; done; sleep 8
    kill $job 2>/dev/null; sleep 10
    break
  fi
done
wait $job; rc=$?
grep -E "step (1|100|300|500|700)/|rollout engine|vLLM .* engine up|rror|Traceback|finished" "$LOG_FILE" | head -40
[ $waited -ge "$STALL_S" ] && tail -c 12000 "$LOG_FILE"
python3 bench/summarize_grpo.py /tmp/vllmtp2/work/metrics.jsonl grpo-digit-sum-vllm-tp2
exit $rc
