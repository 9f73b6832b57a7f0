#!/usr/bin/env bash
# bash poll37.sh SECONDS [train|done]: wait (at most SECONDS) until next_hold.sh has finished training ("train")
# or everything ("done"), print its progress, and put what is finished into $OUT: the trained drafter in 15 MB
# parts as soon as training is over (so that an evaluation cut short by the budget loses nothing), the logs always.
end=$((SECONDS + $1)); until=${2:-done}; W=${W:-/tmp/w}; R=$W/res
pat="^== .* done"; [ "$until" = train ] && pat="^== .* train rc="
while [ $SECONDS -lt $end ] && ! grep -q "$pat" $W/pipe.log 2>/dev/null; do sleep 3; done
cat $W/pipe.log
for f in $R/*.log; do echo "-- $f: $(tr '\r' '\n' < $f | grep -v '^\s*$' | tail -n 1 | cut -c1-240)"; done
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
if grep -q "^== .* train rc=" $W/pipe.log && [ ! -e $W/drafter_sent ]; then
  tar cf - -C $W/train drafter | split -b 15M - $OUT/drafter.tar. && touch $W/drafter_sent
fi
cp $W/pipe.log $R/ 2>/dev/null
tar czf $OUT/res.tgz -C $W res train/train_log.jsonl train/val_log.jsonl data/report.json 2>/dev/null
ls -la $OUT
