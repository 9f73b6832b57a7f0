"""Session 35 CPU experiment: fixed chains against chains that stop early (FastOptions.chain_stop), on the demo's
prompts and settings (SmolLM2 bf16, fast path, 128 tokens), arms interleaved over rounds."""
import sys, time, json
import torch
from eagle3.config import SamplingConfig, SpecConfig
from eagle3.fast import FastEngine, FastTarget
from eagle3.fast.engine import FastOptions
from eagle3.formats import load_drafter
from eagle3.models import load_target
from eagle3.demo import bundled_drafter
from eagle3.evaluate import load_prompts
from eagle3.runtime import encode_prompt, eos_token_ids

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 3
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
arms = [a.split(":") for a in sys.argv[3].split(",")] if len(sys.argv) > 3 else [["3", "-"], ["6", "0.2"]]
model, tok = load_target("smollm2", dtype="bfloat16", device="cpu")
d = load_drafter(bundled_drafter(), target_config=model.config, target_embedding=model.get_input_embeddings().weight,
                 device="cpu", dtype=torch.bfloat16)
shared = FastTarget(model, d.config.aux_layer_ids)
plain = FastEngine(model, draft="none", tokenizer=tok, target=shared)
engines = {}
for k, stop in arms:
    o = FastOptions(chain_stop=None if stop == "-" else float(stop))
    engines[f"{k}:{stop}"] = FastEngine(model, draft="eagle3", spec=SpecConfig(mode="chain", chain_length=int(k)),
                                        drafter=d, tokenizer=tok, target=shared, options=o)
eos = eos_token_ids(model, tok)
_, qs = load_prompts("mt_bench", limit=n_prompts)
ids = [encode_prompt(tok, chat=m) for m in qs]
warm = encode_prompt(tok, chat="Hello!")
for e in [plain, *engines.values()]:
    e.generate(warm, max_new_tokens=8, eos_token_ids=eos)
res = {name: {"s": 0.0, "tok": 0, "cyc": 0, "emit": 0, "same": 0, "drafted": 0} for name in ["plain", *engines]}
for r in range(rounds):
    for p in ids:
        a = plain.generate(p, max_new_tokens=128, sampling=SamplingConfig(), eos_token_ids=eos)
        res["plain"]["s"] += a.stats.total_s; res["plain"]["tok"] += a.stats.new_tokens
        for name, e in engines.items():
            b = e.generate(p, max_new_tokens=128, sampling=SamplingConfig(), eos_token_ids=eos)
            x = res[name]
            x["s"] += b.stats.total_s; x["tok"] += b.stats.new_tokens; x["cyc"] += b.stats.cycles
            x["emit"] += sum(b.stats.accepted_per_cycle) + b.stats.cycles; x["same"] += a.token_ids == b.token_ids
            x["drafted"] += b.stats.drafted_tokens
    base = res["plain"]["tok"] / res["plain"]["s"]
    line = [f"round {r}: plain {base:.1f}"]
    for name in engines:
        x = res[name]
        line.append(f"{name} {x['tok'] / x['s']:.1f} ({x['tok'] / x['s'] / base:.2f}x tau {x['emit'] / x['cyc']:.2f} "
                    f"drafted/cyc {x['drafted'] / x['cyc']:.2f} same {x['same']})")
    print(" | ".join(line), flush=True)
json.dump(res, open("/tmp/cs/ab.json", "w"), indent=1)
