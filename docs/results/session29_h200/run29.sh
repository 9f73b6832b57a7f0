#!/usr/bin/env bash
# Session 29 plan (NGPU=1 or 2). #4: `--fuse-pointwise elementwise` (RoPE with the heads-first copy, and SwiGLU,
# compiled; the norms eager): the CUDA tests, A/B profiles against the default, the 80-prompt bench with and
# without it (are bf16 chains still 80/80 identical?), the real model's pieces. #5: one client over all 80
# MT-bench prompts x 256 tokens (the 12 x 128 workload of sessions 24-28 has a lower tau), then 1/4/16/64 clients
# with v8. Both lanes on cuda:0, one after the other. #3 with NGPU >= 2: arm g10 on cuda:1 (--step-decay 1);
# NGPU >= 3: arm r8 on cuda:2 (v8's recipe, --seed 1: the run-to-run spread).
#   NGPU=2 T0=$(date +%s) SHA=... bash run29.sh
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  EAGLE3_GIT_SHA=${SHA:-unknown}
T0=${T0:-$(date +%s)}; NGPU=${NGPU:-1}
W=${W:-/tmp/w}; R=$W/res; mkdir -p $R/bench $R/profile $R/serve $R/tests
TARGET=smollm2; V8=$PWD/src/eagle3/assets/smollm2-drafter; NEW=${NEW:-256}; BLIM=${BENCH_LIMIT:-80}
E="python3 -m eagle3.cli"
gpu() { [ "${CPU_SMOKE:-0}" = 1 ] && echo cpu || echo cuda:$1; }
st() { echo "== $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*"; }
fp() { [ "$1" = none ] || echo "--fuse-pointwise $1"; }
bench_lane() {
  [ "${CPU_SMOKE:-0}" = 1 ] || { timeout 300 python3 -m pytest -q -x tests/test_fast.py -k "cuda or chain_rows" \
    > $R/tests/cuda.log 2>&1; st "cuda tests rc=$?: $(tail -n 1 $R/tests/cuda.log)"; }
  for f in none elementwise elementwise none; do
    local o=$R/profile/ab_$f; [ -e $o.log ] && o=${o}_again
    timeout 200 python3 scripts/profile_step.py --device $(gpu 0) --shape smollm2-135m --reps ${REPS:-20} $(fp $f) \
      --out $o > $o.log 2>&1
    st "ab $f rc=$?: $(grep -E 'graph replay|tree cycle =' $o.log | cut -c1-90 | tr '\n' '|')"
  done
  for f in elementwise none; do
    timeout 420 $E bench --device $(gpu 0) --target $TARGET --drafter $V8 --limit $BLIM --max-new-tokens $NEW \
      --methods plain,chain,tree --chain 5 --tree 6,10,60 8,10,100 $(fp $f) --out $R/bench/$f > $R/bench/$f.log 2>&1
    st "bench $f rc=$?: $(grep -E '^\([dfg]\) ' $R/bench/$f.log | tr -s ' ' | cut -c1-90 | tr '\n' '|')"
  done
  timeout 300 python3 scripts/profile_step.py --device $(gpu 0) --target $TARGET --drafter $V8 --by-source 30 --pieces \
    --fuse-pointwise elementwise --out $R/profile/smollm2_elementwise > $R/profile/smollm2_elementwise.log 2>&1
  st "profile elementwise rc=$?: $(grep -E 'tree cycle =|pieces in' $R/profile/smollm2_elementwise.log | tr '\n' '|')"
  [ "${CPU_SMOKE:-0}" = 1 ] && return  # no 8B shape on a CPU
  timeout 200 python3 scripts/profile_step.py --device $(gpu 0) --shape llama8b --reps ${REPS:-20} \
    --fuse-pointwise elementwise --out $R/profile/p8b_elementwise > $R/profile/p8b_elementwise.log 2>&1
  st "8b elementwise rc=$?: $(grep -E 'graph replay|tree cycle =|bandwidth' $R/profile/p8b_elementwise.log | cut -c1-100 | tr '\n' '|')"
  timeout 200 python3 scripts/profile_step.py --device $(gpu 0) --shape llama8b --reps ${REPS:-20} \
    --out $R/profile/p8b_none > $R/profile/p8b_none.log 2>&1
  st "8b none rc=$?: $(grep -E 'graph replay|tree cycle =|bandwidth' $R/profile/p8b_none.log | cut -c1-100 | tr '\n' '|')"
}
serve_lane() {  # serve_lane GPU
  local dev=$(gpu $1)
  c1() {
    timeout 420 python3 scripts/bench_serving.py --target $TARGET --drafter $V8 --device $dev --concurrency 1 \
      --max-tokens $NEW --rounds ${C1_ROUNDS:-80} $(fp $1) --out $R/serve/c1_$1 > $R/serve/c1_$1.log 2>&1
    st "serve c1 x ${C1_ROUNDS:-80} $1 rc=$?: $(grep -E '^ +1 \|' $R/serve/c1_$1.log | tr -s ' ')"
  }
  c1 none
  timeout 500 python3 scripts/bench_serving.py --target $TARGET --drafter $V8 --device $dev --concurrency 1 4 16 64 \
    --max-tokens $NEW --out $R/serve/curve > $R/serve/curve.log 2>&1
  st "serve curve rc=$?: $(grep -E '^ +[0-9]+ \|' $R/serve/curve.log | tr -s ' ' | tr '\n' '|')"
  c1 elementwise
}
arm() {  # arm NAME GPU VOCAB MLP TEMPERATURE DECAY [TRAIN FLAGS...]: v8's recipe from scratch on v7's data
  local n=$1 dev=$(gpu $2); mkdir -p $R/$n
  $E train --target $TARGET --data $W/data_$3 --out $W/train_$n --device $dev --epochs 30 --lr 1e-3 \
    --time-budget ${BUDGET:-1000} --batch-tokens ${BATCH_TOKENS:-32768} --save-every 200 --log-every 20 --val-fraction 0.01 \
    --intermediate-size $4 --label-temperature $5 --step-decay $6 "${@:7}" > $R/$n/train.log 2>&1
  st "train $n rc=$?"
  for shape in "--tree 6,10,60" "--chain 5"; do
    local name=$(echo $shape | tr -d ' -' | tr ',' '_')
    OMP_NUM_THREADS=4 $E eval --target $TARGET --drafter $W/train_$n/drafter --device $dev --fast --datasets mt_bench \
      --max-new-tokens $NEW $shape ${EVAL_LIMIT:+--limit $EVAL_LIMIT} --graph-prefill off --out $R/$n/eval_$name \
      > $R/$n/eval_$name.log 2>&1 &
  done
  wait
  st "mt-bench $n: tree $(python3 -c "import json;print(json.load(open('$R/$n/eval_tree6_10_60/eval.json'))['runs'][0]['tau'])" 2>/dev/null) chain5 $(python3 -c "import json;print(json.load(open('$R/$n/eval_chain5/eval.json'))['runs'][0]['tau'])" 2>/dev/null)"
}
# the GPU lanes one after the other on cuda:0 (timings alone on their GPU); with NGPU >= 2 and the data staged,
# arm g10 on cuda:1: TTT steps weighed alike (--step-decay 1; v8: 0.8, EAGLE-3's)
(bench_lane > $W/bench_lane.log 2>&1; serve_lane 0 > $W/serve_lane.log 2>&1) &
DATA=${DATA:-/tmp/stage/regen21.tar.xz}
if [ $NGPU -ge 2 ] && [ -f $DATA ]; then
  tar xJf $DATA -C $W && st "unpacked $(cat $W/regen_*.jsonl | wc -l) answers"
  TOKENIZERS_PARALLELISM=true $E prepare --target $TARGET --data $W/regen_*.jsonl --out $W/data_12288 \
    --max-length 2048 --length-policy truncate --draft-vocab-size 12288 > $R/prepare_12288.log 2>&1
  st "prepared rc=$?"
  arm g10 1 12288 1536 0.5 1.0 &
  # four GPUs: v8's recipe again with another seed (how much two runs of one recipe differ: never measured)
  [ $NGPU -ge 3 ] && arm r8 2 12288 1536 0.5 0.8 --seed 1 &
  wait
fi
wait
cat $W/bench_lane.log $W/serve_lane.log
st "done"
