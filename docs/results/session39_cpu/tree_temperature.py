"""Tau of the bundled drafter's trees when its logits are divided by T before the tree is built (greedy, fp32,
CPU, the generic engine): does a temperature pick better nodes for the same budget?

    python docs/results/session39_cpu/tree_temperature.py PROMPTS NEW_TOKENS T1,T2,... [DEPTH,TOPK,TOTAL]
"""

import sys
import time

import torch

from eagle3.config import SamplingConfig, SpecConfig
from eagle3.decoding.engine import SpeculativeEngine
from eagle3.decoding.proposers import Eagle3Proposer
from eagle3.demo import bundled_drafter
from eagle3.evaluate import load_prompts
from eagle3.formats import load_drafter
from eagle3.models import load_target
from eagle3.runtime import encode_prompt, eos_token_ids
from eagle3.target import Target


def main(argv: list[str]) -> None:
    n, new_tokens = int(argv[0]), int(argv[1])
    temps = [float(t) for t in argv[2].split(",")]
    spec = SpecConfig.parse_tree(argv[3] if len(argv) > 3 else "6,10,60")
    torch.set_num_threads(2)
    model, tok = load_target("smollm2", dtype="float32", device="cpu")
    d = load_drafter(bundled_drafter(), target_config=model.config,
                     target_embedding=model.get_input_embeddings().weight, device="cpu", dtype=torch.float32)
    _, chats = load_prompts("mt_bench", limit=n)
    eos = eos_token_ids(model, tok)
    target = Target(model, d.config.aux_layer_ids)
    logits = d.logits
    for temp in temps:
        d.logits = lambda x, temp=temp: logits(x) / temp  # what the proposer ranks the nodes by
        engine = SpeculativeEngine(target, Eagle3Proposer(d, spec), tok)
        emitted = cycles = 0
        t0 = time.time()
        for chat in chats:
            r = engine.generate(encode_prompt(tok, chat=chat), max_new_tokens=new_tokens,
                                sampling=SamplingConfig(), eos_token_ids=eos)
            emitted += sum(r.stats.accepted_per_cycle) + r.stats.cycles
            cycles += r.stats.cycles
        print(f"T={temp}: tau {emitted / cycles:.3f} ({cycles} cycles, {time.time() - t0:.0f}s)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
