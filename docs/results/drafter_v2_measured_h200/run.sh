#!/usr/bin/env bash
# Session 10, hold 2: the new bundled drafter (recipe v2) measured everywhere, and the compiled fast lane.
set -u
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLE3_CACHE=/tmp/cache EAGLE3_GIT_SHA=${SHA:-unknown}
R=/tmp/res; mkdir -p $R; DR=src/eagle3/assets/smollm2-drafter
st() { echo "== $(date -u +%T) $*"; (cd $R && tar czf /tmp/res.tgz --exclude='*.safetensors' . 2>/dev/null); }
E="python3 -m eagle3.cli"
BE=($E bench --device cuda:0 --target smollm2 --drafter $DR --max-new-tokens 256)
st "bench 80 prompts, fast-path methods, eager"
timeout 300 "${BE[@]}" --limit 80 --methods plain,ngram,chain,tree --out $R/bench80 2>&1 | grep -v "it/s\]\|arn" | tail -n 9
st "bench 80 prompts, plain and tree, compiled"
timeout 300 "${BE[@]}" --limit 80 --methods plain,tree --compile --out $R/bench80c 2>&1 | grep -v "it/s\]\|arn" | tail -n 7
B=(python3 scripts/bench_serving.py --target smollm2 --drafter $DR --device cuda:0 --max-tokens 128)
run() { local name=$1 lim=$2; shift 2; st "serving $name"; timeout $lim "${B[@]}" "$@" --out $R/$name > $R/$name.log 2>&1; echo "rc=$?"; grep -E "^(plain|spec) |^ +[0-9]+ \||geometric" $R/$name.log | tail -14; }
run greedy_rows 200 --concurrency 1 4 16 64 --rounds 3 --temperature 0 --fast-rows on
run greedy_lane_compiled 400 --concurrency 1 --rounds 10 --temperature 0 --fast-rows on --compile
st "eval six datasets, 20 prompts, tree T=0 and T=1; chain 5 T=0"
EV=($E eval --target smollm2 --drafter $DR --device cuda:0 --fast --max-new-tokens 256 --limit 20 --datasets mt_bench humaneval gsm8k alpaca sum qa)
timeout 400 "${EV[@]}" --tree 6,10,60 --temperatures 0 1 --out $R/eval_six_tree > $R/eval_six_tree.log 2>&1 &
timeout 400 "${EV[@]}" --chain 5 --out $R/eval_six_chain > $R/eval_six_chain.log 2>&1 &
wait
grep -ah "tau" $R/eval_six_*.log | sed 's/.*\r//' | tr -s ' ' | cut -c1-120
st "done"
