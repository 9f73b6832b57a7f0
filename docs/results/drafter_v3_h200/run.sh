#!/usr/bin/env bash
# Session 12: recipe v3 of the SmolLM2 drafter (v2's greedy data plus a sampled T=0.8 answer per prompt, 1 % held out
# for validation), same 690 s training budget as v2, in one hold. Greedy/sampled ShareGPT and greedy GSM8K come
# regenerated from session 11 (docs/results/session11_h200/regen); the sampled GSM8K set is generated here.
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLE3_GIT_SHA=${SHA:-unknown}
W=/tmp/w
st() { echo "== $(date -u +%H:%M:%S) $*"; }
st "recipe v3 (scripts/train_smollm2_drafter.sh)"
W=$W SHAREGPT=/tmp/stage/sharegpt_human.jsonl.gz GSM8K=/tmp/stage/gsm8k_train.jsonl SAMPLE_T=0.8 TIME_BUDGET=${TRAIN_S:-690} \
  VAL_FRACTION=0.01 EAGLE3="python3 -m eagle3.cli" bash scripts/train_smollm2_drafter.sh > $W/recipe.log 2>&1
echo "rc=$?"; grep -E "^== |tau|τ" $W/recipe.log | cut -c1-300
python3 -c "
import torch
from eagle3.formats import load_drafter, save_drafter
save_drafter(load_drafter('$W/train/drafter'), '$W/x', format='speculators', include_embedding=False, dtype=torch.bfloat16)"
st "exported: $(du -sh $W/x | cut -f1)"
st "done"
