"""Session 22 (CPU): how many of TTT's scored rows can drafting reach? With the bundled v7 drafter, on 300 of its own
training conversations (the first 150 regenerated ShareGPT and 150 self-written-prompt answers of session 21), count
per TTT step the supervised rows and those whose earlier steps all had the next data token among their K best draft
tokens (`ttt_loss(..., align_top_k=K)` scores only those), for K = 1 (a chain), 3 and 10 (the tree's top_k).

    eagle3 prepare --target smollm2 --data s150.jsonl y150.jsonl --out DATA --max-length 2048 \
        --length-policy truncate --vocab-from src/eagle3/assets/smollm2-drafter
    PYTHONPATH=src python docs/results/session22_cpu/reachable.py DATA
"""
import sys

import torch

from eagle3.demo import bundled_drafter
from eagle3.formats import load_drafter
from eagle3.models import load_target
from eagle3.target import Target
from eagle3.training.dataset import TrainData
from eagle3.training.features import OnlineFeatures
from eagle3.training.ttt import shift_left, step_supervision, unroll

STEPS, KS = 7, (1, 3, 10)
torch.manual_seed(0)
model, _ = load_target("smollm2", dtype="float32", device="cpu")
d = load_drafter(bundled_drafter(), target_config=model.config, target_embedding=model.get_input_embeddings().weight,
                 device="cpu", dtype=torch.float32).eval()
target = Target(model, d.config.aux_layer_ids)
feats = OnlineFeatures(target, d.t2d)
data = TrainData(sys.argv[1], 2048)
plan = data.plan_epoch(0, seed=0, batch_tokens=8192)
sup_n = torch.zeros(STEPS)
reach_n = {k: torch.zeros(STEPS) for k in KS}
hits = torch.zeros(STEPS)
with torch.inference_mode():
    for bi, rows in enumerate(plan):
        batch = data.collate(rows)
        f = feats(batch)
        ids, lm, doc, pos = batch.input_ids, batch.loss_mask, batch.doc_ids, batch.position_ids
        reach = {k: torch.ones(ids.shape, dtype=torch.bool) for k in KS}
        for s, out in enumerate(unroll(d, d.combine(f.aux), ids, pos, doc, STEPS)):
            sup = step_supervision(lm, doc, s) > 0  # [B, T]
            nxt = shift_left(ids, 2 + s)  # the token step s+1 is fed
            top = d.draft_ids_to_target(d.logits(out).topk(max(KS), dim=-1).indices)  # [B, T, 10]
            sup_n[s] += sup.sum()
            hits[s] += (sup & (top[..., 0] == shift_left(f.target_argmax, 1 + s))).sum()
            for k in KS:
                reach_n[k][s] += (sup & reach[k]).sum()
                reach[k] &= (top[..., :k] == nxt[..., None]).any(-1) | ~sup
        print(f"batch {bi + 1}/{len(plan)}", file=sys.stderr)
print(f"{len(plan)} batches, {len(data.trainable_ids)} conversations; supervised rows per step: {sup_n.int().tolist()}")
print("accuracy per step (all supervised rows):", [round(x, 3) for x in (hits / sup_n).tolist()])
for k in KS:
    print(f"reachable share, K={k:2d}:", [round(x, 3) for x in (reach_n[k] / sup_n).tolist()])
