#!/usr/bin/env bash
# Session 34, call A (random weights, no GGUF): split attention bounded by the forward's slots and without its
# per-block branch, the greedy ids by two Triton kernels; every kernel of each profile recorded.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLE3_GIT_SHA=${SHA:-unknown}
T0=$(date +%s); R=/tmp/r/a; mkdir -p $R/profile
st() { echo "== $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*" | tee -a $R/steps.log; tar czf $OUT/res.tgz -C /tmp/r a; }
prof() {  # prof NAME SRC SHAPE [profile_step flags]
  local n=$1 src=$2 shape=$3; shift 3
  PYTHONPATH=$src timeout 120 python3 scripts/profile_step.py --device cuda:0 --shape $shape --reps 20 --all-kernels \
    "$@" --out $R/profile/$n > $R/profile/$n.log 2>&1
  st "prof $n rc=$?: $(grep -E '^(plain step|tree cycle 6|piece draft|piece verify)|cycle =|GB/s|pieces in' $R/profile/$n.log | cut -c1-90 | tr '\n' '|')"
}
NEW=$PWD/src OLD=$PWD/.stage0/old/src
st "start $(nvidia-smi --query-gpu=name,memory.used --format=csv,noheader 2>/dev/null)"
PYTHONPATH=$NEW timeout 150 python3 -m pytest -q -m gpu tests/test_split_attention.py tests/test_row_argmax.py \
  -p no:cacheprovider > $R/tests_kernels.log 2>&1
st "kernel tests rc=$?: $(tail -3 $R/tests_kernels.log | tr '\n' '|')"
prof s_new $NEW smollm2-135m --pieces
prof s_old $OLD smollm2-135m --split-blocks 2 --pieces
prof s_argmax_torch $NEW smollm2-135m --target-argmax torch
prof s_b4 $NEW smollm2-135m --split-blocks 4
prof b_new $NEW llama8b
prof b_old $OLD llama8b --split-blocks 2
prof b_b4 $NEW llama8b --split-blocks 4
prof s_b1 $NEW smollm2-135m --split-blocks 1
prof b_b8 $NEW llama8b --split-blocks 8
st done
