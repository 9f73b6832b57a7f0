"""`eagle3` command line: thin wrappers that parse flags into the config dataclasses and call the library."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from eagle3.cli_args import draft_vocab_size, duration_seconds, layer_ids
from eagle3.config import (
    BATCH_INVARIANT_HELP,
    DEFAULT_DRAFT_VOCAB_SIZE,
    DEFAULT_MAX_NEW_TOKENS,
    DTYPE_HELP,
    GUARD_HELP,
    NO_GRAPHS_HELP,
    ConfigError,
    DraftShape,
    SamplingConfig,
    help_formatter,
)

ENGINE_CHOICES = ("auto", "fast", "generic")
ENGINE_HELP = ("fast: static KV cache + CUDA graphs (Llama/Mistral/Qwen families); generic: any HF model; "
               "auto: fast where the family and draft kind allow it")


def add_trust_remote_code(p) -> None:
    """`--trust-remote-code`, for every command that loads a target (main passes it to eagle3.models)."""
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let the target repository's own Python code run (auto_map models)")


def _add_target(p) -> None:
    p.add_argument("--target", required=True, metavar="MODEL",
                   help="local HF folder, hub id, .gguf file, or bundled name (smollm2, stories260k)")
    add_trust_remote_code(p)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)


def _add_decoding(p) -> None:
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--tree", default=None, metavar="DEPTH,TOPK,TOTAL", help="EAGLE-2 dynamic tree, e.g. 6,10,60")
    shape.add_argument("--chain", type=int, default=None, metavar="K",
                       help="a chain of K draft tokens (default: tuned, else the device's: docs/serving.md)")
    p.add_argument("--guard", choices=("auto", "on", "off"), default="auto", help=GUARD_HELP)


def cmd_generate(args) -> int:
    from eagle3.decoding.grammar import GrammarCompiler, schema_file
    from eagle3.runtime import encode_prompt, load_runtime

    spec = DraftShape.from_flags(args.tree, args.chain)
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    schema = schema_file(args.json_schema) if args.json_schema else None  # refused before the model loads
    rt = load_runtime(args.target, drafter=args.drafter, draft=args.draft, spec=spec, device=args.device,
                      dtype=args.dtype, draft_model=args.draft_model, engine="fast" if args.fast else args.engine)
    ids = encode_prompt(rt.tokenizer, prompt=args.prompt, chat=args.chat)
    grammar = None
    if schema is not None:
        grammar = GrammarCompiler.for_model(rt.model, rt.tokenizer, rt.eos_token_ids).compile(schema)
    stream = None if args.json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    from eagle3.defaults import decoder_from_args, ran_with, ran_with_line

    engine = decoder_from_args(rt, args, args.target)
    ran = ran_with(rt, engine)
    print(f"eagle3 generate: {ran_with_line(ran)}", file=sys.stderr, flush=True)  # stdout keeps the text alone
    res = engine.generate(ids, max_new_tokens=args.max_new_tokens, sampling=sampling,
                          eos_token_ids=rt.eos_token_ids, stop_strings=args.stop or (), on_text=stream,
                          **({"grammar": grammar} if grammar is not None else {}))
    st = res.stats
    if args.json:
        print(json.dumps({
            **ran,
            "text": res.text, "token_ids": res.token_ids, "finish_reason": res.finish_reason,
            "tau": round(st.tau, 4), "acceptance_per_position": [round(a, 4) for a in st.acceptance_per_position],
            "tokens_per_s": round(st.tokens_per_s, 2), "new_tokens": st.new_tokens, "cycles": st.cycles,
            "draft": rt.draft, "spec": rt.spec.to_dict(), "draft_s": round(st.draft_s, 4),
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
    from eagle3.training.vocab import initial_draft_ids

    model, _ = load_target(args.target, dtype="float32", device="cpu")
    vocab = model.get_input_embeddings().weight.shape[0]
    ids, how = initial_draft_ids(vocab, args.draft_vocab_size, args.data, default=DEFAULT_DRAFT_VOCAB_SIZE)
    d = init_drafter(model, seed=args.seed, draft_ids=ids)
    save_drafter(d, args.out, format="speculators")
    print(f"draft vocabulary: {how}; --draft-vocab-size N or full changes it", file=sys.stderr)
    print(f"wrote a random drafter for {args.target} to {args.out} "
          f"(aux layers {d.config.aux_layer_ids}, draft vocab {d.config.draft_vocab_size})")
    return 0


def cmd_export(args) -> int:
    from eagle3.formats import export_drafter, load_target_config
    from eagle3.tuning.cache import engine_flags, serving_choice

    target_config = load_target_config(args.target) if args.target else None  # config only, no weights
    tuned = serving_choice(args.drafter) if Path(args.drafter).is_dir() else None
    shape = tuned[0] if tuned else None
    export_drafter(args.drafter, args.format, args.out, include_embedding=False if args.no_embedding else None,
                   dtype=args.dtype, verifier_name=args.verifier_name, target_config=target_config,
                   speculative_tokens=shape.depth if shape else None)
    print(f"wrote {args.format} checkpoint to {args.out}")
    if shape is not None:
        print(f"tuned on {tuned[1]['key']['device']}: {shape}; {engine_flags(shape)}")
    return 0


def cmd_prepare(args) -> int:
    from eagle3.models import load_tokenizer
    from eagle3.training.inputs import at_least, check_data, check_out_dir, resolve_chat_template
    from eagle3.training.prepare import prepare

    template = resolve_chat_template(args.chat_template)  # inputs and flags first: the tokenizer may download
    at_least("--max-length", args.max_length, 2)
    at_least("--draft-vocab-size", args.draft_vocab_size, 1)
    at_least("--workers", args.workers, 1)
    at_least("--max-rows", args.max_rows, 1)
    check_data(args.data, "prepare")
    check_out_dir(args.out)
    tok, vocab_size = load_tokenizer(args.target)
    mapping = None
    if args.vocab_from:
        from eagle3.formats import read_vocab_mapping

        mapping = read_vocab_mapping(args.vocab_from)
    draft_vocab = args.draft_vocab_size or min(DEFAULT_DRAFT_VOCAB_SIZE, vocab_size)
    report = prepare(tok, args.data, args.out, max_length=args.max_length, length_policy=args.length_policy,
                     draft_vocab_size=draft_vocab, system_prompt=args.system_prompt,
                     num_workers=args.workers, vocab_size=vocab_size, max_rows=args.max_rows,
                     vocab_mapping=mapping, chat_template=template)
    print(json.dumps(report.to_dict() if hasattr(report, "to_dict") else report.__dict__, indent=2, default=str))
    return 0


def cmd_regenerate(args) -> int:
    from eagle3.training.data import PLAIN
    from eagle3.training.inputs import (
        at_least,
        check_data,
        check_out_file,
        needs_template_error,
        resolve_chat_template,
    )
    from eagle3.training.regenerate import EndpointBackend, LocalBackend, regenerate

    # every input and flag before the model loads
    template = resolve_chat_template(args.chat_template)
    if args.endpoint and not args.model:
        raise ConfigError("--endpoint needs --model NAME (the model name the server serves)")
    if not args.endpoint and not args.target:
        raise ConfigError("give --target (local generation) or --endpoint URL --model NAME")
    if args.temperature < 0:
        raise ConfigError(f"--temperature {args.temperature} must be >= 0 (0 = greedy)")
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--batch-size", args.batch_size),
                        ("--concurrency", args.concurrency), ("--max-turns", args.max_turns),
                        ("--max-prompt-tokens", args.max_prompt_tokens), ("--limit", args.limit)):
        at_least(flag, value, 1)
    check_out_file(args.out)
    if any(Path(d).resolve() == Path(args.out).resolve() for d in args.data):
        raise ConfigError(f"the output {args.out} is also an input; write to a new file")
    kinds = check_data(args.data, "regenerate")
    if kinds["chat"] and kinds["completion"]:
        raise ConfigError("--data mixes conversations and completion rows (prompt/text, .txt); regenerate each "
                          "kind in a run of its own")
    if args.endpoint:
        if kinds["completion"]:
            raise ConfigError("completion rows (prompt/text, .txt) are continued as raw text by a local --target; "
                              "an --endpoint answers conversations only")
        if template is not None:
            raise ConfigError("--chat-template applies to local generation (--target); the server uses its own")
        backend = EndpointBackend(args.endpoint, args.model, concurrency=args.concurrency,
                                  api_key=os.environ.get("OPENAI_API_KEY"))
    else:
        from eagle3.models import load_target, load_tokenizer

        if kinds["completion"]:
            template = PLAIN  # completion rows are raw text, whatever the model's template
        elif template is None and not (tok := load_tokenizer(args.target)[0]).chat_template:
            raise needs_template_error(tok, "regenerate")
        model, tok = load_target(args.target, dtype=args.dtype, device=args.device or _default_device())
        backend = LocalBackend(model, tok, max_prompt_tokens=args.max_prompt_tokens, seed=args.seed,
                               engine=args.engine, chat_template=template)
    report = regenerate(args.data, args.out, backend, temperature=args.temperature,
                        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                        max_turns=args.max_turns, limit=args.limit)
    return 0 if not getattr(report, "error", None) else 1


def cmd_synthesize(args) -> int:
    from eagle3.models import load_target
    from eagle3.training.backends import LocalBackend
    from eagle3.training.synthesize import synthesize

    model, tok = load_target(args.target, dtype=args.dtype, device=args.device or _default_device())
    backend = LocalBackend(model, tok, engine=args.engine)
    report = synthesize(backend, args.count, args.out, system=args.system, temperature=args.temperature,
                        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, min_chars=args.min_chars,
                        seed=args.seed)
    return 0 if report.resumed + report.kept >= args.count else 1


def cmd_train(args) -> int:
    from eagle3.training.trainer import TrainConfig, train

    cfg = TrainConfig(
        target=args.target, data=args.data, out=args.out, init=args.init, ttt_steps=args.ttt_steps,
        align_top_k=args.align_top_k, label_temperature=args.label_temperature, step_decay=args.step_decay,
        lr=args.lr, epochs=args.epochs,
        max_steps=args.max_steps, stop_after=args.stop_after, time_budget=args.time_budget,
        batch_size=args.batch_size, batch_tokens=args.batch_tokens, grad_accum=args.grad_accum,
        max_length=args.max_length, packing=args.packing, sort_window=args.sort_window, dtype=args.dtype,
        device=args.device, seed=args.seed,
        save_every=args.save_every, log_every=args.log_every, features=args.features,
        feature_cache=args.feature_cache, resume=args.resume, noise=args.noise, tensorboard=args.tensorboard,
        warmup_ratio=args.warmup_ratio, intermediate_size=args.intermediate_size, aux_layer_ids=args.aux_layers,
        shard_target=args.shard_target, val_fraction=args.val_fraction, compile=False if args.eager else None,
    )
    res = train(cfg)
    print(f"drafter written to {res.drafter_dir} after {res.steps} steps (final loss {res.final_loss})")
    return 0


def cmd_eval(args) -> int:
    from eagle3.evaluate import BENCH_SETS, load_prompt_rows, plot_report, run_dataset
    from eagle3.record import run_record, write_json
    from eagle3.runtime import load_runtime
    from eagle3.training.data import PLAIN
    from eagle3.training.inputs import at_least, check_out_dir, resolve_chat_template

    out = Path(args.out)
    spec = DraftShape.from_flags(args.tree, args.chain)
    # every input and flag before the model loads
    template = resolve_chat_template(args.chat_template)
    at_least("--limit", args.limit, 1)
    at_least("--max-new-tokens", args.max_new_tokens, 1)
    at_least("--temperatures", min(args.temperatures), 0)
    check_out_dir(out)
    datasets = [load_prompt_rows(ds, limit=args.limit) for ds in args.datasets or list(BENCH_SETS)]
    rt = load_runtime(args.target, drafter=args.drafter, draft=args.draft, spec=spec, device=args.device,
                      dtype=args.dtype, engine="fast" if args.fast else args.engine)
    if template is not None:  # plain: no template, prompts as raw text (runtime.encode_messages)
        rt.tokenizer.chat_template = None if template == PLAIN else template
    from eagle3.defaults import decoder_from_args, ran_with, ran_with_line

    rt.engine = decoder_from_args(rt, args, args.target)
    ran = ran_with(rt, rt.engine)
    print(f"eagle3 eval: {ran_with_line(ran)}", flush=True)
    runs = []
    for temp in args.temperatures:
        sampling = SamplingConfig(temperature=temp, seed=args.seed)
        for name, prompts, categories in datasets:
            r = run_dataset(rt, name, prompts, sampling, args.max_new_tokens, categories=categories)
            runs.append(r.to_dict())
            print(f"{name:10s} {r.method:22s} T={temp:<4} tau {r.tau:.3f}  "
                  f"accept/pos {[round(x, 2) for x in r.acceptance_per_position]}  "
                  f"{r.to_dict()['tokens_per_s']} tok/s", flush=True)
            if r.constrained:
                print(f"           valid JSON answers: {r.valid}/{r.constrained}", flush=True)
            if r.tau_by_category:
                print("           by category: " + ", ".join(f"{c} {t:.2f}" for c, t in r.tau_by_category.items()),
                      flush=True)
    settings = getattr(rt.engine, "settings", None)
    report = run_record("eval", target=args.target, drafter=str(args.drafter), draft=rt.draft,
                        spec=rt.spec.to_dict(), max_new_tokens=args.max_new_tokens, limit=args.limit,
                        engine=ran["engine"], dtype=ran["dtype"],
                        engine_settings=settings() if settings is not None else {"engine": "generic"}, runs=runs)
    report["device"]["torch_device"] = ran["device"]  # "device" also describes the machine (run_record)
    write_json(report, out / "eval.json")
    png = plot_report(report, out / "eval.png")
    print(f"report: {out / 'eval.json'}" + (f", chart: {png}" if png else " (pip install 'eagle3[bench]' for a chart)"))
    return 0


def cmd_demo(args) -> int:
    from eagle3.demo import run_demo

    if not args.temperature >= 0:
        raise ConfigError(f"--temperature {args.temperature}: expected 0 (greedy) or more")
    spec = DraftShape.from_flags(args.tree, args.chain)
    summary = run_demo(prompts=args.prompts, max_new_tokens=args.max_new_tokens, spec=spec, device=args.device,
                       drafter=args.drafter, record=args.record, dtype=args.dtype, chain_stop=args.chain_stop,
                       temperature=args.temperature)
    return 0 if summary["identical"] else 1


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build_parser() -> argparse.ArgumentParser:
    from eagle3.training.inputs import CHAT_TEMPLATE_HELP

    p = argparse.ArgumentParser(prog="eagle3", description="EAGLE-3 speculative decoding for HF models")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text, with or without speculation",
                       usage="%(prog)s --target MODEL (--prompt TEXT | --chat TEXT) [--drafter DIR] [options]")
    _add_target(g)
    g.add_argument("--drafter", default=None, metavar="DIR", help="drafter checkpoint directory (speculators or EAGLE format)")
    g.add_argument("--draft", choices=("eagle3", "ngram", "model", "mtp", "none"), default=None,
                   help="draft method (default: eagle3 with --drafter, model with --draft-model, else none; "
                        "mtp: the target's own MTP layer)")
    g.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="a small causal LM with the target's tokenizer as drafter (the target itself: always right)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="raw text prompt (BOS added)")
    src.add_argument("--chat", metavar="TEXT", help="a user message, rendered with the target's chat template")
    _add_decoding(g)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--json-schema", default=None, metavar="FILE",
                   help="constrain the answer to JSON valid under this JSON schema (docs/structured-output.md)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    g.add_argument("--engine", choices=ENGINE_CHOICES, default="auto", help=ENGINE_HELP)
    g.add_argument("--fast", action="store_true", help="same as --engine fast")
    g.add_argument("--no-graphs", action="store_true", help=NO_GRAPHS_HELP)
    g.add_argument("--batch-invariant", action="store_true", help=BATCH_INVARIANT_HELP)
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("init-drafter", help="write a randomly initialised drafter shaped for a target")
    _add_target(i)
    i.add_argument("--out", required=True)
    i.add_argument("--data", default=None, metavar="DIR",
                   help="a folder written by eagle3 prepare: take its draft vocabulary (its most frequent tokens)")
    i.add_argument("--draft-vocab-size", type=draft_vocab_size, default=None, metavar="N|full",
                   help=f"tokens the drafter can propose (default: --data's, else the first {DEFAULT_DRAFT_VOCAB_SIZE}"
                        " ids, at most the target's); full or 0: the whole vocabulary")
    i.add_argument("--seed", type=int, default=0)
    i.set_defaults(func=cmd_init_drafter)

    e = sub.add_parser("export", help="convert a drafter to the speculators (vLLM) or EAGLE (SGLang) format")
    e.add_argument("--drafter", required=True)
    e.add_argument("--format", choices=("speculators", "eagle"), required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--verifier-name", default=None, metavar="NAME",
                   help="the target as `vllm serve` should load it (hub id or path), recorded as the config's "
                        "verifier.name_or_path (default: the name the drafter was made with; a GGUF target's is "
                        "the hub repository its metadata names, else the .gguf path)")
    e.add_argument("--target", default=None, metavar="MODEL",
                   help="the target (folder, hub id, .gguf or bundled name; only its config is read): gives the "
                        "layer count and, for drafters whose config names no aux layers, the EAGLE-3 default "
                        "[2, L//2, L-3]; the drafter is checked against it")
    e.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="the weights' dtype (default: the source's; training writes float32)")
    e.add_argument("--no-embedding", action="store_true",
                   help="leave out the embedding, a copy of the target's that vLLM, SGLang and eagle3 take from the "
                        "target")
    e.set_defaults(func=cmd_export)

    pr = sub.add_parser("prepare", help="tokenize conversations with the target's chat template (or raw text for a "
                        "base model), build loss masks and the draft vocabulary")
    pr.add_argument("--target", required=True, help="the target whose tokenizer and chat template to use")
    add_trust_remote_code(pr)
    pr.add_argument("--data", nargs="+", required=True, help="ShareGPT/OpenAI conversations or text/prompt+completion "
                    "rows: JSON/JSONL (also .gz), parquet, HF datasets folders, or .txt (blank-line-separated documents)")
    pr.add_argument("--chat-template", default=None, metavar="FILE|NAME", help=CHAT_TEMPLATE_HELP)
    pr.add_argument("--out", required=True)
    pr.add_argument("--max-length", type=int, default=2048)
    pr.add_argument("--length-policy", choices=("drop", "truncate"), default="drop")
    pr.add_argument("--draft-vocab-size", type=int, default=None, metavar="N",
                    help=f"default {DEFAULT_DRAFT_VOCAB_SIZE}, or the target's vocabulary where that is smaller")
    pr.add_argument("--vocab-from", default=None, metavar="DRAFTER",
                    help="use this drafter's draft vocabulary (to continue training it with `train --init`)")
    pr.add_argument("--system-prompt", default=None, help="added to conversations that have none")
    pr.add_argument("--workers", type=int, default=1,
                    help="render in this many spawned processes (default 1: one process, whose tokenizer already "
                         "uses all cores)")
    pr.add_argument("--max-rows", type=int, default=None)
    pr.set_defaults(func=cmd_prepare)

    rg = sub.add_parser("regenerate", help="answer every user turn with the target (on-policy training data)")
    rg.add_argument("--target", default=None, help="local generation with this model")
    add_trust_remote_code(rg)
    rg.add_argument("--endpoint", default=None, help="an OpenAI-compatible server URL (vLLM, SGLang, eagle3 serve)")
    rg.add_argument("--model", default=None, help="model name at the endpoint")
    rg.add_argument("--concurrency", type=int, default=16)
    rg.add_argument("--data", nargs="+", required=True, help="conversations to answer, or prompt/text rows and .txt "
                    "files for a base model to continue: the formats prepare reads")
    rg.add_argument("--chat-template", default=None, metavar="FILE|NAME", help=CHAT_TEMPLATE_HELP)
    rg.add_argument("--out", required=True, help="output JSONL (resumable: rerun the same command to continue)")
    rg.add_argument("--temperature", type=float, default=0.0)
    rg.add_argument("--max-new-tokens", type=int, default=512)
    rg.add_argument("--batch-size", type=int, default=32,
                    help="prompts per forward (hf engine) or rows decoding together (fast engine)")
    rg.add_argument("--engine", choices=["auto", "hf", "fast"], default="auto",
                    help="local generation: HF generate, or continuous batching on the static-cache path "
                         "(auto: fast on CUDA for Llama/Mistral/Qwen families)")
    rg.add_argument("--max-turns", type=int, default=None)
    rg.add_argument("--max-prompt-tokens", type=int, default=None)
    rg.add_argument("--limit", type=int, default=None)
    rg.add_argument("--seed", type=int, default=None)
    rg.add_argument("--device", default=None)
    rg.add_argument("--dtype", default="auto")
    rg.set_defaults(func=cmd_regenerate)

    sy = sub.add_parser("synthesize", help="let the target write user prompts (for regenerate to answer) from "
                        "its chat template's user-turn header")
    sy.add_argument("--target", required=True)
    add_trust_remote_code(sy)
    sy.add_argument("--count", type=int, required=True, help="unique prompts wanted in --out")
    sy.add_argument("--out", required=True, help="output JSONL, ShareGPT rows (resumable: rerun to continue)")
    sy.add_argument("--system", default=None, help="system prompt before the user turn (default: the template's)")
    sy.add_argument("--temperature", type=float, default=1.0)
    sy.add_argument("--max-new-tokens", type=int, default=128, help="longest prompt; longer ones are dropped")
    sy.add_argument("--min-chars", type=int, default=16, help="drop prompts shorter than this")
    sy.add_argument("--batch-size", type=int, default=64)
    sy.add_argument("--engine", choices=["auto", "hf", "fast"], default="auto")
    sy.add_argument("--seed", type=int, default=0)
    sy.add_argument("--device", default=None)
    sy.add_argument("--dtype", default="auto")
    sy.set_defaults(func=cmd_synthesize)

    # one set of defaults: the train flags read TrainConfig's
    from eagle3.training.trainer import TrainConfig as tc

    t = sub.add_parser("train", help="train a drafter with training-time test (TTT); torchrun for several processes",
                       usage="%(prog)s --target MODEL --data DIR --out DIR [options]")
    _add_target(t)
    t.add_argument("--data", required=True, metavar="DIR", help="a folder written by eagle3 prepare")
    t.add_argument("--out", required=True, metavar="DIR")
    t.add_argument("--init", default=None, metavar="DRAFTER", help="continue from this drafter checkpoint")
    t.add_argument("--intermediate-size", type=int, default=None, metavar="N",
                   help="MLP width of a fresh drafter (default: the target's); with --init it must match")
    t.add_argument("--aux-layers", type=layer_ids, default=None, metavar="LOW,MID,HIGH",
                   help="target layers feeding a fresh drafter, in HF hidden_states / vLLM numbering "
                        "(default 2,L//2,L-3 for L layers)")
    t.add_argument("--ttt-steps", type=int, default=tc.ttt_steps, metavar="N")
    t.add_argument("--align-top-k", type=int, default=tc.align_top_k, metavar="K",
                   help="score a TTT step's row only where every earlier step's next token was among its K best "
                        "drafts (1: chains; a tree's top_k); 0 (default) scores every row")
    t.add_argument("--label-temperature", type=float, default=tc.label_temperature, metavar="T",
                   help="soft labels softmax(target logits / T): 1 (default) as EAGLE-3 trains; below 1 sharper; "
                        "0 the target's argmax as a hard label")
    t.add_argument("--step-decay", type=float, default=tc.step_decay, metavar="G",
                   help="TTT step k's loss weighs G^k (default 0.8, EAGLE-3's); 1: all steps alike")
    t.add_argument("--lr", type=float, default=tc.lr)
    t.add_argument("--warmup-ratio", type=float, default=tc.warmup_ratio, metavar="R")
    t.add_argument("--epochs", type=int, default=tc.epochs,
                   help="epochs (default: 1, or as many as --max-steps needs; with --time-budget: the most)")
    t.add_argument("--max-steps", type=int, default=None, metavar="N")
    t.add_argument("--stop-after", type=int, default=None, metavar="N", help="stop this run after N steps (resume later)")
    t.add_argument("--time-budget", type=duration_seconds, default=None, metavar="DURATION",
                   help="1200, 90s, 20m, 1.5h: from the first step to the written drafter (loading not counted), "
                        "within half a step; the cosine ends with it")
    t.add_argument("--batch-size", type=int, default=None, metavar="ROWS", help="rows per optimizer step (global)")
    t.add_argument("--batch-tokens", type=int, default=None, metavar="N",
                   help="padded tokens per optimizer step (global)")
    t.add_argument("--grad-accum", type=int, default=tc.grad_accum, metavar="N")
    t.add_argument("--max-length", type=int, default=tc.max_length, metavar="N")
    t.add_argument("--packing", action="store_true")
    t.add_argument("--sort-window", type=int, default=tc.sort_window, metavar="ROWS",
                   help=f"rows sorted by length together before batches are cut: wider pads less (default "
                        f"{tc.sort_window}; --resume needs the value the run started with)")
    t.add_argument("--seed", type=int, default=tc.seed)
    t.add_argument("--save-every", type=int, default=tc.save_every, metavar="STEPS")
    t.add_argument("--log-every", type=int, default=tc.log_every, metavar="STEPS")
    t.add_argument("--features", choices=("online", "offline"), default=tc.features)
    t.add_argument("--feature-cache", default=None, metavar="DIR")
    t.add_argument("--shard-target", action="store_true",
                   help="under torchrun, shard the frozen target over the processes (FSDP), for a target that does "
                        "not fit one device; online features only")
    t.add_argument("--resume", action="store_true")
    t.add_argument("--eager", action="store_true",
                   help="do not compile (default on CUDA: the target's layers and the drafter's norms and MLP are "
                        "inductor-compiled)")
    t.add_argument("--noise", type=float, default=tc.noise)
    t.add_argument("--tensorboard", action="store_true")
    t.add_argument("--val-fraction", type=float, default=tc.val_fraction, metavar="F",
                   help="hold out this share of the samples (e.g. 0.01); their loss and accuracy go to "
                        "val_log.jsonl at every checkpoint")
    t.set_defaults(func=cmd_train)

    ev = sub.add_parser("eval", help="acceptance (tau, per position) on benchmark prompts; JSON report and chart",
                        usage="%(prog)s --target MODEL [--drafter DIR] --out DIR [options]")
    _add_target(ev)
    ev.add_argument("--drafter", default=None, metavar="DIR")
    ev.add_argument("--draft", choices=("eagle3", "ngram", "mtp", "none"), default=None)
    ev.add_argument("--datasets", nargs="+", default=None, metavar="SET",
                    help="bundled sets (mt_bench humaneval gsm8k alpaca sum qa), JSONL or .txt files; default all six")
    ev.add_argument("--chat-template", default=None, metavar="FILE|NAME", help=CHAT_TEMPLATE_HELP)
    ev.add_argument("--limit", type=int, default=None, help="prompts per dataset")
    ev.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7, 1.0], metavar="T",
                    help="greedy (0) and sampled temperatures; default 0 0.7 1 (prompt i samples with seed --seed + i)")
    ev.add_argument("--guard", choices=("auto", "on", "off"), default="off",
                    help="pause drafting where it is slower than plain decoding (default off: eval measures drafts)")
    ev.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, metavar="N")
    ev.add_argument("--seed", type=int, default=0)
    shape = ev.add_mutually_exclusive_group()
    shape.add_argument("--tree", default=None, metavar="DEPTH,TOPK,TOTAL")
    shape.add_argument("--chain", type=int, default=None, metavar="K")
    ev.add_argument("--out", required=True, metavar="DIR", help="folder for eval.json and eval.png")
    ev.add_argument("--engine", choices=ENGINE_CHOICES, default="auto", help=ENGINE_HELP)
    ev.add_argument("--fast", action="store_true", help="same as --engine fast")
    ev.set_defaults(func=cmd_eval)

    dm = sub.add_parser("demo", help="SmolLM2-135M-Instruct with the bundled drafter: plain vs EAGLE-3, "
                        "identical answers, tau and speedup (offline)")
    dm.add_argument("--prompts", type=int, default=3, help="MT-bench prompts to answer")
    dm.add_argument("--max-new-tokens", type=int, default=128)
    dm.add_argument("--device", default="cpu")
    dm.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="auto: bf16 on CUDA, and on CPUs with native bf16, AMX or AVX512-BF16 (there on the "
                         "static-cache fast path with a chain of up to 6 that stops early); fp32 on other CPUs "
                         "(the generic engine, a chain of 2)")
    dm.add_argument("--drafter", default=None, help="another drafter for SmolLM2 (default: the bundled one)")
    shape = dm.add_mutually_exclusive_group()
    shape.add_argument("--tree", default=None, metavar="DEPTH,TOPK,TOTAL")
    shape.add_argument("--chain", type=int, default=None, metavar="K")
    dm.add_argument("--chain-stop", type=float, default=None, metavar="P",
                    help="on the CPU fast path, stop a chain's drafting once its joint draft probability falls "
                         "below P and verify only what was drafted (default: 0.2 with the default chain of up to 6; "
                         "0: the full chain every cycle)")
    dm.add_argument("--temperature", type=float, default=0.0, metavar="T",
                    help="sample at T (prompt i with seed i, both ways; the answers stay identical); default 0")
    dm.add_argument("--record", default="runs/demo.json", help="where to write the run record")
    dm.set_defaults(func=cmd_demo)

    from eagle3.adapt import add_adapt_parser
    from eagle3.bench import add_bench_parser
    from eagle3.check import add_check_parser
    from eagle3.serving.cli import add_serve_parser
    from eagle3.tuning.command import add_tune_parser

    add_check_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    add_tune_parser(sub)
    add_adapt_parser(sub)
    for command in sub.choices.values():
        command.formatter_class = help_formatter
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if getattr(args, "trust_remote_code", False):
        from eagle3.models import set_trust_remote_code

        set_trust_remote_code(True)
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
