#!/usr/bin/env bash
# Session 17 hold 1, call 1: stage GGUF part 0; the cycle at SmolLM2's shape, HEAD (c95178e) vs the working tree, alternating.
set -uo pipefail
mkdir -p /tmp/stage /tmp/old && cp .stage/s1/g0 /tmp/stage/ && tar xzf .stage/s1/old/src.tgz -C /tmp/old
export PYTHONUNBUFFERED=1
R=$OUT/res; mkdir -p $R
for i in 1 2; do
  PYTHONPATH=/tmp/old/src python3 docs/results/session17_h200/cycle_exp4.py old 2>&1 | grep -v Warn | tee -a $R/cycle_exp4.log
  PYTHONPATH=$PWD/src python3 docs/results/session17_h200/cycle_exp4.py heads 2>&1 | grep -v Warn | tee -a $R/cycle_exp4.log
done
PYTHONPATH=$PWD/src python3 docs/results/session17_h200/verify_exp.py cuda:0 > $R/verify_exp_new.log 2>&1
grep -A3 "== chain1\|graph replay" $R/verify_exp_new.log
cd $OUT && tar czf res.tgz res && rm -rf res
