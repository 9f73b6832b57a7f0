#!/usr/bin/env bash
end=$((SECONDS + $1)); L=/tmp/res/run.log
while [ $SECONDS -lt $end ] && ! grep -q "^== .* done" $L 2>/dev/null; do sleep 5; done
grep -v "^\s*$" $L | tail -n 60 | cut -c1-300
cp /tmp/res.tgz $OUT/ 2>/dev/null; ls -la $OUT
