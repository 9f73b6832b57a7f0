# Tree vs chain layout, many trials: vendor-style exact attention (fp32 softmax) vs fp64-summed softmax
import torch, random
torch.manual_seed(0); random.seed(0)
nkv, hd = 3, 64
dt = torch.bfloat16
def att(q, k, v, bias, scale, fp64):
    s = torch.baddbmm(bias, q, k.transpose(-1, -2), alpha=scale)
    if fp64:
        s = s.float(); e = (s - s.amax(-1, keepdim=True)).exp()
        p = e / e.sum(-1, keepdim=True, dtype=torch.float64).float()
    else:
        p = s.softmax(-1, dtype=torch.float32)
    return torch.bmm(p.to(dt), v)
res = {False: 0, True: 0}; n = 0
for S in (256, 512, 1024, 2048):
    for trial in range(120):
        ctx = random.randint(20, S - 40)
        depth = random.randint(1, 6)
        slots = sorted(random.sample(range(ctx, min(S, ctx + 30)), depth))
        k_log = torch.randn(nkv, ctx + depth, hd).to(dt); v_log = torch.randn(nkv, ctx + depth, hd).to(dt)
        q = (torch.randn(nkv, 1, hd) * 3).to(dt).expand(nkv, 2, hd).contiguous()
        kc = torch.randn(nkv, S, hd).to(dt); vc = torch.randn(nkv, S, hd).to(dt)
        kc[:, :ctx + depth] = k_log; vc[:, :ctx + depth] = v_log
        kt = torch.randn(nkv, S, hd).to(dt); vt = torch.randn(nkv, S, hd).to(dt)
        kt[:, :ctx] = k_log[:, :ctx]; vt[:, :ctx] = v_log[:, :ctx]
        for j, s in enumerate(slots):
            kt[:, s] = k_log[:, ctx + j]; vt[:, s] = v_log[:, ctx + j]
        neg = torch.finfo(dt).min
        bc = torch.full((1, 2, S), neg, dtype=dt); bc[..., :ctx + depth] = 0
        bt = torch.full((1, 2, S), neg, dtype=dt); bt[..., :ctx] = 0
        for s in slots: bt[..., s] = 0
        n += 1
        for f in (False, True):
            res[f] += int(not torch.equal(att(q, kc, vc, bc, hd ** -0.5, f), att(q, kt, vt, bt, hd ** -0.5, f)))
print(n, "rows differing: fp32 softmax", res[False], "fp64-summed", res[True])
