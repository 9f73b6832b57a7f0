"""`eagle3 bench --overhead`: what one speculative cycle costs, in target-step units, at a realistic size.

Random weights at the Llama-3.1-8B shape in bf16 (32 layers, hidden 4096, FFN 14336, 32 heads, 8 KV heads,
vocabulary 128256) and a random EAGLE-3 drafter at H = 4096 with a 32000-token draft vocabulary, or (`shape=
"smollm2-135m"`) at SmolLM2-135M's shape with the bundled drafter's 12,288-token draft vocabulary, where every
step is launch-bound. Timings come from the fast path (one row of `eagle3.fast.rows.FastRows`, as `FastEngine`
runs it), each piece captured in its own CUDA graph and replayed `reps` times:

    target step   one-token verification (forward + argmax): the unit everything is divided by
    draft         the d draft steps of a chain (K) or tree (depth, top_k, N nodes), rerank included
    verify        the target forward over N+1 tokens with the tree mask
    bookkeeping   greedy acceptance, KV compaction, and the drafter pass over the accepted rows
    cycle         all of the above in one graph (what the engine replays)

A tree cycle costs more than one target step in every engine; the ratio decides the speedup. Plain
decoding's achieved bandwidth is weight bytes / target-step time, next to the measured device copy bandwidth.
`tiny=True` is the same on a small random Llama (for CPU tests).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import transformers

from eagle3.config import DrafterConfig, DraftShape
from eagle3.decoding.sampling import GREEDY
from eagle3.drafter import Eagle3Drafter
from eagle3.fast.drafter import FastDrafter
from eagle3.fast.engine import drafting_compiled_by_default
from eagle3.fast.graphs import StepRunner, graph_pool
from eagle3.fast.pointwise import fuse_level
from eagle3.fast.rows import FastRows
from eagle3.fast.target import FastTarget

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False)
# SmolLM2-135M-Instruct's shape (the bundled drafter's target): launch-bound on a GPU, where the ratio of a cycle to
# a plain step decides the speedup; its drafter has the bundled one's 12,288-token draft vocabulary.
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
               rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False)


def build_random(shape: dict, device: str | torch.device, dtype: torch.dtype, draft_vocab_size: int):
    """A random `LlamaForCausalLM` and EAGLE-3 drafter created directly on `device` in `dtype` (no fp32 copy)."""
    cfg = transformers.LlamaConfig(**shape)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(cfg).eval()
            dcfg = DrafterConfig.for_target(cfg, draft_vocab_size=min(draft_vocab_size, cfg.vocab_size))
            drafter = Eagle3Drafter(dcfg).eval()
    finally:
        torch.set_default_dtype(prev)
    model.requires_grad_(False)
    drafter.requires_grad_(False)
    if dcfg.uses_draft_vocab:
        drafter.set_vocab_mapping(torch.arange(dcfg.draft_vocab_size))
    return model, drafter


def copy_bandwidth(device: torch.device | str, nbytes: int | None = None, reps: int = 10) -> float:
    """Device copy bandwidth in bytes/s, counting bytes read plus bytes written (median of `reps` copies)."""
    device = torch.device(device)
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 1 << 26)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        times.append(_time_once(lambda: dst.copy_(src), device))
    return 2 * nbytes / statistics.median(times)


def _time_once(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        # Events on `device`'s stream, whichever GPU is current: recorded on another GPU's stream they time only
        # the launches, and the copy bandwidth comes out impossibly high.
        stream = torch.cuda.current_stream(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) / 1000.0
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_step(runner: Callable[[], None], device: torch.device, reps: int, rounds: int = 5) -> float:
    """Median over `rounds` of the mean seconds per call over `reps` back-to-back calls."""
    def burst():
        for _ in range(reps):
            runner()

    burst()  # warm
    return statistics.median(_time_once(burst, device) / reps for _ in range(rounds))


def begin_random(rows: FastRows, context: int, vocab: int) -> None:
    """Prefill one row of `rows` with `context` random tokens (seed 0) and begin decoding after them."""
    g = torch.Generator().manual_seed(0)
    rows.add(torch.randint(3, vocab, (context,), generator=g).tolist())


@torch.no_grad()
def measure_overhead(
    model: torch.nn.Module,
    drafter: Eagle3Drafter,
    context: int = 512,
    chains: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8),
    trees: tuple[int, ...] = (16, 32, 48, 60, 64),
    tree_depth: int = 6,
    tree_top_k: int = 10,
    graphs: bool = True,
    fuse_pointwise: bool | str | None = None,
    reps: int = 20,
    log: Callable[[str], None] = print,
    compile_drafting: bool | None = None,
    target_attention: str | None = None,
    on_progress: Callable[[dict], None] | None = None,
) -> dict:
    """Per-cycle costs for each chain length and tree size, in seconds and in target-step units, on one row of
    `FastRows` (what `FastEngine` runs). `compile_drafting` (None: on CUDA, as `FastOptions`): the cycle's pieces
    that do not run the target are inductor-compiled; `target_attention`: as `FastOptions` (None: auto).
    `on_progress` gets the result so far (`complete` False) after the unit step and after each row, so that a run
    stopped part way keeps what it measured."""
    target = FastTarget(model, drafter.config.aux_layer_ids)
    target.fuse_pointwise(level=fuse_pointwise)  # None: auto, as `FastOptions`
    target_attention = target.use_attention(target_attention)
    progress = on_progress or (lambda result: None)
    fdrafter = FastDrafter(drafter)
    dev = target.device
    if compile_drafting is None:
        compile_drafting = drafting_compiled_by_default(dev)
    vocab = target.vocab_size
    biggest = max([*trees, *chains, 1])
    seq_len = -(-(context + 2 * biggest + tree_depth + 16) // 128) * 128
    pool = graph_pool(dev)
    # Every graph captured into `pool` must outlive the later captures into it: destroying one drops the pool's
    # use count to zero while cuBLAS's workspace still holds a block there, and the next capture into the same
    # pool trips the caching allocator's `use_count > 0` assertion (torch 2.11; pytorch/pytorch#175276).
    runners: list[StepRunner] = []
    def runner(fn, name):
        r = StepRunner(fn, dev, graphs=graphs, pool=pool, name=name)
        r.prepare()
        runners.append(r)
        return r

    # the unit: plain decoding's step (one-token forward + argmax), the row's length restored after it
    plain = FastRows(target, None, capacity=1, seq_len=seq_len, graphs=graphs, sampling=False)
    begin_random(plain, context, vocab)
    saved = plain.length.clone()

    def step():
        plain._plain_cycle(1, GREEDY)
        plain.length.copy_(saved)

    t_step = time_step(runner(step, "target-step"), dev, reps)
    wbytes = target.weight_bytes()
    kv_ctx = target.kv_bytes(context)
    bw = copy_bandwidth(dev)
    out: dict = {
        "context": context, "seq_len": seq_len, "dtype": str(target.dtype).removeprefix("torch."),
        "graphs": graphs and dev.type == "cuda",
        "fuse_pointwise": fuse_level(fuse_pointwise, dev) or "off",
        "compile_drafting": compile_drafting, "target_attention": target_attention,
        "norms_folded": target.folded,
        "reps": reps,
        "target_step_ms": t_step * 1e3, "weight_bytes": wbytes, "kv_bytes_context": kv_ctx,
        "kv_bytes_static": target.kv_bytes(seq_len),
        "copy_bandwidth_gbs": bw / 1e9,
        "plain_bandwidth_gbs": wbytes / t_step / 1e9,
        "plain_bandwidth_with_kv_gbs": (wbytes + kv_ctx) / t_step / 1e9,
        "plain_fraction_of_copy": wbytes / t_step / bw,
        "drafter_weight_bytes": fdrafter.weight_bytes(), "rows": [], "complete": False,
    }
    log(f"target step {t_step * 1e3:.3f} ms; weights {wbytes / 1e9:.2f} GB -> {out['plain_bandwidth_gbs']:.0f} GB/s "
        f"({100 * out['plain_fraction_of_copy']:.0f}% of measured copy bandwidth {bw / 1e9:.0f} GB/s)")
    progress(out)

    configs = [("chain", DraftShape.chain(k)) for k in chains] + [("tree", DraftShape(tree_depth, tree_top_k, n))
                                                                  for n in trees]
    for kind, shape in configs:
        rows = FastRows(target, fdrafter, capacity=1, seq_len=seq_len, shapes=lambda _b, s=shape: s,
                        graphs=graphs, sampling=False)
        out["drafter_attention"] = "split" if fdrafter.paths_op is not None else "mask"
        if compile_drafting:
            rows.compile_drafting()
        begin_random(rows, context, vocab)
        tree: list[torch.Tensor] = []  # the drafted tokens [1, N] and parents [1, N+1] the other pieces read
        checked: list[tuple] = []  # the verification's ancestry, choices and aux

        def draft(rows=rows, tree=tree):
            tree[:] = rows.pieces.run("_draft", 1, GREEDY)

        def verify(rows=rows, tree=tree, checked=checked):
            checked[:] = [rows._verify(1, *tree, GREEDY)]

        saved = rows.length.clone()

        def book(rows=rows, tree=tree, checked=checked, saved=saved):
            anc, top, aux = checked[0][:3]
            keep, n_acc, emitted = rows.pieces.run("_accept", 1, *tree, anc, top, None)
            rows._commit(1, keep, n_acc, emitted, aux)
            rows.length.copy_(saved)  # keep the state fixed across repetitions

        def cycle(draft=draft, verify=verify, book=book):
            draft()
            verify()
            book()

        name = f"{kind}-{shape.text}"
        t_draft = time_step(runner(draft, name + " draft"), dev, reps)
        t_verify = time_step(runner(verify, name + " verify"), dev, reps)
        t_book = time_step(runner(book, name + " bookkeeping"), dev, reps)
        t_cycle = time_step(runner(cycle, name + " cycle"), dev, reps)
        row = {"kind": kind, "depth": shape.depth, "top_k": shape.top_k, "tokens": shape.total,
               "draft_steps": shape.depth,
               "draft_ms": t_draft * 1e3, "verify_ms": t_verify * 1e3, "bookkeeping_ms": t_book * 1e3,
               "cycle_ms": t_cycle * 1e3, "draft_units": t_draft / t_step, "verify_units": t_verify / t_step,
               "bookkeeping_units": t_book / t_step, "cycle_units": t_cycle / t_step}
        out["rows"].append(row)
        log(f"{name:18s} draft {row['draft_units']:.3f}  verify {row['verify_units']:.3f}  "
            f"bookkeeping {row['bookkeeping_units']:.3f}  cycle {row['cycle_units']:.3f} target steps "
            f"({t_cycle * 1e3:.3f} ms)")
        progress(out)
    out["complete"] = True
    return out


# name -> (shape, draft vocabulary size); `eagle3 bench --overhead --shape NAME`
SHAPES = {"llama-3.1-8b": (LLAMA_8B, 32000), "smollm2-135m": (SMOLLM2, 12288)}


def run_overhead(device: str, tiny: bool = False, context: int | None = None, graphs: bool = True,
                 fuse_pointwise: bool | str | None = None, reps: int | None = None,
                 log: Callable[[str], None] = print, compile_drafting: bool | None = None,
                 shape: str = "llama-3.1-8b",
                 target_attention: str | None = None, on_progress: Callable[[dict], None] | None = None) -> dict:
    """Build the random model (`SHAPES[shape]` in bf16, or tiny in fp32) and measure; returns the result dict
    (`on_progress` as `measure_overhead`, each result with its `shape`)."""
    dev = torch.device(device)
    name = "tiny-llama" if tiny else shape
    common = dict(graphs=graphs, fuse_pointwise=fuse_pointwise, log=log,
                  compile_drafting=compile_drafting, target_attention=target_attention,
                  on_progress=None if on_progress is None else lambda r: on_progress({"shape": name, **r}))
    if tiny:
        model, drafter = build_random(TINY, dev, torch.float32, draft_vocab_size=256)
        return {"shape": name, **measure_overhead(
            model, drafter, context=context or 32, chains=(1, 2, 3), trees=(8, 16), tree_depth=3, tree_top_k=4,
            reps=reps or 3, **common)}
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {sorted(SHAPES)}")
    t0 = time.perf_counter()
    dims, draft_vocab = SHAPES[shape]
    model, drafter = build_random(dims, dev, torch.bfloat16, draft_vocab_size=draft_vocab)
    log(f"built random {shape}-shape target and drafter on {dev} in {time.perf_counter() - t0:.1f}s")
    return {"shape": name, **measure_overhead(model, drafter, context=context or 512, reps=reps or 20, **common)}
