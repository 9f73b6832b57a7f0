#!/usr/bin/env bash
# CPU A/B of the demo: HEAD (K/V in one cache) against 08c6201 (before it), alternating
cd /work/main && . .venv/bin/activate
for r in 1 2 3 4; do
  for v in old new; do
    if [ $v = new ]; then PP=/work/main/src; else PP=/work/main/.stage/old28/src; fi
    PYTHONPATH=$PP python -m eagle3.cli demo --record /tmp/cpu27b/demo_${v}_$r.json > /tmp/cpu27b/demo_${v}_$r.log 2>&1
    echo "$v $r rc=$? $(tail -2 /tmp/cpu27b/demo_${v}_$r.log | head -1)"
  done
done
