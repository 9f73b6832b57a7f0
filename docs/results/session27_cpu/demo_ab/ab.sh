#!/usr/bin/env bash
# CPU A/B of the demo: new (this checkout) and old (00d4067's src) alternating, two rounds each
cd /work/main && . .venv/bin/activate
for r in 3 4 5; do
  for v in new old; do
    if [ $v = new ]; then PP=/work/main/src; else PP=/work/main/.stage/old27/src; fi
    PYTHONPATH=$PP python -m eagle3.cli demo --record /tmp/cpu27/demo_${v}_$r.json > /tmp/cpu27/demo_${v}_$r.log 2>&1
    echo "$v $r rc=$? $(grep -iE 'speedup|tau|identical' /tmp/cpu27/demo_${v}_$r.log | tr '\n' ' ' | cut -c1-300)"
  done
done
