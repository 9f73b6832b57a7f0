#!/usr/bin/env bash
# bash poll20.sh SECONDS: wait for run20.sh (at most SECONDS), then pack its records into $OUT
end=$((SECONDS + $1)); W=/tmp/w
while [ $SECONDS -lt $end ] && ! grep -q "== .* done" $W/pipe.log 2>/dev/null; do sleep 5; done
cut -c1-250 $W/pipe.log | tail -n 40
tar czf $OUT/res.tgz -C $W res pipe.log 2>/dev/null; ls -la $OUT
