"""Session 17 experiment: the cycle at SmolLM2's shape with this checkout's code (whatever `eagle3` imports).

Random SmolLM2-135M-shaped target and drafter (bf16, draft vocabulary 8,192), context 512, compiled drafting,
each piece in its own CUDA graph (`measure_overhead`, as `eagle3 bench --overhead --shape smollm2-135m`). Run it
once per code version, alternating, with PYTHONPATH pointing at each version's src:
    PYTHONPATH=src python docs/results/session17_h200/cycle_exp4.py LABEL
"""
import sys

import torch

from eagle3.fast.overhead import SMOLLM2, build_random, measure_overhead

label = sys.argv[1] if len(sys.argv) > 1 else "code"
torch.manual_seed(0)
model, drafter = build_random(SMOLLM2, torch.device("cuda:0"), torch.bfloat16, draft_vocab_size=8192)
res = measure_overhead(model, drafter, chains=(1, 5), trees=(60,), reps=30, log=lambda s: None)
step = res["target_step_ms"] * 1e3
for r in res["rows"]:
    print(f"{label:8s} step {step:7.1f} us  {r['kind']}-{r['tokens']:<3d} draft {r['draft_units'] * step:6.1f} "
          f"verify {r['verify_units'] * step:7.1f} book {r['bookkeeping_units'] * step:5.1f} "
          f"cycle {r['cycle_ms'] * 1e3:7.1f} us = {r['cycle_units']:.3f} steps", flush=True)
