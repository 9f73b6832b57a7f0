"""Milliseconds for random matrices of SmolLM2-135M's shapes (q/k/v fused, o, gate/up fused, down per layer x 30, and
the 49,152 x 576 head; 121 in sequence) applied to M rows, fp32 (F.linear; MKL packed weights) and bf16, CPU."""
import time

import torch
import torch.nn.functional as F

torch.manual_seed(0)
shapes = [(1728, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
Ws = [torch.randn(o, i) for o, i in shapes]
Wb = [W.bfloat16() for W in Ws]


def run(fns, M, dt=torch.float32):
    xs = {i: torch.randn(M, i, dtype=dt) for i in (576, 1536)}

    def go():
        for f, (_, i) in zip(fns, shapes, strict=True):
            f(xs[i])

    go()
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        go()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[3] * 1e3


lin = [(lambda x, W=W: F.linear(x, W)) for W in Ws]
linb = [(lambda x, W=W: F.linear(x, W)) for W in Wb]
packed = {}
for bs in (16, 64):
    packed[bs] = []
    for W in Ws:
        pw = torch.ops.mkl._mkl_reorder_linear_weight(W, bs)
        packed[bs].append(lambda x, pw=pw, W=W, bs=bs: torch.ops.mkl._mkl_linear(x, pw, W, None, bs))
for M in (1, 2, 4, 8, 16, 32, 61):
    print(M, f"fp32 lin {run(lin, M):.1f}  mkl16 {run(packed[16], M):.1f}  mkl64 {run(packed[64], M):.1f}  "
          f"bf16 lin {run(linb, M, torch.bfloat16):.1f}", flush=True)
