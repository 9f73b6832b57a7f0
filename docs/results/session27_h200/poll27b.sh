#!/usr/bin/env bash
# bash poll27b.sh SECONDS [final]: wait for run27b.sh (at most SECONDS; "final": 40 s less), print its progress,
# pack the records into $OUT.
end=$((SECONDS + $1)); W=${W:-/tmp/w}
stop=$end; [ "${2:-}" = final ] && stop=$((end - 40))
while [ $SECONDS -lt $stop ] && ! grep -q "^== .* done$" $W/pipe.log 2>/dev/null; do sleep 3; done
cut -c1-300 $W/pipe.log | tail -n 12; cat $W/lane0.log $W/lane1.log 2>/dev/null | cut -c1-300
cp $W/pipe.log $W/lane*.log $W/res/ 2>/dev/null
tar czf $OUT/res.tgz -C $W res
ls -la $OUT
