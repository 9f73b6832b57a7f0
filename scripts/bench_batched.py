"""Continuous-batching plain decoding (`eagle3.fast.batched.BatchedGenerator`, what `eagle3 regenerate --engine
fast` runs): tokens per second over `--rounds` timed runs after one warm-up run (graph capture).

Answers the prompts of a bundled set or JSONL (chat template; `--repeat` times over, to fill many rows) with
`--rows` rows, greedy (or at `--temperature`, seed 0), at most `--max-new-tokens` each, in a cache of
`--max-prompt-tokens` + `--max-new-tokens` slots per row (as `eagle3 regenerate` sizes it). Writes
`bench_batched.json` (run record: tokens/s per round, answers identical from round to round) and prints a table.

    python scripts/bench_batched.py --target smollm2 --device cuda:0 --rows 512 --dataset gsm8k --repeat 16 \\
        --max-prompt-tokens 1280 --max-new-tokens 384 --out runs/bench-batched
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from eagle3.evaluate import load_prompts
from eagle3.fast.batched import BatchedGenerator
from eagle3.models import load_target
from eagle3.record import run_record, write_json
from eagle3.runtime import encode_messages, eos_token_ids


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="a target (path, hub id or alias: smollm2, stories260k)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--dataset", default="gsm8k", help="bundled set name or JSONL of prompts")
    p.add_argument("--limit", type=int, default=None, help="first N prompts of the set")
    p.add_argument("--repeat", type=int, default=1, help="answer the prompts this many times over")
    p.add_argument("--rows", type=int, default=64, help="rows decoded together (regenerate's --batch-size)")
    p.add_argument("--max-prompt-tokens", type=int, default=1280, help="sizes the cache, as in regenerate")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--rounds", type=int, default=2, help="timed runs")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def timed_run(gen: BatchedGenerator, prompts: list[list[int]], args, eos: list[int], dev: torch.device):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    outs = gen.generate(prompts, max_new_tokens=args.max_new_tokens, eos_token_ids=eos,
                        temperature=args.temperature, seed=0)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.tokens) for o in outs)
    return outs, {"seconds": round(seconds, 3), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1)}


@torch.inference_mode()
def main(argv=None) -> int:
    args = parse_args(argv)
    model, tok = load_target(args.target, dtype=args.dtype, device=args.device)
    dev = next(model.parameters()).device
    eos = eos_token_ids(model, tok)
    _, chats = load_prompts(args.dataset, limit=args.limit)
    prompts = [ids[: args.max_prompt_tokens] for ids in (encode_messages(tok, m) for m in chats)] * args.repeat
    seq_len = args.max_prompt_tokens + args.max_new_tokens
    gen = BatchedGenerator(model, rows=args.rows, max_seq_len=seq_len)
    print(f"{len(prompts)} prompts ({args.dataset} x {args.repeat}), {args.rows} rows, {seq_len} slots a row, "
          f"on {dev}", flush=True)
    warm = min(len(prompts), args.rows)  # captures the cycles, warms the kernels
    gen.generate(prompts[:warm], max_new_tokens=min(args.max_new_tokens, 16), eos_token_ids=eos,
                 temperature=args.temperature, seed=0)
    rounds, answers = [], []
    for r in range(args.rounds):
        outs, res = timed_run(gen, prompts, args, eos, dev)
        rounds.append(res)
        answers.append([o.tokens for o in outs])
        print(f"round {r + 1} {res['tokens_per_s']:10.1f} tok/s ({res['tokens']} tokens in {res['seconds']:.2f} s)",
              flush=True)
    same = all(a == answers[0] for a in answers)
    median = statistics.median(x["tokens_per_s"] for x in rounds)
    print(f"\nmedian tok/s: {median:.1f}; answers identical from round to round: {'yes' if same else 'no'}")
    path = write_json(run_record("bench_batched", target=args.target, dataset=args.dataset, prompts=len(prompts),
                                 rows=args.rows, seq_len=seq_len, max_new_tokens=args.max_new_tokens,
                                 temperature=args.temperature, dtype=str(model.dtype).removeprefix("torch."),
                                 rounds=rounds, median_tokens_per_s=median, identical_rounds=same),
                      Path(args.out) / "bench_batched.json")
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
