#!/usr/bin/env bash
# bash poll25.sh SECONDS [final]: wait for run25.sh (at most SECONDS; "final": 45 s less), print its progress and
# pack the records; each arm's drafter too once its tree tau beats BASE_TREE (v7: 4.204).
end=$((SECONDS + $1)); W=${W:-/tmp/w}; R=$W/res
export PYTHONPATH=$PWD/src:/tmp/site W
pack() {  # pack NAME
  [ -f $W/packed_$1 ] && return
  t=$(python3 -c "import json;print(json.load(open('$R/$1/eval_tree6_10_60/eval.json'))['runs'][0]['tau'])" 2>/dev/null || echo 0)
  python3 -c "import sys; sys.exit(0 if $t > ${BASE_TREE:-4.204} else 1)" || return
  python3 - $1 <<'PY'
import os, sys, torch
from eagle3.formats import load_drafter, save_drafter
w = os.environ["W"]
save_drafter(load_drafter(f"{w}/train_{sys.argv[1]}/drafter"), f"{w}/x_{sys.argv[1]}", format="speculators",
             include_embedding=False, dtype=torch.bfloat16)
PY
  tar cf - -C $W x_$1 | split -b 15M - $OUT/drafter_$1.tar. && touch $W/packed_$1
}
stop=$end; [ "${2:-}" = final ] && stop=$((end - 45))
while [ $SECONDS -lt $stop ] && ! grep -q "^== .* done$" $W/pipe.log 2>/dev/null; do sleep 3; done
for n in w v; do [ -f $R/$n/eval_chain5/eval.json ] && pack $n; done
cut -c1-250 $W/pipe.log | tail -n 30
for n in w v; do
  grep -hE "time budget|held-out|written" $R/$n/train.log 2>/dev/null | grep -v "step/s" | cut -c1-220 | tail -n 4
  tail -n 1 $W/train_$n/train_log.jsonl 2>/dev/null | cut -c1-500
  mkdir -p $R/$n/train; cp $W/train_$n/*.jsonl $W/train_$n/*.json $R/$n/train/ 2>/dev/null
done
cp $W/data8k/report.json $R/prepare8k_report.json 2>/dev/null; cp $W/data16k/report.json $R/prepare16k_report.json 2>/dev/null; cp $W/*.report.json $R/ 2>/dev/null; cp $W/pipe.log $R/
tar czf $OUT/res.tgz -C $W res
ls -la $OUT
