"""`eagle3 demo`: the README's main job. SmolLM2-135M-Instruct answers a few MT-bench prompts twice, with
plain decoding and with EAGLE-3 (the bundled drafter), shows that the answers are identical token for token,
and prints tau and the measured speedup. Offline; CPU by default. With `temperature` > 0 prompt i samples with seed
i both ways: the answers are draws from the target's distribution, and still identical token for token. It decodes as every command does on the device
(`eagle3.defaults`): on a CPU with native bf16, bf16 on the fast engine with a chain that stops where the drafter
is unsure; elsewhere fp32 on the generic engine with a chain of 2.
"""

from __future__ import annotations

import time
from dataclasses import replace
from importlib import resources
from pathlib import Path

import torch

from eagle3.config import DraftShape, SamplingConfig
from eagle3.evaluate import load_prompts
from eagle3.record import run_record, write_json
from eagle3.runtime import encode_prompt


def slowdown_hint(speedup: float, device: str, dtype: str) -> str | None:
    """What to tell a user whose demo ran slower with EAGLE-3 than without, or None."""
    if speedup >= 1.0:
        return None
    if str(device).startswith("cpu") and dtype == "float32":
        return ("EAGLE-3 was slower than plain decoding here: in fp32 a CPU pays for every extra token a "
                "verification checks. On a CPU with native bf16 (AMX or AVX512-BF16, where the demo picks bf16 "
                "itself) or on a GPU it pays: docs/benchmarks.md, \"CPU demo\".")
    return ("EAGLE-3 was slower than plain decoding here: the drafting and the many-token verification cost more "
            "than the accepted tokens saved on this machine (docs/benchmarks.md says where the time goes).")


def bundled_drafter() -> Path:
    return Path(str(resources.files("eagle3") / "assets" / "smollm2-drafter"))


def run_demo(prompts: int = 3, max_new_tokens: int = 128, spec: DraftShape | None = None, device: str = "cpu",
             drafter: str | Path | None = None, record: str | Path | None = None, print_fn=print,
             dtype: str = "auto", chain_stop: float | None = None, temperature: float = 0.0) -> dict:
    from eagle3.defaults import decoding_for
    from eagle3.runtime import decoder, load_runtime

    t0 = time.perf_counter()
    rt = load_runtime("smollm2", drafter=drafter or bundled_drafter(), device=device, dtype=dtype)
    # every cycle drafts (no guard): the demo shows what the drafter does against plain decoding
    eagle_how = replace(decoding_for(rt.model, "eagle3", shape=spec, chain_stop=chain_stop), guard=False)
    plain = decoder(rt, replace(eagle_how, speculate=False))
    eagle = decoder(rt, eagle_how)
    dtype = str(next(rt.model.parameters()).dtype).removeprefix("torch.")
    eos = rt.eos_token_ids
    engine = "fast path" if eagle_how.engine == "fast" else "generic engine"
    print_fn(f"loaded SmolLM2-135M-Instruct and the EAGLE-3 drafter in {time.perf_counter() - t0:.1f}s "
             f"(device {device}, {dtype}, {engine}, {torch.get_num_threads()} threads, {eagle_how.describe()})")
    tok = rt.tokenizer
    _, questions = load_prompts("mt_bench", limit=prompts)
    # warm-up, excluded from timing
    warm = encode_prompt(tok, chat="Hello!")
    plain.generate(warm, max_new_tokens=8, eos_token_ids=eos)
    eagle.generate(warm, max_new_tokens=8, eos_token_ids=eos)
    rows = []
    tot = {"plain_s": 0.0, "eagle_s": 0.0, "tokens": 0, "cycles": 0, "emitted": 0}
    for i, msgs in enumerate(questions, 1):
        ids = encode_prompt(tok, chat=msgs)
        sampling = SamplingConfig(temperature=temperature, seed=i)
        a = plain.generate(ids, max_new_tokens=max_new_tokens, sampling=sampling, eos_token_ids=eos)
        b = eagle.generate(ids, max_new_tokens=max_new_tokens, sampling=sampling, eos_token_ids=eos)
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
               "spec": eagle_how.shape.to_dict(), "chain_stop": eagle_how.chain_stop, "max_new_tokens": max_new_tokens, "dtype": dtype,
               "engine": engine, "device": str(device), "temperature": temperature}
    if record:
        write_json(run_record("demo", **summary), record)
        print_fn(f"run record: {record}")
    return summary
