#!/usr/bin/env bash
# bash poll.sh SECONDS: wait for the pipeline (at most SECONDS), show progress, pack results into $OUT
end=$((SECONDS + $1)); W=/tmp/w
while [ $SECONDS -lt $end ] && ! grep -q "^== .* done" $W/pipe.log 2>/dev/null; do sleep 5; done
tail -n 40 $W/pipe.log
for v in A B; do [ -f $W/t$v/train_log.jsonl ] && { echo "## $v"; tail -n 1 $W/t$v/train_log.jsonl | cut -c1-900; }; done
tail -n 2 $W/trainA.log $W/trainB.log 2>/dev/null | cut -c1-300
cd $W && tar czf $OUT/res.tgz --exclude='*.safetensors' --exclude='*.pt' *.log *.report.json eval*/ t*/train_log.jsonl t*/*.json t*/*.txt d*/report.json 2>/dev/null
for v in A B; do f=$W/t$v/drafter/model.safetensors; if [ -f $f ] && grep -q "^== .* done" $W/pipe.log; then
  mkdir -p $OUT/$v; cp $W/t$v/drafter/config.json $OUT/$v/; split -n 2 -d $f $OUT/$v/st; fi; done
ls -la $OUT; du -sh $W/* 2>/dev/null | head -30
