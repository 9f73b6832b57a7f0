#!/usr/bin/env bash
# Session 17 hold 1 (started in the background by call 3, polled with poll17.sh): bench80 with the working tree and
# with HEAD (c95178e, /tmp/old/src), serving at one client with the working tree, the CUDA tests.
set -uo pipefail
export EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
W=/tmp/w; R=$W/res; mkdir -p $R; D=$PWD/src/eagle3/assets/smollm2-drafter
st() { echo "== $(date -u +%H:%M:%S) $*"; }
bench() {  # name pythonpath sha
  st "bench80 $1"
  PYTHONPATH=$2:/tmp/site EAGLE3_GIT_SHA=$3 timeout 420 python3 -m eagle3.cli bench --device cuda:0 --target smollm2 \
    --drafter $D --limit 80 --max-new-tokens 256 --methods plain,chain,tree --out $R/bench80_$1 > $R/bench80_$1.log 2>&1
  echo "rc=$?"; tail -n 6 $R/bench80_$1.log
}
bench new $PWD/src $SHA
bench old /tmp/old/src c95178e
st "serving c1 new"
PYTHONPATH=$PWD/src:/tmp/site EAGLE3_GIT_SHA=$SHA timeout 240 python3 scripts/bench_serving.py --target smollm2 \
  --drafter $D --device cuda:0 --concurrency 1 --max-tokens 128 --rounds 12 --fast-rows on --out $R/serve1_new \
  > $R/serve1_new.log 2>&1
echo "rc=$?"; grep -E "^(plain|spec) c=|^ +[0-9]+ \|" $R/serve1_new.log | cut -c1-240
st "CUDA tests"
PYTHONPATH=$PWD/src:/tmp/site timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_fast.py tests/test_rows.py \
  -k "cuda or graph" > $R/gpu_tests.log 2>&1; echo "rc=$?"; tail -n 3 $R/gpu_tests.log
st "done"
