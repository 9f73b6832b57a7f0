#!/usr/bin/env bash
# CPU (this 2-core machine), fp32: six datasets x 10 prompts with the bundled v3 drafter: tree 6,10,60 at T=1, chain 5 at T=0
. .venv/bin/activate
EV=(eagle3 eval --target smollm2 --drafter src/eagle3/assets/smollm2-drafter --device cpu --fast --max-new-tokens 256 --limit 10
    --datasets mt_bench humaneval gsm8k alpaca sum qa)
echo "== $(date -u +%T) tree T=1"
nice -n 10 "${EV[@]}" --tree 6,10,60 --temperatures 1 --out .stage/cpu_eval/v3_tree_t1 > .stage/cpu_eval/v3_tree_t1.log 2>&1; echo "rc=$?"
echo "== $(date -u +%T) chain 5 T=0"
nice -n 10 "${EV[@]}" --chain 5 --out .stage/cpu_eval/v3_chain > .stage/cpu_eval/v3_chain.log 2>&1; echo "rc=$?"
echo "== $(date -u +%T) done"
