"""Plain decoding's step time with each SDPA backend (graph replay), SmolLM2 and the 8B shape."""
import sys, torch
from functools import partial
from torch.nn.attention import SDPBackend, sdpa_kernel
from eagle3.fast.core import FastCore
from eagle3.fast.graphs import StepRunner, graph_pool
from eagle3.fast.overhead import LLAMA_8B, build_random, time_step
from eagle3.fast.target import FastTarget
from eagle3.models import load_target
from eagle3.runtime import drafter_for
dev = torch.device("cuda:0")
pool, keep = graph_pool(dev), []
for name in sys.argv[1:]:
    if name == "8b":
        model, drafter = build_random(LLAMA_8B, dev, torch.bfloat16, draft_vocab_size=32000)
    else:
        model, _ = load_target("smollm2", dtype="bfloat16", device="cuda:0")
        drafter = drafter_for(model, "src/eagle3/assets/smollm2-drafter")
    target = FastTarget(model, drafter.config.aux_layer_ids)
    prompt = torch.randint(3, target.vocab_size, (512,), generator=torch.Generator().manual_seed(0)).to(dev)
    for backends in ([SDPBackend.CUDNN_ATTENTION], [SDPBackend.EFFICIENT_ATTENTION], [SDPBackend.MATH]):
        for kind in ("plain", "tree"):
            try:
                with sdpa_kernel(backends):
                    if kind == "plain":
                        core = FastCore(target, "none")
                    else:
                        from eagle3.fast.drafter import FastDrafter
                        core = FastCore(target, "eagle3", FastDrafter(drafter), depth=6, top_k=10, total_tokens=60)
                    core.allocate(768)
                    logits, aux = core.prefill(prompt)
                    core.begin(prompt, aux, logits.argmax().view(1))
                    if kind == "plain":
                        fn = partial(core.verify, greedy=True)
                    else:
                        core.draft(); saved = core.length.clone()
                        def fn(core=core, saved=saved):
                            core.draft(); core.verify(greedy=True); core.accept(); core.commit(); core.length.copy_(saved)
                    r = StepRunner(fn, dev, graphs=True, pool=pool, name=f"{name}-{backends[0].name}-{kind}")
                    r.prepare(); keep.append(r)
                t = time_step(r, dev, 30) * 1e6
                print(f"{name:8s} {backends[0].name:20s} {kind:6s} {t:9.1f} us", flush=True)
            except Exception as e:
                print(f"{name} {backends[0].name} {kind} failed: {type(e).__name__}: {str(e)[:150]}", flush=True)
    del model, drafter, target
