"""`eagle3 serve`: flags into `ServeConfig` and `SpecPolicy`, load the target and drafter, run uvicorn.

Wire into `eagle3.cli.build_parser` with `add_serve_parser(sub)`; the subcommand calls `cmd_serve(args)`.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3.config import (
    DEFAULT_CHAIN_LENGTH,
    DEFAULT_MAX_NEW_TOKENS,
    ConfigError,
    DraftShape,
    on_for_device,
    require_extra,
)
from eagle3.serving.config import ServeConfig
from eagle3.serving.policy import SpecPolicy

if TYPE_CHECKING:
    from eagle3.defaults import Decoding

__all__ = ["add_serve_parser", "cmd_serve", "describe", "fast_rows", "load_server",
           "served_model_name", "serving_decoding"]

log = logging.getLogger("eagle3")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    s = subparsers.add_parser(
        "serve", help="OpenAI-compatible server with batched speculative decoding",
        usage="%(prog)s --target MODEL [--drafter DIR] [--port N] [options]",
        description="Serves /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics.")
    s.add_argument("--target", required=True, metavar="MODEL",
                   help="local HF folder, hub id, .gguf file, or bundled name (smollm2, stories260k)")
    from eagle3.cli import add_trust_remote_code  # here: eagle3.cli imports this module inside build_parser

    add_trust_remote_code(s)
    s.add_argument("--drafter", default=None, metavar="DIR",
                   help="EAGLE-3 drafter checkpoint (speculators or EAGLE format)")
    s.add_argument("--draft", choices=("eagle3", "mtp", "ngram", "none"), default=None, metavar="KIND",
                   help="eagle3, mtp (the target's own multi-token-prediction layer), ngram or none (default: eagle3 "
                        "with --drafter, else none)")
    s.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    s.add_argument("--dtype", default="auto", help="auto (the dtype every command decodes in on this device: bf16 on "
                   "CUDA and on CPUs with native bf16 for the fast path's families, else fp32), float32, bfloat16, "
                   "float16")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the id requests must name (default: --target; a local path's file stem)")
    s.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file, for targets whose tokenizer has none")
    s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    s.add_argument("--record", default=None, metavar="DIR",
                   help="record requests as Parquet, for eagle3 adapt (\"store\": false opts out)")
    s.add_argument("--admin-token", default=None, metavar="TOKEN",
                   help="bearer token for /admin/drafter, live drafter swaps (env EAGLE3_ADMIN_TOKEN)")
    b = s.add_argument_group("batching")
    b.add_argument("--max-batch-size", type=int, default=ServeConfig.max_batch_size, metavar="N",
                   help="rows decoded together")
    b.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="prompt + completion tokens (default: the target's max_position_embeddings)")
    b.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, metavar="N",
                   help="completion length when a request sets no max_tokens")
    b.add_argument("--max-prefill-tokens", type=int, default=ServeConfig.max_prefill_tokens, metavar="N",
                   help="padded prompt tokens per batched prefill")
    b.add_argument("--admit-wait", type=float, default=ServeConfig.admit_wait, metavar="X",
                   help="wait up to X prefill durations for others to share a new prefill (0: none)")
    b.add_argument("--stream-interval", type=int, default=ServeConfig.stream_interval, metavar="N",
                   help="stream a chunk every N tokens (the first and the last at once)")
    b.add_argument("--max-waiting", type=int, default=ServeConfig.max_waiting, metavar="N",
                   help="queued requests before answering 503")
    b.add_argument("--shutdown-timeout", type=float, default=ServeConfig.shutdown_timeout, metavar="S",
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM")
    sp = s.add_argument_group("speculation")
    shape = sp.add_mutually_exclusive_group()
    shape.add_argument("--tree", default=None, metavar="DEPTH,TOPK,TOTAL",
                       help=f"largest draft tree at small batch sizes (default {DraftShape().text}; CPU: chain 2)")
    shape.add_argument("--chain", type=int, default=None, metavar="K",
                       help=f"draft chains of at most K tokens instead of trees (e.g. {DEFAULT_CHAIN_LENGTH})")
    sp.add_argument("--no-spec", action="store_true", help="plain batched decoding (load no drafter)")
    sp.add_argument("--spec-budget", type=int, default=None, metavar="N",
                    help="verified tokens per batched forward (default 256 GPU, 32 CPU, 512 fast rows)")
    sp.add_argument("--spec-max-batch", type=int, default=None, metavar="B",
                    help="no speculation above this batch size")
    sp.add_argument("--no-spec-gate", action="store_true",
                    help="speculate wherever the budget allows, even where measured slower")
    fp = s.add_argument_group("static-cache fast paths (targets of the Llama/Mistral/Qwen families)")
    fp.add_argument("--fast-rows", choices=("auto", "on", "off"), default="auto",
                    help="requests decode as rows of a static-cache batch, one CUDA graph per batch size on a GPU "
                         "(auto: wherever `eagle3 generate` takes the fast engine)")
    fp.add_argument("--fast-rows-len", type=int, default=ServeConfig.fast_rows_len, metavar="N",
                    help="cache slots per fast row; longer requests use the HF rows")
    s.set_defaults(func=cmd_serve)
    return s


def served_model_name(target: str) -> str:
    """The model id `--served-model-name` defaults to: `target` as given for a hub id or a bundled name; for a
    local path, the folder's name, or the file's stem for a .gguf (clients never see the server's paths)."""
    path = Path(target).expanduser()
    if path.is_file():
        return path.stem
    if path.is_dir():
        return path.resolve().name or target
    return target


def load_server(args):
    """(scheduler, app) for parsed `serve` flags: loads the target and drafter."""
    import torch

    from eagle3.decoding.drafters import Eagle3BatchDrafter, ProposerBatchDrafter
    from eagle3.decoding.proposers import NgramProposer
    from eagle3.defaults import load_for_decoding
    from eagle3.runtime import drafter_for, eos_token_ids
    from eagle3.serving.app import create_app
    from eagle3.serving.policy import default_token_budget
    from eagle3.serving.server import build_scheduler
    from eagle3.target import Target

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    draft = "none" if args.no_spec else (args.draft or ("eagle3" if args.drafter else "none"))
    if draft == "eagle3" and not args.drafter:
        raise ConfigError("--draft eagle3 needs --drafter DIR (or use --draft ngram / --no-spec)")
    # the dtype and drafting every command takes on this device (`eagle3.defaults`)
    model, tokenizer = load_for_decoding(args.target, device, args.dtype,
                                         engine="generic" if draft == "mtp" else "auto")
    decoding = serving_decoding(model, draft, args.target, args.drafter, DraftShape.from_flags(args.tree, args.chain))
    spec = decoding.shape
    template = None
    if args.chat_template:
        path = Path(args.chat_template)
        if not path.is_file():
            raise ConfigError(f"--chat-template {path}: no such file")
        template = path.read_text(encoding="utf-8")
    config = ServeConfig(
        model_name=args.served_model_name or served_model_name(args.target), max_batch_size=args.max_batch_size,
        max_model_len=args.max_model_len, default_max_tokens=args.default_max_tokens,
        max_prefill_tokens=args.max_prefill_tokens, admit_wait=args.admit_wait, max_waiting=args.max_waiting,
        stream_interval=args.stream_interval,
        shutdown_timeout=args.shutdown_timeout, chat_template=template, fast_rows_len=args.fast_rows_len,
        record=args.record, admin_token=args.admin_token or os.environ.get("EAGLE3_ADMIN_TOKEN") or None)
    policy = SpecPolicy(
        spec, token_budget=args.spec_budget or default_token_budget(device), max_batch=args.spec_max_batch,
        measure=not args.no_spec_gate)
    drafter, d = None, None
    aux_ids: list[int] = []
    if draft == "eagle3":
        d = drafter_for(model, args.drafter)
        aux_ids = d.config.aux_layer_ids
        drafter = Eagle3BatchDrafter(d)
    elif draft == "mtp":  # batched like EAGLE-3, on the HF rows (`eagle3.decoding.mtp`)
        from eagle3.decoding.mtp import mtp_aux_id, mtp_drafter

        drafter, aux_ids = Eagle3BatchDrafter(mtp_drafter(model, args.target)), [mtp_aux_id(model)]
    elif draft == "ngram":
        drafter = ProposerBatchDrafter(lambda _prompt: NgramProposer(length=spec.depth, device=device), device)
    if drafter is None or not decoding.speculate:  # nothing drafts, or `eagle3 tune` found plain decoding faster
        policy = SpecPolicy(largest=None)
    target = Target(model, aux_ids)
    fast_batch = args.fast_rows
    if draft in ("mtp", "ngram"):  # the fast rows draft with EAGLE-3 only: the others draft on the HF rows
        if fast_batch == "on":
            raise ConfigError(f"--draft {draft} drafts on the HF rows: leave --fast-rows at auto or off")
        fast_batch = "off"
    rows = fast_rows(fast_batch, model, d if draft == "eagle3" else None, policy, config, device,
                     token_budget=args.spec_budget, decoding=decoding)
    sched = build_scheduler(target, tokenizer, eos_token_ids(model, tokenizer), drafter=drafter, policy=policy,
                            config=config, rows=rows)
    if draft == "eagle3":
        sched.loaded.path = str(args.drafter)
    return sched, create_app(sched)


def serving_decoding(model, draft: str, target: str, drafter_dir, shape: DraftShape | None) -> Decoding:
    """How the server drafts for one request: the flags' `shape`, else `eagle3 tune`'s choice for this device,
    else the device's defaults, on the engine `eagle3 generate` would take (`eagle3.defaults.decoding_for`)."""
    from eagle3.defaults import decoding_for, tuned_choice

    engine = decoding_for(model, draft).engine
    tuned = tuned_choice(model, target, drafter_dir, engine) if draft == "eagle3" and shape is None else None
    return decoding_for(model, draft, shape=shape, engine=engine, tuned=tuned)


def fast_rows(choice: str, model, drafter, policy: SpecPolicy, config: ServeConfig, device: str,
              token_budget: int | None = None, fuse_pointwise: bool | str | None = None,
              decoding: Decoding | None = None):
    """The server's `FastRows` (requests on the static-cache batch), captured and ready, or None (see
    `--fast-rows`). The draft shape per batch size is `policy`'s with `token_budget` (default:
    `default_token_budget(device, fast_rows=True)`).
    "auto" builds them where `decoding` (`serving_decoding`) runs on the fast engine (CUDA, and CPUs decoding in
    bf16), and takes its chain stop (eager cycles on a CPU); without `decoding`, on CUDA."""
    on = on_for_device(choice, device)
    if choice == "auto" and decoding is not None:
        on = decoding.engine == "fast"
    if not on:
        return None
    from dataclasses import replace

    import torch

    from eagle3.fast.families import fast_support
    from eagle3.fast.rows import FastRows
    from eagle3.fast.rows_prefill import prefill_buckets, prefill_staging_tokens
    from eagle3.fast.target import FastTarget
    from eagle3.serving.policy import default_token_budget

    reason = fast_support(model)
    if reason is not None:
        if choice == "on":
            raise ConfigError(f"--fast-rows on: this target cannot use the fast path ({reason}); use --fast-rows off")
        log.warning("fast rows off: %s", reason)
        return None
    drafter = drafter if policy.enabled else None
    target = FastTarget(model, sorted(drafter.config.aux_layer_ids) if drafter is not None else [])
    target.fuse_pointwise(level=fuse_pointwise)  # None or "auto": elementwise on CUDA (`fuse_level`)
    limit = config.max_model_len or int(getattr(model.config, "max_position_embeddings", 0) or config.fast_rows_len)
    seq_len = min(config.fast_rows_len, limit + 128)  # a cycle may write past the last token

    rows_policy = replace(policy, token_budget=token_budget or default_token_budget(device, fast_rows=True))
    where = f"{config.max_batch_size} rows x {seq_len} slots"
    if torch.device(device).type == "cpu":  # host memory: an allocation too large fails late or wakes the OOM killer
        from eagle3.fast.cpu import available_memory

        need = 2 * target.num_layers * config.max_batch_size * target.nkv * seq_len * target.hd * target.dtype.itemsize
        free = available_memory()
        if free is not None and need > free // 2:
            why = (f"the fast rows' caches ({where}, {need / 2**30:.1f} GiB) would take more than half of this "
                   f"machine's available memory ({free / 2**30:.1f} GiB)")
            if choice == "on":
                raise ConfigError(f"{why}: lower --max-batch-size or --fast-rows-len, or use --fast-rows off")
            log.warning("fast rows off: %s; lower --max-batch-size or --fast-rows-len to use them", why)
            return None

    try:
        staging = prefill_staging_tokens(config.max_prefill_tokens)
        stop = decoding.chain_stop if decoding is not None and drafter is not None else None
        rows = FastRows(target, drafter, capacity=config.max_batch_size, seq_len=seq_len, shapes=rows_policy.shape,
                        prefill_tokens=staging, chain_stop=stop)
        seconds = rows.prepare()
    except torch.OutOfMemoryError as e:
        raise ConfigError(f"the fast rows' caches ({where}) do not fit on "
                          f"{device} with their prefill staging ({staging} tokens): lower --fast-rows-len, --max-batch-size or "
                          "--max-prefill-tokens, or use --fast-rows off") from e
    log.info("fast rows: %d rows x %d slots (%.2f GiB of cache), %d cycles and %d prefill shapes prepared in "
             "%.1f s", rows.capacity, seq_len, rows.cache_bytes() / 2**30, rows.cycles_prepared,
             len(prefill_buckets(rows)), seconds)
    return rows


def describe(sched) -> str:
    """One line on what the server will do, printed at start (what speculates, how, and where)."""
    p = sched.policy
    if not p.enabled:
        spec = "plain batched decoding (no drafter)"
    else:
        spec = (f"drafter {sched.drafter.name}, up to a {p.largest}, token budget {p.token_budget}, "
                f"speed gate {'on' if p.measure else 'off'}")
    rows = "off" if sched.fast_rows is None else f"on ({sched.fast_rows.seq_len} slots each)"
    return (f"eagle3 serve: {sched.config.model_name} on {sched.target.device}; {spec}; "
            f"max batch {sched.config.max_batch_size}; fast rows {rows}")


def cmd_serve(args) -> int:
    import sys

    require_extra("serve", ("fastapi", "uvicorn", "prometheus_client"), "eagle3 serve")
    import uvicorn

    sched, app = load_server(args)
    print(describe(sched), file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=max(1, int(args.shutdown_timeout)))
    return 0
