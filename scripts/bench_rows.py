"""FastRows without a server: cycle time and tokens per second of plain and speculative cycles per batch size.

Fills B rows (`eagle3.fast.rows.FastRows`, as `eagle3 serve --fast-rows` builds them) with MT-bench prompts,
then times `--cycles` plain cycles and `--cycles` speculative cycles of the B rows (after `--warmup` of each;
every cycle reads its packet, as the server does). The draft shape per batch size comes from the serving policy
with the given token budget(s), so budgets can be compared in one run, and so can `--feed-windows` (how many plain
cycles' tokens a row holds back for the drafter; 0 feeds it in every plain cycle). Drafter-less rows give the
plain-cycle baseline (`bare_ms_per_cycle`), what a server without a drafter pays. Numbers are the engine's
alone: no HTTP, no detokenization, no scheduler. Writes `bench_rows.json` (run record) and prints a table.

    python scripts/bench_rows.py --target smollm2 --drafter src/eagle3/assets/smollm2-drafter \\
        --device cuda:0 --batch 1 4 16 64 --budgets 256 1024 --out runs/bench-rows
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from eagle3.config import FEED_WINDOW, DraftShape, SamplingConfig
from eagle3.decoding.sampling import GREEDY
from eagle3.evaluate import load_prompts
from eagle3.fast.rows import FastRows
from eagle3.fast.target import FastTarget
from eagle3.models import load_target
from eagle3.record import run_record, write_json
from eagle3.runtime import drafter_for, encode_messages
from eagle3.serving.config import ServeConfig
from eagle3.serving.policy import SpecPolicy

DRAFTING = {"eager": False, "compiled": True}  # --drafting -> FastRows(compile_drafting=)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--drafter", help="EAGLE-3 drafter checkpoint")
    src.add_argument("--random-drafter", action="store_true", help="a random drafter (smoke tests only)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64], help="rows decoded together")
    p.add_argument("--budgets", type=int, nargs="+", default=[256], help="verified tokens per cycle, B*(N+1)")
    p.add_argument("--feed-windows", type=int, nargs="+", default=[FEED_WINDOW],
                   help="plain-cycle tokens held back per row before a drafter feed step (0: feed every cycle)")
    p.add_argument("--tree", default=DraftShape().text, metavar="DEPTH,TOPK,TOTAL", help="largest tree")
    p.add_argument("--cycles", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=ServeConfig.fast_rows_len, help="cache slots per row")
    p.add_argument("--prompts", default="mt_bench", help="bundled set name or JSONL")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample every row at this temperature (row i seeded with i; 0: greedy)")
    p.add_argument("--eager-sampling", action="store_true",
                   help="sampled rows draw with eager ops instead of the fused (compiled) draw, which is the "
                        "default on CUDA: to measure what fusing saves")
    p.add_argument("--drafting", nargs="+", choices=tuple(DRAFTING), default=["eager"],
                   help="the speculative cycles' drafting pieces op by op (the default) or inductor-compiled; "
                        "several are each timed")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def timed(rows: FastRows, spec: bool, cycles: int, warmup: int) -> tuple[float, float]:
    """(ms per cycle, new tokens per row per cycle) over `cycles` cycles after `warmup`."""
    for _ in range(warmup):
        rows.cycle(spec)
    tokens = 0
    t0 = time.perf_counter()
    for _ in range(cycles):
        tokens += sum(len(t) for t in rows.cycle(spec))
    seconds = time.perf_counter() - t0
    return 1000 * seconds / cycles, tokens / (cycles * rows.n)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tok = load_target(args.target, dtype=args.dtype, device=device)
    dtype = next(model.parameters()).dtype
    drafter = drafter_for(model, None if args.random_drafter else args.drafter)
    spec = DraftShape.parse(args.tree)
    _, chats = load_prompts(args.prompts, limit=max(args.batch))
    prompts = [encode_messages(tok, m) for m in chats]
    limit = args.seq_len - 8 * (args.warmup + args.cycles) - 128  # room for the timed cycles
    prompts = [p[-limit:] for p in prompts]
    target = FastTarget(model, sorted(drafter.config.aux_layer_ids))

    def fill(rows: FastRows, b: int) -> None:
        while rows.n:
            rows.remove(rows.n - 1)
        for i in range(b):
            sampling = SamplingConfig(temperature=args.temperature, seed=i) if args.temperature > 0 else None
            rows.add(prompts[i % len(prompts)], sampling=sampling)

    fused = False if args.eager_sampling else None  # None: FastRows' default (fused on CUDA)
    bare = FastRows(target, None, capacity=max(args.batch), seq_len=args.seq_len,
                    fused_sampling=fused)  # no drafter: the baseline
    bare.prepare()
    bare_ms = {}
    for b in args.batch:
        fill(bare, b)
        bare_ms[b] = timed(bare, False, args.cycles, args.warmup)[0]
        print(f"no drafter     B={b:<3d} plain {bare_ms[b]:7.2f} ms", flush=True)
    del bare
    results = []
    for budget, window, drafting in ((x, w, c) for x in args.budgets for w in args.feed_windows
                                     for c in args.drafting):
        policy = SpecPolicy(spec, token_budget=budget)
        rows = FastRows(target, drafter, capacity=max(args.batch), seq_len=args.seq_len, shapes=policy.shape,
                        feed_window=window, fused_sampling=fused, compile_drafting=DRAFTING[drafting],
                        sampling=args.temperature > 0)  # greedy runs capture (and compile) greedy cycles only
        prepare_s = rows.prepare()
        for b in args.batch:
            fill(rows, b)
            row = {"budget": budget, "feed_window": window, "drafting": drafting, "batch": b,
                   "shape": str(rows.shape_of(b)),
                   "sampled": rows.mode != GREEDY, "fused_sampling": rows.fused_sampling,
                   "prepare_s": round(prepare_s, 2), "bare_ms_per_cycle": round(bare_ms[b], 3)}
            for mode, spec_on in (("plain", False), ("spec", True)):
                if spec_on and rows.shape_of(b) is None:
                    continue
                ms, per_row = timed(rows, spec_on, args.cycles, args.warmup)
                row[f"{mode}_ms_per_cycle"] = round(ms, 3)
                row[f"{mode}_tokens_per_row_cycle"] = round(per_row, 3)
                row[f"{mode}_tokens_per_s"] = round(1000 * b * per_row / ms, 1)
            if "spec_tokens_per_s" in row:
                row["speedup"] = round(row["spec_tokens_per_s"] / row["plain_tokens_per_s"], 3)
            results.append(row)
            print(f"{drafting:8s} budget {budget:5d} W={window:<2d} B={b:<3d} {row['shape']:<40s} plain {row['plain_ms_per_cycle']:7.2f} ms "
                  f"{row['plain_tokens_per_s']:9.1f} tok/s | spec {row.get('spec_ms_per_cycle', float('nan')):7.2f} ms "
                  f"tau {row.get('spec_tokens_per_row_cycle', float('nan')):5.2f} "
                  f"{row.get('spec_tokens_per_s', float('nan')):9.1f} tok/s  x{row.get('speedup', float('nan')):.2f}",
                  flush=True)
        del rows
    out = Path(args.out)
    write_json(run_record("bench_rows", target=args.target, drafter=args.drafter or "random", device_name=device,
                          dtype=str(dtype), cycles=args.cycles, seq_len=args.seq_len, temperature=args.temperature,
                          results=results),
               out / "bench_rows.json")
    print(f"report: {out / 'bench_rows.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
