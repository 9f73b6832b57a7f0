"""One set of decoding defaults per device, for every command (generate, eval, bench, check, serve, demo).

- CUDA: bf16, the fast engine (static cache, CUDA graphs) where the target's family has one, the EAGLE-2 tree.
- A CPU with native bf16 (AMX or AVX512-BF16), a fast-engine family: bf16 on the fast engine run eagerly, a chain
  of up to 6 that stops where the drafter is unsure. There a few rows cost about what one does, and the fast
  engine's chains give each row the bits of a one-token step, so the output is plain decoding's.
- Other CPUs and families: fp32 on the generic engine with a chain of 2: in fp32 a CPU verifies more than two
  tokens at well over the cost of one.

On a CPU the speculation guard (`eagle3.decoding.guard`) pauses drafting wherever it is slower than plain
decoding. A choice tuned for the device, target and drafter (`eagle3 tune`) replaces the device's draft shape.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from eagle3.config import AUTO_ON_OFF, DEFAULT_CHAIN_LENGTH, ConfigError, DraftShape

log = logging.getLogger("eagle3")

CPU_FP32_SHAPE = DraftShape.chain(2)
CPU_BF16_SHAPE = DraftShape.chain(6)
CPU_BF16_CHAIN_STOP = 0.2  # stop a chain's drafting below this joint draft probability (`FastRows(chain_stop=)`)
CPU_TREE = DraftShape(3, 2, 6)  # the tree `bench` times on a CPU: 6,10,60 verifies 61 rows, several steps' cost there
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Decoding:
    """How a command decodes: resolved from the flags, a tuned choice and the device's defaults."""

    engine: str  # "fast" | "generic"
    shape: DraftShape
    chain_stop: float | None = None  # chains on eager fast cycles: stop drafting below this joint probability
    guard: bool = False  # pause drafting while it is slower than plain decoding
    speculate: bool = True  # False: a tuned choice found plain decoding faster on this device
    source: str = "device defaults"  # "flags", "tuned (PATH)" or "device defaults"

    def describe(self) -> str:
        if not self.speculate:
            return f"plain decoding ({self.source}: speculation does not pay here)"
        shape = (f"chain of up to {self.shape.depth}, stopping below joint draft probability {self.chain_stop:g}"
                 if self.shape.is_chain and self.chain_stop else str(self.shape))
        return f"{shape}{', guarded' if self.guard else ''} ({self.source})"


def native_bf16(device: str | torch.device) -> bool:
    """CUDA, or a CPU that multiplies bf16 natively."""
    from eagle3.fast.target import cpu_has_bf16

    return torch.device(device).type != "cpu" or cpu_has_bf16()


def decoding_dtype(model, device: str | torch.device, dtype: str = "auto", engine: str = "auto") -> torch.dtype:
    """The dtype to decode `model` in: `dtype` unless "auto"; then bf16 on CUDA, bf16 on a CPU with native bf16
    for a fast-engine family (`fast_support`) unless `engine` is "generic", else fp32 (where the generic engine's
    many-row verification rounds like a one-row step)."""
    from eagle3.fast.target import fast_support
    from eagle3.models import resolve_dtype

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if dtype != "auto":
        return resolve_dtype(dtype, device)
    if torch.device(device).type != "cpu":
        return torch.bfloat16
    fast = engine != "generic" and fast_support(model) is None
    return torch.bfloat16 if native_bf16(device) and fast else torch.float32


def load_for_decoding(target: str, device, dtype: str = "auto", engine: str = "auto"):
    """(model, tokenizer) of `target` in its decoding dtype (`decoding_dtype`). On a CPU, "auto" loads in fp32,
    asks the family, and loads again in bf16 where that wins: casting a loaded model would also round the buffers
    HF keeps in fp32 (RoPE's inverse frequencies), a different model from the one loaded in bf16."""
    from eagle3.models import load_target

    model, tok = load_target(target, dtype=dtype, device=device)
    if dtype == "auto":
        want = decoding_dtype(model, device, engine=engine)
        if want != next(model.parameters()).dtype:
            del model
            model, tok = load_target(target, dtype=want, device=device)
    return model, tok


def decoding_for(model, draft: str, shape: DraftShape | None = None, engine: str = "auto",
                 chain_stop: float | None = None, tuned: dict | None = None) -> Decoding:
    """The decoding for a loaded `model` (its device and dtype decide): the flags' `shape` / `engine` /
    `chain_stop` where given, else the `tuned` choice (an `eagle3.tuning` entry), else the device's defaults."""
    from eagle3.fast.engine import FAST_DRAFT_KINDS
    from eagle3.fast.target import fast_support
    from eagle3.target import verifies_chains_only

    param = next(model.parameters())
    cpu = param.device.type == "cpu"
    if engine == "auto":
        fast_ok = draft in FAST_DRAFT_KINDS and fast_support(model) is None
        engine = "fast" if fast_ok and (not cpu or param.dtype == torch.bfloat16) else "generic"
    eager_chain = cpu and engine == "fast" and draft == "eagle3"
    # the guard by default on a CPU only: on an H200 it slowed a good drafter and did not save a random one
    # (docs/benchmarks.md); `--guard on` runs it there
    guard = cpu and draft in ("eagle3", "mtp") and (engine == "generic" or draft == "eagle3")
    if shape is not None:
        stop = chain_stop if chain_stop else None
        return Decoding(engine, shape, stop if eager_chain and shape.is_chain else None, guard, source="flags")
    if tuned is not None:
        choice = tuned["choice"]
        if choice.get("shape") in (None, "plain"):
            return Decoding(engine, DraftShape.chain(1), guard=False, speculate=False,
                            source=f"tuned ({tuned.get('path', 'cache')})")
        tshape = DraftShape.from_dict(choice["shape"])
        stop = choice.get("chain_stop") if eager_chain and tshape.is_chain else None
        return Decoding(engine, tshape, stop, guard, source=f"tuned ({tuned.get('path', 'cache')})")
    if not cpu:  # a hybrid target verifies chains only (`eagle3.target.verifies_chains_only`)
        chains = verifies_chains_only(model)
        return Decoding(engine, DraftShape.chain(DEFAULT_CHAIN_LENGTH) if chains else DraftShape(), None, guard)
    if eager_chain:
        stop = CPU_BF16_CHAIN_STOP if chain_stop is None else (chain_stop or None)
        return Decoding(engine, CPU_BF16_SHAPE, stop, guard)
    return Decoding(engine, CPU_FP32_SHAPE if param.dtype == torch.float32 else CPU_BF16_SHAPE, None, guard)


