#!/usr/bin/env bash
# Session 14, hold 2: tree shapes with compiled drafting; fast rows with compiled drafting (engine and served).
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLE3_GIT_SHA=${SHA:-unknown}
R=/tmp/w/res; mkdir -p $R
D=src/eagle3/assets/smollm2-drafter
st() { echo "== $(date -u +%H:%M:%S) $*"; }
for T in 8,10,60 8,10,80 7,10,60 10,10,80; do
  st "bench20 tree $T"
  timeout 300 python3 -m eagle3.cli bench --device cuda:0 --target smollm2 --drafter $D --limit 20 --max-new-tokens 256 \
    --methods plain,tree --tree $T --out $R/tree_$T > $R/tree_$T.log 2>&1; echo "rc=$?"; grep -E "^\((d|g)\)" $R/tree_$T.log
done
st "bench_rows T=0.8 compiled / eager drafting"
timeout 300 python3 scripts/bench_rows.py --target smollm2 --drafter $D --device cuda:0 --temperature 0.8 --batch 1 4 16 64 \
  --budgets 512 --cycles 64 --out $R/rows_t08_cd > $R/rows_t08_cd.log 2>&1; echo "rc=$?"; grep -E "B=|speedup|x " $R/rows_t08_cd.log | tail -12
timeout 300 python3 scripts/bench_rows.py --target smollm2 --drafter $D --device cuda:0 --temperature 0.8 --batch 1 4 16 64 \
  --budgets 512 --cycles 64 --eager-drafting --out $R/rows_t08_eager > $R/rows_t08_eager.log 2>&1; echo "rc=$?"; grep -E "B=|speedup|x " $R/rows_t08_eager.log | tail -12
st "serving sampled T=0.8"
timeout 480 python3 scripts/bench_serving.py --target smollm2 --drafter $D --device cuda:0 --concurrency 1 4 16 64 \
  --max-tokens 128 --rounds 3 --temperature 0.8 --fast-rows on --out $R/serve_t08 > $R/serve_t08.log 2>&1; echo "rc=$?"; grep -E "^ +[0-9]+ \||geometric" $R/serve_t08.log
st "serving 64 clients x 10 rounds, greedy and T=0.8"
timeout 300 python3 scripts/bench_serving.py --target smollm2 --drafter $D --device cuda:0 --concurrency 64 \
  --max-tokens 128 --rounds 10 --fast-rows on --out $R/serve64_greedy > $R/serve64_greedy.log 2>&1; echo "rc=$?"; grep -E "^ +[0-9]+ \|" $R/serve64_greedy.log
timeout 300 python3 scripts/bench_serving.py --target smollm2 --drafter $D --device cuda:0 --concurrency 64 \
  --max-tokens 128 --rounds 10 --temperature 0.8 --fast-rows on --out $R/serve64_t08 > $R/serve64_t08.log 2>&1; echo "rc=$?"; grep -E "^ +[0-9]+ \|" $R/serve64_t08.log
st "gpu tests"
timeout 400 python3 -m pytest -q -m gpu tests/test_fast.py tests/test_rows.py -p no:cacheprovider > $R/gpu_tests.log 2>&1; echo "rc=$?"; tail -n 3 $R/gpu_tests.log
st "done"
