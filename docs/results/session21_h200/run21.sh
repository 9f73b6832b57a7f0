#!/usr/bin/env bash
# Session 21 (nvidia-h200-x2, one hold): recipe v6 from scratch. Data: SmolLM2's own answers to ShareGPT (greedy),
# GSM8K train (greedy and sampled at T=0.8) and to SYNTH prompts it writes itself (greedy, at most 256 new tokens),
# regenerated on both GPUs until REGEN_END; then prepare, and train on cuda:0 with 65,536-token batches until
# TRAIN_END; then MT-bench tree 6,10,60 on cuda:0 and chain 5 on cuda:1 at once.
#   SHA=... T0=$(date +%s) bash run21.sh   (S: the staged inputs; everything goes to /tmp/w)
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  EAGLE3_GIT_SHA=${SHA:-unknown}
T0=${T0:-$(date +%s)}
S=${S:-/tmp/stage}; W=${W:-/tmp/w}; R=$W/res; mkdir -p $R
D0=${D0:-cuda:0}; D1=${D1:-cuda:1}; TARGET=${TARGET:-smollm2}
SYNTH=${SYNTH:-80000}; SPLIT=${SPLIT:-66000}          # synth_a (first SPLIT) answered on D1, synth_b on D0
REGEN_END=$((T0 + ${REGEN_S:-480})); TRAIN_END=$((T0 + ${TRAIN_S:-1400}))
BATCH=${BATCH:-512}; BATCH_TOKENS=${BATCH_TOKENS:-65536}; EVAL_TOKENS=${EVAL_TOKENS:-256}
E="python3 -m eagle3.cli"
st() { echo "== $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*"; }
left() { local l=$(( $1 - $(date +%s) )); [ $l -lt 1 ] && l=1; echo $l; }  # never 0: timeout 0 means no limit
RG=(--target $TARGET --dtype ${DTYPE:-bfloat16} --engine ${ENGINE:-fast} --batch-size $BATCH)

gpu1() {
  st "gpu1: synthesize $SYNTH"
  $E synthesize "${RG[@]}" --device $D1 --count $SYNTH --max-new-tokens 96 --seed 1 --out $W/synth.jsonl
  head -n $SPLIT $W/synth.jsonl > $W/synth_a.jsonl; tail -n +$((SPLIT + 1)) $W/synth.jsonl > $W/synth_b.jsonl
  st "gpu1: answer synth_a ($(wc -l < $W/synth_a.jsonl)), $(left $REGEN_END) s left"
  timeout $(left $REGEN_END) $E regenerate "${RG[@]}" --device $D1 --temperature 0 --data $W/synth_a.jsonl \
    --out $W/regen_synth_a.jsonl --max-new-tokens 256 --max-prompt-tokens 1280
  st "gpu1: done rc=$?"
}
gpu1 > $R/gpu1.log 2>&1 &
st "gpu0: GSM8K greedy"
$E regenerate "${RG[@]}" --device $D0 --temperature 0 --data $S/gsm8k_train.jsonl --out $W/regen_gsm8k.jsonl \
  --max-new-tokens 512 --max-prompt-tokens 512 > $R/gpu0.log 2>&1
st "gpu0: ShareGPT greedy, 2 turns, 384 tokens"
timeout $(left $REGEN_END) $E regenerate "${RG[@]}" --device $D0 --temperature 0 --data $S/sharegpt_human.jsonl.gz \
  --out $W/regen_sharegpt.jsonl --max-new-tokens 384 --max-prompt-tokens 1280 --max-turns 2 >> $R/gpu0.log 2>&1
st "gpu0: GSM8K sampled T=0.8"
timeout $(left $REGEN_END) $E regenerate "${RG[@]}" --device $D0 --temperature 0.8 --seed 1 --data $S/gsm8k_train.jsonl \
  --out $W/regen_gsm8k_t.jsonl --max-new-tokens 512 --max-prompt-tokens 512 >> $R/gpu0.log 2>&1
while [ ! -s $W/synth_b.jsonl ] && [ $(left $REGEN_END) -gt 30 ]; do sleep 2; done
if [ $(left $REGEN_END) -gt 30 ]; then
  st "gpu0: answer synth_b, $(left $REGEN_END) s left"
  timeout $(left $REGEN_END) $E regenerate "${RG[@]}" --device $D0 --temperature 0 --data $W/synth_b.jsonl \
    --out $W/regen_synth_b.jsonl --max-new-tokens 256 --max-prompt-tokens 1280 >> $R/gpu0.log 2>&1
fi
wait
st "regenerated: $(wc -l $W/regen_*.jsonl | tr '\n' ' ')"
st "prepare"
TOKENIZERS_PARALLELISM=true $E prepare --target $TARGET --data $W/regen_*.jsonl --out $W/data --max-length 2048 \
  --length-policy truncate --draft-vocab-size 8192 > $R/prepare.log 2>&1
st "prepare rc=$?"
# pack the answers for later sessions while training runs (one core, lowest priority)
(cd $W && nice -n 19 tar cf - regen_*.jsonl synth.jsonl | nice -n 19 gzip -6 > $W/regen.tar.gz; st "packed") &
BUDGET=$(( $(left $TRAIN_END) - 60 ))
st "train: budget $BUDGET s, $BATCH_TOKENS-token batches"
$E train --target $TARGET --data $W/data --out $W/train --device $D0 --epochs 30 --lr 1e-3 --time-budget $BUDGET \
  --batch-tokens $BATCH_TOKENS ${TRAIN_ARGS:-} --save-every 200 --log-every 20 --val-fraction 0.01 > $R/train.log 2>&1
st "train rc=$?"
for job in "$D0 --tree 6,10,60" "$D1 --chain 5"; do
  set -- $job; name=${3//,/_}
  $E eval --target $TARGET --drafter $W/train/drafter --device $1 --fast --datasets mt_bench \
    --max-new-tokens $EVAL_TOKENS $2 $3 ${EVAL_LIMIT:+--limit $EVAL_LIMIT} --out $R/eval_${2#--}$name > $R/eval_${2#--}$name.log 2>&1 &
done
wait
st "evals: $(grep -ho '"tau": [0-9.]*' $R/eval_*/*.json 2>/dev/null | head -4 | tr '\n' ' ')"
st "done"
