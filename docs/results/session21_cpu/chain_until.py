"""Session 21 (CPU): chains drafted until they get unlikely (`FastOptions.chain_min_prob`) against the demo's fixed
chain of 3, SmolLM2 bf16 on the fast path with the bundled drafter, greedy, 128 new tokens. One process; each round
runs every engine (plain decoding, fixed chains, each (chain length, min_prob) setting) on one prompt after the
other, prompt by prompt, so that the machine's drift hits all alike.
    PYTHONPATH=src python docs/results/session21_cpu/chain_until.py --first 3 --count 12 --rounds 2
"""
import argparse
import statistics
import time

import torch

from eagle3.config import SpecConfig
from eagle3.demo import bundled_drafter
from eagle3.evaluate import load_prompts
from eagle3.fast import FastEngine, FastTarget
from eagle3.fast.engine import FastOptions
from eagle3.formats import load_drafter
from eagle3.models import load_target
from eagle3.runtime import encode_prompt, eos_token_ids

ap = argparse.ArgumentParser()
ap.add_argument("--first", type=int, default=3, help="skip this many MT-bench prompts (the demo uses the first 3)")
ap.add_argument("--count", type=int, default=12)
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--lengths", type=int, nargs="+", default=[4, 6, 8])
ap.add_argument("--fixed", type=int, nargs="+", default=[3], help="fixed chain lengths to time beside")
ap.add_argument("--probs", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4])
args = ap.parse_args()

model, tok = load_target("smollm2", dtype="bfloat16", device="cpu")
d = load_drafter(bundled_drafter(), target_config=model.config, target_embedding=model.get_input_embeddings().weight,
                 device="cpu", dtype=torch.bfloat16)
shared = FastTarget(model, d.config.aux_layer_ids)
engines = {"plain": FastEngine(model, draft="none", tokenizer=tok, target=shared)}
for n in args.fixed:
    engines[f"chain {n}"] = FastEngine(model, draft="eagle3", spec=SpecConfig(mode="chain", chain_length=n), drafter=d,
                                       tokenizer=tok, target=shared)
for n in args.lengths:
    for p in args.probs:
        engines[f"chain {n} until {p}"] = FastEngine(
            model, draft="eagle3", spec=SpecConfig(mode="chain", chain_length=n), drafter=d, tokenizer=tok,
            target=shared, options=FastOptions(chain_min_prob=p))
_, qs = load_prompts("mt_bench", limit=args.first + args.count)
prompts = [encode_prompt(tok, chat=q) for q in qs[args.first:]]
eos = eos_token_ids(model, tok)
for e in engines.values():
    e.generate(prompts[0], max_new_tokens=16, eos_token_ids=eos)
speed = {k: [] for k in engines}
ref = [None] * len(prompts)
for r in range(args.rounds):
    secs = dict.fromkeys(engines, 0.0)
    stats = {k: [0, 0, 0, 0] for k in engines}  # tokens, cycles, drafted, identical
    for i, p in enumerate(prompts):  # engines interleaved prompt by prompt, so that drift hits all alike
        for name, e in engines.items():
            t0 = time.perf_counter()
            o = e.generate(p, max_new_tokens=128, eos_token_ids=eos)
            secs[name] += time.perf_counter() - t0
            ref[i] = ref[i] or o.token_ids
            st = stats[name]
            st[0] += len(o.token_ids)
            st[1] += o.stats.cycles
            st[2] += o.stats.drafted_tokens
            st[3] += o.token_ids == ref[i]
    for name in engines:
        n_tok, cycles, drafted, same = stats[name]
        speed[name].append(n_tok / secs[name])
        print(f"round {r} {name:22s} {n_tok / secs[name]:6.1f} tok/s  tau {n_tok / max(cycles, 1):.3f}  "
              f"drafted/cycle {drafted / max(cycles, 1):.2f}  identical {same}/{len(prompts)}", flush=True)
plain = statistics.median(speed["plain"])
for name, v in speed.items():
    print(f"{name:22s} median {statistics.median(v):6.1f} tok/s = {statistics.median(v) / plain:.3f}x plain")
