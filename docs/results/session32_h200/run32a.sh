#!/usr/bin/env bash
# Session 32, call A (random weights, no GGUF): the split-KV Triton attention on the GPU. Its tests, profiles of
# the SmolLM2 and Llama-3.1-8B shapes with it (the new default) and with cuDNN's SDPA, the kernel alone against
# SDPA, then the fast path's GPU tests. Writes everything under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLE3_GIT_SHA=${SHA:-unknown}
T0=$(date +%s); R=$OUT; mkdir -p $R/profile
st() { echo "== $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*"; }
prof() {  # prof NAME SHAPE [profile_step flags]
  local n=$1 shape=$2; shift 2
  timeout 150 python3 scripts/profile_step.py --device cuda:0 --shape $shape --reps 20 "$@" --out $R/profile/$n \
    > $R/profile/$n.log 2>&1
  st "prof $n rc=$?: $(grep -E '^(plain step|tree cycle 6)|cycle =|GB/s' $R/profile/$n.log | cut -c1-80 | tr '\n' '|')"
}
st "start $(nvidia-smi --query-gpu=name,memory.used --format=csv,noheader 2>/dev/null)"
timeout 150 python3 -m pytest -q -m gpu tests/test_split_attention.py -p no:cacheprovider > $R/tests_split.log 2>&1
st "split tests rc=$?: $(tail -3 $R/tests_split.log | tr '\n' '|')"
prof s_split smollm2-135m
prof s_sdpa smollm2-135m --target-attention sdpa
prof b_split llama8b
prof b_sdpa llama8b --target-attention sdpa
timeout 100 python3 scripts/bench_split_attention.py --out $R/micro > $R/micro.log 2>&1
st "micro rc=$?"
timeout $(( 560 - ($(date +%s) - T0) )) python3 -m pytest -q -m gpu tests/test_fast.py tests/test_rows.py \
  -p no:cacheprovider > $R/tests_fast.log 2>&1
st "fast tests rc=$?: $(tail -3 $R/tests_fast.log | tr '\n' '|')"
st done
