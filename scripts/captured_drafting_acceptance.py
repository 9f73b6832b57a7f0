"""Acceptance of constrained drafting as captured cycles draft, measurable on a CPU.

Captured drafting (CUDA graphs) cannot ask the host for a grammar mask at every expansion step; before the cycle
the host writes the masks it knows (`eagle3.decoding.grammar.forced_path_masks`: the next token's, then those
along the tokens the grammar forces). This script runs that code path eagerly (`FastRows.graphs` set, each capture's
warm-up run for real) on the `bfcl_json` answers, with those masks and with the next token's mask alone, and prints
tau and how many answers agree. Speed is not measured here: without graphs the pieces run eagerly.

    python scripts/captured_drafting_acceptance.py --target smollm2 --limit 8 --max-new-tokens 128 \
        --shapes 6 6,10,60 --out runs/captured-drafting.json
"""

from __future__ import annotations

import argparse
import statistics
from unittest import mock

from eagle3.config import DraftShape
from eagle3.decoding import grammar
from eagle3.decoding.grammar import ALL, GrammarCompiler
from eagle3.demo import bundled_drafter
from eagle3.evaluate import encode_prompt_messages, load_prompts
from eagle3.fast import row_grammar
from eagle3.fast.engine import FastEngine, FastOptions
from eagle3.fast.graphs import StepRunner
from eagle3.record import run_record, write_json
from eagle3.runtime import eos_token_ids, load_runtime


def next_token_only(grammars, rows: int, depth: int, words: int):
    """`forced_path_masks` with every level past the first open: captured drafting as it was before."""
    masks = grammar.forced_path_masks(grammars, rows, depth, words)
    masks[:, 1:] = ALL
    return masks


def answers(rt, shape: DraftShape, chats, compiler, eos, tokens: int) -> list[tuple[list[int], float]]:
    """(token ids, tau) of each constrained answer, drafting as captured cycles do."""
    engine = FastEngine(rt.model, draft="eagle3", spec=shape, drafter=rt.drafter, tokenizer=rt.tokenizer,
                        options=FastOptions(max_seq_len=4096))
    prompts = [encode_prompt_messages(rt.tokenizer, m) for m in chats]
    engine.reserve(max(map(len, prompts)), tokens)
    engine.rows.graphs = True  # bucketed rows, drafting under host-written masks
    out = []
    for ids, m in zip(prompts, chats, strict=True):
        r = engine.generate(ids, max_new_tokens=tokens, eos_token_ids=eos, grammar=compiler.compile(m.schema))
        out.append((r.token_ids, r.stats.tau))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default=None, help="default: the bundled SmolLM2 drafter")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--shapes", nargs="+", default=["6", "6,10,60"], help="chain lengths K or trees D,K,N")
    p.add_argument("--out", required=True, help="run record (JSON)")
    args = p.parse_args(argv)

    drafter = args.drafter or str(bundled_drafter())
    rt = load_runtime(args.target, drafter=drafter, draft="eagle3", device="cpu", engine="fast")
    eos = eos_token_ids(rt.model, rt.tokenizer)
    compiler = GrammarCompiler.for_model(rt.model, rt.tokenizer, eos)
    _, chats = load_prompts("bfcl_json", limit=args.limit)
    rows = []
    with mock.patch.object(StepRunner, "prepare", StepRunner._warm):  # warm-ups for real, no capture
        for text in args.shapes:
            shape = DraftShape.chain(int(text)) if text.isdigit() else DraftShape.parse(text)
            forced = answers(rt, shape, chats, compiler, eos, args.max_new_tokens)
            with mock.patch.object(row_grammar, "forced_path_masks", next_token_only):
                root = answers(rt, shape, chats, compiler, eos, args.max_new_tokens)
            rows.append({"shape": str(shape), "prompts": len(chats),
                         "tau_forced_path": round(statistics.mean(t for _, t in forced), 3),
                         "tau_next_token_only": round(statistics.mean(t for _, t in root), 3),
                         "same_answers": sum(a == b for (a, _), (b, _) in zip(forced, root, strict=True))})
            r = rows[-1]
            print(f"{r['shape']}: tau {r['tau_forced_path']:.2f} with the forced path's masks, "
                  f"{r['tau_next_token_only']:.2f} with the next token's alone; {r['same_answers']}/{len(chats)} "
                  "answers the same")
    write_json(run_record("captured-drafting-acceptance", target=args.target, drafter=drafter,
                          dataset="bfcl_json", max_new_tokens=args.max_new_tokens, rows=rows), args.out)
    print(f"record: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
