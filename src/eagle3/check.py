"""`eagle3 check`: a pre-flight check of a drafter against a target, before it is shipped or served.

The costly failures of EAGLE-3 deployments are silent: a drafter loaded with the wrong aux layers, a missing
`d2t`, the wrong target or an untrained head still runs, and only the acceptance (tau near 1) gives it away.
This command loads the pair the way every eagle3 command does (refusing what cannot match), then:

0. **tokenizer**: encodes a short text and compares what the tokenizer adds (BOS, EOS) and whether it has a chat
   template with what the target's files say (a GGUF's metadata, a folder's tokenizer config); a difference is a
   warning, since a model fed text without its BOS degrades while both decodings still agree.
1. **lossless**: answers a few prompts greedily with plain decoding and with the drafter; the token ids must be
   identical. In float32 any difference is a failure; in bf16/fp16 a difference can be a rounding near-tie (the
   verification of many tokens at once reduces in another order), so it is a warning that says so.
2. **acceptance**: tau and per-position acceptance on the same answers. Tau below `MIN_TAU` fails (the drafter is
   not predicting this target); below `PROFILE_TOLERANCE` x the checkpoint's own acceptance profile, measured
   under the same settings, it fails too (the pair works, but not as well as when the profile was measured).
3. `--write-profile` stores the measured acceptance in the drafter's `config.json` (`eagle3.acceptance_profile`,
   kept by export), so the next check, on another machine or after a conversion, has a reference.

Every finding goes to a JSON report with a run record; the exit status is 1 when anything failed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from eagle3.config import ConfigError, DraftShape, SamplingConfig
from eagle3.decoding.drafters import Eagle3Proposer
from eagle3.decoding.engine import SpeculativeEngine
from eagle3.evaluate import RunResult, load_prompts, method_name

# below this the drafter is (nearly) never right: a misconfiguration, not a weak drafter. A working drafter is
# well above it, a misconfigured one (e.g. loaded with the wrong norm_before_residual) barely above 1
# (docs/vllm-sglang.md).
MIN_TAU = 1.2
PROFILE_TOLERANCE = 0.8  # a measured tau below this share of the profile's fails
# what must match for a tau to be compared with the profile's (the prompts by content, not by file name)
PROFILE_SETTINGS = ("prompts_sha256", "max_new_tokens", "spec", "chain_stop", "dtype")


@dataclass
class Finding:
    check: str  # "tokenizer" | "load" | "lossless" | "acceptance" | "profile"
    status: str  # "pass" | "warn" | "fail"
    message: str


@dataclass
class CheckReport:
    findings: list[Finding] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    acceptance: dict[str, Any] | None = None
    identical: int = 0
    prompts: int = 0

    def add(self, check: str, status: str, message: str) -> None:
        self.findings.append(Finding(check, status, message))

    @property
    def ok(self) -> bool:
        return all(f.status != "fail" for f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "settings": self.settings, "identical": self.identical, "prompts": self.prompts,
                "acceptance": self.acceptance, "findings": [asdict(f) for f in self.findings]}


class _Collect(logging.Handler):
    """Keeps the warnings the loaders log (RoPE or dtype differences) for the report."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run_check(target: str, drafter: str | Path, device: str = "cpu", dtype: str = "auto", dataset: str | None = None,
              limit: int | None = None, max_new_tokens: int | None = None, spec: DraftShape | None = None,
              print_fn=print) -> tuple[CheckReport, Any]:
    """Load, then check losslessness and acceptance (module docstring). Returns the report and the loaded drafter
    (None when loading failed). Settings not given come from the drafter's profile, else the defaults."""
    from eagle3.defaults import decoding_for, load_for_decoding
    from eagle3.formats import load_drafter
    from eagle3.models import tokenizer_expectations
    from eagle3.runtime import Runtime, decoder, encode_messages, eos_token_ids
    from eagle3.target import Target
    from eagle3.tokenizer_facts import tokenizer_findings

    report = CheckReport()
    model, tok = load_for_decoding(target, device, dtype)  # every command's dtype here (`eagle3.defaults`)
    # a tokenizer that lost its BOS passes every other check (both decodings share it): compare with the files.
    # Agreement is told on the load line; each disagreement is a "tokenizer" warning after it
    tokenizer = tokenizer_findings(tok, tokenizer_expectations(target))
    tokenizer_ok = "; ".join(m for s, m in tokenizer if s == "pass")
    tokenizer_warnings = [m for s, m in tokenizer if s != "pass"]
    collect = _Collect()
    formats_log = logging.getLogger("eagle3.formats")
    formats_log.addHandler(collect)
    try:
        d = load_drafter(drafter, target_config=model.config, target_embedding=model.get_input_embeddings().weight,
                         device=next(model.parameters()).device, dtype=next(model.parameters()).dtype)
    except ConfigError as e:
        report.add("load", "fail", f"the drafter does not fit this target: {e}")
        for message in tokenizer_warnings:
            report.add("tokenizer", "warn", message)
        return report, None
    finally:
        formats_log.removeHandler(collect)
    cfg = d.config
    # a bf16 drafter under an fp32 target is normal on CPU (it is cast); other loader warnings (RoPE) are not
    concerns = [m for m in collect.messages if "torch_dtype" not in m]
    report.add("load", "warn" if concerns else "pass",
               f"aux layers {cfg.aux_layer_ids} of {cfg.target_num_layers}, draft vocabulary {cfg.draft_vocab_size} "
               f"of {cfg.vocab_size}" + "".join(f"; {m}" for m in collect.messages)
               + (f"; tokenizer: {tokenizer_ok}" if tokenizer_ok else ""))
    for message in tokenizer_warnings:
        report.add("tokenizer", "warn", message)

    profile = dict(cfg.acceptance_profile or {})
    if "spec" in profile:  # in the form `to_dict` writes today (a stored tree 5,1,5 is the chain 5)
        profile["spec"] = DraftShape.from_dict(profile["spec"]).to_dict()
    dtype_name = str(next(model.parameters()).dtype).removeprefix("torch.")
    decoding = decoding_for(model, "eagle3")  # the device's defaults: what generate and serve draft here
    # the profile's drafting where it was measured in this dtype (a profile from another device's dtype says
    # nothing about this one: the device's defaults run, and the profile is reported as not compared)
    use_profile = spec is None and "spec" in profile and profile.get("dtype") == dtype_name
    given = spec or (DraftShape.from_dict(profile["spec"]) if use_profile else None)
    if given is not None:
        stop = profile.get("chain_stop") if use_profile else None
        decoding = decoding_for(model, "eagle3", shape=given, chain_stop=stop or 0)
    spec = decoding.shape
    settings = {"dataset": dataset or profile.get("dataset", "mt_bench"),
                "limit": profile.get("limit", 4) if limit is None else limit,
                "max_new_tokens": profile.get("max_new_tokens", 64) if max_new_tokens is None else max_new_tokens,
                "spec": spec.to_dict(), "chain_stop": decoding.chain_stop, "dtype": dtype_name, "device": device}
    if settings["limit"] < 1 or settings["max_new_tokens"] < 1:
        raise ConfigError(f"--limit {settings['limit']} and --max-new-tokens {settings['max_new_tokens']} must be >= 1")
    name, prompts = load_prompts(settings["dataset"], settings["limit"])
    if not prompts:
        raise ConfigError(f"no prompts in {settings['dataset']!r}: the check needs at least one")
    settings["prompts_sha256"] = hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest()
    report.settings = settings

    tgt = Target(model, cfg.aux_layer_ids)
    rt = Runtime(model, tok, tgt, SpeculativeEngine(tgt, Eagle3Proposer(d, spec), tok), d, spec, "eagle3")
    plain = decoder(rt, replace(decoding, speculate=False))
    eagle = decoder(rt, replace(decoding, guard=False))  # every cycle drafts: the drafter is what is checked
    settings["engine"] = decoding.engine
    settings["drafting"] = decoding.describe().replace(", guarded", "")
    eos = eos_token_ids(model, tok)
    result = RunResult(dataset=name, method=method_name("eagle3", spec), temperature=0.0)
    mismatches = []
    plain_s = eagle_s = 0.0
    steps = {"plain_s": 0.0, "plain_steps": 0, "draft_s": 0.0, "verify_s": 0.0, "cycles": 0}  # where time goes
    t0 = time.perf_counter()
    for i, msgs in enumerate(prompts):
        ids = encode_messages(tok, msgs)
        a = plain.generate(ids, max_new_tokens=settings["max_new_tokens"], sampling=SamplingConfig(),
                           eos_token_ids=eos)
        b = eagle.generate(ids, max_new_tokens=settings["max_new_tokens"], sampling=SamplingConfig(),
                           eos_token_ids=eos)
        result.add(b.stats)
        plain_s += a.stats.total_s
        eagle_s += b.stats.total_s
        steps["plain_s"] += a.stats.verify_s
        steps["plain_steps"] += a.stats.cycles
        steps["draft_s"] += b.stats.draft_s
        steps["verify_s"] += b.stats.verify_s
        steps["cycles"] += b.stats.cycles
        if a.token_ids == b.token_ids:
            report.identical += 1
        else:
            first = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y),
                         min(len(a.token_ids), len(b.token_ids)))
            mismatches.append(f"prompt {i} differs from token {first} on")
        print_fn(f"  prompt {i + 1}/{len(prompts)}: {'identical' if a.token_ids == b.token_ids else 'DIFFERENT'}, "
                 f"tau {b.stats.tau:.2f}")
    tgt.close()
    result.seconds = eagle_s
    report.prompts = len(prompts)
    # the same answers timed both ways on this device (the first prompt includes warm-up for both engines)
    report.acceptance = {**result.to_dict(), "seconds": round(time.perf_counter() - t0, 2),
                         "plain_tokens_per_s": round(result.new_tokens / plain_s, 2) if plain_s else 0.0,
                         "speedup": round(plain_s / eagle_s, 3) if eagle_s else 0.0}

    if not mismatches:
        report.add("lossless", "pass", f"greedy output identical to plain decoding on {len(prompts)}/{len(prompts)} "
                                       "prompts")
    elif dtype_name == "float32":
        report.add("lossless", "fail", f"greedy output differs from plain decoding in float32 ({'; '.join(mismatches)}). "
                                       "Verifying several tokens at once can move a logit by ~1e-5 even in float32, "
                                       "so an exact near-tie can flip; on other prompts or repeated, a difference "
                                       "means speculation changed the output: please report it")
    else:
        report.add("lossless", "warn", f"{len(mismatches)}/{len(prompts)} answers differ from plain decoding in "
                                       f"{dtype_name} ({'; '.join(mismatches)}); verifying many tokens at once rounds "
                                       "differently from one at a time and can flip a near-tie. Rerun with "
                                       "--dtype float32 for an exact check")

    tau = result.tau
    per_pos = ", ".join(f"{x:.2f}" for x in result.acceptance_per_position)
    if tau < MIN_TAU:
        report.add("acceptance", "fail",
                   f"tau {tau:.2f} (acceptance per position {per_pos}): the drafter almost never predicts this "
                   "target. Likely causes: a drafter trained for another target or tokenizer, wrong aux layer ids "
                   "(the ids must be those it was trained with), a norm placement it was not trained with "
                   "(norm_before_residual, which vLLM assumes true when the key is missing), a wrong d2t map, "
                   "or an untrained drafter")
    else:
        report.add("acceptance", "pass", f"tau {tau:.2f}, acceptance per position {per_pos}")
        report.add(*speed_finding(report.acceptance["speedup"], tau, steps, spec, decoding.engine))
    if profile:
        same = all(profile.get(k) == settings[k] for k in PROFILE_SETTINGS)
        if not same:
            differ = [k for k in PROFILE_SETTINGS if profile.get(k) != settings[k]]
            report.add("profile", "warn", f"the drafter's acceptance profile was measured with other {', '.join(differ)} "
                                          f"(dataset {profile.get('dataset')!r}, limit {profile.get('limit')}, "
                                          f"{profile.get('max_new_tokens')} tokens, {profile.get('spec')}, "
                                          f"{profile.get('dtype')}); not compared. Pass the profile's settings to compare "
                                          "(--dtype, --chain/--tree, --dataset, --limit, --max-new-tokens), or "
                                          "--write-profile to store this run's")
        elif tau < PROFILE_TOLERANCE * profile["tau"]:
            report.add("profile", "fail", f"tau {tau:.2f} is below {PROFILE_TOLERANCE:.0%} of the {profile['tau']:.2f} "
                                          f"this drafter reached when its profile was measured "
                                          f"({profile.get('measured_utc', '?')}, {profile.get('device', '?')}): "
                                          "the pair is misconfigured here, or the target is not the one it was "
                                          "trained for")
        else:
            report.add("profile", "pass", f"tau {tau:.2f} against the profile's {profile['tau']:.2f}")
    return report, d


