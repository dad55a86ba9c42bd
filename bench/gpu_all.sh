#!/usr/bin/env bash
# The one script the device runs (issues 5, 6, 13): every benchmark in one call, results under $OUT.
#   bash bench/gpu_all.sh [sections...]
#   sections: actor05 grpo actor15 rollout grpombs | grpokl grpo816 actor05w grpo15 grpo15trl trlnockpt
#             rolloutbase (rollout: HF generate static-cache+compile baseline, static engine uncompiled and compiled
#             [the GPU default] at batch 64 and 256, fp32 greedy checks, first-call compile s cold / warm cache,
#             recompiles over 8 prompt widths; ~8 min) | rollouttests (static engine tests incl. the GPU ones)
#             | rolloutbuckets (compiled engine reading the filled cache slots vs the whole cache, batch 256)
#             | warmstart (issue 35: first step of a cold pod, of a pod whose compile cache was restored from the
#             job's storage, of a restarted container, and with compile off, each against its warm step:
#             bench/warm_start.py) | offload15 (issue 35: actor offload + onload at 1.5B by phase against the
#             pinned copy floor: bench/offload.py; offload15reg with cudaHostRegister pinning, offload15d with the
#             distributed optimizer) | offloadrun (issue 35: the trainer's actor_offload per step at 1.5B, the worker's
#             pinned-memory default vs torch's: bench/offload_run.sh)
#             | moereplay (issue 36, vLLM installed: MoE routing replay, the trainer's log-probs against vLLM's with
#             and without vLLM's routed experts, Qwen3-30B-A3B shape at 4 layers: bench/moe_routing_replay.py)
#             | tool15 (issue 31: the same pair on a 1.5B-shaped model over the tool vocabulary, static engine; the agent
#             run twice: turns streamed (default) and batched) | streamtests (the continuous rows' tests, GPU ones included)
#             | longtail (issue 32: rollout alone on log-normal lengths up to 4k, batch at a time vs refilling rows:
#             bench/long_tail_rollout.py) | longtailjob (issue 32, 2 GPUs: the whole GRPO job on those lengths, colocated
#             sync vs a separate pool with refilling rows, tok/s/GPU: bench/long_tail_job.py) | longtail1 (its colocated
#             run on 1 GPU, a few steps: the lengths' knob on a GPU job) | refilltests (the refilling rows' tests, the GPU one included)
#             | agentprofile (the same engine's rollout alone: single turn, turns batched, turns streamed; bench/agent_stream_profile.py)
#             | toolvllm (issue 31, vLLM installed: the tool task and its single-turn twin with vLLM as the engine)
#             | sft [jobs] | gputests | tool (issue 31: examples/secret-tool.yaml on the GPU's static engine, and the
#             agent loop's rollout seconds per token against the same run as one turn: bench/agent_overhead.py)
#             ppo (digit-sum PPO with a shared critic vs GRPO, one GPU) | ppo2 (2 GPUs: digit-sum PPO, split critic
#             (actor 1 GPU + critic 1 GPU) vs shared critic (both on 2 GPUs), step-time breakdown and overlap)
#             | ppo2turns (issue 36, 2 GPUs: PPO with a shared critic at its own TP2 taking turns vs split, 300 steps
#             each, peak memory per GPU of all processes: bench/gpu_mem_peak.sh)
#             | grpopp2 (digit-sum GRPO, 2 GPUs, pipeline parallel 2) | grpocompiled (static vs compiled engine)
#             grpotp2pp2 + gpu4tests (4 GPUs: TP2 x PP2 GRPO learning; mixed layouts vs one GPU)
#             with vLLM installed (bench/vllm_carry.sh install first): vllmtests (the real-vLLM GPU tests),
#             vllmtp2tests (the TP2 engine test, 2 GPUs), grpovllmval (digit-sum on vLLM with validations: the
#             engine's sleep between steps and its state after a validation),
#             grpovllm1 (digit-sum GRPO, engine: vllm, 1 GPU), grpovllmtp2 (same at rollout TP2, 2 GPUs, after
#             bench/vllm_tp2_probe.py: the engine alone; stacks dumped where either stalls),
#             grpovllm (GRPO step: static engine vs vLLM [+ TRL: GRPOVLLM_VARIANTS]), rolloutvllm (rollout
#             bench incl. vLLM rows and its sleep / wake / sync timings), grpo15vllm (the same at 1.5B),
#             rolloutscale (rollout alone, static vs compiled static vs vLLM at 1.5B and 7B, random weights: `auto`)
#             q7bprep, then q7bevery q7brank0 q7breport (4 GPUs, issue 23: Qwen2.5-7B-shape GRPO, TP2 x DP2, hf
#             engine on every GPU vs on rank 0, same call; 16 prompts x 8 by default so both fit one call:
#             Q7B_PROMPTS, Q7B_STEPS (3), Q7B_LIMIT) | q7bpp2 (TP2 x PP2, 32 prompts x 8)
#             | q7blora (after q7bprep, 1 GPU, issue 34: a 7B-shape GRPO step with LoRA rank 32, then bench/lora_push.py:
#             weight push and checkpoint, adapters vs full weights) | lorads (digit-sum GRPO, LoRA vs full, 1 GPU)
#             vllmlora (issue 34, vLLM installed: merged weights pushed into vLLM vs vLLM's own LoRA adapter
#             path, 1.5B char model, one process each: bench/vllm_lora_path.py) | judge (issue 33, vLLM installed: a vLLM-served judge on the same GPU scores 256 samples a step,
#             overlap vs blocking: bench/gpu_judge_overlap.py) | lora15 (the same at the 1.5B shape over the char vocabulary, 200 steps each: bench/lora_vs_full.py)
#             lossmbs1 lossmbs4 (issue 18: digit-sum GRPO at microBatchSizePerGpu 1 vs 4, same reward curve)
#             head (policy head alone: fused vs unfused log-probs + entropy, forward + backward)
#             actor05f actor15f (actor update: fused head vs unfused vs HF packed rows, token budget) fusedtests
#             packtests actor15pack grpopack (concatenated micro-batches: GPU tests; 1.5B update with a 16k budget,
#             concatenated vs rows; GRPO step 0.5B concatenated vs rows vs TRL without checkpointing) actor7hpack (the
#             same at Qwen2.5-7B widths, 14 layers) gpu1tests (the one-GPU actor, critic and packing tests)
#             actor05e (actor update: compiled RMSNorm/RoPE/SwiGLU on vs off vs HF packed rows; actor15f also
#             compares them at 1.5B, with MFU) elemtests grporounds (GRPO step vs TRL without checkpointing, run
#             in turn twice: each round's ratio against its own TRL run) | precompiletests (the precompiled regions'
#             tests with this image's torch, and the static engine's tests, GPU ones included) | enginetests (the GPU
#             tests of everything built on the static engine: graphs, compiled step, precompiled regions, refilling and
#             streamed rows, the cache kept between steps) | firstcompile (issue 35: a fresh process's first compile
#             with a warm cache, imports inside it or paid before it, and a profile: bench/first_compile_probe.py)
# Each section is its own process with its own time limit; a failing section is reported and skipped.
# Every figure is also appended to $OUT/results.jsonl (bench/results.py); pass RLJOB_BENCH_COMMIT=<sha> (the
# device's copy of the tree has no .git), then `python bench/results.py merge <files_at>/results.jsonl`.
# Needs wheels (carry: [".whl/megatron_actor_gpu", ".whl/trl"]): megatron-core 0.16.1 cp312; trl 1.16, datasets,
# dill, multiprocess, pydantic(+core, annotated-types, typing-inspection, typing-extensions). Keep the image's pyarrow.
set -u
SECTIONS=${*:-"actor05 grpo actor15 rollout grpombs"}
export OUT=${OUT:-/tmp/bench_out}
mkdir -p "$OUT"
LOG="$OUT/all.log"
# whichever wheel folders this call carried (a vLLM call may carry megatron alone); same /tmp/site as vLLM's
WHEELS=$(ls .whl/megatron_actor_gpu/*.whl .whl/trl/*.whl 2>/dev/null)
[ -n "$WHEELS" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  $WHEELS 2>&1 | grep -v -i "warning" | tail -3
export PYTHONPATH=/tmp/site:$PWD/operator:$PWD/worker:$PWD/bench
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
# The device image sets PYTHONDONTWRITEBYTECODE=1 and ships torch without .pyc files, so every process compiled
# each module it imported from source (imports, and the compiler's lazy imports inside a first step); the worker
# image has them (Dockerfile.worker compiles them at build). Bytecode kept under /tmp: the first process of a call
# writes it, the later ones start as a worker pod does.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pycache
# vLLM (when installed): engine core in this process (the engine sets it too), no FlashInfer sampler JIT
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee -a "$LOG"
python3 - <<'PY' 2>&1 | grep -v -i warn | tee -a "$LOG"
import importlib
for m in ("torch", "transformers", "trl", "datasets", "pyarrow", "megatron.core", "pydantic", "accelerate", "vllm"):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "?"))
    except Exception as e:
        print(m, "IMPORT FAILED", type(e).__name__, e)
PY

section() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s) $(date +%T)" | tee -a "$LOG"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | grep --line-buffered -v -i -E "warn|^\s*$|Loading weights|Writing model" | tee -a "$LOG"
  echo "=== $name done: rc ${PIPESTATUS[0]}, $((SECONDS - t0))s" | tee -a "$LOG"
}

for s in $SECTIONS; do
  case $s in
    actor05) section actor05 120 python3 bench/actor_update.py --model 0.5b --mbs 4,8 ;;
    actor15) section actor15 150 python3 bench/actor_update.py --model 1.5b --mbs 4,8 ;;
    grpo) section grpo 330 python3 bench/grpo_step.py --variants rljob-static,trl,rljob-hf --timeout-each 110 ;;
    rollout) section rollout 80 python3 bench/rollout.py ;;
    head) section head 200 python3 bench/fused_logprobs.py ;;
    actor05f) section actor05f 360 python3 bench/actor_update.py --model 0.5b --mbs 8,16 --warmup 2 --max-tokens 32768 --systems hf-packed,megatron-unfused,megatron,megatron-budget ;;
    actor15f) section actor15f 420 python3 bench/actor_update.py --model 1.5b --mbs 4,8 --warmup 2 --max-tokens 16384 --systems hf-packed,megatron-noelem,megatron,megatron-budget ;;
    actor05e) section actor05e 330 python3 bench/actor_update.py --model 0.5b --mbs 8,16 --warmup 2 --systems hf-packed,megatron-noelem,megatron ;;
    elemtests) section elemtests 150 python3 -m pytest tests/worker/test_fused_elementwise.py -m gpu -v -p no:cacheprovider -rs ;;
    fusedtests) section fusedtests 300 python3 -m pytest tests/worker/test_fused_head.py -m gpu -v -p no:cacheprovider -rs ;;
    grpo15) section grpo15 120 python3 bench/grpo_step.py --model 1.5b --variants rljob-static:16 --timeout-each 110 --tag _1.5b ;;
    grpo15trl) section grpo15trl 240 python3 bench/grpo_step.py --model 1.5b --variants rljob-static:16,trl --timeout-each 115 --tag _1.5b ;;
    grpo816) section grpo816 200 python3 bench/grpo_step.py --prompts 8 --n 16 --variants rljob-static:32,trl --timeout-each 110 --tag _8x16 ;;
    grpokl) section grpokl 220 python3 bench/grpo_step.py --kl-coef 0.001 --variants rljob-static:32,trl --timeout-each 115 --tag _kl ;;
    actor05w) section actor05w 110 python3 bench/actor_update.py --model 0.5b --mbs 4,8 --warmup 2 --systems hf-padded,hf-packed,megatron ;;
    grpombs) section grpombs 200 python3 bench/grpo_step.py --variants rljob-static:32,rljob-static:64 --timeout-each 95 --tag _mbs ;;
    packtests) section packtests ${PACKTESTS_LIMIT:-240} python3 -m pytest tests/worker/test_sequence_packing.py tests/worker/test_attention_backend.py -v -p no:cacheprovider -rs ;;
    actor15pack) section actor15pack ${ACTOR15PACK_LIMIT:-300} python3 bench/actor_update.py --model 1.5b --mbs 8 --warmup 2 --max-tokens 16384 --systems megatron-budget-rows,megatron-budget ${ACTOR15PACK_ARGS:-} ;;
    actor7hpack) section actor7hpack ${ACTOR7HPACK_LIMIT:-330} python3 bench/actor_update.py --model 7b-half --mbs 4 --warmup 2 --steps 4 --max-tokens 8192 --systems megatron-budget-rows,megatron-budget ${ACTOR7HPACK_ARGS:-} ;;
    precompiletests) section precompiletests ${PRECOMPILETESTS_LIMIT:-300} python3 -m pytest tests/worker/test_precompiled.py tests/worker/test_rollout_static.py -v -p no:cacheprovider -rs ;;
    gpu1tests) section gpu1tests ${GPU1TESTS_LIMIT:-300} python3 -m pytest -m gpu tests/worker/test_megatron_gpu.py tests/worker/test_fused_head.py tests/worker/test_critic_gpu.py tests/worker/test_sequence_packing.py -v -p no:cacheprovider -rs ;;
    grpopack) section grpopack ${GRPOPACK_LIMIT:-420} python3 bench/grpo_step.py --variants ${GRPOPACK_VARIANTS:-rljob-compiled:32,rljob-compiled:32@rows,trl-nockpt} --timeout-each 130 --tag _pack ;;
    grporounds) section grporounds ${GRPOROUNDS_LIMIT:-420} python3 bench/grpo_step.py --variants ${GRPOROUNDS_VARIANTS:-rljob-compiled:64,trl-nockpt} --rounds ${GRPOROUNDS_ROUNDS:-2} --steps 4 --timeout-each 150 --tag _rounds ${GRPOROUNDS_ARGS:-} ;;
    trlnockpt) section trlnockpt 120 python3 bench/grpo_step.py --variants trl-nockpt --timeout-each 110 --tag _trlnockpt ;;
    rolloutbase) section rolloutbase ${ROLLOUTBASE_LIMIT:-560} python3 bench/rollout.py --hf-generate-baseline --compiled --compile-probe --skip-plain-hf ${ROLLOUT_ARGS:-} ;;
    rolloutbuckets) section rolloutbuckets 300 python3 bench/rollout.py --compiled --whole-cache-row --skip-plain-hf --batches 256 ${ROLLOUT_ARGS:-} ;;
    firstcompile) section firstcompile 240 python3 bench/first_compile_probe.py ;;
    enginetests) section enginetests ${ENGINETESTS_LIMIT:-560} python3 -m pytest tests/worker/test_rollout_static.py tests/worker/test_fused_projections.py tests/worker/test_precompiled.py tests/worker/test_static_refill.py tests/worker/test_static_stream.py tests/worker/test_cache_residency.py -v -p no:cacheprovider -rs ;;
    rollouttests) section rollouttests 300 python3 -m pytest tests/worker/test_rollout_static.py -v -p no:cacheprovider -rs ;;
    sft) section sft 560 bash bench/sft_gpu.sh ${SFT_JOBS:-} ;;
    gputests) section gputests ${GPUTESTS_LIMIT:-420} python3 -m pytest -m gpu tests -v -p no:cacheprovider -rs ;;
    ppo) section ppo 300 bash -c "for c in gpu_digit_sum gpu_digit_sum_ppo; do python3 -m rljob_cli.main run bench/\$c.yaml --workdir /tmp/\$c --fresh | grep -E 'step (1|100|300|500|700)/|rror|Traceback|finished'; python3 bench/summarize_grpo.py /tmp/\$c/work/metrics.jsonl \$c; done" ;;
    ppo2) section ppo2 480 bash -c "for c in gpu_digit_sum_ppo_split gpu_digit_sum_ppo_shared2; do python3 -m rljob_cli.main run bench/\$c.yaml --workdir /tmp/\$c --fresh | grep -E 'step (1|100|300|500|700)/|rror|Traceback|finished'; python3 bench/summarize_grpo.py /tmp/\$c/work/metrics.jsonl \$c; done" ;;
    ppo2turns) section ppo2turns ${PPO2TURNS_LIMIT:-540} bash -c "for c in gpu_digit_sum_ppo_turns gpu_digit_sum_ppo_split; do bash bench/gpu_mem_peak.sh \$c python3 -m rljob_cli.main run bench/\$c.yaml --workdir /tmp/\$c --fresh --steps ${PPO2TURNS_STEPS:-300} | grep -E 'step (1|100|200|300)/|rror|Traceback|finished|RESULT'; python3 bench/summarize_grpo.py /tmp/\$c/work/metrics.jsonl \$c; done" ;;
    grpopp2) section grpopp2 150 bash -c "python3 -m rljob_cli.main run bench/gpu_digit_sum_pp2.yaml --workdir /tmp/pp2 --fresh | grep -E 'step (1|100|300|500|700)/|rror|Traceback|finished' ; python3 bench/summarize_grpo.py /tmp/pp2/work/metrics.jsonl grpo-digit-sum-pp2" ;;
    grpocompiled) section grpocompiled 330 python3 bench/grpo_step.py --variants rljob-static:32,rljob-compiled:32 --timeout-each 160 --tag _compiled ;;
    grpotp2pp2) section grpotp2pp2 130 bash -c "python3 -m rljob_cli.main run bench/gpu_digit_sum_tp2pp2.yaml --workdir /tmp/tp2pp2 --fresh | grep -E 'step (1|100|300|500|700)/|rror|Traceback|finished' ; python3 bench/summarize_grpo.py /tmp/tp2pp2/work/metrics.jsonl grpo-digit-sum-tp2pp2" ;;
    lossmbs1|lossmbs4) m=${s#lossmbs}; section $s ${LOSSMBS_LIMIT:-540} bash -c "python3 -m rljob_cli.main run bench/gpu_digit_sum_mbs$m.yaml --workdir /tmp/mbs$m --fresh | grep -E 'step (1|100|200|300)/|rror|Traceback|finished' ; python3 bench/summarize_grpo.py /tmp/mbs$m/work/metrics.jsonl grpo-digit-sum-mbs$m" ;;
    gpu4tests) section gpu4tests ${GPU4_LIMIT:-300} python3 -m pytest tests/worker/test_megatron_gpu.py -k "${GPU4_K:-four_gpu}" -v -p no:cacheprovider -rs ;;
    vllmtests) section vllmtests ${VLLMTESTS_LIMIT:-240} bash -c "for f in tests/worker/test_vllm_gpu_fp32.py tests/worker/test_vllm_gpu.py tests/worker/test_vllm_gpu_moe.py tests/worker/test_vllm_gpu_graphs.py; do python3 -m pytest \$f -v -s -p no:cacheprovider -rs; done; python3 -m pytest tests/worker/test_vllm_engine.py -m vllm -v -p no:cacheprovider -rs" ;;
    grpovllmval) section grpovllmval ${GRPOVLLMVAL_LIMIT:-150} bash -c "python3 -m rljob_cli.main run bench/gpu_digit_sum_vllm_val.yaml --workdir /tmp/vllmval --fresh 2>&1 | grep -E 'step (1|100|200|300)/|validation|rollout engine|rror|Traceback|finished' ; python3 bench/summarize_grpo.py /tmp/vllmval/work/metrics.jsonl grpo-digit-sum-vllm-val" ;;
    grpovllm1) section grpovllm1 180 bash -c "python3 -m rljob_cli.main run bench/gpu_digit_sum_vllm.yaml --workdir /tmp/vllm1 --fresh | grep -E 'step (1|100|300|500|700)/|rollout engine|rror|Traceback|finished' ; python3 bench/summarize_grpo.py /tmp/vllm1/work/metrics.jsonl grpo-digit-sum-vllm" ;;
    vllmtp2tests) section vllmtp2tests 260 python3 -m pytest tests/worker/test_vllm_gpu_tp2.py -v -p no:cacheprovider -rs ;;
    grpovllmtp2) section grpovllmtp2 ${VLLMTP2_LIMIT:-570} bash bench/vllm_tp2_run.sh ;;
    grpovllm) section grpovllm ${GRPOVLLM_LIMIT:-240} python3 bench/grpo_step.py --variants ${GRPOVLLM_VARIANTS:-rljob-static:32,rljob-vllm:32} --timeout-each 150 --tag _vllm ;;
    grpo15vllm) section grpo15vllm 330 python3 bench/grpo_step.py --model 1.5b --variants rljob-static:16,rljob-vllm:16 --timeout-each 160 --tag _1.5b_vllm ;;
    rolloutvllm) section rolloutvllm ${ROLLOUTVLLM_LIMIT:-200} python3 bench/rollout.py --vllm ${ROLLOUT_ARGS:-} ;;
    rolloutscale) section rolloutscale ${ROLLOUTSCALE_LIMIT:-560} python3 bench/rollout_scale.py --models ${ROLLOUTSCALE_MODELS:-1.5b,7b} ;;
    q7bprep) section q7bprep 300 python3 bench/gpu_7b_prepare.py ;;
    lorads) section lorads ${LORADS_LIMIT:-420} bash -c "for c in gpu_digit_sum_lora gpu_digit_sum; do python3 -m rljob_cli.main run bench/\$c.yaml --workdir /tmp/\$c --fresh | grep -E 'step (1|100|300|500|700)/|rror|Traceback|finished|committed'; python3 bench/summarize_grpo.py /tmp/\$c/work/metrics.jsonl \$c; done" ;;
    lora15) section lora15prep 120 python3 bench/gpu_1_5b_char_prepare.py
      section lora15 ${LORA15_LIMIT:-440} bash -c "for k in lora full; do python3 -m rljob_cli.main run bench/gpu_digit_sum_1_5b_\$k.yaml --workdir /tmp/ds15-\$k --fresh | grep -E 'step (1|50|100|150|200)/|rror|Traceback|finished|committed'; done; python3 bench/lora_vs_full.py /tmp/ds15-lora /tmp/ds15-full /tmp/ckpt-1-5b-lora /tmp/ckpt-1-5b-full --shape 'Qwen2.5-1.5B shape over the 16-symbol char vocabulary (random init, 1.31B parameters; bench/gpu_1_5b_char_prepare.py), digit-sum, 16 prompts x 8, T 1, bf16, 1 GPU, static engine uncompiled; LoRA rank 32 alpha 32 lr 5e-4 vs full fine-tuning lr 5e-5' --command 'bash bench/gpu_all.sh lora15'" ;;
    judge) section judgeprep 120 python3 bench/gpu_1_5b_char_prepare.py
      section judge ${JUDGE_LIMIT:-480} python3 bench/gpu_judge_overlap.py --judge /tmp/char1.5b --steps 6 --max-tokens 16 ;;
    vllmlora) section vllmloraprep 120 python3 bench/gpu_1_5b_char_prepare.py
      section vllmloramerged ${VLLMLORA_LIMIT:-240} python3 bench/vllm_lora_path.py --mode merged
      section vllmloraadapter ${VLLMLORA_LIMIT:-240} python3 bench/vllm_lora_path.py --mode adapter
      section vllmloracompare 30 python3 bench/vllm_lora_path.py --compare ;;
    q7blora) section q7blora ${Q7BLORA_LIMIT:-560} bash -c "python3 -m rljob_cli.main run bench/gpu_7b_lora.yaml --workdir /tmp/q7b-lora --fresh | grep --line-buffered -E 'step [0-9]+/|rror|Traceback|done:|committed|exported'; python3 bench/grpo_scale_report.py --gpus 1 --shape 'Qwen2.5-7B shape, random init, bf16, LoRA rank 32, 8 prompts x 8 samples of 1024 + 1024 tokens, reference + old-policy passes' lora-r32=/tmp/q7b-lora/work/metrics.jsonl --command 'bash bench/gpu_all.sh q7bprep q7blora'; du -sh /tmp/q7b-lora-ckpt/*/*/hf; python3 bench/lora_push.py" ;;
    q7bevery) section q7bevery ${Q7B_LIMIT:-300} env Q7B_PROMPTS=${Q7B_PROMPTS:-16} bash bench/q7b_run.sh tp2dp2 every-rank ;;
    q7brank0) section q7brank0 ${Q7B_LIMIT:-300} env Q7B_PROMPTS=${Q7B_PROMPTS:-16} bash bench/q7b_run.sh tp2dp2 rank0 ;;
    q7bpp2) section q7bpp2 ${Q7B_LIMIT:-420} bash bench/q7b_run.sh tp2pp2 every-rank ;;
    q7breport) section q7breport 60 python3 bench/grpo_scale_report.py --gpus 4 \
      tp2dp2-every-rank=/tmp/q7b-tp2dp2-every-rank/work/metrics.jsonl tp2dp2-rank0=/tmp/q7b-tp2dp2-rank0/work/metrics.jsonl ;;
    tool) section tool ${TOOL_LIMIT:-420} bash -c "for c in gpu_secret_tool gpu_secret_single; do python3 -m rljob_cli.main run bench/\$c.yaml --workdir /tmp/\$c --fresh | grep -E 'step (1|50|100)/|rror|Traceback|finished'; python3 bench/summarize_grpo.py /tmp/\$c/work/metrics.jsonl \$c; done; python3 bench/agent_overhead.py /tmp/gpu_secret_tool/work/metrics.jsonl /tmp/gpu_secret_single/work/metrics.jsonl; python3 -m pytest tests/worker/test_rollout_static.py -m gpu -k stop_token -v -p no:cacheprovider -rs" ;;
    toolvllm) section toolvllm ${TOOLVLLM_LIMIT:-480} bash -c "for c in gpu_secret_tool_vllm gpu_secret_single_vllm; do python3 -m rljob_cli.main run bench/\$c.yaml --workdir /tmp/\$c --fresh | grep -E 'step (1|50|100)/|rollout engine|rror|Traceback|finished'; python3 bench/summarize_grpo.py /tmp/\$c/work/metrics.jsonl \$c; done; python3 bench/agent_overhead.py /tmp/gpu_secret_tool_vllm/work/metrics.jsonl /tmp/gpu_secret_single_vllm/work/metrics.jsonl 'vLLM 0.26'" ;;
    tool15) section tool15prep 120 python3 bench/gpu_1_5b_char_prepare.py --tools --output-scale 0.02 --out /tmp/tools1.5b
      section tool15 ${TOOL15_LIMIT:-480} bash -c "for v in stream:gpu_secret_tool_15b:1 batched:gpu_secret_tool_15b:0 single:gpu_secret_single_15b:1; do IFS=: read tag c s <<< \$v; RLJOB_AGENT_STREAM=\$s python3 -m rljob_cli.main run bench/\$c.yaml --workdir /tmp/tool15_\$tag --fresh | grep -E 'step (1|10|30)/|rror|Traceback|finished'; python3 bench/summarize_grpo.py /tmp/tool15_\$tag/work/metrics.jsonl tool15-\$tag; done; python3 bench/agent_overhead.py /tmp/tool15_stream/work/metrics.jsonl /tmp/tool15_single/work/metrics.jsonl 'hf static engine (CUDA graphs, compile off), 1.5B shape bf16, agent turns streamed (continuous rows)'; python3 bench/agent_overhead.py /tmp/tool15_batched/work/metrics.jsonl /tmp/tool15_single/work/metrics.jsonl 'hf static engine (CUDA graphs, compile off), 1.5B shape bf16, agent turns batched (RLJOB_AGENT_STREAM=0)'" ;;
    agentprofile) [ -d /tmp/tools1.5b ] || section tool15prep 120 python3 bench/gpu_1_5b_char_prepare.py --tools --output-scale 0.02 --out /tmp/tools1.5b
      section agentprofile ${AGENTPROFILE_LIMIT:-300} python3 bench/agent_stream_profile.py --model /tmp/tools1.5b ;;
    longtail) section longtail ${LONGTAIL_LIMIT:-420} python3 bench/long_tail_rollout.py ${LONGTAIL_ARGS:-} ;;
    longtailjob) [ -d /tmp/vocab1.5b ] || section longtailprep 120 python3 bench/gpu_1_5b_char_prepare.py --vocab-size 151936 --out /tmp/vocab1.5b
      section longtailjob ${LONGTAILJOB_LIMIT:-560} bash -c "export RLJOB_SYNTHETIC_LENGTHS=${LONGTAIL_LAW:-lognormal:300:1.0}; for v in sync sep; do python3 -m rljob_cli.main run bench/gpu_longtail_\$v.yaml --workdir /tmp/longtail_\$v --fresh --steps ${LONGTAIL_STEPS:-12} | grep -E 'step [0-9]+/|rollout engine|rror|Traceback|finished'; done; python3 bench/long_tail_job.py /tmp/longtail_sync/work/metrics.jsonl /tmp/longtail_sep/work/metrics.jsonl --responses 128 --gpus 2 --shape 'Qwen2.5-1.5B shape over the char vocabulary, random init, bf16, GRPO 16 prompts x 8, lengths LogNormal(300, 1) capped 4096 (RLJOB_SYNTHETIC_LENGTHS), static engine uncompiled; sync: DP2 colocated; separate: 1 trainer + 1 rollout GPU, async maxStaleness 4, partial'" ;;
    longtail1) [ -d /tmp/vocab1.5b ] || section longtailprep 120 python3 bench/gpu_1_5b_char_prepare.py --vocab-size 151936 --out /tmp/vocab1.5b
      section longtail1 ${LONGTAIL1_LIMIT:-300} bash -c "rm -rf /tmp/longtail1; sed -e 's/gpusPerNode: 2/gpusPerNode: 1/' -e 's/gpu-longtail-sync/gpu-longtail-sync1/' bench/gpu_longtail_sync.yaml > /tmp/longtail1.yaml; RLJOB_SYNTHETIC_LENGTHS=${LONGTAIL_LAW:-lognormal:300:1.0} python3 -m rljob_cli.main run /tmp/longtail1.yaml --workdir /tmp/longtail1 --fresh --steps ${LONGTAIL_STEPS:-4} | grep -E 'step [0-9]+/|rror|Traceback|finished'; python3 bench/summarize_grpo.py /tmp/longtail1/work/metrics.jsonl longtail1; cp /tmp/longtail1/work/metrics.jsonl \$OUT/longtail1_metrics.jsonl" ;;
    refilltests) section refilltests 300 python3 -m pytest tests/worker/test_static_refill.py -v -p no:cacheprovider -rs ;;
    streamtests) section streamtests 300 python3 -m pytest tests/worker/test_static_stream.py -v -p no:cacheprovider -rs ;;
    warmstart) section warmstart ${WARMSTART_LIMIT:-540} python3 bench/warm_start.py ${WARMSTART_PODS:+--pods $WARMSTART_PODS} ${WARMSTART_ARGS:-} ;;
    offload15) section offload15 ${OFFLOAD_LIMIT:-240} python3 bench/offload.py --model 1.5b ;;
    offload15reg) section offload15reg ${OFFLOAD_LIMIT:-240} env PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8 python3 bench/offload.py --model 1.5b --tag _hostregister ;;
    offloadrun) section offloadprep 120 python3 bench/gpu_1_5b_char_prepare.py
      section offloadrun ${OFFLOADRUN_LIMIT:-400} bash bench/offload_run.sh ;;
    offload15d) section offload15d ${OFFLOAD_LIMIT:-240} python3 bench/offload.py --model 1.5b --distributed-optimizer --tag _distopt ;;
    weightpush) section weightpush ${WEIGHTPUSH_LIMIT:-420} bash -c "for m in ${WEIGHTPUSH_MODELS:-1.5b 7b}; do python3 -m torch.distributed.run --nproc_per_node 2 bench/weight_push.py --model \$m; done" ;;
    staleness) section staleness ${STALENESS_LIMIT:-560} bash -c "for v in sync sync2 async1 async2; do python3 -m rljob_cli.main run bench/gpu_digit_sum_sep_\$v.yaml --workdir /tmp/sep_\$v --fresh --steps ${STALENESS_STEPS:-300} | grep -E 'step (1|100|200|300|400)/|rror|Traceback|finished'; python3 bench/summarize_grpo.py /tmp/sep_\$v/work/metrics.jsonl sep-\$v; done; python3 bench/staleness_curves.py sync=/tmp/sep_sync/work/metrics.jsonl sync2=/tmp/sep_sync2/work/metrics.jsonl async1=/tmp/sep_async1/work/metrics.jsonl async2=/tmp/sep_async2/work/metrics.jsonl" ;;
    ppo2vllm) section ppo2vllm ${PPO2VLLM_LIMIT:-300} bash -c "c=gpu_digit_sum_ppo_split_vllm; python3 -m rljob_cli.main run bench/\$c.yaml --workdir /tmp/\$c --fresh --steps ${PPO2VLLM_STEPS:-300} | grep -E 'step (1|100|200|300)/|rollout engine|rror|Traceback|finished'; python3 bench/summarize_grpo.py /tmp/\$c/work/metrics.jsonl \$c" ;;
    moereplay) section moereplay ${MOEREPLAY_LIMIT:-480} python3 bench/moe_routing_replay.py ${MOEREPLAY_ARGS:-} ;;
    *) echo "unknown section $s" ;;
  esac
done
echo; echo "################ SUMMARY ($(nvidia-smi --query-gpu=name --format=csv,noheader))"
grep -h -E "^(## |\| |card |fp32 greedy|compile probe|probe sweep|vllm|RESULT|RATIO|[0-9]+ (passed|failed)|.*(passed|failed).* in )" "$LOG"
