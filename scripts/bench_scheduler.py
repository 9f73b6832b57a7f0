"""The serving scheduler without HTTP: plain batched decoding against speculation with and without the speed gate.

Drives `eagle3.serving.scheduler.Scheduler` directly in this thread (no server, no client, no threads), so the
numbers show what the scheduling policy costs or buys, free of HTTP and event-loop noise. Each configuration gets
its own scheduler; the same requests run twice through it (a warm-up pass, in which the gate learns, then the
timed pass). Writes `bench_scheduler.json` (run record) and prints a table.

    python scripts/bench_scheduler.py --target smollm2 --drafter src/eagle3/assets/smollm2-drafter \
        --device cpu --clients 1 4 --max-tokens 96 --out runs/bench-scheduler
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from eagle3.config import DraftShape
from eagle3.decoding.drafters import Eagle3BatchDrafter
from eagle3.evaluate import load_prompts
from eagle3.models import load_target
from eagle3.record import run_record, write_json
from eagle3.runtime import drafter_for, encode_messages, eos_token_ids
from eagle3.serving.config import ServeConfig
from eagle3.serving.policy import SpecPolicy, default_token_budget
from eagle3.serving.requests import GenParams, RequestHandle
from eagle3.serving.scheduler import Scheduler
from eagle3.target import Target

MODES = ("plain", "spec-gate", "spec-nogate")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True, help="EAGLE-3 drafter checkpoint")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4], help="requests decoded together")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--prompts", default="mt_bench", help="bundled set name or JSONL")
    p.add_argument("--tree", default=DraftShape().text, metavar="DEPTH,TOPK,TOTAL", help="largest tree")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--max-prefill-tokens", type=int, default=ServeConfig.max_prefill_tokens,
                   help="padded prompt tokens per batched prefill (as `eagle3 serve`)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def run_once(sched: Scheduler, prompts: list[list[int]], max_tokens: int) -> tuple[float, int, int]:
    """All `prompts` admitted at once, decoded to the end: (seconds, cycles, tokens)."""
    done: list[int] = []

    def sink(ev):
        if ev.kind == "done":
            done.append(ev.completion_tokens)
        elif ev.kind == "error":
            raise RuntimeError(ev.text)

    for ids in prompts:
        sched._waiting.append(RequestHandle(GenParams(prompt_ids=ids, max_tokens=max_tokens), sink))
    cycles, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        # more requests than one prefill admits (`--max-prefill-tokens`) join between cycles, as in the server
        while sched.running or sched._waiting:
            had_rows = bool(sched.running)
            sched._step(sched._take_waiting())
            cycles += had_rows
    return time.perf_counter() - t0, cycles, sum(done)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tok = load_target(args.target, dtype=args.dtype, device=device)
    drafter = drafter_for(model, args.drafter)
    spec = DraftShape.parse(args.tree)
    eos = eos_token_ids(model, tok)
    name, chats = load_prompts(args.prompts, limit=max(args.clients))
    prompts = [encode_messages(tok, m) for m in chats]
    results = []
    for c in args.clients:
        for mode in args.modes:
            if mode == "plain":
                target, batch_drafter, policy = Target(model, []), None, SpecPolicy(largest=None)
            else:
                target, batch_drafter = Target(model, drafter.config.aux_layer_ids), Eagle3BatchDrafter(drafter)
                policy = SpecPolicy(spec, token_budget=default_token_budget(device), measure=mode == "spec-gate")
            sched = Scheduler(target, tok, eos, drafter=batch_drafter, policy=policy,
                              config=ServeConfig(max_prefill_tokens=args.max_prefill_tokens))
            try:
                run_once(sched, prompts[:c], args.max_tokens)  # warm-up; the gate learns here
                seconds, cycles, tokens = run_once(sched, prompts[:c], args.max_tokens)
            finally:
                target.close()
            results.append({"clients": c, "mode": mode, "seconds": round(seconds, 4), "cycles": cycles,
                            "tokens": tokens, "tokens_per_s": round(tokens / seconds, 2),
                            "ms_per_cycle": round(1000 * seconds / max(cycles, 1), 2)})
            print(f"c={c:<3} {mode:<12} {seconds:7.2f} s  {cycles:4d} cycles  {tokens / seconds:8.1f} tok/s",
                  flush=True)
    base = {r["clients"]: r["seconds"] for r in results if r["mode"] == "plain"}
    for r in results:
        if r["clients"] in base:
            r["speed_vs_plain"] = round(base[r["clients"]] / r["seconds"], 3)
    out = Path(args.out)
    write_json(run_record("bench_scheduler", target=args.target, drafter=args.drafter, device_name=device,
                          prompts=name, max_tokens=args.max_tokens, tree=str(spec), results=results),
               out / "bench_scheduler.json")
    print(f"\n{'clients':>7} | " + " | ".join(f"{m:>12}" for m in args.modes) + "   (speed vs plain)")
    for c in args.clients:
        cells = [next(r for r in results if r["clients"] == c and r["mode"] == m).get("speed_vs_plain", float("nan"))
                 for m in args.modes]
        print(f"{c:>7} | " + " | ".join(f"{x:>11.2f}x" for x in cells))
    print(f"\nrecord: {out / 'bench_scheduler.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
