"""Session 16 experiment: where a SmolLM2-shaped tree cycle's time goes, and what two candidate changes save.

Random SmolLM2-135M-shaped target and drafter (bf16, `eagle3.fast.overhead.SMOLLM2`, draft vocabulary 8,192),
compiled drafting as the engines use it on CUDA. For each variant, `measure_overhead` times the plain step and
the draft / verify / bookkeeping pieces and the whole cycle of a chain of 5 and the 6,10,60 tree, each captured in
its own CUDA graph. Variants (module functions patched in place, the same way for target and drafter):

    sorts      the rerank as two stable sorts (the code before this session)
    rank       the sort-free rerank `top_n_in_order` (this session's code)
    gqa        rank + attention with the query heads as SDPA heads (q [1, nh, T, hd] a strided view, K/V
               [1, nkv, S, hd], enable_gqa=True, bias [1, 1, T, S]): no transposing copies for T > 1
    gqa_noflag as gqa with enable_gqa=False (cuDNN accepts different head counts without the flag)

Then per-piece kernel tables (eager launches under the profiler) of the best variant.
    PYTHONPATH=src python docs/results/session16_h200/cycle_exp.py [cuda:0 | cpu (a dry run)]
"""
import sys
from functools import partial

import torch
import torch.nn.functional as F

import eagle3.fast.core as core_mod
import eagle3.fast.drafter as drafter_mod
import eagle3.fast.target as target_mod
from eagle3.fast.core import FastCore
from eagle3.fast.drafter import FastDrafter
from eagle3.fast.overhead import SMOLLM2, begin_random, build_random, measure_overhead

sys.path.insert(0, "scripts")
from profile_step import kernel_table

dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda:0")
REPS = 30 if dev.type == "cuda" else 1
torch.manual_seed(0)
model, drafter = build_random(SMOLLM2, dev, torch.bfloat16, draft_vocab_size=8192)

ORIG = {m: (m.attention_bias, m.grouped_attention) for m in (target_mod, drafter_mod)}
RANK = core_mod.top_n_in_order


def sorts(scores, n):
    order = torch.sort(-scores, dim=-1, stable=True).indices[..., :n]
    return torch.sort(order, dim=-1).values


def bias_1(mask, groups, dtype):
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)[None, None]


def make_gqa(flag):
    def gqa(q, k_all, v_all, bias, scale):
        t, nh, hd = q.shape
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_all[None], v_all[None], attn_mask=bias,
                                           scale=scale, enable_gqa=flag)  # [1, nh, T, hd]
        return o[0].transpose(0, 1).reshape(t, nh * hd)
    return gqa


def use(variant):
    core_mod.top_n_in_order = sorts if variant == "sorts" else RANK
    for m in (target_mod, drafter_mod):
        if variant.startswith("gqa"):
            m.attention_bias, m.grouped_attention = bias_1, make_gqa(variant == "gqa")
        else:
            m.attention_bias, m.grouped_attention = ORIG[m]


# correctness of the attention variants against the current layout (T = 61 verification)
from eagle3.fast.target import FastTarget  # noqa: E402

target = FastTarget(model, drafter.config.aux_layer_ids)
outs = {}
for variant in ("rank", "gqa", "gqa_noflag"):
    use(variant)
    try:
        c = FastCore(target, "eagle3", FastDrafter(drafter), depth=6, top_k=10, total_tokens=60)
        c.allocate(768)
        begin_random(c, 512, target.vocab_size)
        c.draft()
        c.verify(greedy=True)
        outs[variant] = (c.top.clone(), c.aux.clone(), c.tree_tokens.clone())
        ref = outs["rank"]
        same = [torch.equal(a, b) for a, b in zip(outs[variant], ref, strict=True)]
        diff = (outs[variant][1].float() - ref[1].float()).abs().max().item()
        print(f"{variant:10s} top/aux/tree equal to rank: {same}, aux max diff {diff:.3g}", flush=True)
    except Exception as e:
        print(f"{variant} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
del target

results = {}
for variant in ("sorts", "rank", "gqa", "gqa_noflag", "rank"):
    use(variant)
    try:
        res = measure_overhead(model, drafter, chains=(5,), trees=(60,), reps=REPS, log=lambda s: None)
    except Exception as e:
        print(f"{variant} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        continue
    step = res["target_step_ms"]
    for r in res["rows"]:
        print(f"{variant:10s} step {step * 1e3:7.1f} us  {r['kind']}-{r['tokens']:<3d} draft {r['draft_units']:.3f} "
              f"verify {r['verify_units']:.3f} book {r['bookkeeping_units']:.3f} cycle {r['cycle_units']:.3f} "
              f"({r['cycle_ms'] * 1e3:.1f} us)", flush=True)
    results[variant] = res

best = min((v for v in results if v != "sorts"), key=lambda v: results[v]["rows"][-1]["cycle_units"])
print(f"\nkernel tables per piece, variant {best}")
use(best)
target = FastTarget(model, drafter.config.aux_layer_ids)
c = FastCore(target, "eagle3", FastDrafter(drafter), depth=6, top_k=10, total_tokens=60)
c.compile_drafting()
c.allocate(768)
begin_random(c, 512, target.vocab_size)
c.piece("draft")
saved = c.length.clone()


def book():
    c.piece("accept")
    c.commit()
    c.length.copy_(saved)


for name, fn in (("draft", partial(c.piece, "draft")), ("verify", partial(c.verify, greedy=True)), ("book", book)):
    table, launches = kernel_table(fn, dev, REPS)
    print(f"{name}: {launches} launches, {sum(t['us'] for t in table.values()):.1f} us of kernels")
    for k, t in table.items():
        top = "; ".join(f"{x['name'][:70]} {x['us']:.1f}" for x in t["top"])
        print(f"  {k:18s} {t['us']:8.1f} us {t['kernels']:6.1f} kernels [{top}]")
