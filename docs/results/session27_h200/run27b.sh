#!/usr/bin/env bash
# Session 27 hold (two H200s of one host): A/B of the cycle changes, new (NEW_SHA) against old (OLD_SHA, 00d4067).
# New: RoPE tables laid out per head once a forward (vectorized products in every layer), v in the heads-first copy
# (contiguous cache writes), and no scatters in the compiled drafting pieces (inductor leaves int64/bool scatters
# to separate aten kernels on CUDA: 25 per tree cycle in this session's first profile).
# NGPU=2: each GPU runs its own version, then the other one; NGPU=1 (default): one after the other on cuda:0.
#   profile_step --shape smollm2-135m (random weights; plain step, 6,10,60 tree cycle)
#   eagle3 bench, 80 MT-bench prompts, v8 (bundled), plain + chain 5 + trees (first round: 6,10,60 and 8,10,100)
#   bench_serving, one client x 12 rounds (first round only); profile_step --shape llama8b (last, if time is left)
#   NEW_SHA=... OLD_SHA=... T0=$(date +%s) bash run27b.sh      (expects /tmp/ab/{new,old}_src, /tmp/ab/scripts)
set -uo pipefail
T0=${T0:-$(date +%s)}; END=$((T0 + ${SPAN:-1100}))
W=${W:-/tmp/w}; R=$W/res; mkdir -p $R
AB=${AB:-/tmp/ab}; S=$AB/scripts; V8=$AB/new_src/eagle3/assets/smollm2-drafter
BLIM=${BENCH_LIMIT:-80}; TOK=${NEW_TOKENS:-256}; ST=${SERVE_TOKENS:-128}; RND=${ROUNDS:-12}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
st() { echo "== $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*"; }
dev() { [ "${CPU_SMOKE:-0}" = 1 ] && echo cpu || echo cuda:$1; }
left() { echo $(( END - $(date +%s) )); }
# step VERSION GPU KIND TIMEOUT: one measurement of VERSION's code on GPU, skipped when too little time is left
step() {
  local v=$1 g=$2 kind=$3 t=$4; local o=$R/$v/gpu$g; mkdir -p $o
  [ -e $o/$kind.log ] && o=$o/again && mkdir -p $o  # a second run of the same measurement
  [ "${CPU_SMOKE:-0}" = 1 ] && [ $kind = profile8b ] && return  # 16 GB of random weights: not on a small CPU
  [ $(left) -lt $(( t / 2 )) ] && { st "skip $v $kind on gpu$g (left $(left) s)"; return; }
  [ $(left) -lt $t ] && t=$(left)
  local sha=$([ $v = new ] && echo ${NEW_SHA:-unknown} || echo ${OLD_SHA:-unknown})
  local env="PYTHONPATH=$AB/${v}_src:/tmp/site EAGLE3_CACHE=/tmp/cache_g$g EAGLE3_GIT_SHA=$sha"
  case $kind in
    profile|profile8b)
      local shape=$([ $kind = profile ] && echo smollm2-135m || echo llama8b)
      env $env timeout $t python3 $S/profile_step.py --device $(dev $g) --shape $shape --reps ${REPS:-20} \
        --out $o/$kind > $o/$kind.log 2>&1
      st "$v $kind gpu$g rc=$?: $(grep -E 'graph replay|tree cycle =' $o/$kind.log | cut -c1-95 | tr '\n' '|')";;
    bench|bench2)
      local trees=$([ $kind = bench ] && echo "6,10,60 8,10,100" || echo "6,10,60")
      env $env timeout $t python3 -m eagle3.cli bench --device $(dev $g) --target smollm2 --drafter $V8 \
        --limit $BLIM --max-new-tokens $TOK --methods plain,chain,tree --chain 5 --tree $trees \
        --out $o/$kind > $o/$kind.log 2>&1
      st "$v $kind gpu$g rc=$?: $(grep -E '^\([dfg]\) ' $o/$kind.log | tr -s ' ' | cut -c1-80 | tr '\n' '|')";;
    serve)
      env $env timeout $t python3 $S/bench_serving.py --target smollm2 --drafter $V8 --device $(dev $g) \
        --concurrency 1 --max-tokens $ST --rounds $RND --out $o/serve_c1 > $o/serve_c1.log 2>&1
      st "$v serve c1 gpu$g rc=$?: $(grep -E '^ +1 \|' $o/serve_c1.log)";;
  esac
}
if [ ${NGPU:-1} = 2 ]; then
  lane() {  # lane GPU FIRST SECOND
    local g=$1 a=$2 b=$3
    step $a $g profile 200; step $a $g bench 480; step $a $g serve 240
    step $b $g profile 200; step $b $g bench2 420
    step $a $g profile8b 200; step $b $g profile8b 200
  }
  lane 0 old new > $W/lane0.log 2>&1 &
  lane 1 new old > $W/lane1.log 2>&1 &
  wait
  cat $W/lane0.log $W/lane1.log
else  # one GPU: both versions one after the other, the profiles in both orders
  { step old 0 profile 200; step new 0 profile 200; step new 0 bench 480; step old 0 bench2 420
    step new 0 serve 240; step new 0 profile 200; step old 0 profile 200
    step new 0 profile8b 200; step old 0 profile8b 200; } > $W/lane0.log 2>&1
  cat $W/lane0.log
fi
st "done"
