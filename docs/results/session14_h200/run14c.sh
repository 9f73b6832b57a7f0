#!/usr/bin/env bash
# Session 14, hold 3: 64 clients for 10 rounds (greedy and T=0.8), then the GPU tests.
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLE3_GIT_SHA=${SHA:-unknown}
R=/tmp/w/res; mkdir -p $R; D=src/eagle3/assets/smollm2-drafter
st() { echo "== $(date -u +%H:%M:%S) $*"; }
for T in 0 0.8; do
  st "serving 64 clients x 10 rounds, T=$T"
  timeout 300 python3 scripts/bench_serving.py --target smollm2 --drafter $D --device cuda:0 --concurrency 64 \
    --max-tokens 128 --rounds 10 --temperature $T --fast-rows on --out $R/serve64_t$T > $R/serve64_t$T.log 2>&1; echo "rc=$?"
  grep -E "^(plain|spec) c=|^ +[0-9]+ \|" $R/serve64_t$T.log | cut -c1-220
done
st "gpu tests"
timeout 300 python3 -m pytest -q -m gpu tests/test_fast.py tests/test_rows.py -p no:cacheprovider > $R/gpu_tests.log 2>&1; echo "rc=$?"; tail -n 2 $R/gpu_tests.log
st "done"
