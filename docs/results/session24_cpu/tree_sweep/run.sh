cd /work/main && . .venv/bin/activate
for t in 6,10,60 7,10,80 8,10,100 6,6,24; do
  timeout 1200 python -m eagle3.cli eval --target smollm2 --drafter src/eagle3/assets/smollm2-drafter --device cpu --fast \
    --datasets mt_bench --limit 20 --max-new-tokens 256 --tree $t --out /tmp/treesweep/$t > /tmp/treesweep/$t.log 2>&1
done
echo finished > /tmp/treesweep/DONE
