#!/usr/bin/env bash
# Session 26 plan. #3: a bundleable drafter with a larger draft vocabulary (session 25: 16,384 entries gave MT-bench
# tree 4.312 / chain 5 2.849 against v7's 4.204 / 2.803, but 29.2 MB; a wider MLP gave nothing). Arms from scratch
# on v7's data with v7's recipe, each <= 25 MB in bf16 (sizes measured on the CPU with save_drafter):
#   a12: vocabulary 12,288, MLP 1,536 (24.48 MB)     n14: 14,336, MLP 768 (24.21 MB)
#   a12t: as a12 with --label-temperature 0.5 (labels sharpened towards the target's greedy choice; new in session 25)
# #4/#5 on a GPU of its own (BENCH): all 80 MT-bench prompts, plain + chain 5 + four trees in one run; where a tree
# cycle goes (profile_step) for 6,10,60 and 8,10,100; serving at one client, 12 rounds, default tree and 8,10,100;
# the 1-64 curve with 8,10,100. Then the best arm over 4.204 gets the five other sets (tree and chain 5).
#   NGPU=4: a12, n14, a12t on 0, 1, 3, bench on 2.   NGPU=2: a12 on 0, a12t on 1, bench on 1 after a12t (BUDGET=1000).
#   SHA=... T0=$(date +%s) NGPU=4 bash run26.sh
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  EAGLE3_GIT_SHA=${SHA:-unknown}
T0=${T0:-$(date +%s)}; NGPU=${NGPU:-4}
W=${W:-/tmp/w}; R=$W/res; mkdir -p $R/bench $R/serve $R/profile
TARGET=smollm2; DATA=${DATA:-/tmp/stage/regen21.tar.xz}
BUDGET=${BUDGET:-$([ $NGPU = 4 ] && echo 1080 || echo 1000)}; BATCH_TOKENS=${BATCH_TOKENS:-32768}; NEW=${NEW:-256}
LIM=${EVAL_LIMIT:+--limit $EVAL_LIMIT}; BLIM=${BENCH_LIMIT:-80}; ST=${SERVE_TOKENS:-128}; RND=${ROUNDS:-12}
CURVE=${CURVE:-1 4 16 64}
V7=$PWD/src/eagle3/assets/smollm2-drafter; BASE_TREE=${BASE_TREE:-4.204}
E="python3 -m eagle3.cli"
gpu() { [ "${CPU_SMOKE:-0}" = 1 ] && echo cpu || echo cuda:$1; }  # CPU_SMOKE=1: a tiny run on a CPU
st() { echo "== $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*"; }
tau() { python3 -c "import json;print(json.load(open('$1'))['runs'][0]['tau'])" 2>/dev/null || echo 0; }
tar xJf $DATA -C $W && st "unpacked $(cat $W/regen_*.jsonl | wc -l) answers"
if [ $NGPU = 4 ]; then ARMS="a12:0:12288:1536 n14:1:14336:768 a12t:3:12288:1536"; BENCH=$(gpu 2)
else ARMS="a12:0:12288:1536 a12t:1:12288:1536"; BENCH=$(gpu 1); fi
LAST=${ARMS##* }; LAST=${LAST%%:*}  # the arm whose GPU runs the benchmarks afterwards when NGPU=2
extra() { case $1 in a12t) echo "--label-temperature 0.5";; esac; }
for vd in $(for a in $ARMS; do IFS=: read _ _ vd _ <<< "$a"; echo $vd; done | sort -u); do
  TOKENIZERS_PARALLELISM=true $E prepare --target $TARGET --data $W/regen_*.jsonl --out $W/data_$vd --max-length 2048 \
    --length-policy truncate --draft-vocab-size $vd > $R/prepare_$vd.log 2>&1 &
