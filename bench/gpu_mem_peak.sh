#!/usr/bin/env bash
# Peak GPU memory per GPU (nvidia-smi, every process on it: both pools of a taking-turns layout) while a
# command runs:   bash bench/gpu_mem_peak.sh LABEL command...   prints "RESULT LABEL peak memory: GPU0 X MiB, ..."
label=$1; shift
log=$(mktemp)
( while true; do nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits >> "$log"; sleep 0.5; done ) &
sampler=$!
"$@"; rc=$?
kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
awk -F', ' -v label="$label" '{ if ($2 > peak[$1]) peak[$1] = $2 } END { out = ""; for (g in peak) out = out sprintf("GPU%s %d MiB ", g, peak[g]); print "RESULT " label " peak memory (nvidia-smi, all processes): " out }' "$log"
rm -f "$log"
exit $rc
