"""`eagle3 bench`: one command, one device, one run: tokens/s and tau of eagle3 against HF baselines.

Methods (with the letters the tables print):

    (a) hf         HF `generate`, default (dynamic cache, eager)
    (b) hf_static  HF `generate(cache_implementation="static")`: transformers compiles the decoding step itself
                   on CUDA (its automatic compilation for static caches); on CPU it runs eager
    (c) hf_lookup  HF prompt lookup decoding (`prompt_lookup_num_tokens=10`)
    (d) plain      eagle3 plain decoding on the fast path (static cache, CUDA graphs)
    (e) ngram      eagle3 n-gram drafting (prompt lookup) on the fast path
    (f) chain      EAGLE-3 chain of K drafts on the fast path
    (g) tree       EAGLE-3 EAGLE-2-style tree on the fast path

Each method is warmed up (graph capture, compilation) on the longest prompt; then the methods take turns on each
prompt (the order rotating from prompt to prompt), so drift in the device's speed during the run reaches every
method alike. Rows are per prompt, summaries are medians of per-prompt tokens/s (plus the aggregate). tau = tokens emitted per target
verification forward, bonus token included (for HF prompt lookup: forwards counted with a hook). Every method's
greedy token ids are compared with (d)'s. The bandwidth floor is (weight bytes + KV bytes at the mean context) /
measured device copy bandwidth; the fraction (d)'s decoding rate reaches is printed beside it.

`eagle3 bench --overhead` measures the per-cycle cost at the Llama-3.1-8B shape instead (`eagle3.fast.overhead`).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from eagle3.config import (
    BATCH_INVARIANT_HELP,
    DEFAULT_MAX_NEW_TOKENS,
    DTYPE_HELP,
    GUARD_HELP,
    NO_GRAPHS_HELP,
    ConfigError,
    DraftShape,
    SamplingConfig,
)
from eagle3.defaults import CPU_TREE
from eagle3.evaluate import encode_prompt_messages, valid_answer

log = logging.getLogger("eagle3.bench")

METHODS: dict[str, tuple[str, str]] = {
    "hf": ("a", "HF generate (default)"),
    "hf_static": ("b", "HF generate, static cache + compile"),
    "hf_lookup": ("c", "HF prompt lookup decoding"),
    "plain": ("d", "eagle3 plain decoding (fast path)"),
    "ngram": ("e", "eagle3 n-gram (fast path)"),
    "chain": ("f", "EAGLE-3 chain (fast path)"),
    "tree": ("g", "EAGLE-3 tree (fast path)"),
}
HF_LOOKUP_TOKENS = 10
NEEDS_DRAFTER = ("chain", "tree")


def parse_methods(text: str | list[str] | None) -> list[str]:
    """'all', a comma list of names (hf, hf_static, hf_lookup, plain, ngram, chain, tree) or letters a-g."""
    if text is None or text == "all":
        return list(METHODS)
    items = text if isinstance(text, list) else text.split(",")
    by_letter = {v[0]: k for k, v in METHODS.items()}
    out = []
    for item in (i.strip() for i in items if i.strip()):
        name = by_letter.get(item, item)
        if name not in METHODS:
            raise ConfigError(f"--methods: unknown method {item!r}; choose from {', '.join(METHODS)} (or a-g)")
        if name not in out:
            out.append(name)
    return sorted(out, key=list(METHODS).index)


def _dims(tree: DraftShape) -> list[int]:
    return [tree.depth, tree.top_k, tree.total]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------
# method runners: ids -> (new token ids, seconds, accepted tokens per forward info)
# ------------------------------------------------------------------------------------------------
def _hf_runner(model, kind: str, max_new_tokens: int, eos: list[int], pad: int, cache_len: int,
               temperature: float = 0.0):
    device = next(model.parameters()).device
    kw: dict = dict(max_new_tokens=max_new_tokens, do_sample=temperature > 0, eos_token_id=eos or None,
                    pad_token_id=pad)
    if temperature > 0:  # HF's own sampler: the same distribution, other draws
        kw.update(temperature=temperature, top_p=1.0, top_k=0)
    if kind == "hf_static":
        kw["cache_implementation"] = "static"
        if hasattr(model.generation_config, "max_cache_len"):  # one cache size for every prompt: no recompiles
            kw["max_cache_len"] = cache_len
    if kind == "hf_lookup":
        kw["prompt_lookup_num_tokens"] = HF_LOOKUP_TOKENS
    count = kind != "hf_static"  # a Python hook inside a compiled call would break its graph

    def run(ids: list[int], seed: int, schema: None = None) -> dict:  # constrained sets skip HF generate
        calls = [0]
        hook = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) if count else None
        x = torch.tensor([ids], device=device)
        torch.manual_seed(seed)
        try:
            _sync(device)
            t0 = time.perf_counter()
            y = model.generate(x, attention_mask=torch.ones_like(x), **kw)
            _sync(device)
            dt = time.perf_counter() - t0
        finally:
            if hook is not None:
                hook.remove()
        new = y[0, len(ids):].tolist()
        cycles = calls[0] - 1 if count else max(len(new) - 1, 0)  # forwards after the prefill
        return {"ids": new, "seconds": dt, "cycles": cycles, "emitted_in_cycles": len(new) - 1,
                "decode_s": None}

    return run


def _engine_runner(engine, max_new_tokens: int, eos: list[int], temperature: float = 0.0, grammars=None):
    """`grammars` (`eagle3.decoding.grammar.GrammarCompiler`): a prompt with a schema is answered under it."""

    def run(ids: list[int], seed: int, schema: dict | None = None) -> dict:
        sampling = SamplingConfig(temperature=temperature, seed=seed)
        grammar = grammars.compile(schema) if schema is not None else None
        res = engine.generate(ids, max_new_tokens=max_new_tokens, eos_token_ids=eos, sampling=sampling,
                              **({"grammar": grammar} if grammar is not None else {}))
        st = res.stats
        drafting = st.cycles - st.plain_steps  # tau counts cycles that drafted (the guard's plain steps emit one)
        out = {"ids": res.token_ids, "seconds": st.total_s, "cycles": drafting,
               "emitted_in_cycles": sum(st.accepted_per_cycle) + drafting, "decode_s": st.verify_s,
               "plain_steps": st.plain_steps}
        if grammar is not None:
            out.update(valid=valid_answer(res, schema), masks=grammar.masks_computed, mask_s=grammar.mask_s)
        return out

    return run


# ------------------------------------------------------------------------------------------------
# the benchmark
# ------------------------------------------------------------------------------------------------
def run_bench(
    target: str,
    drafter: str | None = None,
    dataset: str = "mt_bench",
    limit: int | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    methods: list[str] | None = None,
    chain: int | None = None,
    tree: DraftShape | list[DraftShape] | None = None,
    ngram_tokens: int = HF_LOOKUP_TOKENS,
    device: str | None = None,
    dtype: str = "auto",
    graphs: bool = True,
    fuse_pointwise: bool | str | None = None,
    pipeline: bool = True,
    target_attention: str | None = None,
    warmup: int = 1,
    echo: Callable[[str], None] = print,
    compile_drafting: bool | None = None,
    graph_prefill: bool | None = None,
    on_progress: Callable[[dict], None] | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    guard: str = "auto",
    batch_invariant: bool = False,
) -> dict:
    """Run the selected methods; returns the run record (rows, summary, bandwidth), without writing it.

    Several tree shapes (`tree` a list) each get their own method, `tree-DEPTH,TOPK,TOTAL`, timed in the same run
    against the same plain decoding: how to find the tree that pays best on a device. `on_progress` gets the
    record of the prompts every method has run so far after each prompt (`complete` False, no bandwidth yet), so that
    a run stopped part way, by a time limit say, keeps what it measured. At `temperature` > 0 prompt i samples with seed
    `seed + i` in every eagle3 method, so their answers are the same draws and still compared token for token.
    `chain` / `tree` None: the shape a tuned choice or the device's defaults give (`eagle3.defaults`), as every
    command drafts, with the guard where it applies (`guard` auto/on/off).
    """
    import transformers

    from eagle3.decoding.grammar import GrammarCompiler
    from eagle3.defaults import decoding_for, device_tree, load_for_decoding, tuned_choice, with_flags
    from eagle3.evaluate import load_prompts
    from eagle3.fast import FastEngine, FastOptions, FastTarget, build_engine, fast_support
    from eagle3.fast.engine import graph_prefill_by_default
    from eagle3.fast.overhead import copy_bandwidth
    from eagle3.fast.target import fuse_level
    from eagle3.models import select_device
    from eagle3.record import run_record
    from eagle3.runtime import drafter_for, eos_token_ids

    methods = methods or list(METHODS)
    dev = select_device(device)
    transformers.logging.set_verbosity_error()  # generation-config notices would drown the table
    model, tok = load_for_decoding(target, dev, dtype)
    # the device's drafting (`eagle3.defaults`): what `generate` would do for the chain and for the tree methods
    tuned = tuned_choice(model, target, drafter, "fast", temperature) if drafter not in (None, "random") else None
    device_chain = with_flags(decoding_for(model, "eagle3", engine="fast", tuned=tuned), guard)
    if not device_chain.shape.is_chain or not device_chain.speculate:
        device_chain = with_flags(decoding_for(model, "eagle3", engine="fast"), guard)
    device_tree = with_flags(decoding_for(model, "eagle3", engine="fast", shape=device_tree(dev)), guard)
    if chain is not None:
        device_chain = with_flags(decoding_for(model, "eagle3", engine="fast", shape=DraftShape.chain(chain),
                                               chain_stop=0), guard)
    chain = device_chain.shape.depth
    trees = [tree] if isinstance(tree, DraftShape) else list(tree or [device_tree.shape])
    eos = eos_token_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else 0)
    name, chats = load_prompts(dataset, limit=limit)
    prompts = [encode_prompt_messages(tok, m) for m in chats]  # tools rendered as the server renders them
    if not prompts:
        raise ConfigError(f"dataset {dataset!r} has no prompts")
    schemas = [getattr(m, "schema", None) for m in chats]  # constrained answers (`eagle3.decoding.grammar`)
    grammars = None
    if any(x is not None for x in schemas):
        grammars = GrammarCompiler.for_model(model, tok, eos)
        if any(m.startswith("hf") for m in methods):
            echo(f"{name} constrains its answers to JSON schemas: skipping HF generate (a, b, c), which cannot")
            methods = [m for m in methods if not m.startswith("hf")]
    longest = max(prompts, key=len)

    d = None
    if any(m in NEEDS_DRAFTER for m in methods):
        if drafter is None:
            echo("no --drafter: skipping the EAGLE-3 methods (chain, tree); pass --drafter DIR or --drafter random")
            methods = [m for m in methods if m not in NEEDS_DRAFTER]
            if not methods:
                raise ConfigError("nothing to time: only EAGLE-3 methods (chain, tree) were asked for, and they need "
                                  "--drafter DIR or --drafter random")
        else:
            d = drafter_for(model, None if drafter == "random" else drafter)
    reason = fast_support(model)
    if reason is not None:
        echo(f"fast path unavailable ({reason}): methods d-g use the generic engine")
    engine_name = "fast" if reason is None else "generic"  # for methods d-g (a-c: HF generate)
    model_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    echo(f"eagle3 bench: {engine_name} engine, {model_dtype} on {dev}")
    chain_spec, ngram_spec = DraftShape.chain(chain), DraftShape.chain(ngram_tokens)
    max_nodes = max(*(t.total for t in trees), chain, ngram_tokens)
    max_depth = max(*(t.depth for t in trees), chain, ngram_tokens)
    cache_len = len(longest) + max_new_tokens + 2 * (max_nodes + 1) + max_depth + 2
    options = FastOptions(graphs=graphs, fuse_pointwise=fuse_pointwise, pipeline=pipeline,
                          max_seq_len=cache_len, compile_drafting=compile_drafting,
                          target_attention=target_attention,
                          graph_prefill=graph_prefill, batch_invariant=batch_invariant)
    eager = dev.type == "cpu" and reason is None
    shared, attention = None, "sdpa"  # the generic engine attends through HF's modules
    if reason is None:
        shared = FastTarget(model, d.config.aux_layer_ids if d is not None else [])
        attention = shared.use_attention(target_attention)  # resolved for the record

    # (method name in the record, kind, spec): one "tree" entry per shape when several are given
    runs = []
    for m in methods:
        if m == "tree" and len(trees) > 1:
            runs += [(f"tree-{t.text}", m, t) for t in trees]
        else:
            runs.append((m, m, {"plain": None, "ngram": ngram_spec, "chain": chain_spec,
                                "tree": trees[0]}.get(m)))

    def engine_for(kind: str, spec: DraftShape | None):
        draft = {"plain": "none", "ngram": "ngram", "chain": "eagle3", "tree": "eagle3"}[kind]
        opts = options
        if kind in ("chain", "tree") and shared is not None:
            how = device_chain if kind == "chain" else device_tree
            # a stopped chain acts between draft steps: eager cycles only
            opts = replace(options, guard=how.guard, chain_stop=how.chain_stop if kind == "chain" and eager else None)
        if shared is not None:
            return FastEngine(model, draft=draft, spec=spec, drafter=d, tokenizer=tok, options=opts, target=shared)
        return build_engine(model, draft=draft, spec=spec, drafter=d, tokenizer=tok, options=opts)

    summary: list[dict] = []
    results: dict[str, list[dict]] = {}

    def record(bandwidth: dict | None) -> dict:
        """The run record of the methods done so far; `bandwidth` None while methods are still to run."""
        ref_method = "plain" if "plain" in results else summary[0]["method"]
        rows = _summarise(summary, results, prompts, ref_method)
        rec = run_record(
            "bench", target=target, drafter=drafter, dataset=name, prompts=len(prompts), chat_template=bool(getattr(tok, "chat_template", None)),
            engine=engine_name, dtype=model_dtype,
            max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, methods=[r[0] for r in runs],
            reference=ref_method,
            drafting={"chain": device_chain.describe(), "tree": device_tree.describe()},
            spec={"chain": chain, "tree": _dims(trees[0]), "trees": [_dims(t) for t in trees],
                  "ngram_tokens": ngram_tokens, "hf_lookup_tokens": HF_LOOKUP_TOKENS},
            options={"graphs": graphs, "fuse_pointwise": fuse_level(fuse_pointwise, dev) or "off",
                     "pipeline": pipeline,
                     "compile_drafting": compile_drafting,
                     "drafter_attention": "split" if attention == "split" and d is not None else "mask",
                     "target_attention": attention, "norms_folded": shared is not None and shared.folded,
                     "graph_prefill": graph_prefill_by_default(dev) if graph_prefill is None else graph_prefill,
                     "warmup": warmup, "device": str(dev),
                     "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                     "cache_slots": cache_len, "batch_invariant": batch_invariant},
            summary=summary, bandwidth=bandwidth, rows=rows, complete=bandwidth is not None,
        )
        rec["device"]["torch_device"] = str(dev)  # "device" also describes the machine (run_record)
        return rec

    # every method is built and warmed up first, then timed prompt by prompt in turn (the order rotating), so a
    # device whose speed drifts during the run (a shared CPU, clocks) slows every method alike
    timed = []  # (method, run)
    for m, kind, spec in runs:
        letter, label = METHODS[kind]
        if m != kind:
            label = label.replace("tree", f"tree {spec.text}")
        if kind.startswith("hf"):
            run = _hf_runner(model, kind, max_new_tokens, eos, pad, cache_len, temperature)
            engine = None
        else:
            engine = engine_for(kind, spec)
            run = _engine_runner(engine, max_new_tokens, eos, temperature, grammars)
        t0 = time.perf_counter()
        for _ in range(warmup):
            run(longest, seed, schemas[prompts.index(longest)])
        warm_s = time.perf_counter() - t0
        fast = isinstance(engine, FastEngine)
        compiled = kind == "hf_static" and dev.type == "cuda"
        ran = "hf" if engine is None else ("fast" if fast else "generic")
        summary.append({"method": m, "letter": letter, "label": label, "engine": ran, "warmup_s": round(warm_s, 3),
                        "fast_path": fast, "compiled": compiled, "cuda_graphs": fast and engine.graphed,
                        "drafting_compiled": fast and engine.drafting_compiled})
        echo(f"({letter}) {label}: ready on the {ran} engine (warm-up {warm_s:.1f}s)")
        results[m] = []
        timed.append((m, run))
    for i, (ids, x) in enumerate(tqdm(list(zip(prompts, schemas, strict=True)), desc="bench", unit="prompt",
                                      disable=not sys.stderr.isatty())):
        for m, run in timed[i % len(timed):] + timed[: i % len(timed)]:
            results[m].append(run(ids, seed + i, x))
        if on_progress is not None:
            on_progress(record(None))  # the prompts done so far, in every method

    bandwidth = _bandwidth(model, shared, prompts, max_new_tokens, dev, _by_method(summary).get("plain"),
                           copy_bandwidth, cache_len)
    return record(bandwidth)


def _by_method(summary: list[dict]) -> dict[str, dict]:
    return {s["method"]: s for s in summary}


def _summarise(summary: list[dict], results: dict[str, list[dict]], prompts: list[list[int]],
               ref_method: str) -> list[dict]:
    """Fills each method's entry in `summary` from its per-prompt results (medians, aggregate, tau, identity with
    `ref_method`, speedups) and returns the per-prompt rows. Idempotent: a partial run's record is rebuilt after
    every method."""
    rows: list[dict] = []
    ref = results[ref_method]
    for s in summary:
        res = results[s["method"]]
        tps = [len(r["ids"]) / r["seconds"] for r in res]
        taus = [r["emitted_in_cycles"] / r["cycles"] if r["cycles"] else 1.0 for r in res]
        identical = [r["ids"] == q["ids"] for r, q in zip(res, ref, strict=True)]
        for i, (r, t, tau, same) in enumerate(zip(res, tps, taus, identical, strict=True)):
            rows.append({"method": s["method"], "prompt": i, "prompt_tokens": len(prompts[i]),
                         "new_tokens": len(r["ids"]), "seconds": round(r["seconds"], 5),
                         "tokens_per_s": round(t, 3), "tau": round(tau, 4), "cycles": r["cycles"],
                         "identical_to_reference": same})
        total_tokens = sum(len(r["ids"]) for r in res)
        s.update(
            tokens_per_s_median=round(statistics.median(tps), 3),
            tokens_per_s_aggregate=round(total_tokens / sum(r["seconds"] for r in res), 3),
            # no drafting cycle at all (the guard kept drafting off): plain steps, one token each
            tau=round(sum(r["emitted_in_cycles"] for r in res) / drafted if (drafted := sum(r["cycles"] for r in res))
                      else 1.0, 4),
            tau_median=round(statistics.median(taus), 4),
            identical=sum(identical), prompts=len(res), new_tokens=total_tokens,
        )
        if "valid" in res[0]:  # constrained answers: how many are valid, and what their masks cost
            s.update(valid_json=sum(r["valid"] for r in res), masks_per_token=round(
                sum(r["masks"] for r in res) / total_tokens, 3), mask_us_per_token=round(
                1e6 * sum(r["mask_s"] for r in res) / total_tokens, 2))
        decode = [(len(r["ids"]) - 1) / r["decode_s"] for r in res if r["decode_s"] and len(r["ids"]) > 1]
        s["decode_tokens_per_s_median"] = round(statistics.median(decode), 3) if decode else None
    by = _by_method(summary)
    for s in summary:
        for base in ("plain", "hf", "hf_static"):
            if base in by:
                s[f"speedup_vs_{base}"] = round(s["tokens_per_s_median"] / by[base]["tokens_per_s_median"], 3)
    return rows


def _bandwidth(model, fast_target, prompts, max_new_tokens, dev, plain, copy_bandwidth, cache_slots: int) -> dict:
    """Bytes one decoding step must read, the floor they imply at the measured copy bandwidth, and the
    fraction of that floor plain decoding reaches."""
    cfg = getattr(model.config, "text_config", None) or model.config
    if fast_target is not None:
        wbytes = fast_target.weight_bytes()
    else:
        emb = model.get_input_embeddings().weight
        tied = emb.data_ptr() == model.get_output_embeddings().weight.data_ptr()
        wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        wbytes -= 0 if tied else emb.numel() * emb.element_size()
    nkv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elt = next(model.parameters()).element_size()
    mean_ctx = statistics.mean(len(p) for p in prompts) + max_new_tokens / 2
    kv = int(2 * cfg.num_hidden_layers * nkv * hd * elt * mean_ctx)
    bw = copy_bandwidth(dev)
    floor = bw / (wbytes + kv)
    out = {"weight_bytes": wbytes, "kv_bytes_mean_context": kv, "mean_context": round(mean_ctx, 1),
           "copy_bandwidth_gbs": round(bw / 1e9, 2), "floor_tokens_per_s": round(floor, 2)}
    if fast_target is not None:  # one row's static cache
        out["kv_bytes_static_cache"] = fast_target.kv_bytes(cache_slots)
    if plain and plain.get("decode_tokens_per_s_median"):
        out["plain_decode_tokens_per_s"] = plain["decode_tokens_per_s_median"]
        out["plain_fraction_of_floor"] = round(plain["decode_tokens_per_s_median"] / floor, 4)
    return out


# ------------------------------------------------------------------------------------------------
# output
# ------------------------------------------------------------------------------------------------
def format_table(record: dict) -> str:
    lines = [f"{'method':44s} {'tok/s med':>10s} {'tok/s agg':>10s} {'tau':>6s} {'x(d)':>6s} {'x(a)':>6s} "
             f"{'x(b)':>6s} {'same as ' + record['reference']:>14s}"]
    for s in record["summary"]:
        def x(base, s=s):
            v = s.get(f"speedup_vs_{base}")
            return f"{v:6.2f}" if v is not None else f"{'-':>6s}"

        lines.append(f"({s['letter']}) {s['label']:40s} {s['tokens_per_s_median']:10.1f} "
                     f"{s['tokens_per_s_aggregate']:10.1f} {s['tau']:6.2f} {x('plain')} {x('hf')} {x('hf_static')} "
                     f"{s['identical']:>8d}/{s['prompts']:<5d}")
    b = record["bandwidth"]
    lines.append(
        f"bandwidth floor: ({b['weight_bytes'] / 1e9:.3f} GB weights + {b['kv_bytes_mean_context'] / 1e9:.4f} GB KV "
        f"at mean context {b['mean_context']:.0f}) / {b['copy_bandwidth_gbs']:.1f} GB/s measured copy bandwidth "
        f"= {b['floor_tokens_per_s']:.1f} tok/s")
    if "plain_fraction_of_floor" in b:
        lines.append(f"plain decoding (d) reaches {b['plain_decode_tokens_per_s']:.1f} tok/s while decoding = "
                     f"{100 * b['plain_fraction_of_floor']:.1f}% of the floor")
    return "\n".join(lines)


def plot_bench(record: dict, png: str | Path) -> Path | None:
    """Bar charts of median tokens/s (with the bandwidth floor) and tau per method. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    s = record["summary"]
    names = [f"({r['letter']}) {r['method']}" for r in s]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
    tps = [r["tokens_per_s_median"] for r in s]
    a1.bar(names, tps, color="tab:blue")
    floor = record["bandwidth"]["floor_tokens_per_s"]
    if floor <= 3 * max(tps):  # a far-away floor would flatten the bars; it is in the title then
        a1.axhline(floor, color="tab:red", ls="--", label=f"bandwidth floor {floor:.0f} tok/s")
        a1.legend(fontsize=8)
    else:
        a1.set_title(f"bandwidth floor {floor:.0f} tok/s (off the chart)", fontsize=9)
    a1.set_ylabel("tokens/s (median over prompts)")
    a2.bar(names, [r["tau"] for r in s], color="tab:green")
    a2.set_ylabel("tau (tokens per target forward)")
    dev = record["device"].get("gpu") or record["device"].get("cpu")
    fig.suptitle(f"{record['target']} on {dev}, {record['dataset']} x{record['prompts']}, "
                 f"{record['max_new_tokens']} new tokens")
    for ax in (a1, a2):
        ax.tick_params(axis="x", rotation=30, labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)


