"""Plain one-token steps of SmolLM2 bf16 on the fast path, packed weights against torch's F.linear, alternating."""
import time, statistics, torch, json, sys
from eagle3.models import load_target
from eagle3.fast.target import FastTarget
model, _ = load_target("smollm2", dtype="bfloat16", device="cpu")
ts = {}
for name in ("packed", "unpacked"):
    t = FastTarget(model)
    if name == "unpacked":
        t.packed = None
    t.allocate(512)
    ts[name] = t
ar = torch.arange(512)
ids = torch.randint(0, 40000, (300,))
with torch.inference_mode():
    for t in ts.values():  # the same 256-token prefill
        t(ids[:256], ar[:256], ar[:256], ar[None, :] <= ar[:256, None])
    res = {k: [] for k in ts}
    for r in range(6):
        for name, t in ts.items():
            t0 = time.perf_counter()
            for p in range(256, 276):
                t(ids[p:p+1], ar[p:p+1], ar[p:p+1], (ar <= p)[None])
            res[name].append((time.perf_counter() - t0) / 20 * 1e3)
for k, v in res.items():
    print(k, "ms per step:", " ".join(f"{x:.1f}" for x in v), "median %.1f" % statistics.median(v))
print("speedup %.2fx" % (statistics.median(res["unpacked"]) / statistics.median(res["packed"])))
json.dump(res, open(sys.argv[1], "w"))
