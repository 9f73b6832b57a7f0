"""`eagle3 tune`: measure on this device what a draft step and a verification of n rows cost and what each draft
shape's acceptance is, predict each shape's tokens/s from those, time the shapes that may win as the commands run
them (every shape on a CPU; on a GPU, where each shape compiles its drafting, the default and the best predicted),
and store the fastest (or plain decoding, where nothing beats it) for every command to use on this device."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

from eagle3.config import DTYPE_HELP, ConfigError, DraftShape, SamplingConfig
from eagle3.tuning.model import CPU_TREES, GPU_TREES, AcceptanceProfile, candidate_shapes, predict

CPU_PROMPTS, CPU_TOKENS = 4, 64  # every shape is timed on a CPU: a short run
GPU_PROMPTS, GPU_TOKENS = 8, 128
GPU_CONFIRM = 2  # shapes timed compiled on a GPU (each compiles its drafting pieces, tens of seconds)
CONFIRM_MARGIN = 0.03  # a shape predicted this far below the best timed one is not timed


def spread(items: list, n: int) -> list:
    """`n` items evenly spaced over `items` (all of them if there are fewer): bundled sets are ordered by category
    (MT-bench: ten writing prompts first), so the first n would measure one kind of answer."""
    if n >= len(items):
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def run_tune(target: str, drafter: str, device: str | None = None, dtype: str = "auto", dataset: str = "mt_bench",
             limit: int | None = None, max_new_tokens: int | None = None, temperatures: tuple[float, ...] = (0.0,),
             max_chain: int = 8, trees: tuple[str, ...] | None = None, confirm: int | None = None, write: bool = True,
             echo=print) -> dict:
    """Measure, predict, time and choose (module docstring); returns the run record with the stored entry.

    `confirm`: time only this many shapes as the commands run them, the device's default first (its cycles give
    the drafting cost), then the best predicted; the others' acceptance is measured with eager drafting. None:
    every shape on a CPU (nothing compiles there), `GPU_CONFIRM` where drafting compiles per shape."""
    from eagle3.defaults import decoding_for
    from eagle3.evaluate import load_prompts
    from eagle3.fast.engine import FastOptions, drafting_compiled_by_default
    from eagle3.record import run_record
    from eagle3.runtime import decoder, encode_messages, load_runtime
    from eagle3.tuning.cache import drafter_store, tuning_key, user_store
    from eagle3.tuning.sweep import measure_rows, time_engine, with_draft_steps

    t_start = time.perf_counter()
    rt = load_runtime(target, drafter=drafter, draft="eagle3", device=device, dtype=dtype)
    base = decoding_for(rt.model, "eagle3")
    param = next(rt.model.parameters())
    cpu = param.device.type == "cpu"
    compiles = base.engine == "fast" and drafting_compiled_by_default(param.device)
    limit = limit if limit is not None else GPU_PROMPTS if compiles else CPU_PROMPTS
    max_new_tokens = max_new_tokens if max_new_tokens is not None else GPU_TOKENS if compiles else CPU_TOKENS
    confirm = confirm if confirm is not None else GPU_CONFIRM if compiles else None
    if limit < 1 or max_new_tokens < 8 or max_chain < 1 or (confirm is not None and confirm < 1):
        raise ConfigError("--limit and --confirm must be >= 1, --max-new-tokens >= 8 and --max-chain >= 1")
    # On a GPU every other chain length is tried (the acceptance of each comes from the longest chain's run)
    shapes = {str(s): s for s in candidate_shapes(max_chain, trees if trees is not None else CPU_TREES if cpu
                                                  else GPU_TREES, chain_step=1 if cpu else 2)}
    stops = {}  # label -> chain_stop: the device's default chain that stops where the drafter is unsure
    default = str(base.shape)
    if base.chain_stop:
        default = f"{base.shape} stop {base.chain_stop:g}"
        stops[default] = base.chain_stop
    shapes.setdefault(default, base.shape)
    screen = confirm is not None and confirm < len(shapes)
    _, chats = load_prompts(dataset)
    prompts = [encode_messages(rt.tokenizer, m) for m in spread(chats, limit)]
    # Cycles are timed as every command runs them: on CUDA with inductor-compiled drafting pieces (timed with
    # eager pieces, the costs favoured small trees: docs/tuning.md). Prompts prefill eagerly (not timed).
    options = FastOptions(graph_prefill=False)
    eager = replace(options, compile_drafting=False) if screen else options
    plan = f"{len(shapes)} shapes timed"
    if screen:
        plan = (f"acceptance of {len(shapes)} shapes{' with eager drafting' if compiles else ''}, then at most "
                f"{confirm} timed as the commands run them" + ("; each compiles its drafting, tens of seconds"
                                                               if compiles else ""))
    echo(f"eagle3 tune: {base.engine} engine, {str(param.dtype).removeprefix('torch.')} on {param.device}; "
         f"{len(prompts)} prompts x {max_new_tokens} tokens at {len(temperatures)} temperature(s); {plan}")

    phases = {"load": round(time.perf_counter() - t_start, 1), "acceptance": 0.0, "costs": 0.0, "timing": 0.0}

    def run(label: str, temperature: float, opts, timed: bool = True):
        t0 = time.perf_counter()
        d = replace(base, shape=shapes[label], chain_stop=stops.get(label), guard=False, speculate=True)
        r = time_engine(decoder(rt, d, opts), prompts, max_new_tokens, SamplingConfig(temperature=temperature), label)
        seconds = time.perf_counter() - t0
        phases["timing" if timed else "acceptance"] += seconds
        echo(f"  T={temperature:g} {label:>18}: tau {r.tau:.2f}" +
             (f", {r.tokens_per_s:.1f} tok/s" if timed else " (acceptance only)") + f" ({seconds:.1f}s)")
        return r

    table, choices, profiles, costs = [], {}, {}, None
    chains = [s for s in shapes.values() if s.is_chain]
    longest = str(max(chains, key=lambda s: s.depth)) if chains else None
    for temp in temperatures:
        timed = {default: run(default, temp, options)} if screen else {}  # its acceptance too
        runs = {label: timed[label] if label in timed else run(label, temp, eager, timed=not screen)
                for label in shapes}
        timed = timed if screen else dict(runs)
        if costs is None:
            t0 = time.perf_counter()
            sizes = [s.total + 1 for s in shapes.values()]
            rows = measure_rows(rt, base, prompts, max_new_tokens, sizes, options, compiled=screen and compiles,
                                echo=echo)
            costs = with_draft_steps(rows, [(shapes[k], r) for k, r in timed.items()])  # a stopped chain: its depth
            phases["costs"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        plain = time_engine(decoder(rt, replace(base, guard=False, speculate=False), options), prompts, max_new_tokens,
                            SamplingConfig(temperature=temp), "plain")
        phases["timing"] += time.perf_counter() - t0
        profile = AcceptanceProfile(temperature=temp, chain=tuple(runs[longest].acceptance) if longest else (),
                                    tree_tau={s.text: runs[k].tau for k, s in shapes.items() if not s.is_chain})
        profiles[str(temp)] = profile.to_dict()
        predicted = {}
        for label, r in runs.items():
            pred = None if label in stops else predict(shapes[label], costs, profile)
            if pred is None:  # a stopped chain: its measured tau over the tokens it drafted on average
                cycle = r.drafted_depth * costs.draft_step(1) + costs.verify(r.drafted_depth + 1)
                predicted[label] = r.tau / cycle if cycle > 0 else 0.0
            else:
                predicted[label] = pred.tokens_per_s
        if screen:  # the best predicted next, while they may beat what is timed (within the model's error)
            for label in sorted(predicted, key=predicted.get, reverse=True):
                if len(timed) >= confirm or predicted[label] < (1 - CONFIRM_MARGIN) * max(predicted[k] for k in timed):
                    break
                if label not in timed:
                    timed[label] = run(label, temp, options)
        # untimed shapes: their prediction, scaled as the timed default's measurement is to its prediction
        scale = timed[default].tokens_per_s / predicted[default] if screen and predicted[default] > 0 else 1.0
        rows_t = [{"shape": "plain", "temperature": temp, "tau": 1.0, "predicted_tok_s": round(1 / costs.plain_s, 2),
                   "measured_tok_s": round(plain.tokens_per_s, 2), "estimated_tok_s": round(plain.tokens_per_s, 2),
                   "speedup": 1.0}]
        for label, r in runs.items():
            t = timed.get(label)
            estimate = t.tokens_per_s if t else predicted[label] * scale
            rows_t.append({"shape": label, "spec": shapes[label].to_dict(), "temperature": temp, "tau": round(r.tau, 3),
                           "predicted_tok_s": round(predicted[label], 2),
                           "measured_tok_s": round(t.tokens_per_s, 2) if t else None,
                           "estimated_tok_s": round(estimate, 2),
                           "speedup": round(estimate / plain.tokens_per_s, 3) if plain.tokens_per_s else 0.0})
        best = max(rows_t, key=lambda row: row["estimated_tok_s"])
        choices[str(temp)] = {"shape": best.get("spec"), "chain_stop": stops.get(best["shape"]),
                              "speedup": best["speedup"],  # shape None: plain decoding
                              "measured": best["measured_tok_s"] is not None}
        table += rows_t

    key = tuning_key(str(param.device), str(param.dtype).removeprefix("torch."), base.engine, target,
                     rt.model.config.to_dict(), drafter)
    entry = {"key": key, "measured_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "costs": costs.to_dict(), "profiles": profiles, "choices": choices,
             "choice": choices[str(temperatures[0])], "table": table,
             "prompts": len(prompts), "max_new_tokens": max_new_tokens, "timed_shapes": confirm if screen else None,
             "phase_seconds": {k: round(v, 1) for k, v in phases.items()}}
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
    """Rows of `run_tune`'s table; an untimed shape's speedup is its estimate, in parentheses."""
    lines = [f"{'T':>4} {'shape':>18} {'tau':>6} {'predicted':>10} {'measured':>9} {'speedup':>9}"]
    for r in table:
        timed = r["measured_tok_s"] is not None
        measured = f"{r['measured_tok_s']:.1f}" if timed else "-"
        speedup = f"{r['speedup']:.2f}x" if timed else f"({r['speedup']:.2f}x)"
        lines.append(f"{r['temperature']:>4g} {r['shape']:>18} {r['tau']:>6.2f} {r['predicted_tok_s']:>10.1f} "
                     f"{measured:>9} {speedup:>9}")
    return "\n".join(lines)


def cmd_tune(args) -> int:
    from eagle3.record import write_json

    if not Path(args.drafter).is_dir():
        raise ConfigError(f"--drafter {args.drafter}: not a folder; tune stores its choice in the drafter's folder")
    rec = run_tune(args.target, args.drafter, device=args.device, dtype=args.dtype, dataset=args.dataset,
                   limit=args.limit, max_new_tokens=args.max_new_tokens, temperatures=tuple(args.temperatures),
                   max_chain=args.max_chain, trees=tuple(args.trees) if args.trees else None, confirm=args.confirm,
                   write=not args.dry_run)
    entry = rec["entry"]
    print("tokens/s per shape (predicted from the costs and acceptance, and measured):")
    print(format_table(entry["table"]))
    cpu_bf16 = entry["key"]["device"].startswith("cpu") and entry["key"]["dtype"] == "bfloat16"
    for temp, c in entry["choices"].items():
        shape = "plain decoding" if c["shape"] is None else DraftShape.from_dict(c["shape"])
        stop = f" stopping below {c['chain_stop']:g}" if c.get("chain_stop") else ""
        how = "" if c.get("measured", True) else ", estimated: predicted, scaled as the default's measurement"
        print(f"T={temp}: {shape}{stop} ({c['speedup']:.2f}x plain decoding{how})")
        if cpu_bf16 and isinstance(shape, DraftShape) and not shape.is_chain:
            print("  a bf16 tree on a CPU can differ from plain decoding at floating-point near-ties (greedy answers "
                  "are not guaranteed identical; a chain's are): docs/tuning.md")
    c = entry["costs"]
    print(f"costs: plain step {1e3 * c['plain_s']:.2f} ms; draft step {1e3 * float(c['draft_step_s']['1']):.3f} ms")
    if entry.get("phase_seconds"):
        print("seconds: " + ", ".join(f"{k} {v:g}" for k, v in entry["phase_seconds"].items()))
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
    t.add_argument("--limit", type=int, default=None, metavar="N",
                   help=f"prompts, spread over the set (default {CPU_PROMPTS} on a CPU, {GPU_PROMPTS} on a GPU)")
    t.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help=f"tokens per answer (default {CPU_TOKENS} on a CPU, {GPU_TOKENS} on a GPU)")
    t.add_argument("--temperatures", type=float, nargs="+", default=[0.0], metavar="T")
    t.add_argument("--max-chain", type=int, default=8, metavar="K", help="longest chain tried (default 8; on a GPU every other length)")
    t.add_argument("--trees", nargs="+", default=None, metavar="D,K,N", help="tree shapes tried (default: 2 on a "
                   "CPU, 5 on a GPU)")
    t.add_argument("--confirm", type=int, default=None, metavar="N",
                   help="time only N shapes as the commands run them (the device's default, then the best predicted); "
                        "the others' acceptance is measured with eager drafting (default: all on a CPU, "
                        f"{GPU_CONFIRM} on a GPU, where each shape compiles its drafting)")
    t.add_argument("--dry-run", action="store_true", help="measure and print, store nothing")
    t.add_argument("--out", default="tune-out", metavar="DIR", help="folder for tune.json (the run record)")
    t.set_defaults(func=cmd_tune)
