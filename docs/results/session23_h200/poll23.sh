#!/usr/bin/env bash
# bash poll23.sh SECONDS [final]: wait for run23.sh (at most SECONDS), print its progress. Once the MT-bench evals
# are in, pack (once) the drafter of each arm whose tree tau beats BASE_TREE (bf16 speculators, 15 MB parts);
# with "final", stop 45 s early if need be and always pack the records.
end=$((SECONDS + $1)); W=${W:-/tmp/w}; R=$W/res
export PYTHONPATH=$PWD/src:/tmp/site W
pack() {
  [ -f $W/packed ] && return
  for n in a b; do
    t=$(python3 -c "import json;print(json.load(open('$R/$n/eval_tree6_10_60/eval.json'))['runs'][0]['tau'])" 2>/dev/null || echo 0)
    python3 -c "import sys; sys.exit(0 if $t > ${BASE_TREE:-4.204} else 1)" || continue
    python3 - $n <<'PY'
import os, sys, torch
from eagle3.formats import load_drafter, save_drafter
w = os.environ["W"]
save_drafter(load_drafter(f"{w}/train_{sys.argv[1]}/drafter"), f"{w}/x_{sys.argv[1]}", format="speculators",
             include_embedding=False, dtype=torch.bfloat16)
PY
    tar cf - -C $W x_$n | split -b 15M - $OUT/drafter_$n.tar.
  done
  touch $W/packed
}
stop=$end; [ "${2:-}" = final ] && stop=$((end - 45))
while [ $SECONDS -lt $stop ] && ! grep -q "^== .* done$" $W/pipe.log 2>/dev/null; do
  grep -q "mt-bench finished" $W/pipe.log 2>/dev/null && [ ! -f $W/packed ] && pack
  sleep 3
done
grep -q "mt-bench finished" $W/pipe.log 2>/dev/null && pack
cut -c1-250 $W/pipe.log | tail -n 30
for n in a b; do
  grep -hE "time budget|held-out|written" $R/$n/train.log 2>/dev/null | grep -v "step/s" | cut -c1-220 | tail -n 6
  tail -n 1 $W/train_$n/train_log.jsonl 2>/dev/null | cut -c1-600
done
for n in a b; do mkdir -p $R/$n/train; cp $W/train_$n/*.jsonl $W/train_$n/*.json $R/$n/train/ 2>/dev/null; done
cp $W/data/report.json $R/prepare_report.json 2>/dev/null; cp $W/pipe.log $R/
tar czf $OUT/res.tgz -C $W res
ls -la $OUT
