#!/usr/bin/env bash
# bash poll36.sh SECONDS: wait for run36.sh (at most SECONDS) and print its progress; once it is done, put the
# packed answers (15 MB parts) and the logs into $OUT
end=$((SECONDS + $1)); W=${W:-/tmp/w}; R=$W/res
while [ $SECONDS -lt $end ] && ! grep -q "^== .* done" $W/pipe.log 2>/dev/null; do sleep 3; done
cat $W/pipe.log
for f in $R/*.log; do echo "-- $f: $(tr '\r' '\n' < $f | grep -v '^\s*$' | tail -n 1 | cut -c1-200)"; done
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
if grep -q "^== .* done" $W/pipe.log; then
  cp $W/pipe.log $R/; split -b 15M $W/regen36.tar.xz $OUT/regen36.tar.xz.
fi
tar czf $OUT/res.tgz -C $W res pipe.log 2>/dev/null
ls -la $OUT
