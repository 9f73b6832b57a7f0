# Where does a fast-path forward over T rows (bf16, CPU) give other bits than T one-row steps?
import torch, torch.nn.functional as F
from eagle3.models import load_target
from eagle3.fast.target import FastTarget
torch.manual_seed(0)
model, tok = load_target("smollm2", dtype="bfloat16", device="cpu")
t = FastTarget(model, [])
t.allocate(256)
prompt = torch.randint(100, 40000, (40,))
n = 40
mask = torch.ones(n, 256, dtype=torch.bool).tril()
# prefill first 34 tokens, then compare: forward of tokens 34..39 at once vs one at a time
k0 = 34
with torch.no_grad():
    t.forward(prompt[:k0], torch.arange(k0), torch.arange(k0), mask[:k0])
    kc, vc = t.k_cache.clone(), t.v_cache.clone()
    # capture per-layer hidden via hooks: monkeypatch post_attention
    rec = {}
    orig = t.post_attention
    def post(i, h, attn, tag=None):
        out = orig(i, h, attn)
        rec.setdefault(cur[0], []).append((attn.clone(), out[0].clone()))
        return out
    t.post_attention = post
    cur = ["multi"]
    lm, _ = t.forward(prompt[k0:n], torch.arange(k0, n), torch.arange(k0, n), mask[k0:n])
    t.k_cache.copy_(kc); t.v_cache.copy_(vc)
    cur = ["single"]
    singles = []
    for j in range(k0, n):
        l1, _ = t.forward(prompt[j:j+1], torch.arange(j, j+1), torch.arange(j, j+1), mask[j:j+1])
        singles.append(l1)
    ls = torch.cat(singles)
print("logits equal:", torch.equal(lm, ls), (lm.float() - ls.float()).abs().max().item())
L = t.num_layers
for i in range(L):
    a_m, h_m = rec["multi"][i]
    a_s = torch.cat([rec["single"][i + L * r][0] for r in range(n - k0)])
    h_s = torch.cat([rec["single"][i + L * r][1] for r in range(n - k0)])
    if not torch.equal(a_m, a_s) or not torch.equal(h_m, h_s):
        print("layer", i, "attn-out equal", torch.equal(a_m, a_s), "h equal", torch.equal(h_m, h_s))
        break
