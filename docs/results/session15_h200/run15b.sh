#!/usr/bin/env bash
# Session 15, hold 3: eagle3 bench (80 MT-bench prompts) and one-client serving with the v4 bundled drafter.
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLE3_GIT_SHA=${SHA:-unknown}
R=/tmp/w/res; mkdir -p $R; D=src/eagle3/assets/smollm2-drafter
st() { echo "== $(date -u +%H:%M:%S) $*"; }
st "bench80 (v4 drafter)"
timeout 330 python3 -m eagle3.cli bench --device cuda:0 --target smollm2 --drafter $D --limit 80 --max-new-tokens 256 \
  --methods plain,chain,tree --out $R/bench80_v4 > $R/bench80_v4.log 2>&1; echo "rc=$?"; tail -n 7 $R/bench80_v4.log
st "serving, one client"
timeout 200 python3 scripts/bench_serving.py --target smollm2 --drafter $D --device cuda:0 --concurrency 1 \
  --max-tokens 128 --rounds 3 --fast-rows on --out $R/serve1_v4 > $R/serve1_v4.log 2>&1; echo "rc=$?"
grep -E "^(plain|spec) c=|^ +[0-9]+ \|" $R/serve1_v4.log | cut -c1-220
st "done"
