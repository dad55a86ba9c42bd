#!/usr/bin/env bash
# The digit-sum GRPO job with vLLM at rollout TP2 on two GPUs (bench/gpu_digit_sum_vllm_tp2.yaml), its whole log
# under $OUT. If no step has finished after STALL_S seconds, every worker prints all its threads' stacks (SIGUSR1,
# registered by the worker) into the log before the job is stopped: where it waits.
# First the engine alone (bench/vllm_tp2_probe.py); if it fails with vLLM's defaults it is tried again without
# vLLM's symmetric-memory all-reduce (VLLM_ALLREDUCE_USE_SYMM_MEM=0), and the job runs with whichever passed.
set -u
OUT=${OUT:-/tmp/bench_out}; STALL_S=${STALL_S:-200}; PROBE_STALL_S=${PROBE_STALL_S:-120}
probe() { timeout -k 10 $((PROBE_STALL_S + 20)) python3 -m torch.distributed.run --nproc-per-node 2 bench/vllm_tp2_probe.py \
  --stall-s "$PROBE_STALL_S" >"$OUT/vllmtp2_probe_$1.log" 2>&1; local rc=$?
  grep -E "^\[rank|probe rank|Error|error:" "$OUT/vllmtp2_probe_$1.log" | head -30; echo "probe $1: rc $rc"; return $rc; }
if [ "${SKIP_PROBE:-0}" != 1 ] && ! probe default; then
  tail -c 6000 "$OUT/vllmtp2_probe_default.log"
  VLLM_ALLREDUCE_USE_SYMM_MEM=0 probe nosymm && export VLLM_ALLREDUCE_USE_SYMM_MEM=0
fi
LOG_FILE=$OUT/vllmtp2.log
python3 -m rljob_cli.main run bench/gpu_digit_sum_vllm_tp2.yaml --workdir /tmp/vllmtp2 --fresh >"$LOG_FILE" 2>&1 &
job=$!
waited=0
while kill -0 $job 2>/dev/null && ! grep -q -E "step [0-9]+/" "$LOG_FILE"; do
  sleep 5; waited=$((waited + 5))
  if [ $waited -ge "$STALL_S" ]; then
    echo "no step after ${STALL_S}s: dumping the workers' stacks"
    for pid in $(pgrep -f "rljob_worker --spec"); do  # the workers, not torchrun's agent (rljob_worker.launch)
      tr '\0' ' ' </proc/$pid/cmdline | grep -q "rljob_worker.launch" || kill -USR1 "$pid"
    done; sleep 8
    pkill -TERM -f "rljob_worker --spec"; sleep 5; kill $job 2>/dev/null
    break
  fi
done
wait $job; rc=$?
grep -E "step (1|100|300|500|700)/|rollout engine|vLLM .* engine up|rror|Traceback|finished" "$LOG_FILE" | head -40
[ $waited -ge "$STALL_S" ] && tail -c 12000 "$LOG_FILE"
python3 bench/summarize_grpo.py /tmp/vllmtp2/work/metrics.jsonl grpo-digit-sum-vllm-tp2
exit $rc
