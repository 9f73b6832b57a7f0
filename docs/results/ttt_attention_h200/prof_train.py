"""Where a TTT training step's time goes on the GPU: random SmolLM2-shaped target (bf16), the bundled drafter,
synthetic length-bucketed batches of 32,768 padded tokens; current dense-mask attention vs variants."""
import json, sys, time, contextlib
import torch, torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from eagle3.target import Target
from eagle3.formats.io import load_drafter
from eagle3.training.ttt import ttt_loss
from eagle3.training.features import OnlineFeatures
from eagle3.attention import varying_shape_attention
import eagle3.drafter as dmod

dev = torch.device(sys.argv[2] if len(sys.argv) > 2 else "cuda")
cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                  max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5)
cfg._attn_implementation = "sdpa"
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).to(dev, torch.bfloat16)
target = Target(model, [2, 15, 27])
drafter = load_drafter("src/eagle3/assets/smollm2-drafter", dtype=torch.float32, device=dev,
                       target_embedding=model.get_input_embeddings().weight).train()
feats_fn = OnlineFeatures(target, drafter.t2d)
params = [p for p in drafter.trainable_parameters()]
opt = torch.optim.AdamW(params, lr=1e-4)

class B:  # minimal Batch stand-in for OnlineFeatures
    packed = False
def batch(T):
    b = 32768 // T
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(0, 49152, (b, T), generator=g)
    lens = torch.randint(T // 2, T + 1, (b,), generator=g); lens[0] = T
    doc = torch.where(torch.arange(T)[None] < lens[:, None], 0, -1)
    lm = ((torch.arange(T)[None] >= (lens[:, None] * 0.3).long()) & (doc >= 0)).float()
    x = B(); x.input_ids = ids.to(dev); x.doc_ids = doc.to(dev); x.loss_mask = lm.to(dev)
    x.position_ids = torch.arange(T, device=dev).expand(b, T).contiguous()
    x.packed = False
    return x

def step(x, parts):
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    ev[0].record()
    with varying_shape_attention(dev):
        f = feats_fn(x)
        ev[1].record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = ttt_loss(drafter, f.aux, x.input_ids, x.position_ids, x.doc_ids, x.loss_mask,
                           f.target_logits, f.target_argmax)
        ev[2].record()
        out.loss.backward()
    opt.step(); opt.zero_grad(set_to_none=True)
    ev[3].record(); torch.cuda.synchronize()
    parts.append([ev[i].elapsed_time(ev[i + 1]) for i in range(3)])

variant = sys.argv[1] if len(sys.argv) > 1 else "before"
if variant == "before":  # the code before TTTMask: dense step masks, padding mask for the target
    import eagle3.training.ttt as ttt_mod, eagle3.training.features as fmod
    from eagle3.drafter import TTTMask
    ttt_mod.ttt_mask = lambda doc: TTTMask(ttt_mod.base_mask(doc)[:, None])
    def dense(q, k, v, base):
        t = q.shape[2]; n = k.shape[2] // t - 1
        eye = torch.eye(t, dtype=torch.bool, device=q.device).expand(base.shape[0], 1, t, t)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.cat([base, *([eye] * n)], dim=-1))
    dmod.ttt_attention = dense
    fmod.target_attention_mask = lambda batch, target: (batch.doc_ids >= 0).long()
res = {}
for T in (512, 1024, 2048):
    x = batch(T); parts = []
    for i in range(6):
        step(x, parts)
    p = torch.tensor(parts[2:]).median(0).values.tolist()
    res[T] = {"features_ms": p[0], "ttt_fwd_ms": p[1], "bwd_opt_ms": p[2], "total_ms": sum(p),
              "peak_gb": torch.cuda.max_memory_allocated() / 1e9}
    torch.cuda.reset_peak_memory_stats()
    print(variant, T, json.dumps(res[T]), flush=True)
if len(sys.argv) > 3:
    from torch.profiler import profile, ProfilerActivity
    x = batch(2048); parts = []
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step(x, parts)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