def format_overhead(res: dict) -> str:
    lines = [f"{'config':18s} {'draft':>8s} {'verify':>8s} {'bookkeep':>9s} {'cycle':>8s}  (target steps; "
             f"1 step = {res['target_step_ms']:.3f} ms)"]
    for r in res["rows"]:
        name = f"{r['kind']}-{r['depth']},{r['top_k']},{r['tokens']}"
        lines.append(f"{name:18s} {r['draft_units']:8.3f} {r['verify_units']:8.3f} {r['bookkeeping_units']:9.3f} "
                     f"{r['cycle_units']:8.3f}")
    lines.append(f"plain decoding: {res['plain_bandwidth_gbs']:.0f} GB/s of weights "
                 f"({100 * res['plain_fraction_of_copy']:.1f}% of measured copy bandwidth "
                 f"{res['copy_bandwidth_gbs']:.0f} GB/s)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register `eagle3 bench` on an argparse subparsers object."""
    from eagle3.fast.overhead import SHAPES

    b = subparsers.add_parser("bench", help="tokens/s and tau of eagle3 vs HF generate, prompt lookup and the "
                              "bandwidth floor; --overhead: per-cycle cost at the Llama-3.1-8B (or SmolLM2) shape",
                              usage="%(prog)s --target MODEL [--drafter DIR] [options]\n"
                                    "       %(prog)s --overhead [--shape SHAPE] [options]")
    b.add_argument("--target", default=None, metavar="MODEL", help="the target model (required unless --overhead)")
    from eagle3.cli import add_trust_remote_code  # here: eagle3.cli imports this module inside build_parser

    add_trust_remote_code(b)
    b.add_argument("--drafter", default=None, metavar="DIR",
                   help="drafter checkpoint directory, or 'random' (timing only)")
    b.add_argument("--dataset", default="mt_bench", help="bundled set name or JSONL file (default mt_bench)")
    b.add_argument("--limit", type=int, default=None, metavar="N", help="first N prompts")
    b.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, metavar="N")
    b.add_argument("--methods", default="all",
                   help="comma list: hf,hf_static,hf_lookup,plain,ngram,chain,tree or a-g (default all)")
    b.add_argument("--chain", type=int, default=None, metavar="K",
                   help="EAGLE-3 chain length (default: tuned, else the device's, as generate)")
    b.add_argument("--tree", nargs="+", default=None, metavar="D,K,N",
                   help=f"EAGLE-3 trees (default {DraftShape().text} on a GPU, {CPU_TREE.text} on a CPU); several are "
                        "each timed against plain decoding")
    b.add_argument("--ngram-tokens", type=int, default=HF_LOOKUP_TOKENS, metavar="N", help="n-gram draft length")
    b.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    b.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    b.add_argument("--guard", choices=("auto", "on", "off"), default="auto", help=GUARD_HELP)
    b.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sample at T (prompt i with seed --seed + i); default 0, greedy")
    b.add_argument("--seed", type=int, default=0, metavar="S", help="first prompt's seed when sampling")
    b.add_argument("--warmup", type=int, default=1, metavar="N", help="warm-up runs per method on the longest prompt")
    b.add_argument("--out", default="bench-out", metavar="DIR", help="folder for bench.json / bench.png (overhead.json)")
    b.add_argument("--no-graphs", action="store_true", help=NO_GRAPHS_HELP)
    b.add_argument("--batch-invariant", action="store_true", help=BATCH_INVARIANT_HELP)
    ov = b.add_argument_group("--overhead")
    ov.add_argument("--overhead", action="store_true", help="per-cycle cost with random weights (--shape)")
    ov.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES), metavar="SHAPE",
                    help=f"the random model's shape: {', '.join(sorted(SHAPES))} (default llama-3.1-8b)")
    ov.add_argument("--tiny", action="store_true", help="a tiny random Llama instead (CPU tests)")
    ov.add_argument("--context", type=int, default=None, metavar="N", help="cached context length (default 512)")
    ov.add_argument("--reps", type=int, default=None, metavar="N", help="replays per timing (default 20)")
    b.set_defaults(func=cmd_bench)
    return b


