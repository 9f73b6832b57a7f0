cd /work/main && source .venv/bin/activate
for r in 1 2 3 4; do
  for arm in fixed3 stop; do
    if [ $arm = fixed3 ]; then a="--chain 3 --chain-stop 0"; else a=""; fi
    eagle3 demo $a --record /tmp/cs/ab3/demo_${arm}_$r.json > /tmp/cs/ab3/demo_${arm}_$r.log 2>&1
    grep "all answers" /tmp/cs/ab3/demo_${arm}_$r.log | sed "s/^/$arm $r: /"
  done
done
