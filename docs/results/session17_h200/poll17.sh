#!/usr/bin/env bash
# bash poll17.sh SECONDS: wait for run17c (at most SECONDS); pack the results into $OUT
end=$((SECONDS + $1)); W=/tmp/w
while [ $SECONDS -lt $end ] && ! grep -q "^== .* done" $W/pipe.log 2>/dev/null; do sleep 5; done
grep -v "it/s\]" $W/pipe.log | cut -c1-250 | tail -n 40
cd $W && tar czf $OUT/res.tgz res 2>/dev/null; ls -la $OUT
