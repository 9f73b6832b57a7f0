#!/usr/bin/env bash
# bash poll28.sh SECONDS [final]: wait for run28.sh (at most SECONDS; "final": 45 s less), print its progress and
# pack the records into $OUT; an arm whose MT-bench tree tau beats BASE_TREE (v8: 4.266) comes back too (bf16,
# speculators format, 15 MB parts), to be checked on the CPU (eagle3 check, the demo) before bundling.
end=$((SECONDS + $1)); W=${W:-/tmp/w}; R=$W/res; BASE_TREE=${BASE_TREE:-4.266}
export PYTHONPATH=$PWD/src:/tmp/site W
stop=$end; [ "${2:-}" = final ] && stop=$((end - 45))
while [ $SECONDS -lt $stop ] && ! grep -q "^== .* done$" $W/pipe.log 2>/dev/null; do sleep 3; done
for f in $R/*/eval_tree6_10_60/eval.json; do
  [ -f "$f" ] || continue; n=$(basename $(dirname $(dirname $f)))
  t=$(python3 -c "import json;print(json.load(open('$f'))['runs'][0]['tau'])")
  if python3 -c "import sys; sys.exit(0 if $t > $BASE_TREE else 1)" && [ ! -f $W/packed_$n ]; then
    python3 - $n <<'PY'
import os, sys, torch
from eagle3.formats import load_drafter, save_drafter
w = os.environ["W"]
save_drafter(load_drafter(f"{w}/train_{sys.argv[1]}/drafter"), f"{w}/x_{sys.argv[1]}", format="speculators",
             include_embedding=False, dtype=torch.bfloat16)
PY
    tar cf - -C $W x_$n | split -b 15M - $OUT/drafter_$n.tar. && touch $W/packed_$n
  fi
done
cut -c1-300 $W/pipe.log | tail -n 30; cut -c1-300 $W/bench_lane.log 2>/dev/null
for d in $W/train_*; do [ -d "$d" ] || continue; n=${d##*_}
  mkdir -p $R/$n/train; cp $d/*.jsonl $d/*.json $R/$n/train/ 2>/dev/null
done
cp $W/pipe.log $W/bench_lane.log $R/ 2>/dev/null
tar czf $OUT/res.tgz -C $W res
ls -la $OUT
