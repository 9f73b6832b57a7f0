"""Session 16 experiment 3: the ranked top-k of compiled drafting (`ranked_top_k`, now CUDA's default) against
torch.topk in two stages, both with the query heads as SDPA heads (experiment 2's winner).

Random SmolLM2-135M-shaped target and drafter as in `cycle_exp.py`, compiled drafting; `measure_overhead` times
the plain step, chains of 1 and 5 and the 6,10,60 tree (draft / verify / bookkeeping / cycle, each in its own CUDA
graph) with `ranked_top_k` forced off (`topk`: two torch.topk stages, and torch.topk for k = 1 too, the code
before) and on (`ranked`), then kernel tables of the ranked draft piece.
    PYTHONPATH=src python docs/results/session16_h200/cycle_exp3.py [cuda:0 | cpu (a dry run)]
"""
import sys
from functools import partial

import torch

import eagle3.fast.core as core_mod
from eagle3.fast.core import FastCore
from eagle3.fast.drafter import FastDrafter
from eagle3.fast.overhead import SMOLLM2, begin_random, build_random, measure_overhead
from eagle3.fast.target import FastTarget

sys.path.insert(0, "scripts")
from profile_step import kernel_table

dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda:0")
REPS = 30 if dev.type == "cuda" else 1
torch.manual_seed(0)
model, drafter = build_random(SMOLLM2, dev, torch.bfloat16, draft_vocab_size=8192)
RANKED = core_mod.ranked_top_k
TOPK = core_mod.top_k_last


def old_top_k(x, k, ranked=False):  # before: torch.topk in two stages, also for k = 1
    v = x.shape[-1]
    if v <= 256 or v % 256 or k > 256:
        return x.topk(k, dim=-1)
    vals, idx = x.unflatten(-1, (v // 256, 256)).topk(k, dim=-1)
    idx = idx + torch.arange(0, v, 256, device=x.device)[:, None]
    best, at = vals.flatten(-2).topk(k, dim=-1)
    return best, idx.flatten(-2).gather(-1, at)


def use(variant):
    core_mod.ranked_top_k = RANKED if variant == "ranked" else (lambda device: False)
    core_mod.top_k_last = TOPK if variant == "ranked" else old_top_k


for variant in ("topk", "ranked", "topk", "ranked"):
    use(variant)
    res = measure_overhead(model, drafter, chains=(1, 5), trees=(60,), reps=REPS, log=lambda s: None)
    step = res["target_step_ms"]
    for r in res["rows"]:
        print(f"{variant:8s} step {step * 1e3:7.1f} us  {r['kind']}-{r['tokens']:<3d} draft {r['draft_ms'] * 1e3:6.1f} "
              f"verify {r['verify_ms'] * 1e3:6.1f} book {r['bookkeeping_ms'] * 1e3:5.1f} cycle {r['cycle_ms'] * 1e3:6.1f} us"
              f" = {r['cycle_units']:.3f} steps", flush=True)

use("ranked")
target = FastTarget(model, drafter.config.aux_layer_ids)
plain = FastCore(target, "none")
plain.allocate(768)
begin_random(plain, 512, target.vocab_size)
c = FastCore(target, "eagle3", FastDrafter(drafter), depth=6, top_k=10, total_tokens=60)
c.compile_drafting()
c.allocate(768)
begin_random(c, 512, target.vocab_size)
c.piece("draft")
for name, fn in (("draft (ranked)", partial(c.piece, "draft")),):
    table, launches = kernel_table(fn, dev, REPS)
    print(f"\n{name}: {launches} launches, {sum(t['us'] for t in table.values()):.1f} us of kernels")
    for k, t in table.items():
        top = "; ".join(f"{x['name'][:70]} {x['us']:.1f}" for x in t["top"])
        print(f"  {k:18s} {t['us']:8.1f} us {t['kernels']:6.1f} kernels [{top}]")
