#!/usr/bin/env bash
# Session 30, hold 1 (one H200), #4: the three changes landed untimed in session 29 (three-stage ranked top-k,
# automatic dynamic shapes for the compiled pointwise pieces, the drafter's matmul attention as an option),
# against e9675f4 (the commit before them, in .old/). Profiles (random weights at SmolLM2's shape, with the
# cycle's pieces) in the order old, new, new+matmul, old; then the 80-prompt bench with the defaults and with
# --drafter-attention matmul; then the 8B shape.
#   SHA=... bash run30.sh    (from a copy of the repo, with .old/ = git archive e9675f4 src/eagle3 scripts)
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  EAGLE3_GIT_SHA=${SHA:-unknown}
T0=${T0:-$(date +%s)}
W=${W:-/tmp/w}; R=$W/res; mkdir -p $R/profile $R/bench
V8=$PWD/src/eagle3/assets/smollm2-drafter
DEV=${DEV:-cuda:0}
st() { echo "== $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*"; }
prof() {  # prof NAME CODE_ROOT SHAPE [profile_step flags]
  local n=$1 code=$2 shape=$3; shift 3
  local o=$R/profile/$n; [ -e $o.log ] && o=${o}_again
  PYTHONPATH=$code/src:/tmp/site timeout 240 python3 $code/scripts/profile_step.py --device $DEV --shape $shape \
    --reps ${REPS:-20} "$@" --out $o > $o.log 2>&1
  st "prof $(basename $o) rc=$?: $(grep -E '^(plain step|tree cycle 6)|cycle =|pieces in' $o.log | cut -c1-80 | tr '\n' '|')"
}
bench() {  # bench NAME [eagle3 bench flags]
  local n=$1; shift
  timeout 420 python3 -m eagle3.cli bench --device $DEV --target smollm2 --drafter $V8 --limit ${BLIM:-80} \
    --max-new-tokens 256 --methods plain,chain,tree --chain 5 --tree 6,10,60 8,10,100 "$@" --out $R/bench/$n \
    > $R/bench/$n.log 2>&1
  st "bench $n rc=$?: $(grep -E '^\([dfg]\) ' $R/bench/$n.log | tr -s ' ' | cut -c1-90 | tr '\n' '|')"
}
st "start $(nvidia-smi --query-gpu=name,memory.used --format=csv,noheader 2>/dev/null)"
prof old .old smollm2-135m --pieces
prof new . smollm2-135m --pieces
prof mm . smollm2-135m --pieces --drafter-attention matmul
prof old .old smollm2-135m
bench default
bench matmul --drafter-attention matmul
prof p8b_new . llama8b
prof p8b_mm . llama8b --drafter-attention matmul
st "done"
