#!/usr/bin/env bash
# Session 18: recipe v4 on the current trainer (sync-free steps) on cuda:0 (A) against the same with the
# drafter reading target layers 2,15,29 instead of 2,15,27 (B) on cuda:1, same prepared data, same budget.
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLE3_GIT_SHA=${SHA:-unknown}
W=/tmp/w; S=/tmp/stage/p3f; mkdir -p $W/res
st() { echo "== $(date -u +%H:%M:%S) $*"; }
for f in regen_gsm8k regen_sharegpt; do gunzip -c $S/$f.jsonl.gz > $W/$f.jsonl; cp $S/$f.jsonl.report.json $W/; done
gunzip -c $S/regen_sharegpt_t08.jsonl.gz > $W/regen_sharegpt_t.jsonl
cp $S/regen_sharegpt_t08.jsonl.report.json $W/regen_sharegpt_t.jsonl.report.json
E="python3 -m eagle3.cli"; B=${TRAIN_S:-1020}
st "A: recipe v4 on cuda:0 (TIME_BUDGET=$B)"
(W=$W SHAREGPT=$S/sharegpt_human.jsonl.gz GSM8K=$S/gsm8k_train.jsonl TIME_BUDGET=$B DEVICE=cuda:0 \
  TRAIN_OUT=$W/trainA EAGLE3="$E" bash scripts/train_smollm2_drafter.sh > $W/res/recipeA.log 2>&1; st "A finished rc=$?") &
st "CUDA-only tests on cuda:1 while A regenerates and prepares"
CUDA_VISIBLE_DEVICES=1 timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_trainer.py tests/test_fast.py tests/test_rows.py -k "cuda or CUDA" > $W/res/gpu_tests.log 2>&1
st "tests rc=$? $(tail -n 1 $W/res/gpu_tests.log)"
while [ ! -f $W/data/report.json ]; do sleep 3; done
st "B: taps 2,15,29 on cuda:1"
$E train --target smollm2 --device cuda:1 --data $W/data --out $W/trainB --epochs 30 --lr 1e-3 --time-budget $B \
  --batch-tokens 32768 --save-every 200 --log-every 20 --val-fraction 0.01 --aux-layers 2,15,29 > $W/res/trainB.log 2>&1
st "B trained rc=$?"
for shape in "--tree 6,10,60" "--chain 5"; do
  $E eval --target smollm2 --drafter $W/trainB/drafter --device cuda:1 --fast --datasets mt_bench \
    --max-new-tokens 256 $shape --out $W/res/evalB_${shape##* } > $W/res/evalB_${shape##* }.log 2>&1
done
st "B evaluated"
wait
st "done"
