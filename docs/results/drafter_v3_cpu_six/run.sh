#!/usr/bin/env bash
# CPU (this 2-core machine), fp32: six datasets x 10 prompts, tree 6,10,60, T=0, v3 (bundled) vs v2 drafters
# /tmp/v2-drafter: the v2 drafter, src/eagle3/assets/smollm2-drafter as of commit 4d5e5a0 (git archive 4d5e5a0 src/eagle3/assets/smollm2-drafter)
. .venv/bin/activate
for d in v3:src/eagle3/assets/smollm2-drafter v2:/tmp/v2-drafter; do
  n=${d%%:*}; p=${d#*:}
  echo "== $(date -u +%T) $n"
  nice -n 10 eagle3 eval --target smollm2 --drafter $p --device cpu --fast --max-new-tokens 256 --limit 10 \
    --datasets mt_bench humaneval gsm8k alpaca sum qa --tree 6,10,60 --out .stage/cpu_eval/$n > .stage/cpu_eval/$n.log 2>&1
  echo "rc=$?"
done
echo "== $(date -u +%T) done"
