#!/usr/bin/env bash
# Session 13, one hold: GPU tests (fused sampling inside captured graphs, fused pointwise), the rows engine with
# fused vs eager sampled draws, sampled and greedy serving with the new gate, then --fuse-pointwise A/B.
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLE3_GIT_SHA=${SHA:-unknown}
R=/tmp/w/res; mkdir -p $R
D=src/eagle3/assets/smollm2-drafter
st() { echo "== $(date -u +%H:%M:%S) $*"; }
st "gpu tests"
timeout 400 python3 -m pytest -q -m gpu tests/test_fast.py tests/test_rows.py -p no:cacheprovider > $R/gpu_tests.log 2>&1; echo "rc=$?"; tail -n 3 $R/gpu_tests.log
st "bench_rows T=0.8 fused"
timeout 300 python3 scripts/bench_rows.py --target smollm2 --drafter $D --device cuda:0 --batch 1 4 16 64 --budgets 512 \
  --cycles 64 --temperature 0.8 --out $R/rows_t08_fused > $R/rows_t08_fused.log 2>&1; echo "rc=$?"; grep -E "^(no|budget)" $R/rows_t08_fused.log
st "bench_rows T=0.8 eager sampling"
timeout 300 python3 scripts/bench_rows.py --target smollm2 --drafter $D --device cuda:0 --batch 1 4 16 64 --budgets 512 \
  --cycles 64 --temperature 0.8 --eager-sampling --out $R/rows_t08_eager > $R/rows_t08_eager.log 2>&1; echo "rc=$?"; grep -E "^(no|budget)" $R/rows_t08_eager.log
st "serving sampled T=0.8"
timeout 420 python3 scripts/bench_serving.py --target smollm2 --drafter $D --device cuda:0 --concurrency 1 4 16 64 \
  --max-tokens 128 --rounds 3 --temperature 0.8 --fast-rows on --out $R/serve_t08 > $R/serve_t08.log 2>&1; echo "rc=$?"; grep -E "^ +[0-9]+ \||geometric" $R/serve_t08.log
st "serving greedy"
timeout 420 python3 scripts/bench_serving.py --target smollm2 --drafter $D --device cuda:0 --concurrency 1 4 16 64 \
  --max-tokens 128 --rounds 3 --fast-rows on --out $R/serve_greedy > $R/serve_greedy.log 2>&1; echo "rc=$?"; grep -E "^ +[0-9]+ \||geometric" $R/serve_greedy.log
st "bench 80 eager pointwise"
timeout 420 python3 -m eagle3.cli bench --device cuda:0 --target smollm2 --drafter $D --limit 80 --max-new-tokens 256 \
  --methods plain,chain,tree --out $R/bench80 > $R/bench80.log 2>&1; echo "rc=$?"; tail -n 12 $R/bench80.log | cut -c1-200
st "bench 80 fused pointwise"
timeout 420 python3 -m eagle3.cli bench --device cuda:0 --target smollm2 --drafter $D --limit 80 --max-new-tokens 256 \
  --methods plain,chain,tree --fuse-pointwise --out $R/bench80_fused > $R/bench80_fused.log 2>&1; echo "rc=$?"; tail -n 12 $R/bench80_fused.log | cut -c1-200
st "overhead eager / fused"
timeout 300 python3 -m eagle3.cli bench --overhead --device cuda:0 --out $R/overhead > $R/overhead.log 2>&1; echo "rc=$?"; tail -n 25 $R/overhead.log | cut -c1-200
timeout 300 python3 -m eagle3.cli bench --overhead --device cuda:0 --fuse-pointwise --out $R/overhead_fused > $R/overhead_fused.log 2>&1; echo "rc=$?"; tail -n 25 $R/overhead_fused.log | cut -c1-200
st "done"
