#!/usr/bin/env bash
# Continue a drafter for sampled decoding. The target writes its own prompts and answers each of them twice,
# sampled at T=1 (the contexts sampled decoding meets) and greedily (so greedy acceptance is kept); the drafter
# then continues training on both with labels at T=1, the target's whole distribution. The bundled SmolLM2
# drafter is the output of scripts/train_smollm2_drafter.sh continued this way with the defaults below
# (docs/training.md, "Training for sampled decoding" has what it measures). Stages are resumable: rerun the same
# command to continue.
#
#   DRAFTER=path/to/drafter [TARGET=smollm2] [W=/tmp/work] bash scripts/continue_drafter_for_sampling.sh
set -euo pipefail

W=${W:-/tmp/eagle3-sampled}
TARGET=${TARGET:-smollm2}
DRAFTER=${DRAFTER:?the drafter to continue (a folder eagle3 train or init-drafter wrote)}
DEVICE=${DEVICE:-cuda:0}
PROMPTS=${PROMPTS:-24000}        # distinct prompts the target writes (the shipped drafter's run stopped at 22,395)
ANSWER_TOKENS=${ANSWER_TOKENS:-256}
SAMPLE_T=${SAMPLE_T:-1}
LABEL_T=${LABEL_T:-1}
LR=${LR:-3e-4}
TIME_BUDGET=${TIME_BUDGET:-350}  # seconds of training (held-out accuracy levels off within it on one H100)
BATCH=${BATCH:-512}
SEED=${SEED:-3}
EAGLE3=${EAGLE3:-python -m eagle3.cli}
mkdir -p "$W"

stage() { echo "== $(date -u +%H:%M:%S) $*"; }
G=(--target "$TARGET" --device "$DEVICE" --dtype bfloat16 --engine fast --batch-size "$BATCH")

stage "the target writes $PROMPTS prompts"
$EAGLE3 synthesize "${G[@]}" --count "$PROMPTS" --max-new-tokens 96 --seed "$SEED" --out "$W/synth.jsonl"
stage "it answers them sampled at T=$SAMPLE_T"
$EAGLE3 regenerate "${G[@]}" --temperature "$SAMPLE_T" --seed "$SEED" --data "$W/synth.jsonl" \
  --out "$W/answers_sampled.jsonl" --max-new-tokens "$ANSWER_TOKENS" --max-prompt-tokens 1280
stage "and greedily"
$EAGLE3 regenerate "${G[@]}" --temperature 0 --data "$W/synth.jsonl" --out "$W/answers_greedy.jsonl" \
  --max-new-tokens "$ANSWER_TOKENS" --max-prompt-tokens 1280

stage "prepare (the drafter's draft vocabulary)"
if [ ! -f "$W/data/report.json" ]; then
  TOKENIZERS_PARALLELISM=true $EAGLE3 prepare --target "$TARGET" --data "$W/answers_sampled.jsonl" \
    "$W/answers_greedy.jsonl" --out "$W/data" --max-length 2048 --length-policy truncate --vocab-from "$DRAFTER"
fi

stage "train (from $DRAFTER, labels at T=$LABEL_T, about $TIME_BUDGET s)"
RESUME=()
[ -d "$W/train" ] && RESUME=(--resume)
$EAGLE3 train --target "$TARGET" --device "$DEVICE" --data "$W/data" --out "$W/train" --init "$DRAFTER" \
  --lr "$LR" --batch-tokens 32768 --time-budget "$TIME_BUDGET" --label-temperature "$LABEL_T" --epochs 30 \
  --save-every 200 --log-every 50 --val-fraction 0.01 "${RESUME[@]}"

stage "export: bf16, without the embedding (engines take the target's)"
$EAGLE3 export --drafter "$W/train/drafter" --format speculators --out "$W/drafter" --dtype bfloat16 --no-embedding
stage "done: $W/drafter; measure it with eagle3 eval --drafter $W/drafter --temperatures 0 0.7 1"
