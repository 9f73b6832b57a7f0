#!/usr/bin/env bash
# Session 9, third run: why the rows gate speculates on sampled requests where it loses: sampled T=0.8 with the
# gates' beliefs recorded per level.
set -u
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLE3_GIT_SHA=${SHA:-unknown}
R=/tmp/res3; mkdir -p $R
timeout 200 python3 scripts/bench_serving.py --target smollm2 --drafter src/eagle3/assets/smollm2-drafter --device cuda:0 \
  --concurrency 1 4 16 64 --max-tokens 128 --rounds 3 --temperature 0.8 --fast-rows on --out $R/sampled_gates > $R/sampled_gates.log 2>&1
echo "rc=$?"
python3 - <<'PY'
import json
r = json.load(open("/tmp/res3/sampled_gates/bench_serving.json"))
for x in r["results"]:
    print(x["mode"], x["concurrency"], x["tokens_per_s"], "spec_rows", x["spec_row_fraction"], "paused", x["paused_cycles"],
          "verify", x["verify_steps"], "cycle_ms", x["mean_cycle_ms"], json.dumps(x["gates"].get("rows")))
PY
cd $R && tar czf $OUT/res.tgz . ; ls -la $OUT
