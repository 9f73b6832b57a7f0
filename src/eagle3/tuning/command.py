"""`eagle3 tune`: measure on this device what a draft step and a verification of n rows cost and what each draft
shape's acceptance is, predict each shape's tokens/s from those, time each shape, and store the fastest (or plain
decoding, where nothing beats it) for every command to use on this device."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

from eagle3.config import DTYPE_HELP, ConfigError, DraftShape, SamplingConfig
from eagle3.tuning.model import CPU_TREES, GPU_TREES, AcceptanceProfile, candidate_shapes, predict


def spread(items: list, n: int) -> list:
    """`n` items evenly spaced over `items` (all of them if there are fewer): bundled sets are ordered by category
    (MT-bench: ten writing prompts first), so the first n would measure one kind of answer."""
    if n >= len(items):
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def run_tune(target: str, drafter: str, device: str | None = None, dtype: str = "auto", dataset: str = "mt_bench",
             limit: int = 4, max_new_tokens: int = 64, temperatures: tuple[float, ...] = (0.0,), max_chain: int = 8,
             trees: tuple[str, ...] | None = None, write: bool = True, echo=print) -> dict:
    """Measure, predict, time and choose (module docstring); returns the run record with the stored entry."""
    from eagle3.defaults import decoding_for
    from eagle3.evaluate import load_prompts
    from eagle3.fast.engine import FastOptions
    from eagle3.record import run_record
    from eagle3.runtime import decoder, encode_messages, load_runtime
    from eagle3.tuning.cache import drafter_store, tuning_key, user_store
    from eagle3.tuning.sweep import measure_costs, time_engine

    if limit < 1 or max_new_tokens < 8 or max_chain < 1:
        raise ConfigError("--limit must be >= 1, --max-new-tokens >= 8 and --max-chain >= 1")
    t_start = time.perf_counter()
    rt = load_runtime(target, drafter=drafter, draft="eagle3", device=device, dtype=dtype)
    base = decoding_for(rt.model, "eagle3")
    cpu = next(rt.model.parameters()).device.type == "cpu"
    # On a GPU every other chain length is timed (the acceptance of each comes from the longest chain's run): each
    # shape compiles its own drafting pieces there
    shapes_tried = candidate_shapes(max_chain, trees if trees is not None else CPU_TREES if cpu else GPU_TREES,
                                    chain_step=1 if cpu else 2)
    chains = [s for s in shapes_tried if s.is_chain]
    tree_shapes = [s for s in shapes_tried if not s.is_chain]
    _, chats = load_prompts(dataset)
    prompts = [encode_messages(rt.tokenizer, m) for m in spread(chats, limit)]
    param = next(rt.model.parameters())
    # Cycles are timed as every command runs them: on CUDA with inductor-compiled drafting pieces (timed with
    # eager pieces, the costs favoured small trees: docs/tuning.md). Prompts prefill eagerly (not timed).
    options = FastOptions(graph_prefill=False)
    echo(f"eagle3 tune: {base.engine} engine, {str(param.dtype).removeprefix('torch.')} on {param.device}; "
         f"{len(prompts)} prompts x {max_new_tokens} tokens; {len(shapes_tried)} shapes and plain decoding at "
         f"{len(temperatures)} temperature(s)" + ("" if cpu else "; each shape compiles its drafting on first use, "
                                                   "tens of seconds before its line"))

    def run(shape: DraftShape, temperature: float, chain_stop: float | None = None, label: str | None = None):
        d = replace(base, shape=shape, chain_stop=chain_stop, guard=False, speculate=True)
        r = time_engine(decoder(rt, d, options), prompts, max_new_tokens, SamplingConfig(temperature=temperature),
                        label or str(shape))
        echo(f"  T={temperature:g} {r.label:>18}: tau {r.tau:.2f}, {r.tokens_per_s:.1f} tok/s")
        return r

    table, choices, profiles, costs = [], {}, {}, None
    for temp in temperatures:
        greedy = SamplingConfig(temperature=temp)
        shapes = {str(s): s for s in [*chains, *tree_shapes]}
        runs = {label: run(s, temp) for label, s in shapes.items()}
        if base.chain_stop:  # the device's default: a chain that stops where the drafter is unsure
            stop_label = f"{base.shape} stop {base.chain_stop:g}"
            shapes[stop_label] = base.shape
            runs[stop_label] = run(base.shape, temp, base.chain_stop, stop_label)
        if costs is None:
            costs, _ = measure_costs(rt, base, prompts, max_new_tokens, tree_shapes, runs[str(chains[-1])],
                                     {t.text: runs[str(t)] for t in tree_shapes}, options, echo=echo)
        plain = time_engine(decoder(rt, replace(base, guard=False, speculate=False), options), prompts, max_new_tokens,
                            greedy, "plain")
        profile = AcceptanceProfile(temperature=temp, chain=tuple(runs[str(chains[-1])].acceptance),
                                    tree_tau={t.text: runs[str(t)].tau for t in tree_shapes})
        profiles[str(temp)] = profile.to_dict()
        rows = [{"shape": "plain", "temperature": temp, "tau": 1.0, "predicted_tok_s": round(1 / costs.plain_s, 2),
                 "measured_tok_s": round(plain.tokens_per_s, 2), "speedup": 1.0}]
        for label, r in runs.items():
            shape = shapes[label]
            pred = predict(shape, costs, profile) if label == str(shape) else None
            if pred is None:  # a stopped chain: its measured tau over the tokens it drafted on average
                depth = r.drafted_depth
                cycle = depth * costs.draft_step(1) + costs.verify(depth + 1)
                predicted = r.tau / cycle if cycle > 0 else 0.0
            else:
                predicted = pred.tokens_per_s
            rows.append({"shape": label, "spec": shape.to_dict(), "temperature": temp, "tau": round(r.tau, 3),
                         "predicted_tok_s": round(predicted, 2), "measured_tok_s": round(r.tokens_per_s, 2),
                         "speedup": round(r.tokens_per_s / plain.tokens_per_s, 3) if plain.tokens_per_s else 0.0})
        best = max(rows, key=lambda row: row["measured_tok_s"])
        stop = base.chain_stop if " stop " in best["shape"] else None
        shape = best.get("spec")  # None: plain decoding
        choices[str(temp)] = {"shape": shape, "chain_stop": stop, "speedup": best["speedup"]}
        table += rows

    key = tuning_key(str(param.device), str(param.dtype).removeprefix("torch."), base.engine, target,
                     rt.model.config.to_dict(), drafter)
    entry = {"key": key, "measured_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "costs": costs.to_dict(), "profiles": profiles, "choices": choices,
             "choice": choices[str(temperatures[0])], "table": table}
    stored = None
    if write:
        for store in (drafter_store(drafter), user_store()):
            try:
                store.store(entry)
                stored = str(store.path)
                break
            except OSError as e:  # a read-only drafter folder: the user's cache instead
                echo(f"  cannot write {store.path} ({e.strerror})")
    return run_record("tune", target=target, drafter=str(drafter), entry=entry, stored=stored,
                      seconds=round(time.perf_counter() - t_start, 1))


def format_table(table: list[dict]) -> str:
    lines = [f"{'T':>4} {'shape':>18} {'tau':>6} {'predicted':>10} {'measured':>9} {'speedup':>8}"]
    for r in table:
        lines.append(f"{r['temperature']:>4g} {r['shape']:>18} {r['tau']:>6.2f} {r['predicted_tok_s']:>10.1f} "
                     f"{r['measured_tok_s']:>9.1f} {r['speedup']:>7.2f}x")
    return "\n".join(lines)


def cmd_tune(args) -> int:
    from eagle3.record import write_json

    if not Path(args.drafter).is_dir():
        raise ConfigError(f"--drafter {args.drafter}: not a folder; tune stores its choice in the drafter's folder")
    rec = run_tune(args.target, args.drafter, device=args.device, dtype=args.dtype, dataset=args.dataset,
                   limit=args.limit, max_new_tokens=args.max_new_tokens, temperatures=tuple(args.temperatures),
                   max_chain=args.max_chain, trees=tuple(args.trees) if args.trees else None,
                   write=not args.dry_run)
    entry = rec["entry"]
    print("tokens/s per shape (predicted from the costs and acceptance, and measured):")
    print(format_table(entry["table"]))
    cpu_bf16 = entry["key"]["device"].startswith("cpu") and entry["key"]["dtype"] == "bfloat16"
    for temp, c in entry["choices"].items():
        shape = "plain decoding" if c["shape"] is None else DraftShape.from_dict(c["shape"])
        stop = f" stopping below {c['chain_stop']:g}" if c.get("chain_stop") else ""
        print(f"T={temp}: {shape}{stop} ({c['speedup']:.2f}x plain decoding)")
        if cpu_bf16 and isinstance(shape, DraftShape) and not shape.is_chain:
            print("  a bf16 tree on a CPU can differ from plain decoding at floating-point near-ties (greedy answers "
                  "are not guaranteed identical; a chain's are): docs/tuning.md")
    c = entry["costs"]
    print(f"costs: plain step {1e3 * c['plain_s']:.2f} ms; draft step {1e3 * float(c['draft_step_s']['1']):.2f} ms")
    print(f"stored in {rec['stored']}; every command on this device now drafts so" if rec["stored"]
          else "not stored (--dry-run)")
    write_json(rec, Path(args.out) / "tune.json")
    print(f"run record: {Path(args.out) / 'tune.json'} ({rec['seconds']}s)", file=sys.stderr)
    return 0


def add_tune_parser(sub) -> None:
    t = sub.add_parser("tune", help="pick the draft shape for this device from measured costs and acceptance; "
                                    "stored in the drafter's folder for every command",
                       usage="%(prog)s --target MODEL --drafter DIR [options]")
    t.add_argument("--target", required=True, metavar="MODEL")
    t.add_argument("--drafter", required=True, metavar="DIR")
    t.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    t.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    t.add_argument("--dataset", default="mt_bench", help="bundled set or JSONL file of your traffic")
    t.add_argument("--limit", type=int, default=4, metavar="N", help="prompts, spread over the set (default 4)")
    t.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    t.add_argument("--temperatures", type=float, nargs="+", default=[0.0], metavar="T")
    t.add_argument("--max-chain", type=int, default=8, metavar="K", help="longest chain tried (default 8; on a GPU every other length is timed)")
    t.add_argument("--trees", nargs="+", default=None, metavar="D,K,N", help="tree shapes tried (default: 2 on a "
                   "CPU, 5 on a GPU)")
    t.add_argument("--dry-run", action="store_true", help="measure and print, store nothing")
    t.add_argument("--out", default="tune-out", metavar="DIR", help="folder for tune.json (the run record)")
    t.set_defaults(func=cmd_tune)
