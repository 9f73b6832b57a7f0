"""Session 17 experiment (CPU): how well the drafter's cumulative tree scores predict acceptance.

SmolLM2-135M-Instruct (fp32) with the bundled drafter, the generic engine, tree 6,10,60, MT-bench first turns.
For every verified tree node: its depth, its cumulative draft log-probability (the EAGLE-2 rerank score) and
whether the target accepts it (its token is the target's argmax after its parent, and its parent is accepted).
Prints acceptance against predicted probability per depth and per score bin; writes calibration.json.
    PYTHONPATH=src python docs/results/session17_cpu/calibration.py [PROMPTS] [NEW_TOKENS]
"""
import itertools
import json
import sys
from pathlib import Path

import torch

import eagle3
import eagle3.decoding.engine as engine_mod
import eagle3.decoding.proposers as prop_mod
from eagle3.config import SpecConfig
from eagle3.decoding.engine import SpeculativeEngine
from eagle3.decoding.proposers import Eagle3Proposer
from eagle3.demo import bundled_drafter
from eagle3.models import load_target
from eagle3.runtime import drafter_for
from eagle3.target import Target

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 8
new_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 128
torch.manual_seed(0)
model, tok = load_target("smollm2", dtype="float32", device="cpu")
drafter = drafter_for(model, str(bundled_drafter()))
spec = SpecConfig(depth=6, top_k=10, total_tokens=60)

kept_scores: list[torch.Tensor] = []  # per cycle: the kept nodes' rerank scores, in tree order
real_propose = Eagle3Proposer.propose

records = []  # (depth, score, accepted)
real_accept = engine_mod.accept


def accept(tree, logits, sampling, gen):
    top = logits.argmax(-1)  # [N+1]: the target's choice after the root (0) and after each node
    parents = tree.parents.tolist()
    tokens = tree.tokens.tolist()
    scores = kept_scores[-1].tolist()
    ok = [False] * len(tokens)
    depth = [0] * len(tokens)
    for i, (p, t) in enumerate(zip(parents, tokens, strict=True)):
        parent_ok = True if p < 0 else ok[p]
        depth[i] = 1 if p < 0 else depth[p] + 1
        ok[i] = parent_ok and t == int(top[0 if p < 0 else p + 1])
        records.append((depth[i], scores[i], ok[i]))
    return real_accept(tree, logits, sampling, gen)


engine_mod.accept = accept

def propose_with_scores(self):
    """`Eagle3Proposer.propose`, keeping the rerank scores of the nodes it keeps (caught from its torch.cat of
    the per-step score lists and re-selected as its rerank does)."""
    scores_seen = {}
    real_cat = torch.cat

    def cat_spy(ts, *a, **kw):
        out = real_cat(ts, *a, **kw)
        if isinstance(ts, list) and ts and ts[0].dtype == torch.float32 and ts[0].dim() == 1:
            scores_seen["all"] = out
        return out

    prop_mod.torch.cat = cat_spy
    try:
        tree = real_propose(self)
    finally:
        prop_mod.torch.cat = real_cat
    all_scores = scores_seen["all"]
    n = tree.tokens.numel()
    order = torch.sort(-all_scores, stable=True).indices[:n]
    keep = torch.sort(order).values
    kept_scores.append(all_scores[keep])
    return tree


Eagle3Proposer.propose = propose_with_scores
eng = SpeculativeEngine(Target(model, drafter.config.aux_layer_ids), Eagle3Proposer(drafter, spec), tok)
with open(Path(eagle3.__file__).parent / "assets/bench/mt_bench.jsonl") as f:
    prompts = [json.loads(line)["turns"][0] for line in f][:n_prompts]
taus = []
for i, p in enumerate(prompts):
    text = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    res = eng.generate(ids, max_new_tokens=new_tokens, eos_token_ids=[])
    taus.append(res.stats.new_tokens / max(1, res.stats.cycles))
    print(f"prompt {i}: {res.stats.cycles} cycles, tau {(sum(res.stats.accepted_per_cycle) + res.stats.cycles) / res.stats.cycles:.2f}", flush=True)

print("\nper depth: nodes per cycle, acceptance, mean predicted (exp score)")
cycles = len(kept_scores)
out = {"depth": {}, "bins": []}
for d in range(1, 7):
    r = [(s, a) for dd, s, a in records if dd == d]
    acc = sum(a for _, a in r) / max(1, len(r))
    pred = sum(torch.tensor(s).exp().item() for s, _ in r) / max(1, len(r))
    print(f"  depth {d}: {len(r) / cycles:5.2f} nodes, accepted {acc:.3f}, predicted {pred:.3f}, "
          f"accepted per cycle {sum(a for _, a in r) / cycles:.3f}")
    out["depth"][d] = {"nodes_per_cycle": len(r) / cycles, "accepted": acc, "predicted": pred}
print("\nper score bin (exp score): nodes, accepted rate, mean predicted")
edges = [0, 0.01, 0.03, 0.1, 0.2, 0.4, 0.6, 0.8, 1.01]
for lo, hi in itertools.pairwise(edges):
    for d in range(1, 7):
        r = [(s, a) for dd, s, a in records if dd == d and lo <= torch.tensor(s).exp().item() < hi]
        if len(r) < 20:
            continue
        acc = sum(a for _, a in r) / len(r)
        pred = sum(torch.tensor(s).exp().item() for s, _ in r) / len(r)
        print(f"  [{lo:.2f}, {hi:.2f}) depth {d}: {len(r):5d} nodes, accepted {acc:.3f}, predicted {pred:.3f}")
        out["bins"].append({"lo": lo, "hi": hi, "depth": d, "nodes": len(r), "accepted": acc, "predicted": pred})
with open(Path(__file__).with_suffix(".json"), "w") as f:
    json.dump(out, f, indent=1)
