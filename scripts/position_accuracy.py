"""Teacher-forced drafter accuracy by position in the answer, on the target's own fresh greedy answers.

The training log's accuracy is an average over whole training answers, and a small target's long answers grow
repetitive and easy to predict towards their end; acceptance on a benchmark's first few hundred tokens is set by
the early, harder part. This script answers prompts with the target (greedy, HF `generate`), scores the drafter on
them with the training objective's own code (`eagle3.training.ttt.ttt_loss`, all TTT steps, teacher-forced
tokens) and reports the accuracy per TTT step for each bucket of answer positions.

    python scripts/position_accuracy.py --prompts mt_bench --limit 8 --max-new-tokens 384 --out runs/posacc.json

Step 0's accuracy is the first drafted token's acceptance rate; step k's is conditional on the k tokens before it
being right (they are teacher-forced).
"""

from __future__ import annotations

import argparse
import itertools

import torch
from tqdm import tqdm

from eagle3.demo import bundled_drafter
from eagle3.evaluate import load_prompts
from eagle3.models import load_target
from eagle3.record import run_record, write_json
from eagle3.runtime import drafter_for, encode_messages, eos_token_ids
from eagle3.target import Target
from eagle3.training.ttt import DEFAULT_TTT_STEPS, ttt_loss


def parse_buckets(edges: list[int]) -> list[tuple[int, int]]:
    pairs = list(itertools.pairwise(edges))
    if not pairs or any(b <= a for a, b in pairs) or edges[0] < 0:
        raise SystemExit(f"--edges must be at least two increasing non-negative positions, got {edges}")
    return pairs


@torch.no_grad()
def position_accuracy(model, tok, drafter, prompts: list[list[dict]], buckets: list[tuple[int, int]],
                      max_new_tokens: int, steps: int = DEFAULT_TTT_STEPS) -> dict[str, dict]:
    """{"lo-hi": {"tokens": N, "acc_per_step": [K floats]}} over every prompt's fresh greedy answer."""
    target = Target(model, drafter.config.aux_layer_ids)
    draft_ids = drafter.t2d.nonzero().squeeze(-1).to(model.device)  # [Vd] target ids in the draft vocabulary
    eos = eos_token_ids(model, tok)
    correct = {b: torch.zeros(steps) for b in buckets}
    count = {b: torch.zeros(steps) for b in buckets}
    try:
        for messages in tqdm(prompts, desc="answer and score", unit="prompt"):
            prompt = encode_messages(tok, messages)
            ids = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=eos[0] if eos else None)[0]  # [n]
            n = ids.shape[0]
            aux, logits = target.features(ids[None])  # [1, n, 3Ht], [1, n, V]
            aux = aux.clone()  # an ordinary tensor (features run under inference mode)
            draft_logits, argmax = logits.index_select(-1, draft_ids), logits.argmax(-1)  # [1, n, Vd], [1, n]
            positions = torch.arange(n, device=ids.device)[None]
            docs = torch.zeros(1, n, dtype=torch.long, device=ids.device)
            for lo, hi in buckets:
                mask = torch.zeros(1, n, device=ids.device)  # answer tokens lo..hi-1 are the supervised ones
                mask[0, len(prompt) + lo : len(prompt) + hi] = 1
                if not mask.any():
                    continue
                out = ttt_loss(drafter, aux, ids[None], positions, docs, mask, draft_logits, argmax, steps=steps)
                correct[(lo, hi)] += out.step_correct.cpu()
                count[(lo, hi)] += out.step_count.cpu()
    finally:
        target.close()
    return {f"{lo}-{hi}": {"tokens": int(count[(lo, hi)][0]),
                           "acc_per_step": [round(x, 4) for x in (correct[(lo, hi)] / count[(lo, hi)].clamp_min(1)).tolist()]}
            for lo, hi in buckets}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--drafter", default=str(bundled_drafter()), help="a drafter folder, or 'random'")
    ap.add_argument("--prompts", default="mt_bench", help="a bundled benchmark set or a JSONL of prompts")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--edges", type=int, nargs="+", default=[0, 96, 192, 384],
                    help="answer-position bucket edges (tokens after the prompt)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default="runs/position_accuracy.json")
    args = ap.parse_args(argv)

    buckets = parse_buckets(args.edges)
    model, tok = load_target(args.target, dtype=args.dtype, device=args.device)
    drafter = drafter_for(model, None if args.drafter == "random" else args.drafter)
    name, prompts = load_prompts(args.prompts, args.limit)
    result = position_accuracy(model, tok, drafter, prompts, buckets, args.max_new_tokens)
    for key, row in result.items():
        print(f"answer tokens {key:>9}: {row['tokens']:6d} scored, acc per TTT step {row['acc_per_step']}")
    record = run_record("position_accuracy", target=args.target, drafter=args.drafter, prompts=name,
                        limit=args.limit, max_new_tokens=args.max_new_tokens, buckets=result)
    write_json(record, args.out)
    print(f"record: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
