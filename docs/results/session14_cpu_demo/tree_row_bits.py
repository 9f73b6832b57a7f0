# bf16 CPU fast path: a tree row whose ancestors sit at scattered slots vs the one-token step after commit.
import torch
from eagle3.models import load_target
from eagle3.fast.target import FastTarget
torch.manual_seed(0)
model, tok = load_target("smollm2", dtype="bfloat16", device="cpu")
t = FastTarget(model, [])
t.allocate(256)
S = 256
diffs = same = 0
for trial in range(20):
    prompt = torch.randint(100, 40000, (40,))
    k0 = 34
    with torch.no_grad():
        t.k_cache.zero_(); t.v_cache.zero_()
        t.forward(prompt[:k0], torch.arange(k0), torch.arange(k0), torch.ones(k0, S, dtype=torch.bool).tril()[:, :S])
        kc, vc = t.k_cache.clone(), t.v_cache.clone()
        root, a, x, b = prompt[34:38].tolist()
        # tree rows: root@slot34 pos34, a@35 pos35 (parent root), x@36 pos35 (sibling of a), b@37 pos36 (parent a)
        ids = torch.tensor([root, a, x, b]); pos = torch.tensor([34, 35, 35, 36]); slots = torch.tensor([34, 35, 36, 37])
        m = torch.zeros(4, S, dtype=torch.bool); m[:, :34] = True
        anc = torch.tensor([[1,0,0,0],[1,1,0,0],[1,0,1,0],[1,1,0,1]], dtype=torch.bool)
        m[:, 34:38] = anc
        lt, _ = t.forward(ids, pos, slots, m)
        t.k_cache.copy_(kc); t.v_cache.copy_(vc)
        ids2 = torch.tensor([root, a, b]); p2 = torch.tensor([34, 35, 36])
        ls, _ = t.forward(ids2, p2, p2, torch.ones(37, S, dtype=torch.bool).tril()[34:37])
        # also the chain of the same path, one token at a time
        eq_b = torch.equal(lt[3], ls[2]); eq_a = torch.equal(lt[1], ls[1])
        same += eq_b; diffs += not eq_b
print("tree row b equal to chain row b:", same, "of", same + diffs)
