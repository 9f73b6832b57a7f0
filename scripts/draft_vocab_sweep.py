"""How tau depends on the draft vocabulary size, estimated without retraining: the drafter's head is cut to
the N most frequent draft tokens (frequencies counted on the target's own answers in regenerated data) by
masking the other logits, and tau is measured on MT-bench prompts.

    python scripts/draft_vocab_sweep.py --data regen.jsonl --sizes 8192 4096 2048 1024 --out runs/vocab.json

This is an estimate: a smaller head trained from scratch would use its capacity differently. It answers
"how much acceptance do the rarer tokens buy".
"""

from __future__ import annotations

import argparse
import collections
import json

import torch

from eagle3.config import DraftShape
from eagle3.decoding.drafters import Eagle3Proposer
from eagle3.decoding.engine import SpeculativeEngine
from eagle3.demo import bundled_drafter
from eagle3.evaluate import load_prompts
from eagle3.formats import load_drafter
from eagle3.models import load_target
from eagle3.record import run_record, write_json
from eagle3.runtime import encode_prompt, eos_token_ids
from eagle3.target import Target


def assistant_token_counts(tok, paths: list[str]) -> collections.Counter:
    freq: collections.Counter = collections.Counter()
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                for turn in json.loads(line)["conversations"]:
                    if turn["from"] == "gpt":
                        freq.update(tok(turn["value"], add_special_tokens=False)["input_ids"])
    return freq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--drafter", default=str(bundled_drafter()))
    ap.add_argument("--data", nargs="+", required=True, help="regenerated conversations (eagle3 regenerate output)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[8192, 4096, 2048, 1024])
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="runs/draft_vocab_sweep.json")
    args = ap.parse_args()

    model, tok = load_target(args.target, dtype="float32")
    d = load_drafter(args.drafter, target_config=model.config, target_embedding=model.get_input_embeddings().weight,
                     dtype=torch.float32)
    freq = assistant_token_counts(tok, args.data)
    target_ids = (torch.arange(d.config.draft_vocab_size) + d.d2t).tolist()
    by_freq = sorted(range(len(target_ids)), key=lambda i: -freq.get(target_ids[i], 0))  # draft indices
    target = Target(model, d.config.aux_layer_ids)
    eos = eos_token_ids(model, tok)
    _, prompts = load_prompts("mt_bench", limit=args.limit)
    full_logits = d.logits
    rows = []
    for n in args.sizes:
        keep = torch.zeros(d.config.draft_vocab_size, dtype=torch.bool)
        keep[torch.tensor(by_freq[:n])] = True
        d.logits = lambda out, keep=keep: full_logits(out).masked_fill(~keep, float("-inf"))
        engine = SpeculativeEngine(target, Eagle3Proposer(d, DraftShape()), tok)
        emitted = cycles = 0
        for msgs in prompts:
            st = engine.generate(encode_prompt(tok, chat=msgs), max_new_tokens=args.max_new_tokens,
                                 eos_token_ids=eos).stats
            emitted += sum(st.accepted_per_cycle) + st.cycles
            cycles += st.cycles
        rows.append({"draft_vocab_size": n, "tau": round(emitted / cycles, 4)})
        print(f"draft vocab {n:6d}: tau {emitted / cycles:.3f}", flush=True)
    d.logits = full_logits
    write_json(run_record("draft_vocab_sweep", target=args.target, drafter=args.drafter, prompts=len(prompts),
                          max_new_tokens=args.max_new_tokens, rows=rows), args.out)


if __name__ == "__main__":
    main()
