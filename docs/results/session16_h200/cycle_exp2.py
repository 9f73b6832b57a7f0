"""Session 16 experiment 2: the GQA head layout (now CUDA's default) against the stacked one, and a top-k variant.

Random SmolLM2-135M-shaped target and drafter as in `cycle_exp.py`, compiled drafting. `measure_overhead` times the
plain step, a chain of 1 and 5 and the 6,10,60 tree (draft / verify / bookkeeping / cycle, each in its own CUDA
graph) for:

    stacked      query heads stacked along the query axis (`stack_query_heads` forced True: the code before)
    heads        query heads as SDPA heads with enable_gqa (this session's CUDA default)
    heads+cmaxC  heads, and the draft top-k as "the k chunks of C with the largest maxima, then the top k of
                 their k·C values" (two small top-k's; values identical to torch.topk)

then kernel tables of the plain step and of the heads variant's draft and verify pieces.
    PYTHONPATH=src python docs/results/session16_h200/cycle_exp2.py [cuda:0 | cpu (a dry run)]
"""
import sys
from functools import partial

import torch

import eagle3.fast.core as core_mod
import eagle3.fast.drafter as drafter_mod
import eagle3.fast.target as target_mod
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
TOPK = core_mod.top_k_last
LAYOUT = target_mod.stack_query_heads


def chunk_max_top_k(c):
    def top_k(x, k):
        v = x.shape[-1]
        if v % c or k > v // c:
            return x.topk(k, dim=-1)
        chunks = x.unflatten(-1, (v // c, c))  # [..., n, C]
        _, ci = chunks.amax(dim=-1).topk(k, dim=-1, sorted=False)  # [..., k] chunks holding the k best
        cand = chunks.gather(-2, ci[..., None].expand(*ci.shape, c)).flatten(-2)  # [..., k·C]
        vals, at = cand.topk(k, dim=-1)  # [..., k]
        return vals, ci.gather(-1, at // c) * c + at % c
    return top_k


g = torch.Generator().manual_seed(1)
for c in (16, 64):
    x = torch.randn(10, 8192, generator=g).to(dev)
    v1, i1 = chunk_max_top_k(c)(x, 10)
    v0, i0 = x.topk(10, dim=-1)
    print(f"chunk-max {c}: values equal {torch.equal(v0, v1)}, indices equal {torch.equal(i0, i1)}", flush=True)


def use(variant):
    stacked = variant == "stacked"
    for m in (target_mod, drafter_mod):
        m.stack_query_heads = (lambda device: True) if stacked else LAYOUT
    core_mod.top_k_last = chunk_max_top_k(int(variant.split("cmax")[1])) if "cmax" in variant else TOPK


for variant in ("stacked", "heads", "heads+cmax16", "heads+cmax64", "stacked", "heads"):
    use(variant)
    res = measure_overhead(model, drafter, chains=(1, 5), trees=(60,), reps=REPS, log=lambda s: None)
    step = res["target_step_ms"]
    for r in res["rows"]:
        print(f"{variant:13s} step {step * 1e3:7.1f} us  {r['kind']}-{r['tokens']:<3d} draft {r['draft_ms'] * 1e3:6.1f} "
              f"verify {r['verify_ms'] * 1e3:6.1f} book {r['bookkeeping_ms'] * 1e3:5.1f} cycle {r['cycle_ms'] * 1e3:6.1f} us"
              f" = {r['cycle_units']:.3f} steps", flush=True)

use("heads")
target = FastTarget(model, drafter.config.aux_layer_ids)
plain = FastCore(target, "none")
plain.allocate(768)
begin_random(plain, 512, target.vocab_size)
c = FastCore(target, "eagle3", FastDrafter(drafter), depth=6, top_k=10, total_tokens=60)
c.compile_drafting()
c.allocate(768)
begin_random(c, 512, target.vocab_size)
c.piece("draft")
for name, fn in (("plain step (heads)", partial(plain.verify, greedy=True)), ("draft", partial(c.piece, "draft")),
                 ("verify", partial(c.verify, greedy=True))):
    table, launches = kernel_table(fn, dev, REPS)
    print(f"\n{name}: {launches} launches, {sum(t['us'] for t in table.values()):.1f} us of kernels")
    for k, t in table.items():
        top = "; ".join(f"{x['name'][:70]} {x['us']:.1f}" for x in t["top"])
        print(f"  {k:18s} {t['us']:8.1f} us {t['kernels']:6.1f} kernels [{top}]")
