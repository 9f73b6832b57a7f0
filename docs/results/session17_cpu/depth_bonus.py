"""Session 17 experiment (CPU): does a depth bonus in the EAGLE-2 rerank raise tau at the same tree size?

calibration.py found that, at equal cumulative draft probability, deeper nodes are accepted more often (depth 3-6
about 1.3-3x depth 1-2). Here the rerank keeps the `total` nodes with the highest adjusted score
    adj(node) = min(adj(parent), cum_logp(node) + bonus * depth(node))
(the min keeps every parent ahead of its children); the frontier of each level is still chosen by cum_logp.
SmolLM2-135M-Instruct (fp32) with the bundled drafter, the generic engine, tree 6,10,60, MT-bench first turns.
    PYTHONPATH=src python docs/results/session17_cpu/depth_bonus.py PROMPTS NEW_TOKENS BONUS [BONUS ...]
"""
import json
import sys
import time
from pathlib import Path

import torch

import eagle3
from eagle3.config import SpecConfig
from eagle3.decoding.engine import SpeculativeEngine
from eagle3.decoding.proposers import Eagle3Proposer
from eagle3.decoding.tree import DraftTree
from eagle3.demo import bundled_drafter
from eagle3.models import load_target
from eagle3.runtime import drafter_for
from eagle3.target import Target

BONUS = 0.0


def propose(self) -> DraftTree:
    """`Eagle3Proposer.propose` with the adjusted rerank (module docstring)."""
    d, k, dev = self.drafter, self.top_k, self.device
    stable = self.cache.length
    p_last = self.next_pos - 1
    logp = torch.log_softmax(d.logits(self.last_out).float(), dim=-1)[0]
    scores, draft_ids = logp.topk(k)
    rec_scores, rec_adj = [scores], [scores + BONUS]
    rec_tokens = [d.draft_ids_to_target(draft_ids)]
    rec_parents = [torch.full((k,), -1, dtype=torch.long, device=dev)]
    frontier = torch.arange(k, device=dev)
    f_hidden = d.feedback(self.last_out).expand(k, -1)[None]
    f_scores = scores
    anc = torch.eye(k, dtype=torch.bool, device=dev)
    n_rec = k
    for step in range(1, self.depth):
        tokens = torch.cat(rec_tokens)[frontier]
        pos = torch.full((1, k), p_last + step, device=dev)
        mask = torch.cat([torch.ones(k, stable, dtype=torch.bool, device=dev), anc], dim=1)[None, None]
        out = d(f_hidden, tokens[None], pos, mask=mask, cache=self.cache)
        child_logp = torch.log_softmax(d.logits(out).float(), dim=-1)[0]
        top_lp, top_ids = child_logp.topk(k, dim=-1)
        cum = (f_scores[:, None] + top_lp).reshape(-1)
        parents = frontier.repeat_interleave(k)
        rec_scores.append(cum)
        rec_adj.append(torch.minimum(torch.cat(rec_adj)[parents], cum + BONUS * (step + 1)))
        rec_tokens.append(d.draft_ids_to_target(top_ids.reshape(-1)))
        rec_parents.append(parents)
        best = cum.topk(k).indices
        parent_row = best // k
        frontier = n_rec + best
        n_rec += k * k
        f_scores = cum[best]
        f_hidden = d.feedback(out)[:, parent_row]
        anc = torch.cat([anc[parent_row], torch.eye(k, dtype=torch.bool, device=dev)], dim=1)
    self.cache.crop(stable)
    all_adj = torch.cat(rec_adj)
    all_tokens = torch.cat(rec_tokens)
    all_parents = torch.cat(rec_parents)
    n = min(self.budget, all_adj.numel())
    order = torch.sort(-all_adj, stable=True).indices[:n]
    keep = torch.sort(order).values
    remap = torch.full((all_adj.numel(),), -1, dtype=torch.long, device=dev)
    remap[keep] = torch.arange(n, device=dev)
    parents = all_parents[keep]
    parents = torch.where(parents >= 0, remap[parents.clamp(min=0)], parents)
    if bool((parents[all_parents[keep] >= 0] < 0).any()):
        raise RuntimeError("draft tree rerank dropped a parent of a kept node")
    return DraftTree(tokens=all_tokens[keep], parents=parents)


n_prompts, new_tokens = int(sys.argv[1]), int(sys.argv[2])
bonuses = [float(b) for b in sys.argv[3:]]
torch.manual_seed(0)
model, tok = load_target("smollm2", dtype="float32", device="cpu")
drafter = drafter_for(model, str(bundled_drafter()))
spec = SpecConfig(depth=6, top_k=10, total_tokens=60)
Eagle3Proposer.propose = propose
eng = SpeculativeEngine(Target(model, drafter.config.aux_layer_ids), Eagle3Proposer(drafter, spec), tok)
with open(Path(eagle3.__file__).parent / "assets/bench/mt_bench.jsonl") as f:
    prompts = [json.loads(line)["turns"][0] for line in f][:n_prompts]
ids = []
for p in prompts:
    text = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
    ids.append(tok(text, add_special_tokens=False)["input_ids"])
results = {}
for b in bonuses:
    BONUS = b
    t0 = time.perf_counter()
    acc = cyc = 0
    outs = []
    for x in ids:
        res = eng.generate(x, max_new_tokens=new_tokens, eos_token_ids=[])
        acc += sum(res.stats.accepted_per_cycle)
        cyc += res.stats.cycles
        outs.append(res.token_ids)
    results[b] = {"tau": (acc + cyc) / cyc, "cycles": cyc, "outputs": outs}
    same = outs == results[bonuses[0]]["outputs"]
    print(f"bonus {b:5.2f}: tau {(acc + cyc) / cyc:.3f} over {cyc} cycles ({time.perf_counter() - t0:.0f} s); "
          f"outputs equal to bonus {bonuses[0]}'s: {same}", flush=True)
with open(Path(__file__).with_suffix(".json"), "w") as f:
    json.dump({"prompts": n_prompts, "new_tokens": new_tokens,
               "tau": {str(b): r["tau"] for b, r in results.items()}}, f, indent=1)
