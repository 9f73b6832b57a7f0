"""Real SmolLM2 on the CPU: greedy outputs of FastEngine plain vs EAGLE-3 tree 6,10,60, with and without
`FastOptions.graph_prefill`, on MT-bench first turns 2..2+N (those bench_serving.py sends after its 2 warm-ups).

    python graph_prefill_check.py float32|bfloat16 N NEW_TOKENS     (session 24: 12 128)
"""
import sys, time, torch
from eagle3.config import SpecConfig
from eagle3.evaluate import load_prompts
from eagle3.fast.engine import FastEngine, FastOptions
from eagle3.models import load_target
from eagle3.runtime import drafter_for, eos_token_ids

dtype = sys.argv[1]; n = int(sys.argv[2]); new = int(sys.argv[3])
torch.manual_seed(0)
model, tok = load_target("smollm2", dtype=dtype)
d = drafter_for(model, "src/eagle3/assets/smollm2-drafter")
eos = eos_token_ids(model, tok)
_, prompts = load_prompts("mt_bench")
ids = [tok.apply_chat_template(p[:1], add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"][0]
       for p in prompts[2:2 + n]]
out = {}
for gp in (False, True):
    for name, draft, spec in (("plain", "none", None), ("tree", "eagle3", SpecConfig.parse_tree("6,10,60"))):
        e = FastEngine(model, draft=draft, spec=spec, drafter=d if draft == "eagle3" else None,
                       options=FastOptions(graph_prefill=gp))
        t = time.time()
        out[(gp, name)] = [e.generate(x, max_new_tokens=new, eos_token_ids=eos).token_ids for x in ids]
        print(gp, name, sum(map(len, out[(gp, name)])), f"{time.time() - t:.1f}s", flush=True)
for gp in (False, True):
    same = sum(a == b for a, b in zip(out[(gp, "plain")], out[(gp, "tree")]))
    print(f"graph_prefill={gp}: tree == plain for {same}/{n}")
print("plain gp == plain eager:", sum(a == b for a, b in zip(out[(False, "plain")], out[(True, "plain")])), "/", n)
for i, (a, b) in enumerate(zip(out[(True, "plain")], out[(True, "tree")])):
    if a != b:
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(i, "first difference at", k, len(a), len(b))
