cd /work/main && source .venv/bin/activate
for r in 1 2 3 4; do
  for arm in a b; do
    if [ $arm = a ]; then a="--chain 6 --chain-stop 0.2"; else a="--chain 8 --chain-stop 0.25"; fi
    eagle3 demo $a --record /tmp/cs/demo2_${arm}_$r.json 2>&1 | grep "all answers" | sed "s/^/$arm $r: /"
  done
done
