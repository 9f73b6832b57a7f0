#!/usr/bin/env bash
# Session 14, hold 1: compiled drafting (FastCore.compile_drafting) against eager drafting, same machine.
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site EAGLE3_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLE3_GIT_SHA=${SHA:-unknown}
R=/tmp/w/res; mkdir -p $R
D=src/eagle3/assets/smollm2-drafter
st() { echo "== $(date -u +%H:%M:%S) $*"; }
st "topk micro"
python3 - > $R/topk.log 2>&1 <<'PY'
import torch, time
from eagle3.fast.drafter import top_k_last
x = torch.randn(10, 8192, device="cuda")
for name, f in (("topk", lambda: x.topk(10, dim=-1)), ("two-stage", lambda: top_k_last(x, 10))):
    for _ in range(20): f()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(100): f()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(10): g.replay()
    torch.cuda.synchronize(); print(name, round((time.perf_counter() - t) / 1000 * 1e6, 2), "us per call")
PY
cat $R/topk.log
B="python3 -m eagle3.cli bench --device cuda:0 --target smollm2 --drafter $D --limit 80 --max-new-tokens 256 --methods plain,chain,tree"
st "bench80 compiled drafting"
timeout 400 $B --out $R/bench80_cd > $R/bench80_cd.log 2>&1; echo "rc=$?"; tail -n 8 $R/bench80_cd.log
st "bench80 eager drafting"
timeout 400 $B --eager-drafting --out $R/bench80_eager > $R/bench80_eager.log 2>&1; echo "rc=$?"; tail -n 8 $R/bench80_eager.log
st "profile smollm2 compiled / eager"
timeout 200 python3 scripts/profile_step.py --device cuda:0 --target smollm2 --drafter $D --out $R/prof_cd > $R/prof_cd.log 2>&1; echo "rc=$?"; grep -E "tree cycle =|wall" $R/prof_cd.log | head
timeout 200 python3 scripts/profile_step.py --device cuda:0 --target smollm2 --drafter $D --eager-drafting --out $R/prof_eager > $R/prof_eager.log 2>&1; echo "rc=$?"; grep -E "tree cycle =" $R/prof_eager.log
st "serving greedy"
timeout 420 python3 scripts/bench_serving.py --target smollm2 --drafter $D --device cuda:0 --concurrency 1 4 16 64 \
  --max-tokens 128 --rounds 3 --fast-rows on --out $R/serve_greedy > $R/serve_greedy.log 2>&1; echo "rc=$?"; grep -E "^ +[0-9]+ \||geometric" $R/serve_greedy.log
st "gpu tests"
timeout 500 python3 -m pytest -q -m gpu tests/test_fast.py tests/test_rows.py -p no:cacheprovider > $R/gpu_tests.log 2>&1; echo "rc=$?"; tail -n 3 $R/gpu_tests.log
st "overhead 8B compiled drafting"
timeout 500 python3 -m eagle3.cli bench --overhead --device cuda:0 --out $R/overhead_cd > $R/overhead_cd.log 2>&1; echo "rc=$?"; tail -n 18 $R/overhead_cd.log
st "done"
