"""Session 20 (CPU): plain decoding on the fast path, SmolLM2 bf16, with the exact-rows kernels (`exact_rows`) and
with the vendor kernels, alternating in one process: 3 MT-bench prompts x 128 tokens x 3 repetitions.
    PYTHONPATH=src python docs/results/session20_cpu/plain_kernels.py
"""
import time, torch
from eagle3.fast import FastEngine, FastTarget
from eagle3.models import load_target
from eagle3.evaluate import load_prompts
from eagle3.runtime import encode_prompt, eos_token_ids
model, tok = load_target("smollm2", dtype="bfloat16", device="cpu")
eos = eos_token_ids(model, tok)
_, qs = load_prompts("mt_bench", limit=3)
ts = {}
for name in ("exact", "vendor"):
    t = FastTarget(model); t.exact_rows = (name == "exact")
    ts[name] = FastEngine(model, draft="none", tokenizer=tok, target=t)
    ts[name].generate(encode_prompt(tok, chat="Hello!"), max_new_tokens=8, eos_token_ids=eos)
tot = {k: [0.0, 0] for k in ts}
for rep in range(3):
    for q in qs:
        ids = encode_prompt(tok, chat=q)
        for k, e in ts.items():
            r = e.generate(ids, max_new_tokens=128, eos_token_ids=eos); tot[k][0] += r.stats.total_s; tot[k][1] += r.stats.new_tokens
for k, (s, n) in tot.items(): print(k, round(n / s, 2), "tok/s")
