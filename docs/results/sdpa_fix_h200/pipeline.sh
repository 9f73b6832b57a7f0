#!/usr/bin/env bash
# Machine 3: the SDPA fix on the GPU. Scheduler profile (plain, c=1/4/64); serving lane on; training speed A/B.
set -u
W=/tmp/work; T=/tmp/stage/model.gguf; T0=$(date +%s); D=/tmp/src/eagle3/assets/smollm2-drafter
export PYTHONPATH=/tmp/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLE3_GIT_SHA=$SHA
E="python3 -m eagle3.cli"
log(){ echo "[$(date -u +%T) +$(( $(date +%s) - T0 ))s] $*" >> $W/pipeline.log; }
mkdir -p $W; cd $W; log start
tar xzf /tmp/stage/regen.tgz -C $W
timeout 200 python3 /tmp/stage/prof_sched_gpu.py $T > $W/prof_sched.log 2>&1
log "prof rc=$?"
timeout 330 python3 /tmp/scripts/bench_serving.py --target $T --drafter $D --device cuda:0 --concurrency 1 4 16 64 --max-tokens 128 --rounds 1 --min-requests 8 --out $W/serving_on > $W/serving_on.log 2>&1
log "serving on rc=$?"
$E prepare --target $T --data $W/regen_gsm.jsonl $W/regen_sg.jsonl --max-length 2048 --length-policy truncate --draft-vocab-size 8192 --workers 12 --out $W/data > $W/prepare.log 2>&1
log "prepare rc=$?"
TR="--target $T --data $W/data --epochs 3 --max-steps 80 --batch-tokens 32768 --log-every 20 --save-every 0 --lr 1e-3"
timeout 200 $E train $TR --out $W/t_fix > $W/train_fix.log 2>&1
log "train fix rc=$?"
timeout 200 python3 /tmp/stage/train_cudnn.py train $TR --out $W/t_cudnn > $W/train_cudnn.log 2>&1
log "train cudnn rc=$?"
touch $W/DONE
