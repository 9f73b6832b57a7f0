#!/usr/bin/env bash
# Session 16, hold 3: the final code (stacked heads, ranked top-k in compiled drafting): bench80 and the CUDA tests.
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLE3_GIT_SHA=${SHA:-unknown}
R=$OUT/res; mkdir -p $R; D=src/eagle3/assets/smollm2-drafter
st() { echo "== $(date -u +%H:%M:%S) $*"; }
st "bench80 final"
timeout 300 python3 -m eagle3.cli bench --device cuda:0 --target smollm2 --drafter $D --limit 80 --max-new-tokens 256 \
  --methods plain,chain,tree --out $R/bench80_final > $R/bench80_final.log 2>&1; echo "rc=$?"; tail -n 7 $R/bench80_final.log
st "CUDA tests"
timeout 200 python3 -m pytest -q -x tests/test_fast.py tests/test_rows.py -k "cuda or graph" > $R/gpu_tests.log 2>&1; echo "rc=$?"
tail -n 3 $R/gpu_tests.log
st "done"
cd $OUT && tar czf res.tgz res && rm -rf res
