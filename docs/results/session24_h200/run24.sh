#!/usr/bin/env bash
# Session 24 plan, two H200s (nvidia-h200-x2).
# #3, data: do more answer starts help? SmolLM2 writes SYNTH new prompts (seeds 2 and 3, one half per GPU; session
# 21's 66,000 used seed 1), deduplicated against v6's prompts, answered greedily with at most NEW_TOKENS tokens on
# both GPUs until REGEN_END; with v6's answers (.stage/c4/regen21.tar.xz) prepared once with v7's vocabulary:
#   cuda:0  "s": v7's recipe from scratch for BUDGET s (v7: 1,080 s on v6's answers alone)
#   cuda:1  "c": v7 continued exactly as session 23's arm b (--init v7, lr 3e-4, 2,767 steps; b on v6's answers:
#           tree 4.145, chain 5 2.827), so c - b is the new data's effect alone
# #5, on cuda:1 while prepare runs: the CUDA tests (graph_prefill's included, never run on a GPU); after prepare and
# before c: bench_serving at one client, 12 rounds of 128 tokens, without and with --graph-prefill (session 20: 2.00x).
#   SHA=... T0=$(date +%s) bash run24.sh
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  EAGLE3_GIT_SHA=${SHA:-unknown}
T0=${T0:-$(date +%s)}
W=${W:-/tmp/w}; R=$W/res; mkdir -p $R/s $R/c $R/serve
D0=${D0:-cuda:0}; D1=${D1:-cuda:1}; TARGET=smollm2; DATA=${DATA:-/tmp/stage/regen21.tar.xz}
SYNTH=${SYNTH:-50000}; NEW_TOKENS=${NEW_TOKENS:-128}; REGEN_END=$((T0 + ${REGEN_S:-400}))
BUDGET=${BUDGET:-900}; STEPS=${STEPS:-2767}; BATCH_TOKENS=${BATCH_TOKENS:-32768}; BATCH=${BATCH:-512}; NEW=${NEW:-256}
LIM=${EVAL_LIMIT:+--limit $EVAL_LIMIT}; SERVE=${SERVE:-1}; ROUNDS=${ROUNDS:-12}
V7=$PWD/src/eagle3/assets/smollm2-drafter
E="python3 -m eagle3.cli"
st() { echo "== $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*"; }
left() { local l=$(( $1 - $(date +%s) )); [ $l -lt 1 ] && l=1; echo $l; }  # never 0: timeout 0 means no limit
tau() { python3 -c "import json;print(json.load(open('$1'))['runs'][0]['tau'])" 2>/dev/null || echo 0; }
RG=(--target $TARGET --dtype bfloat16 --engine fast --batch-size $BATCH)
tar xJf $DATA -C $W && st "unpacked $(cat $W/regen_*.jsonl | wc -l) answers"
for g in 0 1; do
  dev=$([ $g = 0 ] && echo $D0 || echo $D1)
  $E synthesize "${RG[@]}" --device $dev --count $SYNTH --max-new-tokens 96 --seed $((g + 2)) \
    --out $W/synth_seed$((g + 2)).jsonl > $R/synth_$g.log 2>&1 &
done
wait
st "synthesized $(cat $W/synth_seed*.jsonl | wc -l)"
python3 - $W <<'PY'
# one copy of each prompt, none that v6's answers already have; two halves for the two GPUs
import json, sys
w = sys.argv[1]
first = lambda row: next(t["value"] for t in row["conversations"] if t["from"] in ("human", "user")).strip()
import glob
seen = {first(json.loads(l)) for f in glob.glob(f"{w}/regen_*.jsonl") for l in open(f)}
rows = []
for f in sorted(glob.glob(f"{w}/synth_seed*.jsonl")):
    for l in open(f):
        r = json.loads(l)
        if first(r) not in seen:
            seen.add(first(r)); rows.append(r)
for g in (0, 1):
    with open(f"{w}/synth_{g}.jsonl", "w") as out:
        out.writelines(json.dumps(r) + "\n" for r in rows[g::2])
print(f"unique new prompts: {len(rows)}")
PY
for g in 0 1; do
  dev=$([ $g = 0 ] && echo $D0 || echo $D1)
  timeout $(left $REGEN_END) $E regenerate "${RG[@]}" --device $dev --temperature 0 --data $W/synth_$g.jsonl \
    --out $W/regen_more_$g.jsonl --max-new-tokens $NEW_TOKENS --max-prompt-tokens 1280 > $R/regen_$g.log 2>&1 &
done
wait
st "answered: $(cat $W/regen_more_*.jsonl | wc -l) of $(cat $W/synth_?.jsonl | wc -l) (stopped at REGEN_END if short)"
(TOKENIZERS_PARALLELISM=true $E prepare --target $TARGET --data $W/regen_*.jsonl --out $W/data --max-length 2048 \
  --length-policy truncate --vocab-from $V7 > $R/prepare.log 2>&1; st "prepare rc=$?") &
if [ $SERVE = 1 ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_fast.py tests/test_rows.py tests/test_trainer.py \
    -k cuda > $R/serve/cuda_tests.log 2>&1
  st "CUDA tests rc=$?: $(tail -n 1 $R/serve/cuda_tests.log)"
fi
wait
(cd $W && nice -n 19 tar cf - regen_more_*.jsonl synth_?.jsonl | nice -n 19 xz -6 -T1 > $W/more.tar.xz.part \
  && mv $W/more.tar.xz.part $W/more.tar.xz && st "packed the new answers") &
evals() {  # evals NAME DEVICE: MT-bench tree and chain 5 side by side
  local n=$1 dev=$2
  for shape in "--tree 6,10,60" "--chain 5"; do
    local name=$(echo $shape | tr -d ' -' | tr ',' '_')
    OMP_NUM_THREADS=4 $E eval --target $TARGET --drafter $W/train_$n/drafter --device $dev --fast --datasets mt_bench \
      --max-new-tokens $NEW $shape $LIM --out $R/$n/eval_$name > $R/$n/eval_$name.log 2>&1 &
  done
  wait
  st "mt-bench $n: tree $(tau $R/$n/eval_tree6_10_60/eval.json) chain5 $(tau $R/$n/eval_chain5/eval.json)"
}
(st "train s on $D0 (scratch, $BUDGET s)"
 $E train --target $TARGET --data $W/data --out $W/train_s --device $D0 --epochs 30 --lr 1e-3 --time-budget $BUDGET \
   --batch-tokens $BATCH_TOKENS --save-every 200 --log-every 20 --val-fraction 0.01 > $R/s/train.log 2>&1
 st "train s rc=$?"; evals s $D0) &
(if [ $SERVE = 1 ]; then
   for gp in "" "--graph-prefill"; do
     o=$R/serve/serve1${gp:+_gp}
     timeout 240 python3 scripts/bench_serving.py --target $TARGET --drafter $V7 --device $D1 --concurrency 1 \
       --max-tokens 128 --rounds $ROUNDS $gp --out $o > $o.log 2>&1
     st "bench_serving ${gp:-(eager prefill)} rc=$?"; tail -n 4 $o.log
   done
 fi
 st "train c on $D1 (v7 continued, $STEPS steps)"
 $E train --target $TARGET --data $W/data --out $W/train_c --device $D1 --init $V7 --lr 3e-4 --max-steps $STEPS \
   --batch-tokens $BATCH_TOKENS --save-every 200 --log-every 20 --val-fraction 0.01 > $R/c/train.log 2>&1
 st "train c rc=$?"; evals c $D1) &
wait
st "done"