def device_tree(device: str | torch.device) -> DraftShape:
    """The tree shape for `device` where a command times a tree without being given one: EAGLE-2's 6,10,60 on a
    GPU, a small tree on a CPU (docs/tuning.md)."""
    return DraftShape() if torch.device(device).type != "cpu" else CPU_TREE


def with_flags(decoding: Decoding, guard: str = "auto") -> Decoding:
    """`decoding` with an auto/on/off `--guard` flag applied."""
    if guard not in AUTO_ON_OFF:
        raise ConfigError(f"--guard {guard!r}: expected auto, on or off")
    on = AUTO_ON_OFF[guard]
    return decoding if on is None else replace(decoding, guard=on and decoding.speculate)


def tuned_choice(model, target: str, drafter_dir, engine: str, temperature: float = 0.0) -> dict | None:
    """The `eagle3 tune` entry for this device, dtype, engine, target and drafter (drafter folder first, then the
    user cache), its "choice" the one tuned at the temperature nearest `temperature`, with "path" added; None when
    there is none or it was measured for other weights or versions."""
    from pathlib import Path

    from eagle3.tuning.cache import drafter_store, tuning_key, user_store

    if drafter_dir is None or not Path(drafter_dir).is_dir():
        return None
    param = next(model.parameters())
    cfg = getattr(model.config, "to_dict", lambda: {})()
    key = tuning_key(str(param.device), str(param.dtype).removeprefix("torch."), engine, str(target), cfg,
                     drafter_dir)
    for store in (drafter_store(drafter_dir), user_store()):
        entry = store.lookup(key)
        if entry is not None:
            near = min(entry["choices"], key=lambda t: abs(float(t) - temperature))
            return {**entry, "choice": entry["choices"][near], "path": str(store.path)}
    return None


def decoder_from_args(rt, args, target: str):
    """The engine a command's flags ask for (`--tree`/`--chain`, `--engine`, `--guard`, `--no-graphs`),
    each flag left out resolved by `decoding_for`; logs what has no effect."""
    from eagle3.fast.engine import FastOptions
    from eagle3.runtime import decoder

    shape = DraftShape.from_flags(getattr(args, "tree", None), getattr(args, "chain", None))
    engine = "fast" if getattr(args, "fast", False) else getattr(args, "engine", "auto")
    chain_stop = getattr(args, "chain_stop", None)
    d = decoding_for(rt.model, rt.draft, shape=shape, engine=engine, chain_stop=chain_stop)
    if shape is None and rt.draft == "eagle3":
        temperature = getattr(args, "temperature", None) or min(getattr(args, "temperatures", None) or [0.0])
        tuned = tuned_choice(rt.model, target, getattr(args, "drafter", None), d.engine, temperature)
        if tuned is not None:
            d = decoding_for(rt.model, rt.draft, engine=d.engine, tuned=tuned)
    d = with_flags(d, getattr(args, "guard", "auto"))
    if d.engine == "generic":
        if getattr(args, "no_graphs", False):
            log.warning("--no-graphs has no effect: decoding runs on the generic engine (it applies to the "
                        "static-cache fast path of Llama/Mistral/Qwen targets)")
        return decoder(rt, d)
    options = FastOptions(graphs=not getattr(args, "no_graphs", False),  # the variants: library options only
                          batch_invariant=getattr(args, "batch_invariant", False))
    if options.graphs and next(rt.model.parameters()).device.type == "cuda":
        d = replace(d, chain_stop=None)  # it acts between draft steps: eager cycles only
    return decoder(rt, d, options)


def ran_with(rt, engine) -> dict:
    """What decoding ran on: {"engine": "fast" | "generic", "dtype", "device", "drafting"} (text and JSON)."""
    param = next(rt.model.parameters())
    settings = getattr(engine, "settings", None)
    return {"engine": settings()["engine"] if settings is not None else "generic",
            "dtype": str(param.dtype).removeprefix("torch."), "device": str(param.device),
            "drafting": rt.decoding.describe() if rt.decoding is not None and rt.draft != "none" else "none"}


def ran_with_line(ran: dict) -> str:
    return f"{ran['engine']} engine, {ran['dtype']} on {ran['device']}; drafting: {ran['drafting']}"
