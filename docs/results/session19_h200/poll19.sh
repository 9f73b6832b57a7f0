#!/usr/bin/env bash
# bash poll19.sh SECONDS: wait for run19 (at most SECONDS); then pack records and, once trained, the drafter into $OUT
end=$((SECONDS + $1)); W=/tmp/w; R=$W/res
export PYTHONPATH=$PWD/src:/tmp/site
while [ $SECONDS -lt $end ] && ! grep -q "recipe finished" $W/pipe.log 2>/dev/null; do sleep 5; done
cat $W/pipe.log | cut -c1-250 | tail -n 20
grep -E "^== |time budget|held-out|rows |tokens |seconds|kept|generated" $R/recipe.log 2>/dev/null | grep -v "it/s\]" | cut -c1-200 | tail -n 40
cd $W && mkdir -p $R/train
cp train/*.jsonl train/*.json $R/train/ 2>/dev/null
cp data/report.json $R/prepare_report.json 2>/dev/null; cp synth.log *.report.json $R/ 2>/dev/null
tar czf $OUT/res.tgz -C $W res 2>/dev/null
if grep -q "recipe finished" $W/pipe.log && [ -f train/drafter/model.safetensors ]; then
  python3 - <<'PY'
import torch
from eagle3.formats import load_drafter, save_drafter
save_drafter(load_drafter("/tmp/w/train/drafter"), "/tmp/w/x", format="speculators", include_embedding=False,
             dtype=torch.bfloat16)
PY
  tar cf - -C $W x | split -b 15M - $OUT/drafter.tar.
  gzip -c synth.jsonl > $OUT/synth.jsonl.gz; gzip -c regen_synth.jsonl | split -b 15M - $OUT/regen_synth.jsonl.gz.
fi
ls -la $OUT