done
wait
st "prepared: $(ls $W/data_*/report.json | tr '\n' ' ')"
arm() {  # arm NAME DEVICE MLP VOCAB
  local n=$1 dev=$2; mkdir -p $R/$n
  st "train $n on $dev: --intermediate-size $3 $(extra $n), $(python3 -c "import json;r=json.load(open('$W/data_$4/report.json'));print(r['draft_vocab_size'], round(r['draft_vocab_coverage'],4))")"
  $E train --target $TARGET --data $W/data_$4 --out $W/train_$n --device $dev --epochs 30 --lr 1e-3 \
    --time-budget $BUDGET --batch-tokens $BATCH_TOKENS --save-every 200 --log-every 20 --val-fraction 0.01 \
    --intermediate-size $3 $(extra $n) ${TRAIN_EXTRA:-} > $R/$n/train.log 2>&1
  st "train $n rc=$?"
  for shape in "--tree 6,10,60" "--chain 5"; do
    local name=$(echo $shape | tr -d ' -' | tr ',' '_')
    OMP_NUM_THREADS=4 $E eval --target $TARGET --drafter $W/train_$n/drafter --device $dev --fast --datasets mt_bench \
      --max-new-tokens $NEW $shape $LIM --out $R/$n/eval_$name > $R/$n/eval_$name.log 2>&1 &
  done
  wait
  st "mt-bench $n: tree $(tau $R/$n/eval_tree6_10_60/eval.json) chain5 $(tau $R/$n/eval_chain5/eval.json)"
}
benches() {  # #4/#5 on $BENCH
  [ "${SKIP_BENCH:-0}" = 1 ] && return
  st "bench on $BENCH"
  timeout 420 $E bench --device $BENCH --target $TARGET --drafter $V7 --limit $BLIM --max-new-tokens $NEW \
    --methods plain,chain,tree --chain 5 --tree 6,10,60 8,8,64 8,10,100 7,10,80 --out $R/bench/trees80 \
    > $R/bench/trees80.log 2>&1
  st "bench rc=$?: $(grep -E '^\([dfg]\) ' $R/bench/trees80.log | tr -s ' ' | cut -c1-75 | tr '\n' '|')"
  for tree in 6,10,60 8,10,100; do
    timeout 120 python3 scripts/profile_step.py --device $BENCH --target $TARGET --drafter $V7 --tree $tree \
      --out $R/profile/$tree > $R/profile/$tree.log 2>&1
    st "profile $tree rc=$?: $(grep -E 'cycle|step' $R/profile/$tree.log | tail -n 2 | tr '\n' ' ' | cut -c1-200)"
  done
  for tree in 6,10,60 8,10,100; do
    timeout 200 python3 scripts/bench_serving.py --target $TARGET --drafter $V7 --device $BENCH --concurrency 1 \
      --max-tokens $ST --rounds $RND --tree $tree --out $R/serve/c1_$tree > $R/serve/c1_$tree.log 2>&1
    st "serve c1 tree $tree rc=$?: $(grep -E '^ +1 \|' $R/serve/c1_$tree.log)"
  done
  timeout 420 python3 scripts/bench_serving.py --target $TARGET --drafter $V7 --device $BENCH --concurrency $CURVE \
    --max-tokens $ST --tree 8,10,100 --out $R/serve/curve_8_10_100 > $R/serve/curve_8_10_100.log 2>&1
  st "serve curve 8,10,100 rc=$?"; tail -n 7 $R/serve/curve_8_10_100.log
}
for a in $ARMS; do IFS=: read n g vd mlp <<< "$a"
  if [ $NGPU = 2 ] && [ $n = $LAST ]; then (arm $n $(gpu $g) $mlp $vd; benches) & else arm $n $(gpu $g) $mlp $vd & fi
done
[ $NGPU = 4 ] && benches &
wait
# the best arm over v7 gets the five other sets (tree and chain 5), spread over the GPUs
best=$(for a in $ARMS; do IFS=: read n _ _ _ <<< "$a"; echo "$(tau $R/$n/eval_tree6_10_60/eval.json) $n"; done | sort -rn | head -n 1)
st "best: $best"
set -- $best
if python3 -c "import sys; sys.exit(0 if float('$1') > $BASE_TREE else 1)"; then
  i=0
  for shape in "--tree 6,10,60" "--chain 5"; do
    name=$(echo $shape | tr -d ' -' | tr ',' '_')
    for sets in "sum" "humaneval gsm8k alpaca qa"; do
      dev=$(gpu $((i % NGPU))); i=$((i + 1))
      OMP_NUM_THREADS=4 $E eval --target $TARGET --drafter $W/train_$2/drafter --device $dev --fast --datasets $sets \
        --max-new-tokens $NEW $shape $LIM --out $R/$2/eval_five_${name}_${sets%% *} > $R/$2/eval_five_${name}_${sets%% *}.log 2>&1 &
    done
  done
  wait
  st "five sets $2: $(cat $R/$2/eval_five_*.log | tr '\r' '\n' | grep -oE '^[a-z_0-9]+ +eagle3-[a-z]+-[0-9,]+ +T=[0-9.]+ +tau [0-9.]+' | tr -s ' ' | tr '\n' '|')"
fi
st "done"
