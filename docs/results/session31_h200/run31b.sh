#!/usr/bin/env bash
# Session 31, second machine (the first was released between polls): the residual adds in place in the products'
# epilogues (h.addmm_), profiled against separate adds in one code; the 80-prompt bench; the batched generator's
# attention spans; all seven methods on 10 prompts.
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  EAGLE3_GIT_SHA=${SHA:-unknown}
T0=${T0:-$(date +%s)}
W=${W:-/tmp/w}; R=$W/res; mkdir -p $R/profile $R/bench
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
bench() {  # bench NAME LIMIT METHODS [eagle3 bench flags]
  local n=$1 lim=$2 methods=$3; shift 3
  timeout ${BT:-480} python3 -m eagle3.cli bench --device $DEV --target smollm2 \
    --drafter $V8 --limit $lim --max-new-tokens 256 --methods $methods --chain 5 "$@" --out $R/bench/$n \
    > $R/bench/$n.log 2>&1
  st "bench $n rc=$?: $(grep -E '^\([a-g]\) ' $R/bench/$n.log | tr -s ' ' | cut -c1-100 | tr '\n' '|')"
}
st "start $(nvidia-smi --query-gpu=name,memory.used --format=csv,noheader 2>/dev/null)"
prof ip_gemm smollm2-135m
prof ip_sep smollm2-135m --residual-add separate
BT=300 bench new 80 plain,chain,tree --tree 6,10,60 8,10,100
timeout 240 python3 scripts/bench_batched.py --target smollm2 --device $DEV --rows 512 --dataset gsm8k --repeat 16 \
  --max-prompt-tokens 1280 --max-new-tokens 384 --out $R/bb > $R/bb.log 2>&1
st "bench_batched rc=$?: $(tail -4 $R/bb.log | tr -s ' ' | cut -c1-120 | tr '\n' '|')"
BT=400 bench all10 10 all --tree 6,10,60 8,10,100
st "done"
