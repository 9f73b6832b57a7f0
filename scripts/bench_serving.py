"""Serving benchmark: throughput and latency against concurrency, plain batched decoding vs speculative.

Loads a target (+ EAGLE-3 drafter), starts `eagle3 serve`'s app in-process on 127.0.0.1, and drives it over
HTTP with N concurrent streaming clients (httpx, closed loop, in a process of their own) on MT-bench prompts,
for every concurrency level, first with speculation off (same server code, no drafter), then on. Writes `bench_serving.json` (a
run record: git SHA, versions, device, argv, policy, per-level numbers) and `bench_serving.png`, and prints
a table. Output tokens/s counts completion tokens over the level's wall time; TTFT is arrival to first
content chunk; latency is arrival to the last chunk (p50 and p90 over requests). Greedy runs also count, per level,
the speculative answers whose text equals the plain answer to the same request.

GPU (SmolLM2 + a trained drafter):
    python scripts/bench_serving.py --target smollm2 --drafter runs/smollm2-drafter --out runs/bench-serving
CPU smoke test (random drafter, seconds):
    python scripts/bench_serving.py --target stories260k --random-drafter --device cpu \\
        --concurrency 1 4 --max-tokens 16 --out /tmp/bench-serving
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch

from eagle3.config import FUSE_POINTWISE_CHOICES, FUSE_POINTWISE_HELP, DraftShape
from eagle3.decoding.drafters import Eagle3BatchDrafter
from eagle3.defaults import load_for_decoding
from eagle3.evaluate import load_prompts
from eagle3.fast.pointwise import fuse_level
from eagle3.record import run_record, write_json
from eagle3.runtime import drafter_for, eos_token_ids
from eagle3.serving.app import create_app
from eagle3.serving.cli import fast_rows, serving_decoding
from eagle3.serving.config import ServeConfig
from eagle3.serving.loadgen import drive_in_process
from eagle3.serving.policy import SpecPolicy, default_token_budget
from eagle3.serving.server import ServerThread, build_scheduler
from eagle3.target import Target

MODEL = "bench"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--drafter", help="EAGLE-3 drafter checkpoint")
    src.add_argument("--random-drafter", action="store_true", help="a random drafter (smoke tests only)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--modes", nargs="+", choices=("plain", "spec"), default=["plain", "spec"])
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus filter of sampled requests (1: off)")
    p.add_argument("--prompts", default="mt_bench", help="bundled set name or JSONL")
    p.add_argument("--rounds", type=int, default=2, help="requests per client per level")
    p.add_argument("--min-requests", type=int, default=8, help="at least this many requests per level")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests per mode")
    p.add_argument("--tree", default=None, metavar="DEPTH,TOPK,TOTAL",
                   help="largest draft shape (default: what `eagle3 serve` drafts on this device)")
    p.add_argument("--spec-budget", type=int, default=None)
    p.add_argument("--spec-max-batch", type=int, default=None)
    p.add_argument("--no-spec-gate", action="store_true", help="speculate even where measured slower")
    # a variant of the fast rows (a library option of `fast_rows`; `eagle3 serve` takes the default)
    p.add_argument("--fuse-pointwise", choices=FUSE_POINTWISE_CHOICES, nargs="?", const="elementwise", default="auto",
                   help=FUSE_POINTWISE_HELP)
    p.add_argument("--fast-rows", choices=("auto", "on", "off"), default="auto",
                   help="as `eagle3 serve --fast-rows` (auto: wherever `eagle3 generate` takes the fast engine)")
    p.add_argument("--max-batch-size", type=int, default=ServeConfig.max_batch_size)
    p.add_argument("--admit-wait", type=float, default=ServeConfig.admit_wait,
                   help="as `eagle3 serve --admit-wait` (0: admit every request at once)")
    p.add_argument("--stream-interval", type=int, default=ServeConfig.stream_interval,
                   help="as `eagle3 serve --stream-interval`")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request client timeout (s)")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def request_bodies(prompts: list[list[dict]], n: int, start: int, chat: bool, args) -> list[dict]:
    out = []
    for i in range(n):
        msgs = prompts[(start + i) % len(prompts)]
        body = {"model": MODEL, "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        if args.temperature > 0:
            body["seed"] = start + i
            if args.top_p < 1.0:
                body["top_p"] = args.top_p
        body.update({"messages": msgs} if chat else {"prompt": msgs[-1]["content"]})
        out.append(body)
    return out


def run_mode(mode: str, model, tok, drafter, args, prompts, chat: bool, device: str, clients,
             on_level: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """One mode over every concurrency level; `clients` is the process pool the HTTP clients run in; `on_level`
    sees the levels measured so far after each one."""
    decoding = serving_decoding(model, "eagle3", args.target, None if args.random_drafter else args.drafter,
                                DraftShape.parse(args.tree) if args.tree else None)  # as `eagle3 serve`
    spec = decoding.shape
    policy = SpecPolicy(spec, token_budget=args.spec_budget or default_token_budget(device),
                        max_batch=args.spec_max_batch, measure=not args.no_spec_gate)
    if mode == "plain":
        target, batch_drafter, policy = Target(model, []), None, SpecPolicy(largest=None)
    else:
        target, batch_drafter = Target(model, drafter.config.aux_layer_ids), Eagle3BatchDrafter(drafter)
    config = ServeConfig(model_name=MODEL, max_batch_size=args.max_batch_size, default_max_tokens=args.max_tokens,
                         admit_wait=args.admit_wait, stream_interval=args.stream_interval)
    fr = fast_rows(args.fast_rows, model, drafter if batch_drafter else None, policy, config, device,
                   token_budget=args.spec_budget, fuse_pointwise=args.fuse_pointwise, decoding=decoding)
    sched = build_scheduler(target, tok, eos_token_ids(model, tok), batch_drafter, policy, config, rows=fr)
    rows = []
    srv = ServerThread(create_app(sched), shutdown_timeout=10).start()
    try:
        if args.warmup:
            clients.submit(drive_in_process, srv.url, request_bodies(prompts, args.warmup, 0, chat, args), 1, chat,
                           args.timeout).result()
        start = args.warmup
        for c in args.concurrency:
            n = max(args.min_requests, c * args.rounds)
            settle(sched)
            before, traced = sched.metrics.snapshot(), sched.cycles_traced
            res, wall = clients.submit(drive_in_process, srv.url, request_bodies(prompts, n, start, chat, args), c,
                                       chat, args.timeout).result()
            settle(sched)
            after = sched.metrics.snapshot()
            start += n

            def delta(key, after=after, before=before):
                return after.get(key, 0.0) - before.get(key, 0.0)

            ok = [r for r in res if not r.get("error")]
            tokens = sum(r["tokens"] for r in ok)
            spec_rows = delta("eagle3_spec_row_steps_total")
            row = {
                "mode": mode, "concurrency": c, "requests": n, "errors": len(res) - len(ok),
                "error_examples": [r["error"] for r in res if r.get("error")][:3],
                "output_tokens": tokens, "wall_s": round(wall, 4), "tokens_per_s": round(tokens / wall, 2),
                "ttft_p50_s": round(pct([r["ttft"] for r in ok if r["ttft"] is not None], 0.5), 4),
                "ttft_p90_s": round(pct([r["ttft"] for r in ok if r["ttft"] is not None], 0.9), 4),
                "latency_p50_s": round(pct([r["latency"] for r in ok], 0.5), 4),
                "latency_p90_s": round(pct([r["latency"] for r in ok], 0.9), 4),
                "verify_steps": int(delta("eagle3_verify_steps_total")),
                "mean_batch": round(delta("eagle3_batch_size_sum") / max(1.0, delta("eagle3_batch_size_count")), 2),
                "spec_row_fraction": round(spec_rows / max(1.0, delta("eagle3_batch_size_sum")), 3),
                "tau": round(1 + delta("eagle3_accepted_tokens_total") / spec_rows, 3) if spec_rows else None,
                "mean_cycle_ms": round(1000 * delta("eagle3_cycle_seconds_sum")
                                       / max(1.0, delta("eagle3_cycle_seconds_count")), 2),
                # where the level's wall time went on the server: cycles, prefills (rows wait), idle waits
                "cycles_s": round(delta("eagle3_cycle_seconds_sum"), 4),
                "prefill_s": round(delta("eagle3_prefill_seconds_sum"), 4),
                "prefills": int(delta("eagle3_prefill_seconds_count")),
                "idle_s": round(delta("eagle3_idle_seconds_total"), 4),
                "host_s": round(delta("eagle3_cycle_host_seconds_sum"), 4),  # part of cycles_s (fast rows)
                "paused_cycles": int(delta("eagle3_spec_paused_cycles_total")),
                "gates": sched.gate_snapshots(),  # what each speed gate believed at the end of the level
                "cycles": sched.cycle_trace(since=traced),  # every decode cycle: rows, mode, probe, ms, tokens
                "texts": {r["index"]: r["text"] for r in ok},  # compared across modes in `same_text`, then dropped
            }
            rows.append(row)
            if on_level is not None:
                on_level(rows)
            print(f"{mode:5s} c={c:<3d} {row['tokens_per_s']:9.1f} tok/s  ttft p50 {row['ttft_p50_s']:.3f}s  "
                  f"lat p50 {row['latency_p50_s']:.3f}s p90 {row['latency_p90_s']:.3f}s  batch {row['mean_batch']:.1f}"
                  f"  tau {row['tau']}  errors {row['errors']}  | wall {wall:.2f}s: cycles {row['cycles_s']:.2f}s "
                  f"(host {row['host_s']:.2f}s) prefill {row['prefill_s']:.2f}s ({row['prefills']}) idle {row['idle_s']:.2f}s",
                  flush=True)
    finally:
        srv.stop()
        target.close()
    rows_policy = asdict(policy)
    for r in rows:
        r["policy"] = rows_policy
        r["fast_rows"] = fr is not None
        r["admit_wait"], r["stream_interval"] = config.admit_wait, config.stream_interval
    return rows


def same_text(results: list[dict]) -> None:
    """Greedy runs with both modes: per level, how many speculative answers equal the plain answer to the same
    request (`identical_to_plain`, and the request numbers that differ); then drop the texts."""
    plain = {r["concurrency"]: r["texts"] for r in results if r["mode"] == "plain"}
    for r in results:
        texts = r.pop("texts")
        ref = plain.get(r["concurrency"])
        if r["mode"] == "spec" and ref is not None:
            both = sorted(set(texts) & set(ref))
            r["identical_to_plain"] = sum(texts[i] == ref[i] for i in both)
            r["compared"] = len(both)
            r["differing_requests"] = [i for i in both if texts[i] != ref[i]]


def settle(sched, timeout: float = 5.0) -> None:
    """Wait until the scheduler has closed its last cycle's books: clients see their last tokens before the cycle
    that emitted them has been timed, traced and counted, so a level's numbers are read only after that."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and (
            sched.running or sched.cycles_traced < sched.metrics.snapshot().get("eagle3_verify_steps_total", 0)):
        time.sleep(0.001)


