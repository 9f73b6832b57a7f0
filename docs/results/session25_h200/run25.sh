#!/usr/bin/env bash
# Session 25 plan, two H200s (nvidia-h200-x2). #3: is the drafter short of capacity? Two arms from scratch on v6's
# answers (v7's data, .stage/c4/regen21.tar.xz) with v7's recipe (32,768-token batches, --time-budget 1080,
# --epochs 30), side by side (the 8-thread cap keeps both at full speed):
#   cuda:0  "w": MLP 2,816 wide instead of 1,536 (bf16 checkpoint ~24.2 MB: under the 25 MB; 3,072 would be 25.04 MB)
#   cuda:1  "v": draft vocabulary 16,384 instead of 8,192 (coverage 96.0 % -> ~98.7 %; ~29 MB: too big to bundle,
#           measures how tau depends on the vocabulary with a trained head)
# v7 on the same data: MT-bench tree 4.204, chain 5 2.803 (session 22). Each arm evaluated on its own GPU.
# #4/#5 on cuda:0 after w: `eagle3 bench` plain vs five tree shapes (which tree is fastest on an H200?).
# #5 on cuda:1 once "v" has trained: scripts/bench_serving.py at 1, 4, 16, 64 clients with today's defaults
# (captured lane prefills on; session 20 with v5, eager: 2.00x / 1.64x / 1.64x / 1.51x).
#   SHA=... T0=$(date +%s) bash run25.sh
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  EAGLE3_GIT_SHA=${SHA:-unknown}
T0=${T0:-$(date +%s)}
W=${W:-/tmp/w}; R=$W/res; mkdir -p $R/w $R/v $R/serve $R/trees
D0=${D0:-cuda:0}; D1=${D1:-cuda:1}; TARGET=smollm2; DATA=${DATA:-/tmp/stage/regen21.tar.xz}
BUDGET=${BUDGET:-1000}; BATCH_TOKENS=${BATCH_TOKENS:-32768}; NEW=${NEW:-256}; SERVE=${SERVE:-1}
LIM=${EVAL_LIMIT:+--limit $EVAL_LIMIT}
V7=$PWD/src/eagle3/assets/smollm2-drafter
E="python3 -m eagle3.cli"
st() { echo "== $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*"; }
tau() { python3 -c "import json;print(json.load(open('$1'))['runs'][0]['tau'])" 2>/dev/null || echo 0; }
tar xJf $DATA -C $W && st "unpacked $(cat $W/regen_*.jsonl | wc -l) answers"
# w uses v7's vocabulary (the same as v7's own prepare); v gets its own of 16,384
TOKENIZERS_PARALLELISM=true $E prepare --target $TARGET --data $W/regen_*.jsonl --out $W/data8k --max-length 2048 \
  --length-policy truncate --vocab-from $V7 > $R/prepare8k.log 2>&1 &
TOKENIZERS_PARALLELISM=true $E prepare --target $TARGET --data $W/regen_*.jsonl --out $W/data16k --max-length 2048 \
  --length-policy truncate --draft-vocab-size 16384 > $R/prepare16k.log 2>&1 &
wait
st "prepared: $(ls $W/data8k/report.json $W/data16k/report.json 2>&1 | tr '\n' ' ')"
arm() {  # arm NAME DEVICE DATA EXTRA...
  local n=$1 dev=$2 data=$3; shift 3
  st "train $n on $dev: $*"
  $E train --target $TARGET --data $data --out $W/train_$n --device $dev --epochs 30 --lr 1e-3 --time-budget $BUDGET \
    --batch-tokens $BATCH_TOKENS --save-every 200 --log-every 20 --val-fraction 0.01 "$@" > $R/$n/train.log 2>&1
  st "train $n rc=$?"
  for shape in "--tree 6,10,60" "--chain 5"; do
    local name=$(echo $shape | tr -d ' -' | tr ',' '_')
    OMP_NUM_THREADS=4 $E eval --target $TARGET --drafter $W/train_$n/drafter --device $dev --fast --datasets mt_bench \
      --max-new-tokens $NEW $shape $LIM --out $R/$n/eval_$name > $R/$n/eval_$name.log 2>&1 &
  done
  wait
  st "mt-bench $n: tree $(tau $R/$n/eval_tree6_10_60/eval.json) chain5 $(tau $R/$n/eval_chain5/eval.json)"
}
(arm w $D0 $W/data8k --intermediate-size 2816
 # #4/#5: which tree pays best on this GPU? The tau target fixes 6,10,60; speed does not. Each run times
 # plain decoding too (same process), first 20 MT-bench prompts x 256 tokens, the bundled v7 drafter.
 for tree in 6,10,60 7,10,80 8,10,100 6,6,24 8,8,64; do
   timeout 120 $E bench --device $D0 --target $TARGET --drafter $V7 --limit 20 --max-new-tokens 256 \
     --methods plain,tree --tree $tree --out $R/trees/$tree > $R/trees/$tree.log 2>&1
   st "bench tree $tree rc=$?: $(grep -E '^\([dg]\) ' $R/trees/$tree.log | tr -s ' ' | tr '\n' ' ' | cut -c1-220)"
 done) &
(arm v $D1 $W/data16k
 if [ $SERVE = 1 ]; then
   timeout 420 python3 scripts/bench_serving.py --target $TARGET --drafter $V7 --device $D1 --concurrency 1 4 16 64 \
     --max-tokens 128 --out $R/serve/curve > $R/serve/curve.log 2>&1
   st "bench_serving 1-64 rc=$?"; tail -n 7 $R/serve/curve.log
 fi) &
wait
st "done"
