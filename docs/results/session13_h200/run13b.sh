#!/usr/bin/env bash
# Session 13, second hold: sampled and greedy serving with the reworked speed gate (decayed sums, 4-cycle probes).
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLE3_GIT_SHA=${SHA:-unknown}
R=/tmp/w/res; mkdir -p $R
D=src/eagle3/assets/smollm2-drafter
st() { echo "== $(date -u +%H:%M:%S) $*"; }
st "serving sampled T=0.8, gate v2"
timeout 420 python3 scripts/bench_serving.py --target smollm2 --drafter $D --device cuda:0 --concurrency 1 4 16 64 \
  --max-tokens 128 --rounds 3 --temperature 0.8 --fast-rows on --out $R/serve_t08_gate2 > $R/serve_t08_gate2.log 2>&1; echo "rc=$?"; grep -E "^ +[0-9]+ \||geometric" $R/serve_t08_gate2.log
st "serving greedy, gate v2"
timeout 420 python3 scripts/bench_serving.py --target smollm2 --drafter $D --device cuda:0 --concurrency 1 4 16 64 \
  --max-tokens 128 --rounds 3 --fast-rows on --out $R/serve_greedy_gate2 > $R/serve_greedy_gate2.log 2>&1; echo "rc=$?"; grep -E "^ +[0-9]+ \||geometric" $R/serve_greedy_gate2.log
st "done"
