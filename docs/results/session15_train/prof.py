"""Where a TTT training step's time goes on the GPU, and what torch.compile of its pieces buys.

Random SmolLM2-shaped target (bf16), the bundled drafter (fp32 master weights, bf16 autocast), synthetic
right-padded batches of 32,768 tokens (one document per row, 30 % prompt), AdamW. Variants are cumulative:
  base        the code as it is
  ce          + torch.compile(soft_cross_entropy, dynamic=True)
  drafter     + compiled drafter pieces (RMSNorm, MLP)
  target      + compiled target decoder layers (forward only; hooks stay eager)
  layer       + the whole drafter decoder layer compiled (attention, cache append, TTT slots)
Usage (repo root, PYTHONPATH=src): python docs/results/session15_train/prof.py VARIANT [profile]
"""
import json, sys, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import eagle3.drafter as dmod
import eagle3.training.ttt as ttt_mod
from eagle3.target import Target
from eagle3.formats.io import load_drafter
from eagle3.training.features import OnlineFeatures
from eagle3.attention import varying_shape_attention

variant = sys.argv[1]
order = ["base", "ce", "drafter", "target", "layer"]
on = set(order[: order.index(variant) + 1])
dev = torch.device("cuda")
cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                  max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5)
cfg._attn_implementation = "sdpa"
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).to(dev, torch.bfloat16)
target = Target(model, [2, 15, 27])
if "ce" in on:
    ttt_mod.soft_cross_entropy = torch.compile(ttt_mod.soft_cross_entropy, dynamic=True)
if "drafter" in on:
    dmod.RMSNorm.forward = torch.compile(dmod.RMSNorm.forward, dynamic=True)
    dmod.DrafterMLP.forward = torch.compile(dmod.DrafterMLP.forward, dynamic=True)
if "target" in on:
    for layer in model.model.layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)
if "layer" in on:
    dmod.Eagle3DecoderLayer.forward = torch.compile(dmod.Eagle3DecoderLayer.forward, dynamic=True)
drafter = load_drafter("src/eagle3/assets/smollm2-drafter", dtype=torch.float32, device=dev,
                       target_embedding=model.get_input_embeddings().weight).train()
feats_fn = OnlineFeatures(target, drafter.t2d)
params = list(drafter.trainable_parameters())
opt = torch.optim.AdamW(params, lr=1e-4)


class B:
    packed = False


def batch(T, seed):
    b = 32768 // T
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 49152, (b, T), generator=g)
    lens = torch.randint(T // 2, T + 1, (b,), generator=g); lens[0] = T
    doc = torch.where(torch.arange(T)[None] < lens[:, None], 0, -1)
    lm = ((torch.arange(T)[None] >= (lens[:, None] * 0.3).long()) & (doc >= 0)).float()
    x = B(); x.input_ids = ids.to(dev); x.doc_ids = doc.to(dev); x.loss_mask = lm.to(dev)
    x.position_ids = torch.arange(T, device=dev).expand(b, T).contiguous()
    return x


def step(x, parts, losses):
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    ev[0].record()
    with varying_shape_attention(dev):
        f = feats_fn(x)
        ev[1].record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = ttt_mod.ttt_loss(drafter, f.aux, x.input_ids, x.position_ids, x.doc_ids, x.loss_mask,
                                   f.target_logits, f.target_argmax)
        ev[2].record()
        out.loss.backward()
    opt.step(); opt.zero_grad(set_to_none=True)
    ev[3].record(); torch.cuda.synchronize()
    parts.append([ev[i].elapsed_time(ev[i + 1]) for i in range(3)])
    losses.append(round(out.loss.item(), 5))


res = {"variant": variant}
t0 = time.time()
for T in (512, 1024, 2048, 768, 1536):  # the last two: shapes not seen before (recompiles?)
    x = batch(T, T); parts, losses = [], []
    t1 = time.time()
    step(x, parts, losses)
    first = time.time() - t1
    for _ in range(5):
        step(x, parts, losses)
    p = torch.tensor(parts[2:]).median(0).values.tolist()
    res[T] = {"features_ms": round(p[0], 2), "ttt_fwd_ms": round(p[1], 2), "bwd_opt_ms": round(p[2], 2),
              "total_ms": round(sum(p), 2), "first_step_s": round(first, 2), "loss_first": losses[0]}
    print(variant, T, json.dumps(res[T]), flush=True)
res["wall_s"] = round(time.time() - t0, 1)
print(json.dumps(res), flush=True)
if len(sys.argv) > 2:
    from torch.profiler import profile, ProfilerActivity
    x = batch(1024, 1024); parts, losses = [], []
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step(x, parts, losses)
    import os
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=60, max_name_column_width=90)
    with open(os.path.join(os.environ.get("OUT", "."), f"prof_{variant}.txt"), "w") as f:
        f.write(table)
