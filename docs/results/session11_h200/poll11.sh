#!/usr/bin/env bash
end=$((SECONDS + $1)); L=/tmp/res/run.log
while [ $SECONDS -lt $end ] && ! grep -q "^== .* done" $L 2>/dev/null; do sleep 5; done
grep -v "^\s*$" $L | tail -n 70 | cut -c1-300
cp /tmp/res.tgz $OUT/ 2>/dev/null
if grep -q "^== .* done" $L && ls /tmp/regen/*.gz >/dev/null 2>&1; then
  for f in /tmp/regen/*.gz; do s=$(stat -c %s $f); if [ $s -gt 15000000 ]; then split -b 15000000 -d $f $OUT/$(basename $f).; else cp $f $OUT/; fi; done
fi
ls -la $OUT
