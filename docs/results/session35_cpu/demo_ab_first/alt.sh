cd /work/main && source .venv/bin/activate
for r in 1 2 3 4; do
  for arm in base stop; do
    if [ $arm = base ]; then a=""; else a="--chain 6 --chain-stop 0.2"; fi
    eagle3 demo $a --record /tmp/cs/demo_${arm}_$r.json 2>&1 | grep "all answers" | sed "s/^/$arm $r: /"
  done
done
