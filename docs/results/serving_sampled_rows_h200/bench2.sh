#!/usr/bin/env bash
# Session 9, second run: sampled requests on the fast rows after the sort-free variant (T=0.8), with top-p 0.9
# (the filtered variant), and greedy requests (plain and speculative) on the same code as a regression check.
set -u
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLE3_GIT_SHA=${SHA:-unknown}
R=/tmp/res2; mkdir -p $R
B=(python3 scripts/bench_serving.py --target smollm2 --drafter src/eagle3/assets/smollm2-drafter --device cuda:0
   --concurrency 1 4 16 64 --max-tokens 128 --rounds 3)
run() { local name=$1 lim=$2; shift 2; echo "== $(date -u +%T) $name"; timeout $lim "${B[@]}" "$@" --out $R/$name > $R/$name.log 2>&1; echo "rc=$?"; grep -E "^(plain|spec) |^ +[0-9]+ \||geometric" $R/$name.log | tail -14; }
run sampled_rows 175 --temperature 0.8 --fast-rows on
run sampled_rows_topp 175 --temperature 0.8 --top-p 0.9 --fast-rows on
run greedy_rows 190 --temperature 0 --fast-rows on
cd $R && tar czf $OUT/res.tgz . ; ls -la $OUT
