"""Time the target's decode attention alone: the split-KV Triton kernel against SDPA, as the fast path calls them.

For each shape (heads, KV heads, head size), cache size S, context and token count T (1: a plain step; 6: a
chain of 5; 61: the 6,10,60 tree), both run 30 layers' worth of calls captured in one CUDA graph, each with what
it needs per forward (SDPA: the additive bias from the mask, built once per forward; split: nothing), and the
graph replay is timed. Also sweeps the kernel's key-block size. Writes a JSON run record.

    python scripts/bench_split_attention.py --device cuda:0 --out runs/split-attention
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from eagle3.fast import split_attention as split
from eagle3.fast.attention import attention_bias, grouped_attention
from eagle3.record import run_record, write_json

SHAPES = {"smollm2-135m": (9, 3, 64), "llama-3.1-8b": (32, 8, 128)}  # (query heads, KV heads, head size)


def time_graph(fn, reps: int) -> float:
    """Microseconds per replay of `fn` captured in a CUDA graph (median of 5 bursts of `reps`)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[2]


def measure(shape: str, context: int, t: int, layers: int, block_ns: list[int], reps: int,
            dev: torch.device) -> dict:
    """One row: SDPA and the split kernel (each key-block size) over `layers` calls, in us per replay."""
    nh, nkv, hd = SHAPES[shape]
    s = -(-(context + 2 * t + 16) // 128) * 128  # as the engines size the cache
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(nh, t, hd, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(layers, nkv, s, hd, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(layers, nkv, s, hd, device=dev, dtype=torch.bfloat16, generator=g)
    ar = torch.arange(s, device=dev)
    mask = ar[None, :] <= context + torch.arange(t, device=dev)[:, None]  # [T, S] a chain's
    scale = hd**-0.5

    def sdpa():
        bias = attention_bias(mask, nh // nkv, torch.bfloat16)
        for i in range(layers):
            grouped_attention(q, k[i], v[i], bias, scale)

    def by_splits():
        for i in range(layers):
            split.split_attention(q.view(nkv, -1, hd), k[i], v[i], mask, scale)

    row = {"shape": shape, "context": context, "tokens": t, "slots": s, "sdpa_us": round(time_graph(sdpa, reps), 1)}
    want = grouped_attention(q, k[0], v[0], attention_bias(mask, nh // nkv, torch.bfloat16), scale)
    default_bn = split.BLOCK_N
    try:
        for bn in block_ns:
            split.BLOCK_N = bn  # read by split_attention at each call
            got = split.split_attention(q.view(nkv, -1, hd), k[0], v[0], mask, scale)
            row[f"split_bn{bn}_us"] = round(time_graph(by_splits, reps), 1)
            row[f"split_bn{bn}_max_abs_diff"] = (got.float() - want.float()).abs().max().item()
    finally:
        split.BLOCK_N = default_bn
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--context", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 6, 61])
    p.add_argument("--layers", type=int, default=30, help="calls per captured graph")
    p.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128], help="key-block sizes to sweep")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="runs/split-attention")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    torch.cuda.set_device(dev)
    rows = []
    for shape in args.shapes:
        for context in args.context:
            for t in args.tokens:
                rows.append(measure(shape, context, t, args.layers, args.block_n, args.reps, dev))
                print(rows[-1], flush=True)
    out = Path(args.out)
    path = write_json(run_record("bench_split_attention", layers=args.layers, rows=rows), out / "split.json")
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
