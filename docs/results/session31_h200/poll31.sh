#!/usr/bin/env bash
# bash poll31.sh SECONDS: wait for the run (at most SECONDS), packing its records into $OUT every 15 s.
end=$((SECONDS + $1)); W=${W:-/tmp/w}
while [ $SECONDS -lt $end ] && ! grep -q "^== .* done$" $W/pipe.log 2>/dev/null; do
  sleep 15; cp $W/pipe.log $W/res/ 2>/dev/null; tar czf $OUT/res.tgz.part -C $W res && mv $OUT/res.tgz.part $OUT/res.tgz
done
cut -c1-600 $W/pipe.log
cp $W/pipe.log $W/res/ 2>/dev/null
tar czf $OUT/res.tgz -C $W res
