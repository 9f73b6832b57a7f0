#!/usr/bin/env bash
# last poll: wait for the MT-bench evals, pack the drafter, then wait for the rest until $1 seconds have passed
end=$((SECONDS + $1)); W=${W:-/tmp/w}; R=$W/res
export PYTHONPATH=$PWD/src:/tmp/site W
while [ $SECONDS -lt $((end - 60)) ] && ! grep -q "eval chain5" $W/pipe.log 2>/dev/null; do sleep 3; done
if [ -f $W/train/drafter/config.json ] || ls $W/train/drafter >/dev/null 2>&1; then
  python3 - <<'PY'
import os, torch
from eagle3.formats import load_drafter, save_drafter
save_drafter(load_drafter(os.environ["W"] + "/train/drafter"), os.environ["W"] + "/x", format="speculators", include_embedding=False,
             dtype=torch.bfloat16)
PY
  tar cf - -C $W x | split -b 15M - $OUT/drafter.tar.
fi
while [ $SECONDS -lt $end ] && ! grep -q "^== .* done" $W/pipe.log 2>/dev/null; do sleep 3; done
cut -c1-250 $W/pipe.log | tail -n 12
mkdir -p $R/train; cp $W/train/*.jsonl $W/train/*.json $R/train/ 2>/dev/null
cp $W/data/report.json $R/prepare_report.json 2>/dev/null; cp $W/pipe.log $R/
tar czf $OUT/res.tgz -C $W res
ls -la $OUT
