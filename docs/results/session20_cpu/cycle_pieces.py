"""Session 20 (CPU): one MT-bench answer (128 tokens) with the demo's chain 3 on the fast path, SmolLM2 bf16, timed
piece by piece (draft, verify, accept, commit/feed), then plain decoding of the same prompt.
    PYTHONPATH=src python docs/results/session20_cpu/cycle_pieces.py
"""
import time, torch, collections
from eagle3.demo import bundled_drafter, CPU_BF16_SPEC
from eagle3.fast import FastEngine, FastTarget
from eagle3.formats import load_drafter
from eagle3.models import load_target
from eagle3.evaluate import load_prompts
from eagle3.runtime import encode_prompt, eos_token_ids
from eagle3.config import SamplingConfig
model, tok = load_target("smollm2", dtype="bfloat16", device="cpu")
d = load_drafter(bundled_drafter(), target_config=model.config, target_embedding=model.get_input_embeddings().weight, device="cpu", dtype=torch.bfloat16)
shared = FastTarget(model, d.config.aux_layer_ids)
eng = FastEngine(model, draft="eagle3", spec=CPU_BF16_SPEC, drafter=d, tokenizer=tok, target=shared)
plain = FastEngine(model, draft="none", tokenizer=tok, target=shared)
_, qs = load_prompts("mt_bench", limit=3)
ids = encode_prompt(tok, chat=qs[0]); eos = eos_token_ids(model, tok)
eng.generate(ids, max_new_tokens=16, eos_token_ids=eos)
core = eng.core
T = collections.defaultdict(float); N = collections.Counter()
def wrap(obj, name):
    f = getattr(obj, name)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); T[name] += time.perf_counter() - t; N[name] += 1; return r
    setattr(obj, name, g)
for n in ("draft", "verify", "accept", "commit", "feed", "tree_inputs"):
    wrap(core, n)
orig_piece = core.piece
t0 = time.perf_counter(); out = eng.generate(ids, max_new_tokens=128, eos_token_ids=eos); tot = time.perf_counter() - t0
print("total", round(tot*1e3), "ms cycles", out.stats.cycles, "tau", round(out.stats.tau,2))
for n in T: print(n, N[n], "calls", round(T[n]/max(N[n],1)*1e3, 3), "ms each", round(T[n]*1e3), "ms total")
t0 = time.perf_counter(); p = plain.generate(ids, max_new_tokens=128, eos_token_ids=eos); tp = time.perf_counter() - t0
print("plain total", round(tp*1e3), "ms", "per token", round(tp/128*1e3,2))
