"""Where a plain batched scheduler cycle spends its time on the GPU (no HTTP): ms/cycle at c=1,4,64 + cProfile."""
import cProfile, pstats, sys, time, torch
sys.path.insert(0, "/tmp/scripts")
from bench_scheduler import run_once
from eagle3.evaluate import load_prompts
from eagle3.models import load_target
from eagle3.target import Target
from eagle3.serving.policy import SpecPolicy
from eagle3.serving.scheduler import Scheduler
from eagle3.runtime import eos_token_ids
from eagle3.runtime import encode_prompt
model, tok = load_target(sys.argv[1], device="cuda:0")
eos = eos_token_ids(model, tok)
_, chats = load_prompts("mt_bench", limit=64)
prompts = [encode_prompt(tok, chat=m) for m in chats]
for c in (1, 4, 64):
    sched = Scheduler(Target(model, []), tok, eos, drafter=None, policy=SpecPolicy(enabled=False))
    run_once(sched, prompts[:c], 32)
    torch.cuda.synchronize()
    pr = cProfile.Profile(); pr.enable()
    s, cyc, toks = run_once(sched, prompts[:c], 64)
    torch.cuda.synchronize()
    pr.disable()
    print(f"c={c}: {s:.3f}s {cyc} cycles {1000*s/max(cyc,1):.2f} ms/cycle {toks} tokens {toks/s:.1f} tok/s", flush=True)
    if c in (4, 64):
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
