"""GPU check: the TTT loss and gradients of the new attention path (TTTMask, causal target) vs the old dense one."""
import sys, torch, torch.nn.functional as F
sys.argv = [sys.argv[0], "after", "cuda"]
exec(open(__file__.replace("equiv.py", "prof_train.py")).read().split("variant = sys.argv[1]")[0])
import eagle3.training.ttt as ttt_mod, eagle3.training.features as fmod
from eagle3.drafter import TTTMask
def run(T):
    x = batch(T)
    f = feats_fn(x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = ttt_loss(drafter, f.aux, x.input_ids, x.position_ids, x.doc_ids, x.loss_mask, f.target_logits, f.target_argmax)
    g = torch.autograd.grad(out.loss, params)
    return out, torch.cat([t.flatten().float() for t in g])
new = {T: run(T) for T in (512, 2048)}
ttt_mod.ttt_mask = lambda doc: TTTMask(ttt_mod.base_mask(doc)[:, None])
def dense(q, k, v, base):
    t = q.shape[2]; n = k.shape[2] // t - 1
    eye = torch.eye(t, dtype=torch.bool, device=q.device).expand(base.shape[0], 1, t, t)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.cat([base, *([eye] * n)], dim=-1))
dmod.ttt_attention = dense
fmod.target_attention_mask = lambda batch, target: (batch.doc_ids >= 0).long()
for T in (512, 2048):
    (o1, g1), (o0, g0) = new[T], run(T)
    cos = F.cosine_similarity(g1, g0, dim=0).item()
    print(f"T={T} loss new {o1.loss.item():.6f} old {o0.loss.item():.6f} | acc/step new {(o1.step_correct/o1.step_count).tolist()} "
          f"old {(o0.step_correct/o0.step_count).tolist()} | grad cos {cos:.6f} rel-norm-diff {((g1-g0).norm()/g0.norm()).item():.2e}")
