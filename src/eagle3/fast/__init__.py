"""The fast path: static KV caches, fixed-shape draft trees, CUDA-graph-captured cycles.

    from eagle3.fast import build_engine
    engine = build_engine(model, draft="eagle3", spec=DraftShape(), drafter=drafter, tokenizer=tok)
    engine.generate(prompt_ids, max_new_tokens=256, eos_token_ids=[...])

Modules: `target` (functional Llama/Qwen forward over static caches), `drafter` (the EAGLE-3 drafter over static
caches), `rows` (the one speculative cycle, draft / verify / accept / compact as fixed-shape device steps over B
rows), `graphs` (capture and replay), `engine` (one request as one row, the interface of
`eagle3.decoding.engine.SpeculativeEngine`), `overhead` (the cost of one speculative cycle in target-step units),
`batched` (continuous-batching plain decoding over many rows, for `eagle3 regenerate`).
"""

from eagle3.fast.drafter import FastDrafter
from eagle3.fast.engine import FastEngine, FastOptions, build_engine, fast_engine_for
from eagle3.fast.families import FAST_MODEL_TYPES, fast_support
from eagle3.fast.rows import FastRows
from eagle3.fast.target import FastTarget

__all__ = ["FAST_MODEL_TYPES", "FastDrafter", "FastEngine", "FastOptions", "FastRows", "FastTarget",
           "build_engine", "fast_engine_for", "fast_support"]
