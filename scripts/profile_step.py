"""Where the time of one decoding step goes: GPU kernel time by kind, against the step's captured wall time.

For plain decoding's step (one-token forward + argmax) and, with a drafter, one EAGLE-3 tree cycle (draft,
verify, accept, commit) on the fast path (one row of `eagle3.fast.rows.FastRows`, what `FastEngine` runs): the
step runs eagerly under `torch.profiler`
(kernel durations do not depend on how they were launched), and its CUDA-graph replay is timed as the engines
run it. Kernels are grouped by name into matmul, attention, top-k/sort/reduce, index/copy, elementwise and other;
"idle" is the graph's wall time minus the sum of its kernels (gaps between small kernels). `--pieces` does the
same for each piece of the cycle (draft, verify, accept, commit). `--rows N` also profiles the cycles with N rows
of `--context` tokens each (a server batch), plain and speculative (and their pieces). `--by-source N` also
lists the N (eagle3 function, operator) pairs that took the most kernel time, with the operator's calls: which code
to change. Writes `profile_step.json` (run record) and prints a table.

    python scripts/profile_step.py --device cuda:0 --shape llama8b --out runs/profile-8b
    python scripts/profile_step.py --device cuda:0 --target smollm2 --drafter src/eagle3/assets/smollm2-drafter \\
        --out runs/profile-smollm2
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

import torch

from eagle3.config import FUSE_POINTWISE_CHOICES, TARGET_ATTENTION, TARGET_ATTENTION_HELP, DraftShape
from eagle3.decoding.sampling import GREEDY
from eagle3.fast import split_attention
from eagle3.fast.cpu import cpu_has_bf16
from eagle3.fast.drafter import FastDrafter
from eagle3.fast.graphs import StepRunner, graph_pool
from eagle3.fast.overhead import SHAPES, begin_random, build_random, copy_bandwidth, time_step
from eagle3.fast.pointwise import fuse_level
from eagle3.fast.row_norm import rms_norm_rows
from eagle3.fast.rows import FastRows
from eagle3.fast.target import FastTarget
from eagle3.record import run_record, write_json

KINDS = [  # first match wins
    ("matmul", r"gemm|gemv|nvjet|xmma|cutlass|splitk|cublas|aten::mm|aten::addmm|aten::bmm|mkldnn::_linear"),
    ("attention", r"fmha|flash|attention|efficient"),
    ("topk/sort/reduce", r"topk|sort|radix|scan|reduce|argmax|softmax"),
    ("index/copy", r"index|scatter|gather|copy|cat|fill"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise"),
]


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, pattern in KINDS if re.search(pattern, low)), "other")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--shape", choices=("llama8b", *SHAPES), help="random weights at this shape (bf16; llama8b is "
                     "llama-3.1-8b), with a random drafter: a cycle's cost does not depend on what it accepts")
    src.add_argument("--target", help="a real target (path, hub id or alias)")
    p.add_argument("--drafter", help="EAGLE-3 drafter for --target (without it: plain decoding only)")
    p.add_argument("--random-drafter", action="store_true", help="a random drafter for --target (smoke tests)")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="--target's dtype (auto: bf16 on CUDA and on CPUs with native bf16, as `eagle3 demo`)")
    p.add_argument("--context", type=int, default=512, help="cached tokens before the profiled step")
    p.add_argument("--tree", default=DraftShape().text, metavar="DEPTH,TOPK,TOTAL")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--fuse-pointwise", choices=FUSE_POINTWISE_CHOICES, nargs="?", const="elementwise", default="auto",
                   help="the target's elementwise work compiled (Pointwise, FastOptions.fuse_pointwise; "
                        "auto: elementwise on CUDA, off on a CPU)")
    p.add_argument("--residual-add", choices=("auto", "gemm", "separate"), default="auto",
                   help="experiment: the target's residual adds in the products' epilogues (gemm) or after them "
                        "(separate); auto: FastTarget's default (gemm on CUDA)")
    p.add_argument("--target-attention", choices=TARGET_ATTENTION, default="auto",
                   help=TARGET_ATTENTION_HELP.removeprefix("fast path: "))
    p.add_argument("--target-norm", choices=("auto", "fold", "torch", "triton"), default="auto",
                   help="experiment: the target's RMSNorms folded into the products after them (eagle3.fast."
                        "norm_fold), by torch (F.rms_norm on CUDA) or by one Triton program per row (eagle3.fast."
                        "row_norm; CUDA only); auto: FastTarget's default (fold where the target attends by splits)")
    p.add_argument("--split-blocks", type=int, default=None, metavar="N",
                   help="experiment: key blocks per split at least in the split attention (default "
                        "eagle3.fast.split_attention.MIN_SPLIT_BLOCKS)")
    p.add_argument("--eager-drafting", action="store_true", help="do not compile the cycle's drafting pieces "
                   "(FastRows.compile_drafting, on by default on CUDA as in the engines)")
    p.add_argument("--pieces", action="store_true",
                   help="also profile the cycle's pieces one by one (draft, verify, accept, commit with the drafter's "
                        "feed), each timed as its own graph: which piece holds the kernels a cycle adds")
    p.add_argument("--rows", type=int, nargs="*", default=[], metavar="N",
                   help="also profile the cycles with each of these row counts (a server batch; drafting compiled "
                        "unless --eager-drafting)")
    p.add_argument("--by-source", type=int, default=0, metavar="N",
                   help="also list the N (eagle3 function, operator) pairs with the most kernel time")
    p.add_argument("--all-kernels", action="store_true",
                   help="also record every kernel of each profile (name, us and launches per call) in the JSON")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


# Functions that only pass a product on (`FastTarget.linear`, `FastDrafter.linear`, `PackedWeights.linear`):
# an operator under them is credited to the function that called them.
PASS_THROUGH = (": linear",)


def _eagle3_frame(event) -> str:
    """The innermost Python function inside the eagle3 package that led to a profiled operator
    ("fast/target.py(466): forward", the line where the function starts), or "(outside eagle3)"; `PASS_THROUGH`
    functions are skipped. With stacks on, the profiler records Python calls as parent events named
    "path(line): function" (older releases: a `stack` list on the operator)."""
    while event is not None:
        for frame in [event.name, *(event.stack or [])]:
            frame = frame.replace("\\", "/")
            at = frame.rfind("eagle3/")
            if frame.endswith(PASS_THROUGH):
                continue
            if at >= 0 and "(" in frame and (at == 0 or frame[at - 1] == "/"):
                return frame[at + len("eagle3/"):]
        event = event.cpu_parent
    return "(outside eagle3)"


def source_table(prof, cuda: bool, reps: int, n: int) -> list[dict]:
    """The n (eagle3 function, operator) pairs with the most kernel time per call (on a CPU: operators' self time),
    from a profile taken with stacks."""
    acc: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if cuda and e.device_type == torch.autograd.DeviceType.CUDA:
            continue  # kernels: their time counts for the host event that launched them (an operator, or a
            # compiled region's launcher, whose name is kept as it is)
        if not cuda and not e.name.startswith(("aten::", "mkldnn::")):  # mkldnn: products over packed weights
            continue
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us > 0:
            a = acc[(_eagle3_frame(e), e.name)]
            a[0] += us / reps
            a[1] += 1 / reps
    rows = sorted(acc.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"where": where, "op": op, "us": round(us, 1), "calls": round(calls, 1)}
            for (where, op), (us, calls) in rows]


def _stack_config(by_source: int) -> dict:
    """Profiler settings that keep Python frames: on CUDA builds of torch 2.11 `with_stack` alone recorded no
    frames for operators; the experimental config's `verbose` brings them back. Empty where stacks are off or
    the config does not exist."""
    config = getattr(torch._C._profiler, "_ExperimentalConfig", None)
    return {"experimental_config": config(verbose=True)} if by_source and config is not None else {}


def kernel_table(fn, dev: torch.device, reps: int, by_source: int = 0
                 ) -> tuple[dict[str, dict], int, list[dict], list[dict]]:
    """Profile `reps` eager calls of fn: per kind, microseconds and kernels per call; kernel launches per call;
    with `by_source`, that many (function, operator) pairs by kernel time (`source_table`); every kernel's name,
    kind, microseconds and launches per call, longest first.
    (On a CPU, for smoke tests: operators' self time instead of kernels.)"""
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities, with_stack=by_source > 0, **_stack_config(by_source)) as prof:
        for _ in range(reps):
            fn()
        sync()
    table: dict[str, dict] = defaultdict(lambda: {"us": 0.0, "kernels": 0.0, "top": defaultdict(float)})
    launches, every = 0, []
    for e in prof.key_averages():
        if cuda and e.device_type != torch.autograd.DeviceType.CUDA:
            continue  # the CPU side of the profile only serves the source lines
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us <= 0 or (not cuda and not e.key.startswith(("aten::", "mkldnn::"))):
            continue
        t = table[kind_of(e.key)]
        t["us"] += us / reps
        t["kernels"] += e.count / reps
        t["top"][e.key[:90]] += us / reps
        launches += e.count
        every.append({"name": e.key[:200], "kind": kind_of(e.key), "us": round(us / reps, 2),
                      "launches": round(e.count / reps, 2)})
    out = {}
    for k, t in sorted(table.items(), key=lambda kv: -kv[1]["us"]):
        top = sorted(t["top"].items(), key=lambda kv: -kv[1])[:3]
        out[k] = {"us": round(t["us"], 1), "kernels": round(t["kernels"], 1),
                  "top": [{"name": n, "us": round(u, 1)} for n, u in top]}
    sources = source_table(prof, cuda, reps, by_source) if by_source else []
    return out, round(launches / reps), sources, sorted(every, key=lambda k: -k["us"])


def profile(name: str, fn, dev: torch.device, pool, reps: int, runners: list, by_source: int = 0,
            all_kernels: bool = False) -> dict:
    table, launches, sources, every = kernel_table(fn, dev, reps, by_source)
    r = StepRunner(fn, dev, graphs=True, pool=pool, name=name)
    r.prepare()
    runners.append(r)  # keep every graph alive until the end (see eagle3.fast.overhead)
    wall_us = time_step(r, dev, reps) * 1e6
    busy = sum(t["us"] for t in table.values())
    print(f"\n{name}: graph replay {wall_us:.1f} us, kernels {busy:.1f} us ({launches} launches), "
          f"idle {wall_us - busy:.1f} us ({100 * (wall_us - busy) / wall_us:.0f} %)")
    for k, t in table.items():
        top = "; ".join(f"{x['name'][:60]} {x['us']:.1f}" for x in t["top"])
        print(f"  {k:18s} {t['us']:9.1f} us {100 * t['us'] / wall_us:5.1f} %  {t['kernels']:6.1f} kernels  [{top}]")
    if sources:
        print("  by eagle3 function (eager, per call):")
        for r in sources:
            print(f"    {r['us']:8.1f} us  {r['calls']:5.1f} calls  {r['op']:28s} {r['where']}")
    out = {"wall_us": round(wall_us, 1), "kernel_us": round(busy, 1), "launches": launches, "kinds": table}
    return out | ({"sources": sources} if sources else {}) | ({"kernels": every} if all_kernels else {})


def profile_rows(target: FastTarget, drafter, shape: DraftShape, n: int, context: int, compiled: bool,
                 pieces: bool, dev: torch.device, pool, reps: int, runners: list, plain_us: float,
                 by_source: int = 0, all_kernels: bool = False) -> dict:
    """The plain and speculative cycles of `n` rows of `context` random tokens, each repetition from the same
    lengths; with `pieces`, draft / verify / accept / commit one by one."""
    seq_len = -(-(context + 2 * shape.total + shape.depth + 16) // 128) * 128
    rows = FastRows(target, drafter, capacity=n, seq_len=seq_len, shapes=lambda _b: shape, sampling=False,
                    compile_drafting=compiled)
    gen = torch.Generator().manual_seed(0)
    rows.add_many([torch.randint(0, target.vocab_size, (context,), generator=gen).tolist() for _ in range(n)])
    nb, saved = rows.bucket(n), rows.length.clone()

    def restoring(fn):
        def run():
            fn()
            rows.length.copy_(saved)
        return run

    out = {"plain_cycle": profile(f"rows={n} plain cycle", restoring(lambda: rows._plain_cycle(nb, GREEDY)), dev,
                                  pool, reps, runners, by_source, all_kernels),
           "spec_cycle": profile(f"rows={n} tree cycle {shape.text}", restoring(lambda: rows._spec_cycle(nb, GREEDY)),
                                 dev, pool, reps, runners, by_source, all_kernels)}
    print(f"rows={n}: tree cycle = {out['spec_cycle']['wall_us'] / plain_us:.2f} plain steps of one row")
    if pieces:
        tokens, parents1 = rows.pieces.run("_draft", nb, GREEDY)
        anc, top, aux = rows._verify(nb, tokens, parents1, GREEDY)[:3]
        keep, n_acc, emitted = rows.pieces.run("_accept", nb, tokens, parents1, anc, top, None)
        steps = {"draft": lambda: rows.pieces.run("_draft", nb, GREEDY),
                 "verify": lambda: rows._verify(nb, tokens, parents1, GREEDY),
                 "accept": lambda: rows.pieces.run("_accept", nb, tokens, parents1, anc, top, None),
                 "commit": restoring(lambda: rows._commit(nb, keep, n_acc, emitted, aux))}
        out["pieces"] = {name: profile(f"rows={n} piece {name}", fn, dev, pool, reps, runners,
                                       all_kernels=all_kernels) for name, fn in steps.items()}
        print(f"rows={n} pieces in plain steps: " +
              ", ".join(f"{k} {r['wall_us'] / plain_us:.3f}" for k, r in out["pieces"].items()))
    return out


@torch.no_grad()
def main(argv=None) -> int:
    args = parse_args(argv)
    dev = torch.device(args.device)
    if args.shape:
        dims, draft_vocab = SHAPES["llama-3.1-8b" if args.shape == "llama8b" else args.shape]
        model, drafter = build_random(dims, dev, torch.bfloat16, draft_vocab_size=draft_vocab)
    else:
        from eagle3.models import load_target
        from eagle3.runtime import drafter_for

        dtype = args.dtype
        if dtype == "auto":
            dtype = "bfloat16" if dev.type == "cuda" or cpu_has_bf16() else "float32"
        model, _ = load_target(args.target, dtype=dtype, device=str(dev))
        drafter = drafter_for(model, args.drafter) if args.drafter or args.random_drafter else None
    shape = DraftShape.parse(args.tree)
    target = FastTarget(model, drafter.config.aux_layer_ids if drafter is not None else [])
    target.fuse_pointwise(level=args.fuse_pointwise)  # auto: elementwise on CUDA, as the engines
    if args.residual_add != "auto":
        target.residual_in_gemm = args.residual_add == "gemm"
    target_attention = target.use_attention(args.target_attention)
    if args.target_norm == "triton":
        target.use_norm_kernel()
    else:  # auto: folded where the target attends by splits (`FastTarget.select_norm`)
        target.norm_kernel = {"torch": "off", "fold": "fold"}.get(args.target_norm, "auto")
        target.select_norm()
    if args.split_blocks is not None:
        split_attention.MIN_SPLIT_BLOCKS = args.split_blocks
    seq_len = -(-(args.context + 2 * shape.total + shape.depth + 16) // 128) * 128
    pool, runners, results = graph_pool(dev), [], {}

    plain = FastRows(target, None, capacity=1, seq_len=seq_len, sampling=False)
    begin_random(plain, args.context, target.vocab_size)
    saved = plain.length.clone()

    def plain_step():
        plain._plain_cycle(1, GREEDY)
        plain.length.copy_(saved)  # the same state every repetition

    results["plain_step"] = profile("plain step", plain_step, dev, pool, args.reps, runners,
                                    args.by_source, args.all_kernels)
    wbytes, bw = target.weight_bytes(), copy_bandwidth(dev)
    step_s = results["plain_step"]["wall_us"] / 1e6
    print(f"\nweights {wbytes / 1e9:.3f} GB: {wbytes / step_s / 1e9:.0f} GB/s, {100 * wbytes / step_s / bw:.1f} % of "
          f"measured copy bandwidth ({bw / 1e9:.0f} GB/s)")
    compiled = drafter is not None and dev.type == "cuda" and not args.eager_drafting
    if drafter is not None:
        fd = FastDrafter(drafter)
        for n in sorted({1, *args.rows}):
            r = profile_rows(target, fd, shape, n, args.context, compiled, args.pieces and n == 1, dev, pool,
                             args.reps, runners, results["plain_step"]["wall_us"], args.by_source, args.all_kernels)
            if n == 1:  # one request's cycle, what `FastEngine` replays
                results["tree_cycle"] = r["spec_cycle"]
                if "pieces" in r:
                    results["pieces"] = r["pieces"]
            if n in args.rows:
                results[f"rows_{n}"] = r
    out = Path(args.out)
    write_json(run_record("profile_step", target=args.target or args.shape,
                          drafter=args.drafter or ("random" if drafter is not None else None),
                          device_name=str(dev), dtype=str(target.dtype), context=args.context, tree=args.tree,
                          weight_bytes=wbytes,
                          drafting_compiled=compiled,
                          drafter_attention=None if drafter is None else "split" if fd.paths_op else "mask",
                          fuse_pointwise=fuse_level(args.fuse_pointwise, dev) or "off",
                          residual_in_gemm=target.residual_in_gemm, target_attention=target_attention,
                          target_norm="fold" if target.folded else
                          "triton" if target.pointwise.norm is rms_norm_rows else "torch",
                          split_blocks=split_attention.MIN_SPLIT_BLOCKS,
                          copy_bandwidth_gbs=round(bw / 1e9, 1), results=results), out / "profile_step.json")
    print(f"report: {out / 'profile_step.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
