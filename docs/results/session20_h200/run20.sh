#!/usr/bin/env bash
# Session 20, one H200 (in the background; poll20.sh waits for it): the v5 drafter (bundled since session 19) measured
# on a GPU for the first time. In order of priority: bench of all 80 MT-bench first turns (plain, chain 5, tree
# 6,10,60), `eagle3 eval` tree and chain 5, one-client serving, then the serving curve 1..64.
set -uo pipefail
export EAGLE3_GIT_SHA=${SHA:-unknown} EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD/src:/tmp/site
W=/tmp/w; R=$W/res; mkdir -p $R; D=$PWD/src/eagle3/assets/smollm2-drafter
E="python3 -m eagle3.cli"
st() { echo "== $(date -u +%H:%M:%S) $*"; }
st "bench80"
timeout 420 $E bench --device cuda:0 --target smollm2 --drafter $D --limit 80 --max-new-tokens 256 \
  --methods plain,chain,tree --chain 5 --out $R/bench80 > $R/bench80.log 2>&1
st "bench80 rc=$?"; grep -E "^\((d|f|g)\) " $R/bench80.log
for shape in "--tree 6,10,60" "--chain 5"; do
  name=$(echo $shape | tr -d ' -' | tr ',' '_')
  st "eval $name"
  timeout 240 $E eval --target smollm2 --drafter $D --device cuda:0 --fast --datasets mt_bench --max-new-tokens 256 \
    $shape --out $R/eval_$name > $R/eval_$name.log 2>&1
  st "eval rc=$?"; grep -E "tau" $R/eval_$name.log | head -3
done
st "serving c1"
timeout 240 python3 scripts/bench_serving.py --target smollm2 --drafter $D --device cuda:0 --concurrency 1 \
  --max-tokens 128 --rounds 12 --out $R/serve1 > $R/serve1.log 2>&1
st "serving c1 rc=$?"; grep -E "^ +[0-9]+ \|" $R/serve1.log | cut -c1-240
st "serving curve"
timeout 420 python3 scripts/bench_serving.py --target smollm2 --drafter $D --device cuda:0 \
  --concurrency 1 4 16 64 --max-tokens 128 --out $R/serve_curve > $R/serve_curve.log 2>&1
st "serving curve rc=$?"; grep -E "^ +[0-9]+ \|" $R/serve_curve.log | cut -c1-240
st "done"
