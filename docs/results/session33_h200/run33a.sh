#!/usr/bin/env bash
# Session 33, call A (random weights, no GGUF): the RoPE/KV-write kernel and the draft top-k kernels on the GPU.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLE3_GIT_SHA=${SHA:-unknown}
T0=$(date +%s); R=/tmp/r/a; mkdir -p $R/profile
st() { echo "== $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*" | tee -a $R/steps.log; tar czf $OUT/res.tgz -C /tmp/r a; }
prof() {  # prof NAME SHAPE [profile_step flags]
  local n=$1 shape=$2; shift 2
  timeout 120 python3 scripts/profile_step.py --device cuda:0 --shape $shape --reps 20 "$@" --out $R/profile/$n \
    > $R/profile/$n.log 2>&1
  st "prof $n rc=$?: $(grep -E '^(plain step|tree cycle 6|piece draft|piece verify)|cycle =|GB/s|pieces in' $R/profile/$n.log | cut -c1-90 | tr '\n' '|')"
}
st "start $(nvidia-smi --query-gpu=name,memory.used --format=csv,noheader 2>/dev/null)"
timeout 150 python3 -m pytest -q -m gpu tests/test_rope_cache.py tests/test_draft_top_k.py tests/test_split_attention.py -p no:cacheprovider > $R/tests_kernels.log 2>&1
st "kernel tests rc=$?: $(tail -3 $R/tests_kernels.log | tr '\n' '|')"
prof s_new smollm2-135m --pieces
prof s_rope_torch smollm2-135m --target-rope torch
prof s_topk_torch smollm2-135m --draft-top-k torch
prof s_old smollm2-135m --target-rope torch --draft-top-k torch
prof s_norm smollm2-135m --target-norm triton
prof b_new llama8b
prof b_rope_torch llama8b --target-rope torch
prof b_norm llama8b --target-norm triton
timeout $(( 555 - ($(date +%s) - T0) )) python3 -m pytest -q -m gpu tests/test_fast.py tests/test_rows.py \
  -p no:cacheprovider > $R/tests_fast.log 2>&1
st "fast tests rc=$?: $(tail -3 $R/tests_fast.log | tr '\n' '|')"
st done
