"""Session 22 (CPU): the chain-3 demo setup with the drafting pieces inductor-compiled (FastOptions(compile_drafting=True));
after one 32-token answer, each piece timed compiled and eager, 50 calls each with the weights warm in cache.
    PYTHONPATH=src python docs/results/session22_cpu/compile_pieces.py
"""
import time, torch
from eagle3.demo import bundled_drafter, CPU_BF16_SPEC
from eagle3.fast import FastEngine, FastTarget, FastOptions
from eagle3.formats import load_drafter
from eagle3.models import load_target
from eagle3.evaluate import load_prompts
from eagle3.runtime import encode_prompt, eos_token_ids
model, tok = load_target("smollm2", dtype="bfloat16", device="cpu")
d = load_drafter(bundled_drafter(), target_config=model.config, target_embedding=model.get_input_embeddings().weight, device="cpu", dtype=torch.bfloat16)
e = FastEngine(model, draft="eagle3", spec=CPU_BF16_SPEC, drafter=d, tokenizer=tok, options=FastOptions(compile_drafting=True, max_seq_len=512))
_, qs = load_prompts("mt_bench", limit=1)
ids = encode_prompt(tok, chat=qs[0]); eos = eos_token_ids(model, tok)
t = time.perf_counter(); e.generate(ids, max_new_tokens=32, eos_token_ids=eos); print("first", time.perf_counter() - t)
print("compiled pieces:", list(e.core.pieces.fns), "tried:", e.core.pieces.tried)
import collections
T = collections.defaultdict(float)
for n in ("draft", "accept", "feed", "tree_inputs"):
    f = e.core.pieces.fns.get(n)
    if f is None: continue
    g = e.core.pieces.eager[n]
    for name, fn in (("compiled", f), ("eager", g)):
        for _ in range(3): fn()
        t = time.perf_counter()
        for _ in range(50): fn()
        print(n, name, round((time.perf_counter() - t) / 50 * 1e3, 3), "ms")
