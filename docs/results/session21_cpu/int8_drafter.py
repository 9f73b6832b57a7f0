"""Session 21 (CPU): prototype, not in the library: the drafter's matrices (fc, q/k/v, o, gate/up, down, head) as int8
weight-only products (torch.ops.aten._weight_int8pack_mm, per-row scales) against bf16, the demo's setup, alternating.
    PYTHONPATH=src python docs/results/session21_cpu/int8_drafter.py ROUNDS
"""
import sys, time, torch
import torch.nn.functional as F
import eagle3.fast.drafter as dmod
from eagle3.demo import CPU_BF16_SPEC, bundled_drafter
from eagle3.evaluate import load_prompts
from eagle3.fast import FastEngine, FastTarget
from eagle3.formats import load_drafter
from eagle3.models import load_target
from eagle3.runtime import encode_prompt, eos_token_ids
model, tok = load_target("smollm2", dtype="bfloat16", device="cpu")
d = load_drafter(bundled_drafter(), target_config=model.config, target_embedding=model.get_input_embeddings().weight, device="cpu", dtype=torch.bfloat16)
shared = FastTarget(model, d.config.aux_layer_ids)
spec = FastEngine(model, draft="eagle3", spec=CPU_BF16_SPEC, drafter=d, tokenizer=tok, target=shared)
plain = FastEngine(model, draft="none", tokenizer=tok, target=shared)
fd = spec.core.drafter
Q = {}
for name in ("fc", "wqkv", "wo", "w13", "w2", "lm_head"):
    w = getattr(fd, name)
    s = w.float().abs().amax(1).clamp_min(1e-8) / 127
    Q[w.data_ptr()] = ((w.float() / s[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous(), s.to(w.dtype))
real_linear = F.linear
class FQ:
    def __getattr__(self, n): return getattr(F, n)
    @staticmethod
    def linear(x, w, b=None):
        q = Q.get(w.data_ptr()) if USE[0] else None
        if q is None: return real_linear(x, w, b)
        shp = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shp[-1]).contiguous(), q[0], q[1]).view(*shp[:-1], -1)
        return y if b is None else y + b
USE=[False]
dmod.F = FQ()
_, qs = load_prompts("mt_bench", limit=int(sys.argv[2]) if len(sys.argv)>2 else 3)
prompts = [encode_prompt(tok, chat=q) for q in qs]
eos = eos_token_ids(model, tok)
for e in (plain, spec): e.generate(prompts[0], max_new_tokens=16, eos_token_ids=eos)
for r in range(int(sys.argv[1])):
    for use in (False, True):
        USE[0] = use
        t0=time.perf_counter(); outs=[plain.generate(p, max_new_tokens=128, eos_token_ids=eos) for p in prompts]; tp=time.perf_counter()-t0
        t0=time.perf_counter(); so=[spec.generate(p, max_new_tokens=128, eos_token_ids=eos) for p in prompts]; ts=time.perf_counter()-t0
        n=sum(len(o.token_ids) for o in so); cyc=sum(o.stats.cycles for o in so)
        same=all(a.token_ids==b.token_ids for a,b in zip(outs,so))
        print(f"round {r} int8={use}: plain {n/tp:.1f} spec {n/ts:.1f} {tp/ts:.3f}x tau {n/cyc:.3f} identical {same}", flush=True)
