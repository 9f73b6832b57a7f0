for t in 4,4,16 5,4,24 3,4,12 6,6,32 4,8,32; do
  eagle3 bench --device cpu --dtype bfloat16 --target smollm2 --drafter src/eagle3/assets/smollm2-drafter --limit 5 --max-new-tokens 128 --methods plain,tree --tree $t --out /tmp/cpusweep/$t 2>&1 | grep -E "^\(d\)|^\(g\)" | sed "s/^/$t /"
done
eagle3 bench --device cpu --dtype bfloat16 --target smollm2 --drafter src/eagle3/assets/smollm2-drafter --limit 5 --max-new-tokens 128 --methods plain,chain --chain 3 --out /tmp/cpusweep/c3 2>&1 | grep -E "^\(d\)|^\(f\)" | sed "s/^/c3 /"
