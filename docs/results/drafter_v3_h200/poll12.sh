#!/usr/bin/env bash
# bash poll12.sh SECONDS: wait for run12 (at most SECONDS), show progress; when done, pack results into $OUT
end=$((SECONDS + $1)); W=/tmp/w
while [ $SECONDS -lt $end ] && ! grep -q "^== .* done" $W/pipe.log 2>/dev/null; do sleep 5; done
tail -n 25 $W/pipe.log | cut -c1-300; grep -E "^== " $W/recipe.log | tail -n 3
[ -f $W/train/train_log.jsonl ] && tail -n 1 $W/train/train_log.jsonl | cut -c1-500
[ -f $W/train/val_log.jsonl ] && tail -n 2 $W/train/val_log.jsonl | cut -c1-500
if grep -q "^== .* done" $W/pipe.log; then
  cd $W && tar czf $OUT/res.tgz --exclude='*.safetensors' --exclude='*.pt' pipe.log recipe.log *.report.json \
    eval_* train/train_log.jsonl train/val_log.jsonl train/*.json data/report.json 2>/dev/null
  mkdir -p $OUT/drafter && cp $W/x/*.json $OUT/drafter/ && split -n 2 -d $W/x/model.safetensors $OUT/drafter/st
  sha256sum $W/x/model.safetensors
fi
ls -la $OUT
