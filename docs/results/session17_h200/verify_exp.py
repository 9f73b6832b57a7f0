"""Session 17 experiment: why verifying 2 tokens costs 13 % more than a plain one-token step (SmolLM2 shape).

Random SmolLM2-135M-shaped target and drafter (bf16, draft vocabulary 8,192), context 512. Profiles, kernel by
kernel (name, launches and microseconds per call), the plain step (`FastCore(target, "none").verify`) and the
verification of chain 1, chain 5 and the 6,10,60 tree, and prints, for each verification, the kernels whose time
differs most from the plain step's. Then the graph-replay time of each piece.
    PYTHONPATH=src python docs/results/session17_h200/verify_exp.py [cuda:0 | cpu (a dry run)]
"""
import sys
from collections import defaultdict
from functools import partial

import torch

from eagle3.fast.core import FastCore
from eagle3.fast.drafter import FastDrafter
from eagle3.fast.graphs import StepRunner, graph_pool
from eagle3.fast.overhead import SMOLLM2, begin_random, build_random, time_step
from eagle3.fast.target import FastTarget

dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda:0")
cuda = dev.type == "cuda"
REPS = 20 if cuda else 1
torch.manual_seed(0)
model, drafter = build_random(SMOLLM2, dev, torch.bfloat16, draft_vocab_size=8192)
target = FastTarget(model, drafter.config.aux_layer_ids)


def kernels(fn):
    fn()
    if cuda:
        torch.cuda.synchronize()
    act = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[act]) as prof:
        for _ in range(REPS):
            fn()
        if cuda:
            torch.cuda.synchronize()
    out = defaultdict(lambda: [0.0, 0.0])
    for e in prof.key_averages():
        us = (getattr(e, "self_device_time_total", 0) or 0) if cuda else e.self_cpu_time_total
        if us <= 0 or (not cuda and not e.key.startswith("aten::")):
            continue
        out[e.key[:110]][0] += e.count / REPS
        out[e.key[:110]][1] += us / REPS
    return dict(out)


cores = {}
plain = FastCore(target, "none")
plain.allocate(768)
begin_random(plain, 512, target.vocab_size)
cores["plain"] = plain
for name, kw in (("chain1", dict(depth=1, top_k=1, total_tokens=1)), ("chain5", dict(depth=5, top_k=1, total_tokens=5)),
                 ("tree60", dict(depth=6, top_k=10, total_tokens=60))):
    c = FastCore(target, "eagle3", FastDrafter(drafter), **kw)
    if cuda:
        c.compile_drafting()
    c.allocate(768)
    begin_random(c, 512, target.vocab_size)
    c.piece("draft")
    cores[name] = c

tables = {n: kernels(partial(c.verify, greedy=True)) for n, c in cores.items()}
base = tables["plain"]
for n, t in tables.items():
    tot = sum(v[1] for v in t.values())
    cnt = sum(v[0] for v in t.values())
    print(f"\n== {n}: {cnt:.0f} launches, {tot:.1f} us of kernels", flush=True)
    rows = []
    for k in set(t) | set(base):
        a, b = t.get(k, [0, 0]), base.get(k, [0, 0])
        rows.append((a[1] - b[1], k, a, b))
    rows.sort(key=lambda r: -abs(r[0]))
    for d, k, a, b in rows[:28] if n != "plain" else []:
        print(f"  {d:+8.1f} us  n {a[0]:5.1f} vs {b[0]:5.1f}  us {a[1]:7.1f} vs {b[1]:7.1f}  {k}")
    if n == "plain":
        for k, v in sorted(t.items(), key=lambda kv: -kv[1][1])[:30]:
            print(f"  n {v[0]:5.1f}  us {v[1]:7.1f}  {k}")

if cuda:
    pool = graph_pool(dev)
    keep = []
    for n, c in cores.items():
        r = StepRunner(partial(c.verify, greedy=True), dev, graphs=True, pool=pool, name=n)
        r.prepare()
        keep.append(r)
        print(f"graph replay {n}: {time_step(r, dev, 50) * 1e6:.1f} us", flush=True)
