"""Tau of the bundled drafter's tree 6,10,60 when the drafter's logits are divided by T before the tree is built
(greedy, fp32 CPU, generic engine): does a calibration temperature pick better nodes for the same budget?"""
import sys, time, torch
from eagle3.config import SamplingConfig, SpecConfig
from eagle3.decoding.engine import SpeculativeEngine
from eagle3.decoding.proposers import Eagle3Proposer
from eagle3.evaluate import load_prompts
from eagle3.runtime import encode_prompt, eos_token_ids
from eagle3.target import Target
from eagle3.formats import load_drafter
from eagle3.models import load_target
from eagle3.demo import bundled_drafter
torch.set_num_threads(2)
model, tok = load_target("smollm2", dtype="float32", device="cpu")
d = load_drafter(bundled_drafter(), target_config=model.config, target_embedding=model.get_input_embeddings().weight, device="cpu", dtype=torch.float32)
n, toks = int(sys.argv[1]), int(sys.argv[2])
temps = [float(t) for t in sys.argv[3].split(",")]
_, qs = load_prompts("mt_bench", limit=n)
eos = eos_token_ids(model, tok)
spec = SpecConfig.parse_tree(sys.argv[4] if len(sys.argv) > 4 else "6,10,60")
t = Target(model, d.config.aux_layer_ids)
orig = d.logits
for T in temps:
    d.logits = (lambda x, T=T: orig(x) / T)
    eng = SpeculativeEngine(t, Eagle3Proposer(d, spec), tok)
    emitted = cycles = 0; t0 = time.time()
    for q in qs:
        r = eng.generate(encode_prompt(tok, chat=q), max_new_tokens=toks, sampling=SamplingConfig(), eos_token_ids=eos)
        emitted += sum(r.stats.accepted_per_cycle) + r.stats.cycles; cycles += r.stats.cycles
    print(f"T={T}: tau {emitted / cycles:.3f} ({cycles} cycles, {time.time() - t0:.0f}s)", flush=True)
