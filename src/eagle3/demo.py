"""`eagle3 demo`: the README's main job. SmolLM2-135M-Instruct answers a few MT-bench prompts twice, with
plain decoding and with EAGLE-3 (the bundled drafter), shows that the answers are identical token for token,
and prints tau and the measured speedup. Offline; CPU by default.

On a CPU with native bf16 (AMX or AVX512-BF16) the demo runs in bf16 on the static-cache fast path with a chain
of up to 6 that stops where the drafter is unsure; elsewhere in fp32 on the generic engine with a chain of 2 (why:
the comments on `CPU_SPEC` and `CPU_BF16_SPEC`)."""

from __future__ import annotations

import time
from importlib import resources
from pathlib import Path

import torch

from eagle3.config import ConfigError, DraftShape, SamplingConfig
from eagle3.decoding.engine import SpeculativeEngine
from eagle3.decoding.proposers import Eagle3Proposer, NoDraftProposer
from eagle3.evaluate import load_prompts
from eagle3.fast.target import cpu_has_bf16
from eagle3.record import run_record, write_json
from eagle3.runtime import encode_prompt, eos_token_ids
from eagle3.target import Target

# In fp32 a CPU verifies more than 2 tokens at well over the cost of one (its fp32 GEMMs are compute-bound for a
# few rows where a GPU is bandwidth-bound), so longer chains and trees gain nothing there (docs/benchmarks.md):
# the CPU default is a chain of 2 in fp32.
CPU_SPEC = DraftShape.chain(2)
# In bf16 a CPU with native bf16 verifies a few tokens for about the cost of one, and on the fast path a chain's
# verification gives each row the bits of a one-token step: its rows see the same cache slots in the same order,
# and on a CPU without AMX the fast path picks kernels whose rows do not depend on the row count
# (`eagle3.fast.target.exact_rows`). So chains stay identical to bf16 plain decoding; trees do not reliably (a node's
# ancestors sit at scattered slots, so some tree rows round differently from the same row in a chain). The chain
# stops where the drafter is unsure (`FastOptions.chain_stop`): at most 6 tokens, none after the chain's joint
# draft probability falls below 0.2, and only the drafted tokens verified, which beats any fixed chain length
# there (docs/benchmarks.md, "CPU demo").
CPU_BF16_SPEC = DraftShape.chain(6)
CPU_BF16_CHAIN_STOP = 0.2
DEMO_DTYPES = ("auto", "float32", "bfloat16")


def demo_dtype(device: str, dtype: str = "auto") -> str:
    """The demo's dtype: `dtype` unless "auto"; then bf16 on CUDA and on CPUs with native bf16, fp32 on other
    CPUs."""
    if dtype not in DEMO_DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: expected one of {DEMO_DTYPES}")
    if dtype != "auto":
        return dtype
    return "bfloat16" if not str(device).startswith("cpu") or cpu_has_bf16() else "float32"


def slowdown_hint(speedup: float, device: str, dtype: str) -> str | None:
    """What to tell a user whose demo ran slower with EAGLE-3 than without, or None."""
    if speedup >= 1.0:
        return None
    if str(device).startswith("cpu") and dtype == "float32":
        return ("EAGLE-3 was slower than plain decoding here: in fp32 a CPU pays for every extra token a "
                "verification checks (on an AMD EPYC two rows cost twice one). On a CPU with native bf16 (AMX or "
                "AVX512-BF16, where the demo picks bf16 itself) or on a GPU it pays: docs/benchmarks.md, \"CPU demo\".")
    return ("EAGLE-3 was slower than plain decoding here: the drafting and the many-token verification cost more "
            "than the accepted tokens saved on this machine (docs/benchmarks.md says where the time goes).")


def _shape(spec: DraftShape, chain_stop: float | None = None) -> str:
    if spec.is_chain and chain_stop:
        return f"chain of up to {spec.depth}, stopping below joint draft probability {chain_stop:g}"
    return str(spec)


def bundled_drafter() -> Path:
    return Path(str(resources.files("eagle3") / "assets" / "smollm2-drafter"))


