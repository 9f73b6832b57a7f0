#!/usr/bin/env bash
# bash poll30.sh SECONDS: wait for run30.sh (at most SECONDS), print its progress, pack the records into $OUT.
end=$((SECONDS + $1)); W=${W:-/tmp/w}
while [ $SECONDS -lt $end ] && ! grep -q "^== .* done$" $W/pipe.log 2>/dev/null; do sleep 3; done
cut -c1-400 $W/pipe.log
cp $W/pipe.log $W/res/ 2>/dev/null
tar czf $OUT/res.tgz -C $W res
ls -la $OUT
