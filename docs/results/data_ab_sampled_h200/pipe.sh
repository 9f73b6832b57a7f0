#!/usr/bin/env bash
# Session 9 A/B on one GPU: continue the bundled drafter on (A) greedy answers only vs (B) greedy + one
# sampled (T=0.8) answer per prompt; same prompts, same time budget, trained side by side; MT-bench tree and chain 5.
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
W=/tmp/w; mkdir -p $W
E="python3 -m eagle3.cli"; T=smollm2; D=cuda:0
INIT=$PWD/src/eagle3/assets/smollm2-drafter
NSG=${NSG:-3000}; NGSM=${NGSM:-3000}; TRAIN_S=${TRAIN_S:-420}
st() { echo "== $(date -u +%H:%M:%S) $*"; }
RG=(--target $T --device $D --dtype bfloat16 --engine fast --batch-size 512 --max-prompt-tokens 1280)
for temp in 0 0.8; do
  tag=g; [ $temp = 0 ] || tag=s
  st "regenerate GSM8K ($NGSM), T=$temp"
  $E regenerate "${RG[@]}" --temperature $temp --seed 1 --limit $NGSM --data /tmp/stage/gsm8k_train.jsonl --out $W/${tag}_gsm.jsonl --max-new-tokens 512 2>&1 | tail -n 4
  st "regenerate ShareGPT ($NSG, 2 turns), T=$temp"
  $E regenerate "${RG[@]}" --temperature $temp --seed 1 --limit $NSG --data /tmp/stage/sharegpt_human.jsonl.gz --out $W/${tag}_sg.jsonl --max-new-tokens 768 --max-turns 2 2>&1 | tail -n 4
done
wc -l $W/*.jsonl
st "prepare A and B"
P=(--target $T --max-length 2048 --length-policy truncate --vocab-from $INIT)
$E prepare "${P[@]}" --data $W/g_sg.jsonl $W/g_gsm.jsonl --out $W/dA > $W/prepA.log 2>&1 &
$E prepare "${P[@]}" --data $W/g_sg.jsonl $W/g_gsm.jsonl $W/s_sg.jsonl $W/s_gsm.jsonl --out $W/dB > $W/prepB.log 2>&1 &
wait; tail -n 12 $W/prepA.log $W/prepB.log
st "train A and B side by side, ${TRAIN_S}s each, from the bundled drafter"
for v in A B; do
  $E train --target $T --data $W/d$v --out $W/t$v --init $INIT --lr 3e-4 --batch-tokens 32768 --epochs 30 \
    --time-budget $TRAIN_S --save-every 200 --log-every 20 > $W/train$v.log 2>&1 &
done
wait
st "eval on MT-bench (80 first turns, 256 tokens)"
for v in A B; do
  ( for s in tree chain; do
      [ $s = tree ] && shape=(--tree 6,10,60) || shape=(--chain 5)
      $E eval --target $T --drafter $W/t$v/drafter --device $D --fast --datasets mt_bench --max-new-tokens 256 "${shape[@]}" --out $W/eval${v}_$s
    done ) > $W/eval$v.log 2>&1 &
done
wait
grep -h -i "tau" $W/eval*.log | head -20
st "done"
