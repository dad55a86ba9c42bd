#!/usr/bin/env bash
# SFT throughput on the GPU (issue 10): random-init Qwen2.5-0.5B shape, 640 pre-tokenised rows of
# 256-2048 tokens (loss on the last 3/4), 12 steps of 32 rows through `rljob run`.
#   bash bench/sft_gpu.sh [job...]     jobs: tp1-packed tp1-unpacked tp2-packed pp2-packed
# Needs the megatron-core, psutil and pydantic wheels (see bench/gpu_all.sh). Results: RESULT lines.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/megatron_actor_gpu/megatron_core-*.whl .whl/megatron_actor_gpu/psutil-*.whl \
  .whl/trl/pydantic-*.whl .whl/trl/pydantic_core-*.whl .whl/trl/annotated_types-*.whl \
  .whl/trl/typing_inspection-*.whl .whl/trl/typing_extensions-*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/operator:$PWD/worker PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv
W=/tmp/sftgpu; mkdir -p $W
python3 - <<'PY' 2>&1 | grep -v -i warn
import random, torch, pyarrow as pa, pyarrow.parquet as pq
from transformers import Qwen2Config, AutoModelForCausalLM
from rljob_worker.data.builtin_models import build_char_tokenizer
c = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
                rope_theta=1e6, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=1, pad_token_id=0)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(c, dtype=torch.bfloat16).save_pretrained("/tmp/sftgpu/q05")
build_char_tokenizer().save_pretrained("/tmp/sftgpu/q05")  # pad/eos ids only: the data is pre-tokenised
rng = random.Random(0)
rows = []
for _ in range(640):
    n = rng.randint(256, 2048); p = n // 4
    ids = [rng.randrange(2, 151936) for _ in range(n)]
    rows.append({"input_ids": ids, "attention_mask": [1] * n, "labels": [-100] * p + ids[p:]})
pq.write_table(pa.Table.from_pylist(rows), "/tmp/sftgpu/train.parquet")
pq.write_table(pa.Table.from_pylist(rows[:64]), "/tmp/sftgpu/val.parquet")
print("rows", len(rows), "mean tokens", sum(len(r["input_ids"]) for r in rows) / len(rows))
PY
job() {  # name gpus tp packing
cat > $W/$1.yaml <<Y
apiVersion: rljob.dev/v1alpha1
kind: RLJob
metadata: {name: $1}
spec:
  gpusPerNode: $2
  model: {path: "file:///tmp/sftgpu/q05", dtype: bfloat16}
  algorithm: {name: sft}
  sft: {format: tokenized, maxLength: 2048, packing: $4, lrSchedule: cosine}
  data: {trainFiles: [/tmp/sftgpu/train.parquet], valFiles: [/tmp/sftgpu/val.parquet]}
  training: {trainBatchSizePerNode: 32, microBatchSizePerGpu: 8, lr: 1.0e-5, lrWarmupSteps: 2, totalTrainingSteps: 12, testFreq: 12, valBeforeTrain: false}
  megatron: {tensorModelParallelSize: $3, pipelineModelParallelSize: ${5:-1}, useDistributedOptimizer: true}
  checkpoint: {saveFreq: -1, exportHf: false}
  metrics: {enabled: false}
Y
t0=$SECONDS
timeout 240 python3 -m rljob_cli.main run $W/$1.yaml --workdir $W/$1 --checkpoint-uri file://$W/ckpt 2>&1 | grep -v -i -E "warn|^\s*$" | grep -E "step |validation|done|rror|Traceback|finished" | tail -16
cp $W/$1/work/metrics.jsonl $OUT/$1.jsonl 2>/dev/null
python3 - $W/$1/work/metrics.jsonl $1 <<'PY'
import json, statistics, sys
r = [json.loads(l) for l in open(sys.argv[1]) if '"actor/loss"' in l][3:]
tps = [x["throughput/train_tokens_per_s"] for x in r]
print(f"RESULT {sys.argv[2]}: median {statistics.median(tps):.0f} tok/s over steps 4-12 (min {min(tps):.0f}, max {max(tps):.0f}), "
      f"MFU {statistics.median([x['perf/mfu'] for x in r]):.3f}, step {statistics.median([x['timing/step_s'] for x in r]):.2f}s, "
      f"tokens/step {r[0]['data/tokens']:.0f}, loss {r[-1]['actor/loss']:.3f}")
PY
echo "wall $1: $((SECONDS - t0))s"
}
for j in ${*:-tp1-packed tp1-unpacked tp2-packed}; do
  case $j in
    tp1-packed) job tp1-packed 1 1 true ;;
    tp1-unpacked) job tp1-unpacked 1 1 false ;;
    tp2-packed) job tp2-packed 2 2 true ;;
    pp2-packed) job pp2-packed 2 1 true 2 ;;
    *) echo "unknown job $j" ;;
  esac
done
