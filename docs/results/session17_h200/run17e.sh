#!/usr/bin/env bash
# Session 17 hold 2 (in the background, polled with poll17.sh): bench80 and one-client serving, the working tree (new)
# and c95178e (old, /tmp/old/src), alternating, on one machine.
set -uo pipefail
export EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
W=/tmp/w; R=$W/res; mkdir -p $R; D=$PWD/src/eagle3/assets/smollm2-drafter
st() { echo "== $(date -u +%H:%M:%S) $*"; }
bench() {  # name pythonpath sha
  st "bench80 $1"
  PYTHONPATH=$2:/tmp/site EAGLE3_GIT_SHA=$3 timeout 420 python3 -m eagle3.cli bench --device cuda:0 --target smollm2 \
    --drafter $D --limit 80 --max-new-tokens 256 --methods plain,chain,tree --out $R/bench80_$1 > $R/bench80_$1.log 2>&1
  echo "rc=$?"; grep -E "^\((d|f|g)\) .*  " $R/bench80_$1.log
}
serve() {
  st "serving c1 $1"
  PYTHONPATH=$2:/tmp/site EAGLE3_GIT_SHA=$3 timeout 240 python3 scripts/bench_serving.py --target smollm2 --drafter $D \
    --device cuda:0 --concurrency 1 --max-tokens 128 --rounds 12 --fast-rows on --out $R/serve1_$1 > $R/serve1_$1.log 2>&1
  echo "rc=$?"; grep -E "^ +[0-9]+ \|" $R/serve1_$1.log | cut -c1-240
}
bench new $PWD/src $SHA
bench old /tmp/old/src c95178e
serve old /tmp/old/src c95178e
serve new $PWD/src $SHA
st "done"
