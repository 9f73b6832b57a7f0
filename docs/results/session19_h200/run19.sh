#!/usr/bin/env bash
# Session 19 (nvidia-h200-x2): recipe v4 plus greedy answers to SYNTH prompts SmolLM2 writes itself (made on cuda:1
# while cuda:0 regenerates), trained on cuda:0 with the sync-free trainer until DEADLINE (at most 1,080 s).
# Meanwhile on the side: the CUDA tests while prepare runs, and the bundled drafter's MT-bench eval on cuda:1
# (the cuda:1 graph fix) once training is past its speed calibration.
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLE3_GIT_SHA=${SHA:-unknown}
W=/tmp/w; S=/tmp/stage/p3f; R=$W/res; mkdir -p $R
st() { echo "== $(date -u +%H:%M:%S) $*"; }
for f in regen_gsm8k regen_sharegpt; do gunzip -c $S/$f.jsonl.gz > $W/$f.jsonl; cp $S/$f.jsonl.report.json $W/; done
gunzip -c $S/regen_sharegpt_t08.jsonl.gz > $W/regen_sharegpt_t.jsonl
cp $S/regen_sharegpt_t08.jsonl.report.json $W/regen_sharegpt_t.jsonl.report.json
E="python3 -m eagle3.cli"
st "recipe: SYNTH=${SYNTH:-20000} on cuda:1, DEADLINE=$DEADLINE ($(( DEADLINE - $(date +%s) )) s from now)"
(W=$W SHAREGPT=$S/sharegpt_human.jsonl.gz GSM8K=$S/gsm8k_train.jsonl DEVICE=cuda:0 SYNTH=${SYNTH:-20000} \
  SYNTH_DEVICE=cuda:1 SYNTH_S=${SYNTH_S:-180} DEADLINE=$DEADLINE EVAL=0 TRAIN_OUT=$W/train EAGLE3="$E" \
  bash scripts/train_smollm2_drafter.sh > $R/recipe.log 2>&1; st "recipe finished rc=$?") &
while ! grep -q "^== .* prepare" $R/recipe.log 2>/dev/null && ! grep -q "recipe finished" $W/pipe.log; do sleep 2; done
st "CUDA tests while prepare runs"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_trainer.py tests/test_fast.py tests/test_rows.py \
  tests/test_target.py -k "cuda or CUDA or gpu" > $R/gpu_tests.log 2>&1
st "tests rc=$? $(tail -n 1 $R/gpu_tests.log)"
while ! grep -q "step 1000," $R/recipe.log 2>/dev/null && ! grep -q "recipe finished" $W/pipe.log; do sleep 5; done
st "eval of the bundled drafter on cuda:1 (training goes on on cuda:0)"
$E eval --target smollm2 --drafter src/eagle3/assets/smollm2-drafter --device cuda:1 --fast --datasets mt_bench \
  --max-new-tokens 256 --tree 6,10,60 --out $R/eval_bundled_cuda1 > $R/eval_bundled_cuda1.log 2>&1
st "eval rc=$? $(grep -m1 -o '"tau": [0-9.]*' $R/eval_bundled_cuda1/*.json 2>/dev/null)"
wait
st "done"
