#!/usr/bin/env bash
# Session 31, one H200. #4: the target's residual adds in the products' epilogues (98059af, CUDA default) against
# them as separate adds (profiles in one code with --residual-add, and the 80-prompt bench against ce50ea4 in
# .old/); the target attending by two batched products (--target-attention matmul, cost only); a tree-shape sweep;
# the attention spans of the batched generator (session 30, untimed); one run of all seven methods on 20 prompts.
#   SHA=... bash run31.sh    (from a copy of the repo, with .old/ = git archive ce50ea4 src/eagle3 scripts)
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  EAGLE3_GIT_SHA=${SHA:-unknown}
T0=${T0:-$(date +%s)}
W=${W:-/tmp/w}; R=$W/res; mkdir -p $R/profile $R/bench $R/tests
V8=$PWD/src/eagle3/assets/smollm2-drafter
DEV=${DEV:-cuda:0}
st() { echo "== $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*"; }
prof() {  # prof NAME SHAPE [profile_step flags]
  local n=$1 shape=$2; shift 2
  local o=$R/profile/$n
  timeout 200 python3 scripts/profile_step.py --device $DEV --shape $shape --reps ${REPS:-20} "$@" --out $o \
    > $o.log 2>&1
  st "prof $n rc=$?: $(grep -E '^(plain step|tree cycle 6)|cycle =|pieces in|GB/s' $o.log | cut -c1-70 | tr '\n' '|')"
}
bench() {  # bench NAME CODE_ROOT LIMIT METHODS [eagle3 bench flags]
  local n=$1 code=$2 lim=$3 methods=$4; shift 4
  PYTHONPATH=$code/src:/tmp/site timeout ${BT:-480} python3 -m eagle3.cli bench --device $DEV --target smollm2 \
    --drafter $V8 --limit $lim --max-new-tokens 256 --methods $methods --chain 5 "$@" --out $R/bench/$n \
    > $R/bench/$n.log 2>&1
  st "bench $n rc=$?: $(grep -E '^\([a-g]\) ' $R/bench/$n.log | tr -s ' ' | cut -c1-100 | tr '\n' '|')"
}
st "start $(nvidia-smi --query-gpu=name,memory.used --format=csv,noheader 2>/dev/null)"
timeout 180 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fast.py tests/test_rows.py \
  > $R/tests/gpu.log 2>&1
st "gpu tests rc=$?: $(tail -1 $R/tests/gpu.log)"
prof sep smollm2-135m --residual-add separate
prof gemm smollm2-135m --pieces
prof tmm smollm2-135m --target-attention matmul
prof p8b_sep llama8b --residual-add separate
prof p8b_gemm llama8b
prof p8b_tmm llama8b --target-attention matmul
BT=480 bench new . 80 plain,chain,tree --tree 6,10,60 8,10,100 8,8,80 7,10,80
timeout 300 python3 scripts/bench_batched.py --target smollm2 --device $DEV --rows 512 --dataset gsm8k --repeat 16 \
  --max-prompt-tokens 1280 --max-new-tokens 384 --out $R/bb > $R/bb.log 2>&1
st "bench_batched rc=$?: $(tail -4 $R/bb.log | tr -s ' ' | cut -c1-120 | tr '\n' '|')"
BT=560 bench all20 . 20 all --tree 6,10,60 8,10,100
BT=300 bench old .old 80 plain,chain,tree --tree 6,10,60 8,10,100
st "done"
