#!/usr/bin/env bash
# The train script took the device's $OUT as its output folder: mirror it into /tmp/w/train while training runs.
P=$(pgrep -f "eagle3.cli train" | head -1)
TO=$(tr '\0' '\n' < /proc/$P/cmdline | grep -A1 -- '^--out$' | tail -1)
echo "train pid $P out $TO; this call OUT=$OUT"; ls -la $TO | head; mkdir -p /tmp/w/train
setsid nohup bash -c "while kill -0 $P 2>/dev/null; do cp -a $TO/. /tmp/w/train/ 2>/dev/null; sleep 3; done; cp -a $TO/. /tmp/w/train/; echo mirrored" > /tmp/w/mirror.log 2>&1 < /dev/null &
sleep 2; ls /tmp/w/train
