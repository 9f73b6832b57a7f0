"""Continuous-batching plain decoding (`eagle3.fast.batched.BatchedGenerator`, what `eagle3 regenerate --engine
fast` runs): tokens per second with attention over spans that follow the rows in flight (the default), against
attention over every row's whole cache (one span), in the same run on the same device.

Answers the prompts of a bundled set or JSONL (chat template; `--repeat` times over, to fill many rows) with
`--rows` rows, greedy, at most `--max-new-tokens` each, in a cache of `--max-prompt-tokens` + `--max-new-tokens`
slots per row (as `eagle3 regenerate` sizes it), the two settings alternating `--rounds` times after one warm-up
run each (graph capture). Writes `bench_batched.json` (run record: tokens/s per round, the windows run at each
span, answers identical between the settings) and prints a table.

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
from eagle3.fast.batched import MIN_SPAN, BatchedGenerator
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
    p.add_argument("--min-span", type=int, default=MIN_SPAN, help="the narrowest attention span")
    p.add_argument("--rounds", type=int, default=2, help="timed runs of each setting, alternating")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def timed_run(gen: BatchedGenerator, prompts: list[list[int]], args, eos: list[int], dev: torch.device):
    gen.span_windows.clear()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    outs = gen.generate(prompts, max_new_tokens=args.max_new_tokens, eos_token_ids=eos)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.tokens) for o in outs)
    return outs, {"seconds": round(seconds, 3), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
                  "span_windows": {str(s): n for s, n in sorted(gen.span_windows.items())}}


@torch.inference_mode()
def main(argv=None) -> int:
    args = parse_args(argv)
    model, tok = load_target(args.target, dtype=args.dtype, device=args.device)
    dev = next(model.parameters()).device
    eos = eos_token_ids(model, tok)
    _, chats = load_prompts(args.dataset, limit=args.limit)
    prompts = [ids[: args.max_prompt_tokens] for ids in (encode_messages(tok, m) for m in chats)] * args.repeat
    seq_len = args.max_prompt_tokens + args.max_new_tokens
    gens = {"spans": BatchedGenerator(model, rows=args.rows, max_seq_len=seq_len, min_span=args.min_span),
            "whole": BatchedGenerator(model, rows=args.rows, max_seq_len=seq_len, min_span=seq_len)}
    print(f"{len(prompts)} prompts ({args.dataset} x {args.repeat}), {args.rows} rows, {seq_len} slots a row, "
          f"spans {gens['spans'].spans} against ({seq_len},), on {dev}", flush=True)
    warm = min(len(prompts), args.rows)  # one run each first: captures every span's graph, warms the kernels
    for gen in gens.values():
        gen.generate(prompts[:warm], max_new_tokens=min(args.max_new_tokens, 16), eos_token_ids=eos)
    rounds: dict[str, list[dict]] = {name: [] for name in gens}
    answers: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        for name in (("spans", "whole") if r % 2 == 0 else ("whole", "spans")):
            outs, res = timed_run(gens[name], prompts, args, eos, dev)
            rounds[name].append(res)
            answers[name] = [o.tokens for o in outs]
            print(f"round {r + 1} {name:6s} {res['tokens_per_s']:10.1f} tok/s ({res['tokens']} tokens in "
                  f"{res['seconds']:.2f} s) windows by span {res['span_windows']}", flush=True)
    same = sum(a == b for a, b in zip(answers["spans"], answers["whole"], strict=True))
    summary = {name: statistics.median(x["tokens_per_s"] for x in rs) for name, rs in rounds.items()}
    ratio = summary["spans"] / summary["whole"]
    print(f"\nmedian tok/s: spans {summary['spans']:.1f}, whole cache {summary['whole']:.1f}: {ratio:.2f}x; "
          f"answers identical {same}/{len(prompts)}")
    path = write_json(run_record("bench_batched", target=args.target, dataset=args.dataset, prompts=len(prompts),
                                 rows=args.rows, seq_len=seq_len, max_new_tokens=args.max_new_tokens,
                                 spans=list(gens["spans"].spans), dtype=str(model.dtype).removeprefix("torch."),
                                 rounds=rounds, median_tokens_per_s=summary, speedup=round(ratio, 3),
                                 identical=same), Path(args.out) / "bench_batched.json")
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