def speed_finding(speedup: float, tau: float, steps: dict, spec: DraftShape,
                  engine: str = "generic") -> tuple[str, str, str]:
    """The "speed" finding: pass where speculation beat plain decoding on this device; else a warning that names
    where a cycle's time went (drafting or verifying, in plain decoding steps) against the tau it bought."""
    note = f"(the {engine} engine, every cycle drafting; generate and serve pause drafting where it loses)"
    if speedup >= 1.0:
        return "speed", "pass", f"{speedup:.2f}x plain decoding on this device {note}"
    step = steps["plain_s"] / steps["plain_steps"] if steps["plain_steps"] else 0.0
    if not (step > 0 and steps["cycles"]):
        return "speed", "warn", f"{speedup:.2f}x plain decoding on this device: speculation loses here {note}"
    draft, verify = (steps[k] / steps["cycles"] / step for k in ("draft_s", "verify_s"))  # in plain steps
    if draft == 0:  # the fast engine runs a cycle as one piece
        parts, cause = "drafting and verification in one piece", "the cycle"
    else:
        parts = f"drafting {draft:.2f}, verification {verify:.2f}"
        cause = "drafting" if draft >= verify - 1.0 else "verifying several tokens at once"
    return "speed", "warn", (
        f"{speedup:.2f}x plain decoding on this device: a cycle emits {tau:.2f} tokens but costs "
        f"{draft + verify:.2f} plain steps ({parts}); {cause} costs more than the accepted tokens save. "
        f"`eagle3 tune` picks the shape that pays here (or plain decoding); try a shorter draft than {spec}, "
        f"bf16 on a CPU that has it natively, or a GPU {note}")


