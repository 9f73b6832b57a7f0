#!/usr/bin/env bash
# Session 28 plan. #4/#5 on cuda:0: what captured prefills (the default of generate/bench on CUDA since session 27)
# give the 80-prompt bench: `--graph-prefill off` and the default, one after the other, each with its own plain
# decoding; why profile_step --by-source named no function on this image (stackprobe.py), then the profile.
# #3 on the other GPUs (NGPU >= 2), arms from scratch on v7's data with v8's recipe (12,288 entries, MLP 1,536):
#   b25: labels at T=0.25 (cuda:1)   b0: T=0, hard labels (cuda:2)   n14t: 14,336 entries, MLP 768, T=0.5 (cuda:3)
#   NGPU=2 T0=$(date +%s) SHA=... bash run28.sh
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  EAGLE3_GIT_SHA=${SHA:-unknown}
T0=${T0:-$(date +%s)}; NGPU=${NGPU:-1}
W=${W:-/tmp/w}; R=$W/res; mkdir -p $R/bench $R/profile
TARGET=smollm2; DATA=${DATA:-/tmp/stage/regen21.tar.xz}; V8=$PWD/src/eagle3/assets/smollm2-drafter
BUDGET=${BUDGET:-1000}; BATCH_TOKENS=${BATCH_TOKENS:-32768}; NEW=${NEW:-256}; BLIM=${BENCH_LIMIT:-80}
LIM=${EVAL_LIMIT:+--limit $EVAL_LIMIT}
E="python3 -m eagle3.cli"
gpu() { [ "${CPU_SMOKE:-0}" = 1 ] && echo cpu || echo cuda:$1; }
st() { echo "== $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*"; }
tau() { python3 -c "import json;print(json.load(open('$1'))['runs'][0]['tau'])" 2>/dev/null || echo 0; }
ab_profiles() {  # the K/V-in-one-cache change (f84cb81) against 08c6201 (/tmp/old28/src), random weights, both orders
  [ -d ${OLD28:-/tmp/old28/src} ] || return
  for v in old new new old; do
    local pp=$([ $v = old ] && echo ${OLD28:-/tmp/old28/src} || echo $PWD/src) o=$R/profile/ab_$v
    [ -e $o.log ] && o=${o}_again
    PYTHONPATH=$pp:/tmp/site timeout 200 python3 $pp/../scripts/profile_step.py --device $(gpu 0) --shape smollm2-135m \
      --reps ${REPS:-20} --out $o > $o.log 2>&1
    st "ab $v rc=$?: $(grep -E 'graph replay|tree cycle =' $o.log | cut -c1-90 | tr '\n' '|')"
  done
  # inductor's max-autotune for the drafting pieces (Triton templates for the drafter's small matmuls), new code
  timeout 420 python3 scripts/profile_step.py --device $(gpu 0) --shape smollm2-135m --reps ${REPS:-20} --pieces \
    --drafting-mode max-autotune-no-cudagraphs --out $R/profile/autotune > $R/profile/autotune.log 2>&1
  st "autotune rc=$?: $(grep -E 'graph replay|tree cycle =|pieces in' $R/profile/autotune.log | cut -c1-90 | tr '\n' '|')"
}
benches() {
  [ "${CPU_SMOKE:-0}" = 1 ] || { python3 ${PLAN:-/tmp/plan28}/stackprobe.py > $R/profile/stackprobe.log 2>&1
    st "stackprobe: $(tr '\n' '|' < $R/profile/stackprobe.log)"; }
  ab_profiles
  for gp in off auto; do
    timeout 420 $E bench --device $(gpu 0) --target $TARGET --drafter $V8 --limit $BLIM --max-new-tokens $NEW \
      --methods plain,chain,tree --chain 5 --graph-prefill $gp --out $R/bench/prefill_$gp > $R/bench/prefill_$gp.log 2>&1
    st "bench --graph-prefill $gp rc=$?: $(grep -E '^\([dfg]\) ' $R/bench/prefill_$gp.log | tr -s ' ' | cut -c1-80 | tr '\n' '|')"
  done
  timeout 300 python3 scripts/profile_step.py --device $(gpu 0) --target $TARGET --drafter $V8 --by-source 45 --pieces \
    --out $R/profile/smollm2 > $R/profile/smollm2.log 2>&1
  st "profile rc=$?: $(grep -E 'tree cycle =' $R/profile/smollm2.log)"
}
arm() {  # arm NAME GPU VOCAB MLP TEMPERATURE
  local n=$1 dev=$(gpu $2); mkdir -p $R/$n
  $E train --target $TARGET --data $W/data_$3 --out $W/train_$n --device $dev --epochs 30 --lr 1e-3 \
    --time-budget $BUDGET --batch-tokens $BATCH_TOKENS --save-every 200 --log-every 20 --val-fraction 0.01 \
    --intermediate-size $4 --label-temperature $5 ${TRAIN_EXTRA:-} > $R/$n/train.log 2>&1
  st "train $n rc=$?"
  for shape in "--tree 6,10,60" "--chain 5"; do
    local name=$(echo $shape | tr -d ' -' | tr ',' '_')
    OMP_NUM_THREADS=4 $E eval --target $TARGET --drafter $W/train_$n/drafter --device $dev --fast --datasets mt_bench \
      --max-new-tokens $NEW $shape $LIM --graph-prefill off --out $R/$n/eval_$name > $R/$n/eval_$name.log 2>&1 &
  done
  wait
  st "mt-bench $n: tree $(tau $R/$n/eval_tree6_10_60/eval.json) chain5 $(tau $R/$n/eval_chain5/eval.json)"
}
ARMS=""
[ $NGPU -ge 2 ] && ARMS="b25:1:12288:1536:0.25"
[ $NGPU -ge 3 ] && ARMS="$ARMS b0:2:12288:1536:0"
[ $NGPU -ge 4 ] && ARMS="$ARMS n14t:3:14336:768:0.5"
benches > $W/bench_lane.log 2>&1 &
if [ -n "$ARMS" ]; then
  tar xJf $DATA -C $W && st "unpacked $(cat $W/regen_*.jsonl | wc -l) answers"
  pids=""
  for vd in $(for a in $ARMS; do IFS=: read _ _ vd _ _ <<< "$a"; echo $vd; done | sort -u); do
    TOKENIZERS_PARALLELISM=true $E prepare --target $TARGET --data $W/regen_*.jsonl --out $W/data_$vd \
      --max-length 2048 --length-policy truncate --draft-vocab-size $vd > $R/prepare_$vd.log 2>&1 &
    pids="$pids $!"
  done
  wait $pids
  st "prepared: $(ls $W/data_*/report.json | tr '\n' ' ')"
  for a in $ARMS; do IFS=: read n g vd mlp t <<< "$a"; arm $n $g $vd $mlp $t & done
fi
wait
cat $W/bench_lane.log
st "done"
