#!/usr/bin/env bash
# bash poll10.sh SECONDS: wait for the pipeline (at most SECONDS), show progress; when done, pack results into $OUT
end=$((SECONDS + $1)); W=/tmp/w
while [ $SECONDS -lt $end ] && ! grep -q "^== .* done" $W/pipe.log 2>/dev/null; do sleep 5; done
tail -n 30 $W/pipe.log | cut -c1-400
[ -f $W/train/train_log.jsonl ] && tail -n 1 $W/train/train_log.jsonl | cut -c1-700
grep -h "time budget" $W/train.log 2>/dev/null | cut -c1-300
if grep -q "^== .* done" $W/pipe.log; then
  cd $W && tar czf $OUT/res.tgz --exclude='*.safetensors' --exclude='*.pt' pipe.log train.log eval_*.log *.report.json \
    eval_tree eval_chain train/train_log.jsonl train/*.json data/report.json 2>/dev/null
  mkdir -p $OUT/drafter && cp $W/x/*.json $OUT/drafter/ && split -n 2 -d $W/x/model.safetensors $OUT/drafter/st
  sha256sum $W/x/model.safetensors
fi
ls -la $OUT
