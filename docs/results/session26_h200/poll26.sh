#!/usr/bin/env bash
# bash poll26.sh SECONDS [final]: wait for run26.sh (at most SECONDS; "final": 45 s less), print its progress and
# pack the records; the best arm's drafter too once its tree tau beats BASE_TREE (v7: 4.204) and its five sets ran.
end=$((SECONDS + $1)); W=${W:-/tmp/w}; R=$W/res
export PYTHONPATH=$PWD/src:/tmp/site W
stop=$end; [ "${2:-}" = final ] && stop=$((end - 45))
while [ $SECONDS -lt $stop ] && ! grep -q "^== .* done$" $W/pipe.log 2>/dev/null; do sleep 3; done
best=$(grep -oE "five sets [a-z0-9]+" $W/pipe.log | awk '{print $3}' | tail -n 1)
if [ -n "$best" ] && [ ! -f $W/packed ] && grep -q "^== .* done$" $W/pipe.log; then
  python3 - $best <<'PY'
import os, sys, torch
from eagle3.formats import load_drafter, save_drafter
w = os.environ["W"]
save_drafter(load_drafter(f"{w}/train_{sys.argv[1]}/drafter"), f"{w}/x_{sys.argv[1]}", format="speculators",
             include_embedding=False, dtype=torch.bfloat16)
PY
  tar cf - -C $W x_$best | split -b 15M - $OUT/drafter_$best.tar. && touch $W/packed
fi
cut -c1-250 $W/pipe.log | tail -n 40
for d in $W/train_*; do n=${d##*_}
  grep -hE "held-out|written" $R/$n/train.log 2>/dev/null | grep -v "step/s" | cut -c1-220 | tail -n 2
  mkdir -p $R/$n/train; cp $d/*.jsonl $d/*.json $R/$n/train/ 2>/dev/null
done
for d in $W/data_*; do cp $d/report.json $R/prepare_${d##*_}_report.json 2>/dev/null; done; cp $W/pipe.log $R/
tar czf $OUT/res.tgz -C $W res
ls -la $OUT
