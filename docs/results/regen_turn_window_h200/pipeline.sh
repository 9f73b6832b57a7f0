#!/usr/bin/env bash
# Session 8 A/B on one GPU: continue the bundled drafter on (A) greedy answers only vs (B) greedy + one
# sampled (T=0.8) answer per prompt; same prompts, same budget, trained side by side; MT-bench tree and chain 5.
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
W=/tmp/w; mkdir -p $W
E="python3 -m eagle3.cli"; T=smollm2; D=cuda:0
INIT=$PWD/src/eagle3/assets/smollm2-drafter
REGEN_S=${REGEN_S:-180}; TRAIN_S=${TRAIN_S:-450}
st() { echo "== $(date -u +%H:%M:%S) $*"; }
RG=(--target $T --device $D --dtype bfloat16 --engine fast --batch-size 512 --max-prompt-tokens 1280)
st "regenerate GSM8K, greedy"
$E regenerate "${RG[@]}" --temperature 0 --data /tmp/stage/gsm8k_train.jsonl --out $W/g_gsm.jsonl --max-new-tokens 512 2>&1 | tail -n 25
st "regenerate ShareGPT (2 turns), greedy, ${REGEN_S}s"
timeout $REGEN_S $E regenerate "${RG[@]}" --temperature 0 --data /tmp/stage/sharegpt_human.jsonl.gz --out $W/g_sg.jsonl --max-new-tokens 768 --max-turns 2 2>&1 | tail -n 5
st "regenerate GSM8K, sampled T=0.8"
$E regenerate "${RG[@]}" --temperature 0.8 --seed 1 --data /tmp/stage/gsm8k_train.jsonl --out $W/s_gsm.jsonl --max-new-tokens 512 2>&1 | tail -n 25
st "regenerate ShareGPT, sampled T=0.8, ${REGEN_S}s"
timeout $REGEN_S $E regenerate "${RG[@]}" --temperature 0.8 --seed 1 --data /tmp/stage/sharegpt_human.jsonl.gz --out $W/s_sg.jsonl --max-new-tokens 768 --max-turns 2 2>&1 | tail -n 5
wc -l $W/*.jsonl
st "prepare A and B"
P=(--target $T --max-length 2048 --length-policy truncate --vocab-from $INIT)
$E prepare "${P[@]}" --data $W/g_sg.jsonl $W/g_gsm.jsonl --out $W/dA > $W/prepA.log 2>&1 &
$E prepare "${P[@]}" --data $W/g_sg.jsonl $W/g_gsm.jsonl $W/s_sg.jsonl $W/s_gsm.jsonl --out $W/dB > $W/prepB.log 2>&1 &
wait; tail -n 30 $W/prepA.log $W/prepB.log
st "train A and B side by side, ${TRAIN_S}s each, from the bundled drafter"
for v in A B; do
  $E train --target $T --data $W/d$v --out $W/t$v --init $INIT --lr 3e-4 --batch-tokens 32768 --epochs 30 \
    --time-budget $TRAIN_S --save-every 200 --log-every 20 > $W/train$v.log 2>&1 &
done
python3 -m pytest -m gpu -q tests/test_fast.py tests/test_rows.py > $W/gputests.log 2>&1
wait
tail -n 3 $W/gputests.log
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
