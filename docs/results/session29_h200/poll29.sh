#!/usr/bin/env bash
# bash poll29.sh SECONDS [final]: wait for run29.sh (at most SECONDS; "final": 30 s less), print its progress
# and pack the records into $OUT.
end=$((SECONDS + $1)); W=${W:-/tmp/w}; R=$W/res
stop=$end; [ "${2:-}" = final ] && stop=$((end - 30))
while [ $SECONDS -lt $stop ] && ! grep -q "^== .* done$" $W/pipe.log 2>/dev/null; do sleep 3; done
cut -c1-300 $W/pipe.log | tail -n 30; cut -c1-300 $W/bench_lane.log $W/serve_lane.log 2>/dev/null
cp $W/pipe.log $W/bench_lane.log $W/serve_lane.log $R/ 2>/dev/null
for d in $W/train_*; do [ -d "$d" ] || continue; n=${d##*_}; mkdir -p $R/$n/train; cp $d/*.jsonl $d/*.json $R/$n/train/ 2>/dev/null; done
f=$R/g10/eval_tree6_10_60/eval.json  # an arm over v8's 4.266 comes back too (bf16, speculators format, 15 MB parts)
if [ -f $f ] && python3 -c "import json,sys; sys.exit(0 if json.load(open('$f'))['runs'][0]['tau'] > 4.266 else 1)" && [ ! -f $W/packed ]; then
  PYTHONPATH=$PWD/src:/tmp/site python3 -c "
import torch; from eagle3.formats import load_drafter, save_drafter
save_drafter(load_drafter('$W/train_g10/drafter'), '$W/x_g10', format='speculators', include_embedding=False, dtype=torch.bfloat16)"
  tar cf - -C $W x_g10 | split -b 15M - $OUT/drafter_g10.tar. && touch $W/packed
fi
tar czf $OUT/res.tgz -C $W res
ls -la $OUT