def run_demo(prompts: int = 3, max_new_tokens: int = 128, spec: DraftShape | None = None, device: str = "cpu",
             drafter: str | Path | None = None, record: str | Path | None = None, print_fn=print,
             dtype: str = "auto", chain_stop: float | None = None) -> dict:
    from eagle3.fast import FastEngine, FastOptions, FastTarget
    from eagle3.formats import load_drafter
    from eagle3.models import load_target

    t0 = time.perf_counter()
    cpu = str(device).startswith("cpu")
    dtype = demo_dtype(device, dtype)
    model, tok = load_target("smollm2", dtype=dtype, device=device)
    d = load_drafter(drafter or bundled_drafter(), target_config=model.config,
                     target_embedding=model.get_input_embeddings().weight, device=device,
                     dtype=next(model.parameters()).dtype)
    fast = cpu and dtype == "bfloat16"  # bf16 chains match bf16 plain decoding on the fast path (CPU_BF16_SPEC)
    if fast and spec is None and chain_stop is None:
        chain_stop = CPU_BF16_CHAIN_STOP
    chain_stop = chain_stop or None  # 0: the full chain every cycle
    if chain_stop is not None and not fast:
        raise ConfigError("--chain-stop is for the CPU fast path (bf16 on a CPU with native bf16)")
    spec = spec or (DraftShape() if not cpu else CPU_BF16_SPEC if dtype == "bfloat16" else CPU_SPEC)
    if fast:
        shared = FastTarget(model, d.config.aux_layer_ids)
        plain = FastEngine(model, draft="none", tokenizer=tok, target=shared)
        eagle = FastEngine(model, draft="eagle3", spec=spec, drafter=d, tokenizer=tok, target=shared,
                           options=FastOptions(chain_stop=chain_stop))
    else:
        target = Target(model, d.config.aux_layer_ids)
        plain = SpeculativeEngine(target, NoDraftProposer(device), tok)
        eagle = SpeculativeEngine(target, Eagle3Proposer(d, spec), tok)
    eos = eos_token_ids(model, tok)
    engine = "fast path" if fast else "generic engine"
    print_fn(f"loaded SmolLM2-135M-Instruct and the EAGLE-3 drafter in {time.perf_counter() - t0:.1f}s "
             f"(device {device}, {dtype}, {engine}, {torch.get_num_threads()} threads, "
             f"{_shape(spec, chain_stop)})")
    _, questions = load_prompts("mt_bench", limit=prompts)
    # warm-up, excluded from timing
    warm = encode_prompt(tok, chat="Hello!")
    plain.generate(warm, max_new_tokens=8, eos_token_ids=eos)
    eagle.generate(warm, max_new_tokens=8, eos_token_ids=eos)
    rows = []
    tot = {"plain_s": 0.0, "eagle_s": 0.0, "tokens": 0, "cycles": 0, "emitted": 0}
    for i, msgs in enumerate(questions, 1):
        ids = encode_prompt(tok, chat=msgs)
        a = plain.generate(ids, max_new_tokens=max_new_tokens, sampling=SamplingConfig(), eos_token_ids=eos)
        b = eagle.generate(ids, max_new_tokens=max_new_tokens, sampling=SamplingConfig(), eos_token_ids=eos)
        same = a.token_ids == b.token_ids
        sa, sb = a.stats, b.stats
        rows.append({"prompt": msgs[0]["content"][:80], "identical": same, "tokens": sa.new_tokens,
                     "plain_tok_s": round(sa.tokens_per_s, 2), "eagle_tok_s": round(sb.tokens_per_s, 2),
                     "tau": round(sb.tau, 3)})
        tot["plain_s"] += sa.total_s
        tot["eagle_s"] += sb.total_s
        tot["tokens"] += sa.new_tokens
        tot["cycles"] += sb.cycles
        tot["emitted"] += sum(sb.accepted_per_cycle) + sb.cycles
        print_fn(f"\n[{i}] {msgs[0]['content'][:100]}")
        print_fn(f"    answer: {b.text[:300].strip()}{'...' if len(b.text) > 300 else ''}")
        print_fn(f"    identical to plain decoding: {'yes' if same else 'NO'} ({sa.new_tokens} tokens); "
                 f"plain {sa.tokens_per_s:.1f} tok/s, EAGLE-3 {sb.tokens_per_s:.1f} tok/s, tau {sb.tau:.2f}")
    tau = tot["emitted"] / tot["cycles"] if tot["cycles"] else 0.0
    speedup = tot["plain_s"] / tot["eagle_s"] if tot["eagle_s"] else 0.0
    all_same = all(r["identical"] for r in rows)
    print_fn(f"\nall answers identical: {'yes' if all_same else 'NO'}; tau {tau:.2f}; "
             f"plain {tot['tokens'] / tot['plain_s']:.1f} tok/s, EAGLE-3 {tot['tokens'] / tot['eagle_s']:.1f} tok/s; "
             f"speedup {speedup:.2f}x")
    hint = slowdown_hint(speedup, device, dtype)
    if hint:
        print_fn(hint)
    summary = {"identical": all_same, "tau": round(tau, 3), "speedup": round(speedup, 3), "rows": rows,
               "spec": spec.to_dict(), "chain_stop": chain_stop, "max_new_tokens": max_new_tokens, "dtype": dtype,
               "engine": engine, "device": str(device)}
    if record:
        write_json(run_record("demo", **summary), record)
        print_fn(f"run record: {record}")
    return summary
