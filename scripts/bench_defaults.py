"""Each command with no decoding flags against plain decoding, in one run on one device: what a user gets from
the defaults (`eagle3.defaults`), with a real drafter and with a random one (which must fall back to about plain
speed).

    generate  tokens/s per prompt (as it prints them: the generation, not the model load), `--draft none` as plain
    eval      tokens/s over the prompts (guard off: eval measures the drafter), `--draft none` as plain
    bench     its chain and tree methods against its own plain method
    check     the speedup it reports (every cycle drafting)

    python scripts/bench_defaults.py --target smollm2 --drafters bundled random --limit 10 --out runs/defaults.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import tempfile
from pathlib import Path

from eagle3.cli import main
from eagle3.demo import bundled_drafter
from eagle3.evaluate import load_prompts
from eagle3.record import run_record, write_json


def cli_json(argv: list[str]) -> dict:
    """Run `eagle3 ARGV` in this process; its last stdout line as JSON."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        if main(argv) != 0:
            raise SystemExit(f"eagle3 {' '.join(argv)} failed")
    return json.loads(out.getvalue().strip().splitlines()[-1])


def quiet(argv: list[str]) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main(argv)


def measure(target: str, drafter: str, limit: int, tokens: int, work: Path, chat: bool = True) -> dict:
    _, chats = load_prompts("mt_bench", limit=limit)
    res: dict = {}
    # generate: one process-like call per prompt, as a user runs it
    rates = {"plain": [], "eagle": []}
    drafting = ""
    for msgs in chats:
        base = ["generate", "--target", target, "--chat" if chat else "--prompt", msgs[0]["content"],
                "--max-new-tokens", str(tokens), "--json"]
        a = cli_json([*base, "--draft", "none"])
        b = cli_json([*base, "--drafter", drafter])
        rates["plain"].append(a["tokens_per_s"])
        rates["eagle"].append(b["tokens_per_s"])
        drafting = b["drafting"]
    ratios = [e / p for e, p in zip(rates["eagle"], rates["plain"], strict=True)]
    res["generate"] = {"speedup_median": round(statistics.median(ratios), 3),
                       "speedup_mean_rate": round(sum(rates["eagle"]) / sum(rates["plain"]), 3),
                       "plain_tok_s": rates["plain"], "eagle_tok_s": rates["eagle"], "drafting": drafting}
    # eval
    evals = {}
    for name, extra in (("plain", ["--draft", "none"]), ("eagle", ["--drafter", drafter])):
        out = work / f"eval-{name}"
        assert quiet(["eval", "--target", target, *extra, "--datasets", "mt_bench", "--limit", str(limit),
                      "--max-new-tokens", str(tokens), "--temperatures", "0", "--out", str(out)]) == 0
        evals[name] = json.loads((out / "eval.json").read_text())["runs"][0]
    res["eval"] = {"speedup": round(evals["eagle"]["tokens_per_s"] / evals["plain"]["tokens_per_s"], 3),
                   "tau": evals["eagle"]["tau"], "plain_tok_s": evals["plain"]["tokens_per_s"],
                   "eagle_tok_s": evals["eagle"]["tokens_per_s"]}
    # bench
    out = work / "bench"
    assert quiet(["bench", "--target", target, "--drafter", drafter, "--limit", str(limit), "--max-new-tokens",
                  str(tokens), "--methods", "plain,chain,tree", "--out", str(out)]) == 0
    rec = json.loads((out / "bench.json").read_text())
    res["bench"] = {s["method"]: {k: s.get(k) for k in ("speedup_vs_plain", "tau", "tokens_per_s_median",
                                                        "identical", "prompts")}
                    for s in rec["summary"]}
    res["bench"]["drafting"] = rec.get("drafting")
    # check
    out = work / "check.json"
    quiet(["check", "--target", target, "--drafter", drafter, "--limit", str(limit), "--max-new-tokens",
           str(tokens), "--out", str(out)])
    rep = json.loads(out.read_text())
    res["check"] = {"speedup": rep["acceptance"]["speedup"], "tau": rep["acceptance"]["tau"], "ok": rep["ok"],
                    "findings": [f"[{f['status']}] {f['check']}" for f in rep["findings"]]}
    return res


def main_(argv: list[str] | None = None) -> int:
    from eagle3.models import load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--drafters", nargs="+", default=["bundled", "random"],
                    help="drafter folders; 'bundled' (SmolLM2's), 'random' (a random drafter made for the target)")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="runs/defaults.json")
    args = ap.parse_args(argv)
    chat = bool(getattr(load_tokenizer(args.target)[0], "chat_template", None))  # a base model: raw prompts
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in args.drafters:
            path = str(bundled_drafter()) if name == "bundled" else name
            if name == "random":
                path = str(work / "random-drafter")
                assert quiet(["init-drafter", "--target", args.target, "--out", path]) == 0
            results[name] = measure(args.target, path, args.limit, args.max_new_tokens, work / name, chat)
            r = results[name]
            print(f"{name}: generate {r['generate']['speedup_median']:.2f}x (median per prompt), "
                  f"eval {r['eval']['speedup']:.2f}x, bench chain {r['bench']['chain']['speedup_vs_plain']}x "
                  f"tree {r['bench']['tree']['speedup_vs_plain']}x, check {r['check']['speedup']:.2f}x", flush=True)
    write_json(run_record("bench-defaults", target=args.target, limit=args.limit,
                          max_new_tokens=args.max_new_tokens, results=results), args.out)
    print(f"record: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main_())
