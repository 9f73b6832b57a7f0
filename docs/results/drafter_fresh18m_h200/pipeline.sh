#!/usr/bin/env bash
# Machine 1: prepare the regenerated data (fresh draft vocab), train a fresh drafter alone on the GPU with an
# 18-minute time budget (the issue's <= 20 min target), export bf16, eval MT-bench (tree 6,10,60 and chain 5).
set -u
W=/tmp/work; T=/tmp/stage/model.gguf; T0=$(date +%s)
export PYTHONPATH=/tmp/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLE3_GIT_SHA=$SHA
E="python3 -m eagle3.cli"
log(){ echo "[$(date -u +%T) +$(( $(date +%s) - T0 ))s] $*" >> $W/pipeline.log; }
mkdir -p $W; cd $W; log start
tar xzf /tmp/stage/regen.tgz -C $W
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv >> $W/pipeline.log
$E prepare --target $T --data $W/regen_sg.jsonl $W/regen_gsm.jsonl --max-length 2048 --length-policy truncate \
  --draft-vocab-size 8192 --workers 12 --out $W/data_a > $W/prepare_a.log 2>&1
log "prepare rc=$? $(ls $W/data_a | tr '\n' ' ')"
t0=$(date +%s)
timeout 1300 $E train --target $T --data $W/data_a --out $W/t_a --epochs 30 --time-budget 18m --batch-tokens 32768 \
  --lr 1e-3 --save-every 500 --log-every 20 > $W/train_a.log 2>&1
log "train a rc=$? wall=$(( $(date +%s) - t0 ))s (prepared data -> drafter)"
D=$W/t_a/drafter; [ -d $D ] || D=$(ls -d $W/t_a/checkpoints/step_*/drafter | tail -1)
python3 -c "
import torch
from eagle3.formats import load_drafter, save_drafter
save_drafter(load_drafter('$D'), '$W/x_a', format='speculators', include_embedding=False, dtype=torch.bfloat16)"
log "exported from $D: $(du -sh $W/x_a | cut -f1)"
EV="$E eval --target $T --drafter $W/x_a --device cuda:0 --fast --max-new-tokens 256 --datasets mt_bench"
timeout 400 $EV --tree 6,10,60 --out $W/ev_a_tree > $W/ev_a_tree.log 2>&1 &
timeout 400 $EV --chain 5 --out $W/ev_a_chain > $W/ev_a_chain.log 2>&1 &
wait
log "eval: $(grep -ah 'tau' $W/ev_a_*.log | sed 's/.*\r//' | tr -s ' ' | cut -c1-100 | tr '\n' '|')"
log "all done"; touch $W/DONE
