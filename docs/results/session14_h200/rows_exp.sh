#!/usr/bin/env bash
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLE3_GIT_SHA=${SHA:-unknown}
R=/tmp/w/res2; mkdir -p $R; D=src/eagle3/assets/smollm2-drafter
st() { echo "== $(date -u +%H:%M:%S) $*"; }
st "rows T=0.8 compiled dynamic (with fallback)"
timeout 240 python3 scripts/bench_rows.py --target smollm2 --drafter $D --device cuda:0 --temperature 0.8 --batch 1 4 16 64 \
  --budgets 512 --cycles 64 --out $R/rows_dyn > $R/rows_dyn.log 2>&1; echo "rc=$?"; grep -E "failed|budget" $R/rows_dyn.log | cut -c1-300
sed -i 's/self.pieces.compile(list(ROWS_DRAFTING_PIECES), dynamic=True)/self.pieces.compile(list(ROWS_DRAFTING_PIECES), dynamic=False)/' src/eagle3/fast/rows.py
st "rows T=0.8 compiled static per bucket"
timeout 300 python3 scripts/bench_rows.py --target smollm2 --drafter $D --device cuda:0 --temperature 0.8 --batch 1 4 16 64 \
  --budgets 512 --cycles 64 --out $R/rows_static > $R/rows_static.log 2>&1; echo "rc=$?"; grep -E "failed|budget|prepare" $R/rows_static.log | cut -c1-300
python3 -c "import json;d=json.load(open('$R/rows_static/bench_rows.json'));print([r['prepare_s'] for r in d['rows']])"
python3 -c "import json;d=json.load(open('$R/rows_dyn/bench_rows.json'));print([r['prepare_s'] for r in d['rows']])"
st "done"
