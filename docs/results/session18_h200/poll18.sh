#!/usr/bin/env bash
# bash poll18.sh SECONDS: wait for run18 (at most SECONDS); pack logs, evals and the two drafters into $OUT
end=$((SECONDS + $1)); W=/tmp/w
export PYTHONPATH=$PWD/src:/tmp/site  # the first PACK=1 call lacked this (the export failed); the last one set it
while [ $SECONDS -lt $end ] && ! grep -q "^== .* done" $W/pipe.log 2>/dev/null; do sleep 5; done
grep -v "it/s\]" $W/pipe.log | cut -c1-250 | tail -n 30
grep -E "^== |time budget|tau" $W/res/recipeA.log 2>/dev/null | cut -c1-250 | tail -n 12
grep -E "time budget|held-out" $W/res/trainB.log 2>/dev/null | cut -c1-250 | tail -n 6
cd $W && mkdir -p res/A res/B
for x in A B; do
  [ -d train$x ] && cp train$x/*.jsonl train$x/*.json res/$x/ 2>/dev/null
done
cp -r eval_* data/report.json res/A/ 2>/dev/null
tar czf $OUT/res.tgz res 2>/dev/null
if [ "${PACK:-0}" = 1 ]; then
  python3 - <<'PY'
import torch
from pathlib import Path
from eagle3.formats import load_drafter, save_drafter
for x in "AB":
    p = Path(f"/tmp/w/train{x}/drafter")
    if p.exists():
        save_drafter(load_drafter(p), f"/tmp/w/x{x}", format="speculators", include_embedding=False, dtype=torch.bfloat16)
PY
  tar cf /tmp/w/drafters.tar -C /tmp/w xA xB 2>/dev/null; split -b 15M /tmp/w/drafters.tar $OUT/drafters.tar.
fi
ls -la $OUT
