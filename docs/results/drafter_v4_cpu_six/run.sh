#!/usr/bin/env bash
# CPU (this 2-core machine), fp32: six datasets x 10 prompts, tree 6,10,60, T=0, the v4 (bundled) drafter; the same
# command as results/drafter_v3_cpu_six/run.sh, so its v3.json is the comparison.
. .venv/bin/activate
echo "== $(date -u +%T) v4"
eagle3 eval --target smollm2 --drafter src/eagle3/assets/smollm2-drafter --device cpu --fast --max-new-tokens 256 \
  --limit 10 --datasets mt_bench humaneval gsm8k alpaca sum qa --tree 6,10,60 --out .stage/cpu_eval4/v4 > .stage/cpu_eval4/v4.log 2>&1
echo "rc=$?"
echo "== $(date -u +%T) done"
