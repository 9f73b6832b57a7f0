"""Session 17 (CPU): one speculative cycle of the CPU demo's shape in plain-step units, piece by piece.

SmolLM2-135M-Instruct in bf16 with the bundled drafter on the static-cache fast path (as `eagle3 demo` on a CPU
with AMX), context 200, chains of 2-4, eager (`measure_overhead` without graphs or compiled drafting).
    PYTHONPATH=src python docs/results/session17_cpu/cpu_cycle.py
"""

import torch

from eagle3.demo import bundled_drafter
from eagle3.fast.overhead import measure_overhead
from eagle3.models import load_target
from eagle3.runtime import drafter_for

torch.manual_seed(0)
model, tok = load_target("smollm2", dtype="bfloat16", device="cpu")
d = drafter_for(model, str(bundled_drafter()))
res = measure_overhead(model, d, context=200, chains=(2, 3, 4), trees=(), graphs=False, reps=10, log=print, compile_drafting=False)
step = res["target_step_ms"]
for r in res["rows"]:
    print(f"{r['kind']}-{r['tokens']} step {step:.2f} ms draft {r['draft_units']:.3f} verify {r['verify_units']:.3f} book {r['bookkeeping_units']:.3f} cycle {r['cycle_units']:.3f}")