def write_profile(drafter_dir: str | Path, report: CheckReport) -> Path:
    """Store the measured acceptance in `drafter_dir/config.json` under `eagle3.acceptance_profile`, atomically."""
    path = Path(drafter_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: --write-profile needs a drafter folder")
    from eagle3 import __version__

    config = json.loads(path.read_text())
    acc = report.acceptance or {}
    config.setdefault("eagle3", {})["acceptance_profile"] = {
        **{k: report.settings[k] for k in ("dataset", "limit", *PROFILE_SETTINGS, "device")},
        "tau": acc.get("tau"), "acceptance_per_position": acc.get("acceptance_per_position"),
        "measured_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "eagle3_version": __version__,
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def cmd_check(args) -> int:
    from eagle3.record import run_record, write_json

    spec = DraftShape.from_flags(args.tree, args.chain)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"eagle3 check: {args.drafter} against {args.target} on {device}")
    report, _ = run_check(args.target, args.drafter, device=device, dtype=args.dtype, dataset=args.dataset,
                          limit=args.limit, max_new_tokens=args.max_new_tokens, spec=spec)
    for f in report.findings:
        print(f"[{f.status.upper():4}] {f.check}: {f.message}")
    if args.write_profile:
        if report.ok:
            print(f"profile written to {write_profile(args.drafter, report)}")
        else:
            print("profile not written: the check failed")
    if args.out:
        write_json(run_record("check", **report.to_dict()), args.out)
        print(f"report: {args.out}")
    print("check passed" if report.ok else "check FAILED")
    return 0 if report.ok else 1


def add_check_parser(sub) -> None:
    c = sub.add_parser("check", help="pre-flight check of a drafter against a target: loads, lossless, acceptance "
                                     "(against the drafter's stored profile)")
    c.add_argument("--target", required=True, help="local HF directory, hub id, .gguf file, or a bundled name")
    from eagle3.cli import add_trust_remote_code  # here: eagle3.cli imports this module inside build_parser

    add_trust_remote_code(c)
    c.add_argument("--drafter", required=True, help="a drafter folder (speculators or EAGLE format)")
    c.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    c.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    c.add_argument("--dataset", default=None, help="bundled set or JSONL of prompts (default: the profile's, "
                                                   "else mt_bench)")
    c.add_argument("--limit", type=int, default=None, help="prompts (default: the profile's, else 4)")
    c.add_argument("--max-new-tokens", type=int, default=None, help="default: the profile's, else 64")
    shape = c.add_mutually_exclusive_group()
    shape.add_argument("--tree", metavar="DEPTH,TOPK,TOTAL", default=None)
    shape.add_argument("--chain", type=int, metavar="K", default=None)
    c.add_argument("--write-profile", action="store_true",
                   help="store the measured acceptance in the drafter's config.json when the check passes")
    c.add_argument("--out", default=None, help="JSON report with a run record")
    c.set_defaults(func=cmd_check)
