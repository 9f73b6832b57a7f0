"""Session 36 CPU experiment: session 35's drafting (the drafter attending by SDPA over the whole cache, every
cycle feeding it all D+1 rows) against this session's (`prefix_attention`: fp32 over the slots in use; feeding only
the accepted rows), each change alone too, on the demo's prompts and settings (SmolLM2 bf16, fast path, chain of
up to 6 stopping below 0.2, 128 tokens), arms interleaved over rounds, with the cycle's pieces timed.

    python drafter_attention_arms.py ROUNDS OUT.json [ARM,...]   # arms: sdpa+all prefix+all sdpa+accepted prefix+accepted

An arm name ending in +int8 also multiplies the drafter's one-row products by int8 copies of its matrices (per-row
scales, `torch._weight_int8pack_mm`): `int8_drafter_arms.json` is `prefix+all,prefix+all+int8` (named bf16 and
int8 there) on commit bdc094b's code, before the feed was trimmed.
"""
import collections
import sys
import time

import torch

from eagle3.config import SamplingConfig
from eagle3.demo import CPU_BF16_CHAIN_STOP, CPU_BF16_SPEC, bundled_drafter
from eagle3.evaluate import load_prompts
from eagle3.fast import FastEngine, FastTarget
from eagle3.fast.engine import FastOptions
from eagle3.formats import load_drafter
from eagle3.models import load_target
from eagle3.record import run_record, write_json
from eagle3.runtime import encode_prompt, eos_token_ids

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
model, tok = load_target("smollm2", dtype="bfloat16", device="cpu")
d = load_drafter(bundled_drafter(), target_config=model.config, target_embedding=model.get_input_embeddings().weight,
                 device="cpu", dtype=torch.bfloat16)
shared = FastTarget(model, d.config.aux_layer_ids)
plain = FastEngine(model, draft="none", tokenizer=tok, target=shared)
names = sys.argv[3].split(",") if len(sys.argv) > 3 else ["sdpa+all", "prefix+accepted"]
arms = {a: FastEngine(model, draft="eagle3", spec=CPU_BF16_SPEC, drafter=d, tokenizer=tok, target=shared,
                      options=FastOptions(chain_stop=CPU_BF16_CHAIN_STOP, drafter_attention=a.split("+")[0]))
        for a in names}


def feed_all(core):
    """Session 35's `FastCore.feed`: all D+1 rows every cycle (the rows after n_acc are padding)."""

    def feed():
        length, keep, n_acc = core.length, core.keep, core.n_acc
        dst = length + core.ar[: core.max_depth + 1]
        hidden = core.drafter.combine(core.aux.index_select(0, keep))
        mask = core.ar_sd[None, :] <= dst[:, None]
        out = core.drafter(hidden, core.emitted, dst, dst, mask)
        core.last_out.copy_(out.index_select(0, n_acc))
        core.root.copy_(core.emitted.gather(0, n_acc))
        core.length.add_(n_acc + 1)

    core.feed = feed


def int8_products(fd):
    """The drafter's one-row products by int8 copies of its matrices (per-row scales); others as before."""
    packed = {}
    for w in (fd.wqkv, fd.wo, fd.w13, fd.w2, fd.lm_head):
        scale = w.float().abs().amax(1).clamp_min(1e-8) / 127
        q = torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
        packed[w.data_ptr()] = (q, scale.bfloat16())
    linear = fd.linear

    def int8_linear(x, w, b=None):
        q = packed.get(w.data_ptr())
        if q is None or x.shape[0] > 1:
            return linear(x, w, b)
        y = torch._weight_int8pack_mm(x, *q)
        return y if b is None else y + b

    fd.linear = int8_linear


for a, e in arms.items():
    if "+all" in a:
        feed_all(e.core)
    if a.endswith("+int8"):
        int8_products(e.core.drafter)
pieces = collections.defaultdict(float)


def timed(core, name, arm):
    fn = getattr(core, name)

    def run(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        pieces[(arm, name)] += time.perf_counter() - t
        return out

    setattr(core, name, run)


for arm, e in arms.items():
    for name in ("draft_chain_until", "verify", "feed", "accept"):
        timed(e.core, name, arm)
eos = eos_token_ids(model, tok)
_, qs = load_prompts("mt_bench", limit=3)
ids = [encode_prompt(tok, chat=m) for m in qs]
for e in [plain, *arms.values()]:
    e.generate(encode_prompt(tok, chat="Hello!"), max_new_tokens=8, eos_token_ids=eos)
pieces.clear()
res = {name: {"s": 0.0, "tok": 0, "cyc": 0, "same": 0, "drafted": 0} for name in ["plain", *arms]}
for r in range(rounds):
    for p in ids:
        a = plain.generate(p, max_new_tokens=128, sampling=SamplingConfig(), eos_token_ids=eos)
        res["plain"]["s"] += a.stats.total_s
        res["plain"]["tok"] += a.stats.new_tokens
        for name, e in arms.items():
            b = e.generate(p, max_new_tokens=128, sampling=SamplingConfig(), eos_token_ids=eos)
            x = res[name]
            x["s"] += b.stats.total_s
            x["tok"] += b.stats.new_tokens
            x["cyc"] += b.stats.cycles
            x["same"] += a.token_ids == b.token_ids
            x["drafted"] += b.stats.drafted_tokens
    base = res["plain"]["tok"] / res["plain"]["s"]
    line = [f"round {r}: plain {base:.1f} tok/s"]
    for name in arms:
        x = res[name]
        line.append(f"{name} {x['tok'] / x['s']:.1f} ({x['tok'] / x['s'] / base:.2f}x, tau {x['tok'] / x['cyc']:.2f}, "
                    f"drafting {pieces[(name, 'draft_chain_until')] / x['cyc'] * 1e3:.2f} ms, feed "
                    f"{pieces[(name, 'feed')] / x['cyc'] * 1e3:.2f} ms, verify "
                    f"{pieces[(name, 'verify')] / x['cyc'] * 1e3:.2f} ms a cycle, identical {x['same']})")
    print(" | ".join(line), flush=True)
if len(sys.argv) > 2:  # the run record: git SHA, versions, device, argv (`eagle3.record.run_record`)
    write_json(run_record("drafter_attention_arms", results=res, rounds=rounds,
                          pieces_ms_per_cycle={f"{a}.{n}": v / res[a]["cyc"] * 1e3 for (a, n), v in pieces.items()}),
               sys.argv[2])
