"""Sampled decoding with coupled drafts against the drafter's top-k, per temperature, in one run on one device.

For each temperature the bundled MT-bench prompts are answered three ways with the device's drafting
(`eagle3.defaults`): plain decoding, EAGLE-3 drafting the drafter's top-k (what greedy requests draft), and EAGLE-3
with coupled drafts (`FastRows.choose_drafts`: the drafter draws with the noise of the target's own draw). Prompt i
samples with seed i in all three, so every answer must equal plain decoding's token for token (up to bf16 rounding
of many-row verifications on a GPU's trees). Prints tau, acceptance by position, tok/s and the speedup, and writes
a run record.

    python scripts/sampled_drafting.py --target smollm2 --limit 10 --max-new-tokens 128 --out runs/sampled.json
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from eagle3.config import DraftShape, SamplingConfig
from eagle3.defaults import decoding_for
from eagle3.demo import bundled_drafter
from eagle3.evaluate import RunResult, load_prompts
from eagle3.fast.engine import FastOptions
from eagle3.record import run_record, write_json
from eagle3.runtime import decoder, encode_messages, load_runtime


def run(engine, prompts: list[list[int]], tokens: int, temperature: float,
        label: str) -> tuple[RunResult, list, float]:
    """(acceptance, each prompt's tokens, tok/s over the cycles) of `engine` on `prompts`, prompt i at seed i."""
    engine.generate(prompts[0], max_new_tokens=8, sampling=SamplingConfig(temperature=temperature, seed=0))  # warm
    acc, seconds, n, outs = RunResult(dataset="mt_bench", method=label, temperature=temperature), 0.0, 0, []
    for i, ids in enumerate(prompts):
        r = engine.generate(ids, max_new_tokens=tokens, sampling=SamplingConfig(temperature=temperature, seed=i))
        acc.add(r.stats)
        seconds += r.stats.draft_s + r.stats.verify_s
        n += r.stats.new_tokens - 1  # the first token comes from the prefill
        outs.append(r.token_ids)
    return acc, outs, n / seconds if seconds else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default=None, help="default: the bundled SmolLM2 drafter")
    p.add_argument("--device", default=None)
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7, 1.0])
    p.add_argument("--tree", default=None, metavar="D,K,N", help="draft shape (default: the device's)")
    p.add_argument("--out", required=True, help="run record (JSON)")
    args = p.parse_args(argv)

    drafter = args.drafter or str(bundled_drafter())
    rt = load_runtime(args.target, drafter=drafter, draft="eagle3", device=args.device)
    shape = DraftShape.parse(args.tree) if args.tree else None
    how = replace(decoding_for(rt.model, "eagle3", shape=shape), guard=False)  # every cycle drafts: compared
    _, chats = load_prompts("mt_bench", limit=args.limit)
    prompts = [encode_messages(rt.tokenizer, m) for m in chats]
    print(f"{args.target}: {how.engine} engine; drafting: {how.describe()}; {len(prompts)} prompts")
    rows = []
    for t in args.temperatures:
        _, ref, plain_s = run(decoder(rt, replace(how, speculate=False)), prompts, args.max_new_tokens, t, "plain")
        for label, coupled in (("top-k drafts", False), ("coupled drafts", True)):
            if how.engine == "fast":
                engine = decoder(rt, how, FastOptions(coupled_drafts=coupled))
            else:  # the generic engine's proposer
                engine = decoder(rt, how)
                engine.proposer.coupled = coupled
            res, outs, tok_s = run(engine, prompts, args.max_new_tokens, t, label)
            same = sum(a == b for a, b in zip(outs, ref, strict=True))
            rows.append({"temperature": t, "drafts": label, "tau": round(res.tau, 3),
                         "acceptance": [round(a, 3) for a in res.acceptance_per_position],
                         "tokens_per_s": round(tok_s, 2), "plain_tokens_per_s": round(plain_s, 2),
                         "speedup": round(tok_s / plain_s, 3), "identical": same,
                         "prompts": len(prompts)})
            r = rows[-1]
            print(f"T={t:g} {label:>15}: tau {r['tau']:.2f}, {r['tokens_per_s']:.1f} tok/s "
                  f"({r['speedup']:.2f}x plain {r['plain_tokens_per_s']:.1f}), {same}/{len(prompts)} identical; "
                  f"acceptance {r['acceptance'][:6]}")
    write_json(run_record("sampled-drafting", target=args.target, drafter=drafter, drafting=how.describe(),
                          max_new_tokens=args.max_new_tokens, rows=rows), args.out)
    print(f"record: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
