#!/usr/bin/env bash
# bash poll21.sh SECONDS: wait for run21.sh (at most SECONDS), print its progress; once it is done, pack the records,
# the drafter (bf16 speculators checkpoint, in 15 MB parts) and the regenerated answers into $OUT
end=$((SECONDS + $1)); W=${W:-/tmp/w}; R=$W/res
export PYTHONPATH=$PWD/src:/tmp/site W
while [ $SECONDS -lt $end ] && ! grep -q "^== .* done" $W/pipe.log 2>/dev/null; do sleep 3; done
cut -c1-250 $W/pipe.log | tail -n 30
grep -hE "time budget|held-out|kept|written" $R/train.log $R/prepare.log 2>/dev/null | grep -v "step/s" | cut -c1-220 | tail -n 12
tail -n 1 $W/train/train_log.jsonl 2>/dev/null | cut -c1-400
if grep -q "^== .* done" $W/pipe.log; then
  mkdir -p $R/train; cp $W/train/*.jsonl $W/train/*.json $R/train/ 2>/dev/null
  cp $W/data/report.json $R/prepare_report.json 2>/dev/null; cp $W/*.report.json $R/ 2>/dev/null
  cp $W/pipe.log $R/
  python3 - <<'PY'
import os, torch
from eagle3.formats import load_drafter, save_drafter
save_drafter(load_drafter(os.environ["W"] + "/train/drafter"), os.environ["W"] + "/x", format="speculators", include_embedding=False,
             dtype=torch.bfloat16)
PY
  tar cf - -C $W x | split -b 15M - $OUT/drafter.tar.
  # the answers only where they fit beside the rest (8 files, 64 MiB back)
  [ -f $W/regen.tar.gz ] && [ $(stat -c %s $W/regen.tar.gz) -lt 40000000 ] && split -b 15M $W/regen.tar.gz $OUT/regen.tar.gz.
fi
tar czf $OUT/res.tgz -C $W res
ls -la $OUT
