#!/usr/bin/env bash
# Machine 1: prepare the regenerated data twice (fresh vocab; the bundled drafter's vocab), train A (fresh) and
# B (continued from the bundled drafter) side by side with a 1000 s time budget each, export bf16, eval MT-bench.
set -u
W=/tmp/work; T=/tmp/stage/model.gguf; T0=$(date +%s); D0=/tmp/src/eagle3/assets/smollm2-drafter
export PYTHONPATH=/tmp/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLE3_GIT_SHA=$SHA
E="python3 -m eagle3.cli"
log(){ echo "[$(date -u +%T) +$(( $(date +%s) - T0 ))s] $*" >> $W/pipeline.log; }
mkdir -p $W; cd $W; log start
tar xzf /tmp/stage/regen.tgz -C $W
P="--target $T --data $W/regen_sg.jsonl $W/regen_gsm.jsonl --max-length 2048 --length-policy truncate --draft-vocab-size 8192 --workers 6"
$E prepare $P --out $W/data_a > $W/prepare_a.log 2>&1 &
$E prepare $P --out $W/data_b --vocab-from $D0 > $W/prepare_b.log 2>&1 &
wait; log "prepared: $(ls $W/data_a | tr '\n' ' ')"
run(){ # name data extra...
  local n=$1 d=$2; shift 2
  local t0=$(date +%s)
  timeout 1150 $E train --target $T --data $W/$d --out $W/t_$n --epochs 30 --time-budget 1000 --batch-tokens 32768 --save-every 200 --log-every 20 "$@" > $W/train_$n.log 2>&1
  log "train $n rc=$? wall=$(( $(date +%s) - t0 ))s"
  local D=$W/t_$n/drafter; [ -d $D ] || D=$(ls -d $W/t_$n/checkpoints/step_*/drafter | tail -1)
  python3 -c "
import torch
from eagle3.formats import load_drafter, save_drafter
save_drafter(load_drafter('$D'), '$W/x_$n', format='speculators', include_embedding=False, dtype=torch.bfloat16)"
  log "$n exported from $D: $(du -sh $W/x_$n | cut -f1)"
  EV="$E eval --target $T --drafter $W/x_$n --device cuda:0 --fast --max-new-tokens 256 --datasets mt_bench"
  $EV --tree 6,10,60 --out $W/ev_${n}_tree > $W/ev_${n}_tree.log 2>&1 &
  $EV --chain 5 --out $W/ev_${n}_chain > $W/ev_${n}_chain.log 2>&1 &
  wait
  log "$n eval: $(grep -ah 'tau' $W/ev_${n}_*.log | sed 's/.*\r//' | tr -s ' ' | cut -c1-100 | tr '\n' '|')"
}
run a data_a --lr 1e-3 &
run b data_b --lr 5e-4 --init $D0 &
wait
log "all done"; touch $W/DONE
