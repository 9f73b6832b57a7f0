"""Plain decoding's step at the 8B shape: eager fast path vs the same with its pointwise work compiled (RoPE,
residual add + RMSNorm, SiLU-gate), matrix products left to cuBLAS. One-off experiment (session 11)."""
import sys, time, torch
import torch.nn.functional as F
from functools import partial
import eagle3.fast.target as T
from eagle3.fast.core import FastCore
from eagle3.fast.graphs import StepRunner, graph_pool
from eagle3.fast.overhead import LLAMA_8B, TINY, build_random, time_step

dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda:0")
big = dev.type == "cuda"
t0 = time.time()
model, _ = build_random(LLAMA_8B if big else TINY, dev, torch.bfloat16 if big else torch.float32, 32000 if big else 256)
target = T.FastTarget(model, [])
ctx = 512 if big else 32
prompt = torch.randint(3, target.vocab_size, (ctx,), generator=torch.Generator().manual_seed(0)).to(dev)
pool, keep = graph_pool(dev), []
core = FastCore(target, "none"); core.allocate(ctx + 128)
logits, aux = core.prefill(prompt); core.begin(prompt, aux, logits.argmax().view(1))
length0 = core.length.clone()
def measure(name):
    core.length.copy_(length0)
    r = StepRunner(partial(core.verify, greedy=True), dev, graphs=True, pool=pool, name=name); r.prepare(); keep.append(r)
    t = time_step(r, dev, 30 if big else 3)
    print(f"{name}: {t * 1e6:.1f} us per step, weights {target.weight_bytes() / t / 1e9:.0f} GB/s ({time.time() - t0:.0f} s)", flush=True)

measure("eager")
# reference logits of one decode step at the current state
slot = length0.view(1)
mask = (torch.arange(target.seq_len, device=dev) <= length0)[None]
ref, _ = target.forward(torch.tensor([5], device=dev), slot, slot, mask)

rope = torch.compile(T.apply_rope, fullgraph=True, dynamic=False)
@torch.compile(fullgraph=True, dynamic=False)
def add_rms(h, o, w, eps: float):
    h = h + o
    return h, T.rms_norm(h, w, eps)
@torch.compile(fullgraph=True, dynamic=False)
def first_rms(h, w, eps: float):
    return T.rms_norm(h, w, eps)
@torch.compile(fullgraph=True, dynamic=False)
def silu_mul(gu):
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u

def forward(self, ids, pos, slots, mask, last_only=False, want_aux=False):
    t = ids.shape[0]; nh, nkv, hd = self.nh, self.nkv, self.hd
    h = F.embedding(ids, self.embed)
    cos, sin = self.cos[pos], self.sin[pos]
    bias = T.attention_bias(mask, nh // nkv, self.dtype)
    x = first_rms(h, self.layers[0].ln1, self.eps)
    n = len(self.layers)
    for i, lw in enumerate(self.layers):
        qkv = F.linear(x, lw.wqkv, lw.bqkv)
        v = qkv[:, (nh + nkv) * hd:].view(t, nkv, hd)
        qk = rope(qkv[:, : (nh + nkv) * hd].view(t, nh + nkv, hd), cos, sin)
        self.k_cache[i].index_copy_(1, slots, qk[:, nh:].transpose(0, 1))
        self.v_cache[i].index_copy_(1, slots, v.transpose(0, 1))
        o = T.grouped_attention(qk[:, :nh], self.k_cache[i], self.v_cache[i], bias, self.scale)
        h, x = add_rms(h, F.linear(o, lw.wo, lw.bo), lw.ln2, self.eps)
        mid = F.linear(silu_mul(F.linear(x, lw.w13, lw.b13)), lw.w2, lw.b2)
        h, x = add_rms(h, mid, self.layers[i + 1].ln1 if i + 1 < n else self.norm, self.eps)
    if last_only:
        x = x[-1:]
    return F.linear(x, self.lm_head), None

T.FastTarget.forward = forward
got, _ = target.forward(torch.tensor([5], device=dev), slot, slot, mask)
print(f"compiled pieces ready ({time.time() - t0:.0f} s); logits max |diff| {(got.float() - ref.float()).abs().max().item():.4g}, "
      f"argmax equal {bool(got.argmax() == ref.argmax())}", flush=True)
measure("pointwise compiled")
