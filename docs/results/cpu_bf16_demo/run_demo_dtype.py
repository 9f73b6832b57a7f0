"""`eagle3 demo` (3 MT-bench prompts x 128 tokens, CPU) with the target and drafter in another dtype:
    python run_demo_dtype.py bfloat16 c2 4,4,16     # shapes: cK for a chain of K, or DEPTH,TOPK,TOTAL"""

import sys

import eagle3.demo as demo
import eagle3.models as models
from eagle3.config import SpecConfig

load_target = models.load_target
DTYPE = sys.argv[1]


def load_in_dtype(spec, dtype="auto", device="cpu", **kw):
    return load_target(spec, dtype=DTYPE, device=device, **kw)


models.load_target = load_in_dtype  # run_demo imports it at call time
for shape in sys.argv[2:]:
    spec = (SpecConfig(mode="chain", chain_length=int(shape[1:])) if shape.startswith("c")
            else SpecConfig.parse_tree(shape))
    s = demo.run_demo(prompts=3, max_new_tokens=128, spec=spec, print_fn=lambda *a: None)
    print(DTYPE, shape, "identical", s["identical"], "tau", s["tau"], "speedup", s["speedup"],
          [(r["plain_tok_s"], r["eagle_tok_s"], r["identical"]) for r in s["rows"]], flush=True)
