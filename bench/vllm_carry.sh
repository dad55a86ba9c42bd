#!/usr/bin/env bash
# Carry vLLM 0.26.0 to a GPU machine that has torch 2.11 but no vLLM, in parts of <= 60 MiB, one part per
# back-to-back call (the machine keeps /tmp only while it stays warm), then run the vLLM GPU work.
#
# Here (a machine with pip and internet; once, ~15 minutes, most of it xz):
#   bash bench/vllm_carry.sh build          # wheels -> .vparts/p1..pN (git-ignored: add /.vparts/ to .git/info/exclude)
# On the GPU machine, one call per part, in order, without pauses (each call carries only its part):
#   call 1 (carry .vparts/p1):   bash bench/vllm_carry.sh stash
#   call 2 (carry .vparts/p2):   bash bench/vllm_carry.sh stash
#   call 3 (carry .vparts/p3, .whl/megatron_actor_gpu [, .whl/trl]):
#          bash bench/vllm_carry.sh install && bash bench/gpu_all.sh vllmtests grpovllm1 grpovllm rolloutvllm
# `install` joins the parts, checks every sha256, pip-installs the wheels into /tmp/site (bench/gpu_all.sh puts
# /tmp/site first on PYTHONPATH) and imports vllm. `status` lists which parts the machine holds; a fresh machine
# (the previous one was given back) holds none: start again at call 1.
#
# env: VLLM_CARRY_TOOLS (build: the folder with dl.sh, split.sh, reassemble.sh and the wheel list),
#      VLLM_LIST (build: default $VLLM_CARRY_TOOLS/vllm-0.26.0.lean.txt), VLLM_WHEELS (build: download folder)
set -euo pipefail
MODE=${1:-status}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PARTS_DIR="$ROOT/.vparts"

parts() { ls -d "$PARTS_DIR"/p* 2>/dev/null | sort -V; }

case "$MODE" in
  build)
    TOOLS=${VLLM_CARRY_TOOLS:-$ROOT/../shared/tools/vllm-carry}
    LIST=${VLLM_LIST:-$TOOLS/vllm-0.26.0.lean.txt}
    WHEELS=${VLLM_WHEELS:-$(mktemp -d)/wheels}
    [ -f "$TOOLS/split.sh" ] || { echo "vllm_carry.sh: no split.sh in $TOOLS (set VLLM_CARRY_TOOLS)" >&2; exit 2; }
    bash "$TOOLS/dl.sh" "$LIST" "$WHEELS"
    # Left out (checked optional for Qwen2-family models on Hopper): the FA2 kernels (FA3 is used), the vllm-rs
    # binary, the SM100 attention sources and deep_gemm builds for other Pythons.
    # 56 MiB parts: a call carries its part plus the working tree (~5 MiB) under the 64 MiB limit
    bash "$TOOLS/split.sh" --xz -s 56 \
      --drop 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' --drop 'vllm/vllm-rs' --drop 'vllm/third_party/fmha_sm100/*' \
      --drop 'vllm/third_party/deep_gemm/_C.cpython-310-*' --drop 'vllm/third_party/deep_gemm/_C.cpython-311-*' \
      --drop 'vllm/third_party/deep_gemm/_C.cpython-313-*' --drop 'vllm/third_party/deep_gemm/_C.cpython-314-*' \
      -o "$PARTS_DIR" "$WHEELS"
    grep -qx '/.vparts/' "$ROOT/.git/info/exclude" 2>/dev/null || echo "note: add /.vparts/ to .git/info/exclude"
    ;;
  stash)
    [ -n "$(parts)" ] || { echo "vllm_carry.sh: this call carried no .vparts/pK" >&2; exit 2; }
    for p in $(parts); do bash "$p/reassemble.sh" stash; done
    ;;
  install)
    [ -n "$(parts)" ] || { echo "vllm_carry.sh: this call carried no .vparts/pK" >&2; exit 2; }
    last=$(parts | tail -1)
    for p in $(parts); do [ "$p" = "$last" ] || bash "$p/reassemble.sh" stash; done
    t0=$SECONDS
    bash "$last/reassemble.sh" install
    PYTHONPATH=/tmp/site python3 -c "import vllm, torch; print(f'vllm {vllm.__version__} on torch {torch.__version__}')"
    echo "vllm_carry.sh: installed in $((SECONDS - t0)) s"
    ;;
  status)
    p=$(parts | tail -1)
    [ -n "$p" ] || { echo "vllm_carry.sh: no .vparts here (build them first)"; exit 2; }
    bash "$p/reassemble.sh" status
    ;;
  *) sed -n 2,20p "$0"; exit 2 ;;
esac
