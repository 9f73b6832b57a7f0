#!/usr/bin/env bash
# Two H200s (nvidia-h200-x2), two arms on v6's answers (.stage/c4/regen21.tar.xz), both v7's settings
# (32,768-token batches, 1,080 s, 16,384-row sort window), prepared once with v7's draft vocabulary:
#   a (cuda:0): from scratch with --align-top-k 3            (recipe v8 as planned in session 22)
#   b (cuda:1): --init the bundled v7 drafter, peak lr 3e-4   (does more training on the same data still pay?)
# then MT-bench tree 6,10,60 and chain 5 for each; the arm with the best tree tau, if it beats BASE_TREE
# (v7: 4.204), also gets the other five sets (tree on cuda:0, chain 5 on cuda:1).
#   SHA=... T0=$(date +%s) bash run23.sh
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  EAGLE3_GIT_SHA=${SHA:-unknown}
T0=${T0:-$(date +%s)}
W=${W:-/tmp/w}; R=$W/res; mkdir -p $R/a $R/b
TARGET=smollm2; BUDGET=${BUDGET:-1080}; BATCH_TOKENS=${BATCH_TOKENS:-32768}
DATA=${DATA:-/tmp/stage/regen21.tar.xz}; D0=${D0:-cuda:0}; D1=${D1:-cuda:1}; LIM=${EVAL_LIMIT:+--limit $EVAL_LIMIT}
V7=$PWD/src/eagle3/assets/smollm2-drafter
E="python3 -m eagle3.cli"
st() { echo "== $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*"; }
tau() { python3 -c "import json;print(json.load(open('$1'))['runs'][0]['tau'])" 2>/dev/null || echo 0; }
st "unpack $DATA"
tar xJf $DATA -C $W && ls -la $W/regen_*.jsonl
st "prepare"
TOKENIZERS_PARALLELISM=true $E prepare --target $TARGET --data $W/regen_*.jsonl --out $W/data --max-length 2048 \
  --length-policy truncate --vocab-from $V7 > $R/prepare.log 2>&1
st "prepare rc=$?"
arm() {  # arm NAME DEVICE TRAIN_ARGS...
  local n=$1 dev=$2; shift 2
  st "train $n on $dev: $*"
  $E train --target $TARGET --data $W/data --out $W/train_$n --device $dev --epochs 30 --lr 1e-3 \
    --time-budget $BUDGET --batch-tokens $BATCH_TOKENS "$@" --save-every 200 --log-every 20 --val-fraction 0.01 \
    > $R/$n/train.log 2>&1
  st "train $n rc=$?"
  for shape in "--tree 6,10,60" "--chain 5"; do  # tau does not depend on timing: side by side on one GPU
    local name=$(echo $shape | tr -d ' -' | tr ',' '_')
    $E eval --target $TARGET --drafter $W/train_$n/drafter --device $dev --fast --datasets mt_bench \
      --max-new-tokens 256 $shape $LIM --out $R/$n/eval_$name > $R/$n/eval_$name.log 2>&1 &
  done
  wait
  st "mt-bench $n: tree $(tau $R/$n/eval_tree6_10_60/eval.json) chain5 $(tau $R/$n/eval_chain5/eval.json)"
}
arm a $D0 --align-top-k 3 &
arm b $D1 --init $V7 --lr 3e-4 &
wait
ta=$(tau $R/a/eval_tree6_10_60/eval.json); tb=$(tau $R/b/eval_tree6_10_60/eval.json)
best=$(python3 -c "print('a' if $ta >= $tb else 'b')"); tbest=$(python3 -c "print(max($ta, $tb))")
echo "$best" > $W/best
st "mt-bench finished: a $ta, b $tb; best $best"
if python3 -c "import sys; sys.exit(0 if $tbest > ${BASE_TREE:-4.204} else 1)"; then
  for pair in "$D0 --tree 6,10,60" "$D1 --chain 5"; do
    set -- $pair; dev=$1; shift; shape="$*"
    name=$(echo $shape | tr -d ' -' | tr ',' '_')
    $E eval --target $TARGET --drafter $W/train_$best/drafter --device $dev --fast \
      --datasets humaneval gsm8k alpaca sum qa --max-new-tokens 256 $shape $LIM --out $R/$best/eval_five_$name \
      > $R/$best/eval_five_$name.log 2>&1 &
  done
  wait
  st "five sets finished for $best"
fi
st "done"
