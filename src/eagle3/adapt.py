"""`eagle3 adapt` and `eagle3.adapt.adapt`: keep a drafter good while the traffic (or an RL policy) moves.

The drafter continues training on recorded requests (`eagle3.traffic`: token ids the target saw and produced,
or an RL loop's rollouts), with features from the target online. The most recent slice is held out. The old
and the new drafter are measured on that slice in the same run: tau of greedy speculative decoding on its
prompts. Where the drafter has an acceptance profile (`eagle3 check --write-profile`), both are also measured
on the profile's prompts. The candidate is written only if it is no worse on the held-out slice and no more
than `margin` worse on the profile, so adapting to new traffic cannot silently trade the old domain away.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from eagle3.config import DTYPE_HELP, ConfigError, SamplingConfig


@dataclass
class AdaptReport:
    rows_train: int = 0
    rows_holdout: int = 0
    tokens_train: int = 0
    steps: int = 0
    tau: dict[str, float] = field(default_factory=dict)  # {"old", "new"} on the held-out prompts
    profile_tau: dict[str, float] = field(default_factory=dict)  # {"old", "new"} on the profile's prompts
    written: bool = False
    reason: str = ""
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rows_from_traffic(rows: list[dict]) -> list[dict]:
    """Recorded rows (`eagle3.traffic.read_traffic`) with a completion, oldest first."""
    kept = [r for r in rows if r.get("completion_ids") and r.get("prompt_ids")]
    return sorted(kept, key=lambda r: r.get("time_unix") or 0.0)


def adapt(target: str, drafter: str, rows: list[dict] | str, out: str, holdout: float = 0.1,
          time_budget: float | None = 300.0, max_steps: int | None = None, lr: float = 1e-4,
          max_length: int = 2048, eval_tokens: int = 64, eval_limit: int = 16, margin: float = 0.03,
          device: str | None = None, dtype: str = "auto", seed: int = 0, progress: bool = True,
          echo=print) -> AdaptReport:
    """Adapt `drafter` to `rows` (a recorded-traffic folder, or rows with `prompt_ids` and `completion_ids`, e.g.
    an RL loop's rollouts); write the candidate to `out` only if it passes (module docstring)."""
    from eagle3.models import load_tokenizer
    from eagle3.traffic import read_traffic
    from eagle3.training.config import TrainConfig
    from eagle3.training.prepare import write_token_rows
    from eagle3.training.trainer import train

    t0 = time.perf_counter()
    if not 0.0 < holdout < 1.0:
        raise ConfigError(f"--holdout {holdout}: expected a share between 0 and 1")
    if Path(out).exists() and any(Path(out).iterdir()):
        raise ConfigError(f"--out {out} exists and is not empty: choose a new folder (the old drafter stays)")
    data = rows_from_traffic(list(read_traffic(rows)) if isinstance(rows, (str, Path)) else list(rows))
    n_hold = max(1, round(holdout * len(data)))
    if len(data) - n_hold < 1:
        raise ConfigError(f"{len(data)} recorded requests with an answer: adapting needs at least 2 "
                          "(one to train on, the most recent to judge by)")
    train_rows, held = data[:-n_hold], data[-n_hold:]
    report = AdaptReport(rows_train=len(train_rows), rows_holdout=len(held))
    tok, vocab = load_tokenizer(target)
    with tempfile.TemporaryDirectory(prefix="eagle3-adapt-") as tmp:
        work = Path(tmp)

        def token_rows():
            for r in train_rows:
                ids = np.asarray([*r["prompt_ids"], *r["completion_ids"]][:max_length])
                mask = np.zeros(len(ids), dtype=np.uint8)
                mask[len(r["prompt_ids"]):] = 1  # the drafter learns the answers, as prepare masks a chat
                yield ids, mask

        prep = write_token_rows(token_rows(), work / "data", tok, vocab, _vocab_mapping(drafter, vocab),
                                source=str(rows) if isinstance(rows, (str, Path)) else "rows")
        report.tokens_train = prep.total_tokens
        echo(f"adapt: {report.rows_train} requests ({prep.total_tokens} tokens) to train on, {len(held)} held out")
        if prep.draft_vocab_coverage < 0.5:
            echo(f"adapt: warning: the drafter's draft vocabulary covers {prep.draft_vocab_coverage:.0%} of the "
                 "recorded answers' tokens; adapting cannot change it: train a new drafter on this traffic "
                 "(eagle3 prepare chooses a vocabulary from it)")
        cfg = TrainConfig(target=target, data=str(work / "data"), out=str(work / "run"), init=str(drafter), lr=lr,
                          time_budget=time_budget, max_steps=max_steps, device=device, seed=seed, save_every=0,
                          progress=progress, max_length=max_length, epochs=None if max_steps else 1)
        res = train(cfg)
        report.steps = res.steps
        _judge(report, target, str(drafter), str(res.drafter_dir), held, eval_tokens, eval_limit, margin, device,
               dtype, echo)
        if report.written:
            staged = Path(str(out) + ".tmp")
            shutil.rmtree(staged, ignore_errors=True)
            shutil.copytree(res.drafter_dir, staged)
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            if Path(out).exists():
                Path(out).rmdir()  # empty (checked above)
            staged.rename(out)
    report.seconds = round(time.perf_counter() - t0, 1)
    return report


def _vocab_mapping(drafter: str, vocab: int):
    """The drafter's (d2t, t2d), or the identity where it drafts over the whole vocabulary."""
    import torch

    from eagle3.formats import read_checkpoint, read_vocab_mapping

    if not read_checkpoint(drafter)[0].uses_draft_vocab:
        return torch.zeros(vocab, dtype=torch.int64), torch.ones(vocab, dtype=torch.bool)
    return read_vocab_mapping(drafter)


def _judge(report: AdaptReport, target: str, old: str, new: str, held: list[dict], eval_tokens: int,
           eval_limit: int, margin: float, device, dtype: str, echo) -> None:
    """Tau of the old and the new drafter on the held-out prompts and on the old drafter's profile prompts."""
    from eagle3.defaults import decoding_for
    from eagle3.evaluate import RunResult, load_prompts
    from eagle3.runtime import decoder, drafter_for, encode_messages, load_runtime

    rt = load_runtime(target, drafter=old, device=device, dtype=dtype)
    how = replace(decoding_for(rt.model, "eagle3"), guard=False)  # every cycle drafts: tau is what is compared
    drafters = {"old": rt.drafter, "new": drafter_for(rt.model, new)}
    profile = rt.drafter.config.acceptance_profile or {}
    prompts = [r["prompt_ids"] for r in held[-eval_limit:]]
    if profile.get("dataset"):
        _, chats = load_prompts(profile["dataset"], limit=profile.get("limit", 4))
        profile_prompts = [encode_messages(rt.tokenizer, m) for m in chats]
    else:
        profile_prompts = []
    for name, d in drafters.items():
        rt.drafter = d
        engine = decoder(rt, how)
        for key, ids_list, tokens in (("tau", prompts, eval_tokens),
                                      ("profile_tau", profile_prompts, profile.get("max_new_tokens", eval_tokens))):
            if not ids_list:
                continue
            res = RunResult(dataset=key, method=name, temperature=0.0)
            for ids in ids_list:
                res.add(engine.generate(ids, max_new_tokens=tokens, sampling=SamplingConfig(),
                                        eos_token_ids=rt.eos_token_ids).stats)
            getattr(report, key)[name] = round(res.tau, 4)
    echo(f"adapt: held-out tau {report.tau['old']:.3f} (old) -> {report.tau['new']:.3f} (new)"
         + (f"; profile tau {report.profile_tau['old']:.3f} -> {report.profile_tau['new']:.3f}"
            if report.profile_tau else ""))
    report.written, report.reason = verdict(report.tau, report.profile_tau, margin, profile.get("dataset"))


def verdict(tau: dict[str, float], profile_tau: dict[str, float], margin: float,
            profile_set: str | None = None) -> tuple[bool, str]:
    """(write the candidate?, why) from the old and new drafters' taus on the held-out and the profile prompts."""
    if tau["new"] < tau["old"]:
        return False, "the new drafter is worse on the held-out requests"
    if profile_tau and profile_tau["new"] < (1 - margin) * profile_tau["old"]:
        return False, (f"the new drafter lost more than {margin:.0%} on the drafter's profile prompts "
                       f"({profile_set}): it would trade the old domain away")
    return True, "no worse on the held-out requests or the profile"


def cmd_adapt(args) -> int:
    from eagle3.record import run_record, write_json

    rep = adapt(args.target, args.drafter, args.data, args.out, holdout=args.holdout, time_budget=args.time_budget,
                max_steps=args.max_steps, lr=args.lr, eval_tokens=args.eval_tokens, eval_limit=args.eval_limit,
                margin=args.margin, device=args.device, dtype=args.dtype)
    record = Path(args.report)
    write_json(run_record("adapt", target=args.target, drafter=args.drafter, data=args.data, out=args.out,
                          **rep.to_dict()), record)
    print(f"{'wrote ' + args.out if rep.written else 'did not write the candidate'}: {rep.reason} "
          f"(held-out tau {rep.tau['old']:.3f} -> {rep.tau['new']:.3f}); report: {record}")
    return 0 if rep.written else 1


def add_adapt_parser(sub) -> None:
    from eagle3.cli_args import duration_seconds

    a = sub.add_parser("adapt", help="continue training a drafter on recorded traffic; written only if no worse",
                       usage="%(prog)s --target MODEL --drafter DIR --data TRAFFIC --out NEW [options]")
    a.add_argument("--target", required=True, metavar="MODEL")
    a.add_argument("--drafter", required=True, metavar="DIR", help="the drafter to adapt (left as it is)")
    a.add_argument("--data", required=True, metavar="TRAFFIC", help="a folder recorded by eagle3 serve --record")
    a.add_argument("--out", required=True, metavar="NEW", help="where the adapted drafter goes if it passes")
    a.add_argument("--holdout", type=float, default=0.1, metavar="F", help="the most recent share held out")
    a.add_argument("--time-budget", type=duration_seconds, default=300.0, metavar="T", help="training time (5m)")
    a.add_argument("--max-steps", type=int, default=None, metavar="N")
    a.add_argument("--lr", type=float, default=1e-4)
    a.add_argument("--margin", type=float, default=0.03, help="largest tau loss allowed on the drafter's profile")
    a.add_argument("--eval-tokens", type=int, default=64, metavar="N", help="new tokens per held-out prompt")
    a.add_argument("--eval-limit", type=int, default=16, metavar="N", help="held-out prompts measured")
    a.add_argument("--device", default=None)
    a.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    a.add_argument("--report", default="adapt-report.json", metavar="FILE", help="the run record")
    a.set_defaults(func=cmd_adapt)
