"""Session 21 (CPU): bf16 logits' argmax as it is (torch's bf16 kernel) against upcast first (`argmax_ids`), in one
process, alternating: the demo's setup (SmolLM2 bf16, fast path, bundled drafter, chain 3, 3 MT-bench prompts x 128).
    PYTHONPATH=src python docs/results/session21_cpu/argmax_ab.py [ROUNDS]
"""
import sys
import time

import torch

import eagle3.fast.core as core_mod
import eagle3.fast.engine as engine_mod
from eagle3.demo import CPU_BF16_SPEC, bundled_drafter
from eagle3.evaluate import load_prompts
from eagle3.fast import FastEngine, FastTarget
from eagle3.fast.target import argmax_ids
from eagle3.formats import load_drafter
from eagle3.models import load_target
from eagle3.runtime import encode_prompt, eos_token_ids

model, tok = load_target("smollm2", dtype="bfloat16", device="cpu")
d = load_drafter(bundled_drafter(), target_config=model.config, target_embedding=model.get_input_embeddings().weight,
                 device="cpu", dtype=torch.bfloat16)
shared = FastTarget(model, d.config.aux_layer_ids)
spec = FastEngine(model, draft="eagle3", spec=CPU_BF16_SPEC, drafter=d, tokenizer=tok, target=shared)
plain = FastEngine(model, draft="none", tokenizer=tok, target=shared)
_, qs = load_prompts("mt_bench", limit=3)
prompts = [encode_prompt(tok, chat=q) for q in qs]
eos = eos_token_ids(model, tok)
variants = {"bf16 argmax": lambda x: x.argmax(dim=-1), "upcast (argmax_ids)": argmax_ids}
for e in (plain, spec):
    e.generate(prompts[0], max_new_tokens=16, eos_token_ids=eos)
res = {k: {"plain": [], "spec": [], "out": []} for k in variants}
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    for name, fn in variants.items():
        core_mod.argmax_ids = engine_mod.argmax_ids = fn
        for kind, e in (("plain", plain), ("spec", spec)):
            t0 = time.perf_counter()
            outs = [e.generate(p, max_new_tokens=128, eos_token_ids=eos).token_ids for p in prompts]
            res[name][kind].append(sum(map(len, outs)) / (time.perf_counter() - t0))
            res[name]["out"].append(outs)
        print(f"round {r} {name:20s} plain {res[name]['plain'][-1]:.1f} tok/s, chain 3 {res[name]['spec'][-1]:.1f} "
              f"tok/s, {res[name]['spec'][-1] / res[name]['plain'][-1]:.3f}x", flush=True)
first = res["bf16 argmax"]["out"][0]
print("all outputs identical:", all(o == first for v in res.values() for o in v["out"]))
for name, v in res.items():
    p, s = sorted(v["plain"]), sorted(v["spec"])
    print(f"{name:20s} median plain {p[len(p) // 2]:.1f} tok/s, chain 3 {s[len(s) // 2]:.1f} tok/s")