def cmd_bench(args) -> int:
    from eagle3.record import run_record, write_json

    out = Path(args.out)
    graphs = not args.no_graphs
    if args.overhead:
        from eagle3.fast.overhead import run_overhead

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device.startswith("cuda") and not args.tiny:
            from eagle3.models import select_device

            select_device(device)
        def save(res: dict) -> Path:  # after every row: a run stopped part way keeps its rows
            return write_json(run_record("bench-overhead", **res), out / "overhead.json")

        res = run_overhead(device, tiny=args.tiny, context=args.context, graphs=graphs, reps=args.reps,
                           shape=args.shape, on_progress=save)
        path = save(res)
        print(format_overhead(res))
        print(f"record: {path}")
        return 0
    if not args.target:
        raise ConfigError("eagle3 bench needs --target (or --overhead for the random 8B-shape measurement)")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    SamplingConfig(temperature=args.temperature)  # a ConfigError for a temperature out of range
    trees = [DraftShape.parse(t) for t in args.tree] if args.tree else None
    if trees and len(set(trees)) < len(trees):
        raise ConfigError(f"--tree {' '.join(args.tree)}: a shape is given twice")
    def save(partial: dict) -> Path:  # after every prompt: a run stopped part way keeps what it measured
        return write_json(partial, out / "bench.json")

    record = run_bench(
        args.target, drafter=args.drafter, dataset=args.dataset, limit=args.limit,
        max_new_tokens=args.max_new_tokens, methods=parse_methods(args.methods), chain=args.chain, tree=trees,
        ngram_tokens=args.ngram_tokens, device=args.device, dtype=args.dtype, graphs=graphs, warmup=args.warmup,
        on_progress=save, temperature=args.temperature, seed=args.seed, guard=args.guard,
        batch_invariant=args.batch_invariant,
    )
    path = save(record)
    png = plot_bench(record, out / "bench.png")
    print(format_table(record))
    print(f"record: {path}" + (f", chart: {png}" if png else " (pip install 'eagle3[bench]' for a chart)"))
    return 0