def plot(results: list[dict], png: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    colors = {"plain": "C0", "spec": "C1"}
    for mode in sorted({r["mode"] for r in results}):
        rs = sorted((r for r in results if r["mode"] == mode), key=lambda r: r["concurrency"])
        cs, col = [r["concurrency"] for r in rs], colors[mode]
        axes[0].plot(cs, [r["tokens_per_s"] for r in rs], marker="o", color=col, label=mode)
        axes[2].plot(cs, [r["latency_p50_s"] for r in rs], marker="o", color=col, label=f"{mode} latency p50")
        axes[2].plot(cs, [r["ttft_p50_s"] for r in rs], marker="x", linestyle="--", color=col,
                     label=f"{mode} TTFT p50")
    plain = {r["concurrency"]: r["tokens_per_s"] for r in results if r["mode"] == "plain"}
    spec = {r["concurrency"]: r["tokens_per_s"] for r in results if r["mode"] == "spec"}
    both = sorted(set(plain) & set(spec))
    if both:
        axes[1].plot(both, [spec[c] / plain[c] if plain[c] else 0 for c in both], marker="o", color="C2")
        axes[1].axhline(1.0, color="grey", linestyle=":")
    for ax, title, ylabel in zip(axes, ("output throughput", "speculative / plain", "latency"),
                                 ("tokens/s", "speedup", "seconds"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tok = load_for_decoding(args.target, device, args.dtype)  # the dtype `eagle3 serve` takes
    dtype = next(model.parameters()).dtype
    drafter = drafter_for(model, None if args.random_drafter else args.drafter)
    chat = bool(getattr(tok, "chat_template", None))
    name, prompts = load_prompts(args.prompts)
    out = Path(args.out)

    def save(results: list[dict], complete: bool) -> dict[int, float]:
        """Write the record (after every level, `complete` false until the run ends); returns the speedups."""
        plain = {r["concurrency"]: r["tokens_per_s"] for r in results if r["mode"] == "plain"}
        speedup = {c: round(r["tokens_per_s"] / plain[c], 3) for r in results if r["mode"] == "spec"
                   for c in [r["concurrency"]] if plain.get(c)}
        record = run_record("bench_serving", target=args.target, drafter=args.drafter or "random",
                            device_name=device, dtype=str(dtype), prompts=name,
                            endpoint="chat" if chat else "completions", max_tokens=args.max_tokens,
                            temperature=args.temperature, top_p=args.top_p,
                            fuse_pointwise=fuse_level(args.fuse_pointwise, device) or "off",
                            results=[{k: v for k, v in r.items() if k != "texts"} for r in results],
                            speedup_spec_over_plain=speedup, complete=complete)
        write_json(record, out / "bench_serving.json")
        return speedup

    results = []
    # the clients get a process of their own: in the server's process they would compete with its scheduler
    # thread for the interpreter lock (`eagle3.serving.loadgen`)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as clients:
        for mode in args.modes:
            results += run_mode(mode, model, tok, drafter, args, prompts, chat, device, clients,
                                on_level=lambda rows, done=list(results): save(done + rows, complete=False))
    if args.temperature == 0:
        same_text(results)
    speedup = save(results, complete=True)
    png = plot(results, out / "bench_serving.png")
    print()
    print(f"{'clients':>7} | " + " | ".join(f"{m + ' tok/s':>11} {m + ' p50 lat':>12} {m + ' ttft':>10}"
                                            for m in args.modes) + (" | speedup" if speedup else ""))
    for c in args.concurrency:
        cells = []
        for m in args.modes:
            r = next(r for r in results if r["mode"] == m and r["concurrency"] == c)
            cells.append(f"{r['tokens_per_s']:>11.1f} {r['latency_p50_s']:>11.3f}s {r['ttft_p50_s']:>9.3f}s")
        same = next((r for r in results if r["mode"] == "spec" and r["concurrency"] == c and "compared" in r), None)
        print(f"{c:>7} | " + " | ".join(cells) + (f" | {speedup.get(c, float('nan')):.2f}x" if speedup else "")
              + (f" | {same['identical_to_plain']}/{same['compared']} answers as plain" if same else ""))
    errors = sum(r["errors"] for r in results)
    print(f"\nreport: {out / 'bench_serving.json'}" + (f", chart: {png}" if png else "")
          + (f"; {errors} failed requests" if errors else ""))
    if speedup:
        print(f"geometric-mean speedup {statistics.geometric_mean(speedup.values()):.2f}x")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
