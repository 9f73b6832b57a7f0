"""`eagle3` command line: thin wrappers that parse flags into the config dataclasses and call the library."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from eagle3.config import (
    DEFAULT_CHAIN_LENGTH,
    DEFAULT_MAX_NEW_TOKENS,
    ConfigError,
    SamplingConfig,
    SpecConfig,
)


def _spec_from_args(args) -> SpecConfig:
    if getattr(args, "chain", None) is not None and getattr(args, "tree", None) is not None:
        raise ConfigError("give at most one of --chain and --tree")
    if getattr(args, "chain", None) is not None:
        return SpecConfig(mode="chain", chain_length=args.chain)
    if getattr(args, "tree", None) is not None:
        return SpecConfig.parse_tree(args.tree)
    return SpecConfig()


def _add_target(p) -> None:
    p.add_argument("--target", required=True,
                   help="local HF directory, hub id, .gguf file, or a bundled name (smollm2, stories260k)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")


def _add_decoding(p) -> None:
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--tree", default=None, metavar="DEPTH,TOPK,TOTAL",
                       help="EAGLE-2 dynamic tree (default 6,10,60)")
    shape.add_argument("--chain", type=int, default=None, metavar="K",
                       help=f"a chain of K draft tokens (e.g. {DEFAULT_CHAIN_LENGTH})")


def cmd_generate(args) -> int:
    from eagle3.runtime import encode_prompt, load_runtime

    spec = _spec_from_args(args)
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    rt = load_runtime(args.target, drafter=args.drafter, draft=args.draft, spec=spec,
                      device=args.device, dtype=args.dtype)
    ids = encode_prompt(rt.tokenizer, prompt=args.prompt, chat=args.chat)
    stream = None if args.json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    res = rt.engine.generate(ids, max_new_tokens=args.max_new_tokens, sampling=sampling,
                             eos_token_ids=rt.eos_token_ids, stop_strings=args.stop or (), on_text=stream)
    st = res.stats
    if args.json:
        print(json.dumps({
            "text": res.text, "token_ids": res.token_ids, "finish_reason": res.finish_reason,
            "tau": round(st.tau, 4), "acceptance_per_position": [round(a, 4) for a in st.acceptance_per_position],
            "tokens_per_s": round(st.tokens_per_s, 2), "new_tokens": st.new_tokens, "cycles": st.cycles,
            "draft": rt.draft, "spec": rt.spec.__dict__, "draft_s": round(st.draft_s, 4),
            "verify_s": round(st.verify_s, 4), "prefill_s": round(st.prefill_s, 4),
        }))
    else:
        sys.stdout.write("\n")
        print(f"[{rt.draft}] {st.new_tokens} tokens in {st.total_s:.2f}s ({st.tokens_per_s:.1f} tok/s), "
              f"tau {st.tau:.2f}, {st.cycles} target forwards", file=sys.stderr)
    return 0


def cmd_init_drafter(args) -> int:
    from eagle3.formats import save_drafter
    from eagle3.models import load_target
    from eagle3.runtime import init_drafter

    model, _ = load_target(args.target, dtype="float32", device="cpu")
    d = init_drafter(model, draft_vocab_size=args.draft_vocab_size, seed=args.seed)
    save_drafter(d, args.out, format="speculators")
    print(f"wrote a random drafter for {args.target} to {args.out} "
          f"(aux layers {d.config.aux_layer_ids}, draft vocab {d.config.draft_vocab_size})")
    return 0


def cmd_export(args) -> int:
    from eagle3.formats import export_drafter

    export_drafter(args.drafter, args.format, args.out)
    print(f"wrote {args.format} checkpoint to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eagle3", description="EAGLE-3 speculative decoding for HF models")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text, with or without speculation")
    _add_target(g)
    g.add_argument("--drafter", default=None, help="drafter checkpoint directory (speculators or EAGLE format)")
    g.add_argument("--draft", choices=("eagle3", "ngram", "none"), default=None,
                   help="draft method (default: eagle3 with --drafter, else none)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw text prompt (BOS added)")
    src.add_argument("--chat", help="a user message, rendered with the target's chat template")
    _add_decoding(g)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("init-drafter", help="write a randomly initialised drafter shaped for a target")
    _add_target(i)
    i.add_argument("--out", required=True)
    i.add_argument("--draft-vocab-size", type=int, default=None)
    i.add_argument("--seed", type=int, default=0)
    i.set_defaults(func=cmd_init_drafter)

    e = sub.add_parser("export", help="convert a drafter to the speculators (vLLM) or EAGLE (SGLang) format")
    e.add_argument("--drafter", required=True)
    e.add_argument("--format", choices=("speculators", "eagle"), required=True)
    e.add_argument("--out", required=True)
    e.set_defaults(func=cmd_export)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"eagle3: error: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"eagle3: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
