#!/usr/bin/env bash
# Session 36 (one H200): recipe v7/v8's training data made again (the answers of session 21 did not survive), and
# SmolLM2's answers sampled at T=0.8 to the same synthesized prompts (the data lever docs/training.md lists as
# untried), packed so that later holds can spend their time on training. Stages in order of need; the last one
# stops at the deadline, keeping its finished rows (regenerate resumes).
#   SHA=... T0=$(date +%s) setsid nohup bash run36.sh &     (inputs in /tmp/in; everything else in /tmp/w)
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  EAGLE3_GIT_SHA=${SHA:-unknown}
T0=${T0:-$(date +%s)}; S=${S:-/tmp/in}; W=${W:-/tmp/w}; R=$W/res; mkdir -p $R
END=$((T0 + ${REGEN_S:-1140}))
E="python3 -m eagle3.cli"
RG=(--target smollm2 --device ${DEV:-cuda:0} --dtype bfloat16 --engine fast --batch-size ${BATCH:-512})  # DEV=cpu COUNT=8 LIMIT=3: a smoke run
st() { echo "== $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*" >> $W/pipe.log; }
left() { local l=$(( END - $(date +%s) )); [ $l -lt 1 ] && l=1; echo $l; }  # never 0: timeout 0 means no limit
regen() {  # regen NAME T DATA TOKENS PROMPT_TOKENS [more flags]
  local n=$1 t=$2 data=$3 tok=$4 ptok=$5; shift 5
  timeout $(left) $E regenerate "${RG[@]}" --temperature $t --seed 1 --data $data --out $W/regen_$n.jsonl \
    --max-new-tokens $tok --max-prompt-tokens $ptok ${LIMIT:+--limit $LIMIT} "$@" > $R/regen_$n.log 2>&1
  st "regen $n rc=$?: $(wc -l < $W/regen_$n.jsonl 2>/dev/null) rows"
}
st "start $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"
$E synthesize "${RG[@]}" --count ${COUNT:-66000} --max-new-tokens 96 --seed 1 --out $W/synth.jsonl > $R/synth.log 2>&1
st "synthesize rc=$?: $(wc -l < $W/synth.jsonl) prompts"
regen gsm8k 0 $S/gsm8k_train.jsonl.gz 512 512
regen gsm8k_t 0.8 $S/gsm8k_train.jsonl.gz 512 512
regen sharegpt 0 $S/sharegpt_human.jsonl.gz 384 1280 --max-turns 2
regen synth 0 $W/synth.jsonl 256 1280
regen synth_t 0.8 $W/synth.jsonl 256 1280
cp $W/*.report.json $R/ 2>/dev/null
(cd $W && tar cf - synth.jsonl regen_*.jsonl *.report.json | xz -T0 -6 > $W/regen36.tar.xz)
st "packed $(stat -c %s $W/regen36.tar.xz) bytes, sha256 $(sha256sum $W/regen36.tar.xz | cut -c1-16)"
st "done"
