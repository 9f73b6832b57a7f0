#!/usr/bin/env bash
# Session 15: recipe v4 of the SmolLM2 drafter = v3's data (greedy and T=0.8 answers; ShareGPT and greedy GSM8K
# regenerated in session 11, sampled GSM8K here) trained by the compiled trainer for 1,080 s, in one hold.
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLE3_GIT_SHA=${SHA:-unknown}
W=/tmp/w; S=/tmp/stage/p3f; mkdir -p $W
st() { echo "== $(date -u +%H:%M:%S) $*"; }
for f in regen_gsm8k regen_sharegpt; do gunzip -c $S/$f.jsonl.gz > $W/$f.jsonl; cp $S/$f.jsonl.report.json $W/; done
gunzip -c $S/regen_sharegpt_t08.jsonl.gz > $W/regen_sharegpt_t.jsonl
cp $S/regen_sharegpt_t08.jsonl.report.json $W/regen_sharegpt_t.jsonl.report.json
cp $S/sharegpt_human.jsonl.gz /tmp/stage/
st "recipe v4 (scripts/train_smollm2_drafter.sh, TIME_BUDGET=${TRAIN_S:-1080})"
W=$W SHAREGPT=/tmp/stage/sharegpt_human.jsonl.gz GSM8K=/tmp/stage/gsm8k_train.jsonl TIME_BUDGET=${TRAIN_S:-1080} \
  TRAIN_OUT=$W/train EAGLE3="python3 -m eagle3.cli" bash scripts/train_smollm2_drafter.sh > $W/recipe.log 2>&1
echo "rc=$?"; grep -E "^== |tau|τ|time budget" $W/recipe.log | cut -c1-300
python3 -c "
import torch
from eagle3.formats import load_drafter, save_drafter
save_drafter(load_drafter('$W/train/drafter'), '$W/x', format='speculators', include_embedding=False, dtype=torch.bfloat16)"
st "exported: $(du -sh $W/x | cut -f1)"
st "done"
