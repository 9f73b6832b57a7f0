#!/usr/bin/env bash
# Session 11, hold 2: regenerate recipe-v2 data (greedy) plus sampled ShareGPT answers, to carry into a later hold.
set -u
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLE3_CACHE=/tmp/cache
W=/tmp/regen; mkdir -p $W
st() { echo "== $(date -u +%T) $*"; }
RG=(python3 -m eagle3.cli regenerate --target smollm2 --device cuda:0 --dtype bfloat16 --engine fast --batch-size 512)
st "GSM8K greedy, 512 tokens"
"${RG[@]}" --temperature 0 --data /tmp/stage/gsm8k_train.jsonl --out $W/regen_gsm8k.jsonl --max-new-tokens 512 --max-prompt-tokens 512 2>&1 | tail -n 2
st "ShareGPT greedy, 2 user turns, 384 tokens"
timeout 330 "${RG[@]}" --temperature 0 --data /tmp/stage/sharegpt_human.jsonl.gz --out $W/regen_sharegpt.jsonl --max-new-tokens 384 \
  --max-prompt-tokens 1280 --max-turns 2 2>&1 | tail -n 2
st "ShareGPT sampled T=0.8 seed 1, 2 user turns, 384 tokens"
timeout 300 "${RG[@]}" --temperature 0.8 --seed 1 --data /tmp/stage/sharegpt_human.jsonl.gz --out $W/regen_sharegpt_t08.jsonl --max-new-tokens 384 \
  --max-prompt-tokens 1280 --max-turns 2 2>&1 | tail -n 2
wc -l $W/*.jsonl; cp $W/*.report.json $W/ 2>/dev/null
(cd $W && gzip -k -f *.jsonl && ls -la)
st "done"
