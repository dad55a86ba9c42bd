#!/usr/bin/env bash
# bench/grpo_step.py for two trees in one device call, alternating (base, this tree, base, this tree, ...),
# so a refactor's step time is compared on the same card in the same run.
#   here, before the call:  git archive BASE_COMMIT worker operator bench > .ab_base.tar
#   on the device:          bash bench/ab_grpo_step.sh .ab_base.tar [variant, default rljob-static:32] [rounds, default 2]
# Needs the wheels of bench/gpu_all.sh (carry: [".whl/megatron_actor_gpu", ".whl/trl"]). Results: $OUT/base_N/ and
# $OUT/head_N/ (grpo_step_ab.json each) and the step-time summary at the end of the output.
set -eu
BASE_TAR=$1
VARIANT=${2:-rljob-static:32}
ROUNDS=${3:-2}
OUT=${OUT:-/tmp/bench_out}
HEAD=$PWD
BASE=/tmp/ab_base
rm -rf "$BASE" && mkdir -p "$BASE" "$OUT" && tar -xf "$BASE_TAR" -C "$BASE"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/megatron_actor_gpu/*.whl .whl/trl/*.whl 2>&1 | grep -v -i "warning" | tail -3 || true
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
for round in $(seq "$ROUNDS"); do
  for side in base head; do
    tree=$BASE; [ "$side" = head ] && tree=$HEAD
    echo "=== $side round $round ($tree) $(date +%T)"
    PYTHONPATH=/tmp/site:$tree/operator:$tree/worker:$tree/bench timeout -k 10 200 \
      python3 "$tree/bench/grpo_step.py" --variants "$VARIANT" --timeout-each 180 --out "$OUT/${side}_$round" --tag _ab \
      2>&1 | grep --line-buffered -v -i -E "warn|^\s*$|Loading weights" || echo "=== $side round $round failed"
  done
done
python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
KEYS = ("variant", "error", "step_s_median", "stage/rollout", "stage/actor_update", "stage/weight_sync", "peak_gib")
for side in ("base", "head"):
    for f in sorted(out.glob(f"{side}_*/grpo_step_ab.json")):
        rows = json.loads(f.read_text())["rows"]
        print(side, f.parent.name, json.dumps({k: rows[0].get(k) for k in KEYS}))
PY
