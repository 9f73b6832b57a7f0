#!/usr/bin/env bash
# Session 11, hold 1: the fast rows' held drafter feed measured (engine and server), GPU tests, kernel profiles.
set -u
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLE3_CACHE=/tmp/cache EAGLE3_GIT_SHA=${SHA:-unknown}
R=/tmp/res; mkdir -p $R; DR=src/eagle3/assets/smollm2-drafter
st() { echo "== $(date -u +%T) $*"; (cd $R && tar czf /tmp/res.tgz --exclude='*.safetensors' . 2>/dev/null); }
st "bench_rows: feed window 0 (every plain cycle) vs 32, and drafter-less rows"
timeout 300 python3 scripts/bench_rows.py --target smollm2 --drafter $DR --device cuda:0 --batch 1 4 16 64 --budgets 512 \
  --feed-windows 0 32 --cycles 64 --out $R/bench_rows > $R/bench_rows.log 2>&1; echo "rc=$?"; grep -E "^(budget|no drafter)" $R/bench_rows.log
B=(python3 scripts/bench_serving.py --target smollm2 --drafter $DR --device cuda:0 --max-tokens 128)
run() { local name=$1 lim=$2; shift 2; st "serving $name"; timeout $lim "${B[@]}" "$@" --out $R/$name > $R/$name.log 2>&1; echo "rc=$?"; grep -E "^(plain|spec) |^ +[0-9]+ \||geometric" $R/$name.log | tail -14; }
run sampled_rows 300 --concurrency 1 4 16 64 --rounds 3 --temperature 0.8 --fast-rows on
st "profile: 8B shape plain step and tree cycle"
timeout 240 python3 scripts/profile_step.py --device cuda:0 --shape llama8b --out $R/profile_8b > $R/profile_8b.log 2>&1; echo "rc=$?"
grep -v "^\s*$" $R/profile_8b.log | grep -v arn | tail -n 30 | cut -c1-250
st "profile: SmolLM2 plain step and tree cycle"
timeout 180 python3 scripts/profile_step.py --device cuda:0 --target smollm2 --drafter $DR --out $R/profile_smollm2 > $R/profile_smollm2.log 2>&1; echo "rc=$?"
grep -v "^\s*$" $R/profile_smollm2.log | grep -v "arn\|Loading" | tail -n 30 | cut -c1-250
st "GPU tests"
timeout 300 python3 -m pytest -q -m gpu tests/test_fast.py tests/test_rows.py -p no:cacheprovider > $R/gpu_tests.log 2>&1; echo "rc=$?"; tail -n 5 $R/gpu_tests.log
run greedy_rows 240 --concurrency 1 4 16 64 --rounds 3 --temperature 0 --fast-rows on
if [ "${REGEN:-0}" = 1 ]; then
  st "regenerate for recipe v3 (as v2: GSM8K 512 tokens; ShareGPT 2 user turns, 384 tokens)"
  RG=(python3 -m eagle3.cli regenerate --target smollm2 --device cuda:0 --dtype bfloat16 --engine fast --batch-size 512 --temperature 0)
  "${RG[@]}" --data /tmp/stage/gsm8k_train.jsonl --out /tmp/regen/regen_gsm8k.jsonl --max-new-tokens 512 --max-prompt-tokens 512 2>&1 | tail -n 3
  timeout 330 "${RG[@]}" --data /tmp/stage/sharegpt_human.jsonl.gz --out /tmp/regen/regen_sharegpt.jsonl --max-new-tokens 384 \
    --max-prompt-tokens 1280 --max-turns 2 2>&1 | tail -n 3
  wc -l /tmp/regen/*.jsonl; (cd /tmp/regen && gzip -k -f *.jsonl && ls -la)
fi
st "done"
