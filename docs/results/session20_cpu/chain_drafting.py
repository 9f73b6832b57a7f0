"""Session 20 (CPU): the demo's chain 3 drafted by `FastCore.draft_tree` (top_k 1) and by `draft_chain`, SmolLM2
bf16 on the fast path, alternating with plain decoding in one process (3 MT-bench prompts x 128 tokens x 3).
    PYTHONPATH=src python docs/results/session20_cpu/chain_drafting.py
"""
import time, torch
from eagle3.demo import bundled_drafter, CPU_BF16_SPEC
from eagle3.fast import FastEngine, FastTarget
from eagle3.formats import load_drafter
from eagle3.models import load_target
from eagle3.evaluate import load_prompts
from eagle3.runtime import encode_prompt, eos_token_ids

model, tok = load_target("smollm2", dtype="bfloat16", device="cpu")
d = load_drafter(bundled_drafter(), target_config=model.config, target_embedding=model.get_input_embeddings().weight, device="cpu", dtype=torch.bfloat16)
shared = FastTarget(model, d.config.aux_layer_ids)
eos = eos_token_ids(model, tok)
_, qs = load_prompts("mt_bench", limit=3)
plain = FastEngine(model, draft="none", tokenizer=tok, target=shared)
e1 = FastEngine(model, draft="eagle3", spec=CPU_BF16_SPEC, drafter=d, tokenizer=tok, target=shared)
e2 = FastEngine(model, draft="eagle3", spec=CPU_BF16_SPEC, drafter=d, tokenizer=tok, target=shared)
e1.core.draft = e1.core.draft_tree  # the general expansion with top_k 1 (what chains drafted with before)
warm = encode_prompt(tok, chat="Hello!")
for e in (plain, e1, e2): e.generate(warm, max_new_tokens=8, eos_token_ids=eos)
tot = {"plain": 0.0, "general": 0.0, "lean": 0.0}; cyc = {"general": 0, "lean": 0}
for rep in range(3):
    for q in qs:
        ids = encode_prompt(tok, chat=q)
        a = plain.generate(ids, max_new_tokens=128, eos_token_ids=eos); tot["plain"] += a.stats.total_s
        for k, e in (("general", e1), ("lean", e2)):
            b = e.generate(ids, max_new_tokens=128, eos_token_ids=eos); tot[k] += b.stats.total_s; cyc[k] += b.stats.cycles
            assert b.token_ids == a.token_ids, k
for k in ("general", "lean"): print(k, "speedup", round(tot["plain"] / tot[k], 3), "cycles", cyc[k], "ms/cycle", round(tot[k] / cyc[k] * 1e3, 2))
print("plain ms/token", round(tot["plain"] / (9 * 128) * 1e3, 2))
